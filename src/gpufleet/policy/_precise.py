"""Precise prefix routing: ``prefix_aware``'s rule on what the engines say they hold.

::

    routing: {policy: prefix_precise}

The ranking is ``prefix_aware``'s (the longest match among replicas that are not
overloaded, by load; docs/design/routing.md); only the match changes. A request carries its
prompt's engine block hashes (``RouteRequest.block_hashes``: the engine's tokens, block size
and hash chain), and each candidate's match is::

    live feed (its KV events arrive, no hole)   leading blocks its engine reports cached,
                                                or that a request in flight there holds
    otherwise (no events, a gap, stale)         leading blocks of what was routed there
                                                (the approximate index, on the same hashes)

so one pool can mix engines that publish events with engines that do not. A request with no
block hashes (the shell cannot compute them) is matched on its text prefix hashes by the
approximate index alone: ``prefix_aware``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from random import Random
from types import MappingProxyType

from gpufleet.fleet import FleetView, KvBatch, Outcome, ReplicaId, RouteRequest
from gpufleet.policy._config import PrecisePrefixConfig
from gpufleet.policy._kv_index import FeedSnapshot, KvBlockIndex
from gpufleet.policy._prefix import PrefixAwareRouter
from gpufleet.policy._ranking import CandidateFilter, LoadSnapshot


@dataclass(frozen=True, slots=True)
class PreciseSnapshot:
    index_sizes: Mapping[ReplicaId, int]
    """The approximate fallback's blocks per replica."""
    indexed_hashes: int
    load: LoadSnapshot
    feeds: Mapping[ReplicaId, FeedSnapshot]
    """Each replica's KV-event feed and the blocks its engine reports cached."""
    resyncs: int
    """Replays asked for (gaps seen)."""


class PrecisePrefixRouter(PrefixAwareRouter):
    """Longest prefix the engines report cached (approximate where they do not)."""

    name = "prefix_precise"

    def __init__(
        self,
        config: PrecisePrefixConfig,
        rng: Random,
        filters: tuple[CandidateFilter, ...] | None = None,
    ) -> None:
        super().__init__(config, rng, filters)
        self.kv = KvBlockIndex(config.kv_index_blocks, stale_after=config.stale_after)

    # -- what the controller tells it -----------------------------------------------------

    def on_kv_events(
        self,
        now: float,
        replica: ReplicaId,
        incarnation: str | None,
        batches: tuple[KvBatch, ...],
        replay: bool,
    ) -> int | None:
        """Apply a replica's event batches; the seq to replay from when a gap opened."""
        return self.kv.apply(now, replica, incarnation, batches, replay=replay)

    def restarted(self, replica: ReplicaId, incarnation: str | None) -> None:
        """``replica`` runs a new process: what its old one cached is gone."""
        self.kv.restarted(replica, incarnation)
        self._index.forget(replica)

    def forget(self, replica: ReplicaId) -> None:
        """``replica`` left the pool."""
        self.kv.forget(replica)
        self._index.forget(replica)

    # -- the router -----------------------------------------------------------------------

    def _matches(self, now: float, request: RouteRequest) -> dict[ReplicaId, int]:
        hashes = request.block_hashes
        if not hashes:
            return self._index.match(request.prefix_hashes)
        approx = self._index.match(hashes)
        live = self.kv.live(now)
        if not live:
            return approx
        matched = {r: n for r, n in approx.items() if r not in live}
        matched.update(self.kv.match(now, hashes))
        return matched

    def _sync(self, view: FleetView) -> None:
        super()._sync(view)
        for replica in self.kv.feeds():
            if view.replica(replica) is None:
                self.kv.forget(replica)

    def on_request_start(self, now: float, request: RouteRequest, replica: ReplicaId) -> None:
        self._load.start(request, replica)
        hashes = request.block_hashes
        self._index.insert(replica, hashes or request.prefix_hashes)
        self.kv.started(now, replica, hashes)

    def on_request_end(
        self, now: float, request: RouteRequest, replica: ReplicaId, outcome: Outcome
    ) -> None:
        self._load.end(request, replica)
        self.kv.ended(replica, request.block_hashes)

    def snapshot(self) -> PreciseSnapshot:  # type: ignore[override]
        approximate = super().snapshot()
        return PreciseSnapshot(
            approximate.index_sizes,
            approximate.indexed_hashes,
            approximate.load,
            MappingProxyType(self.kv.feeds()),
            self.kv.resyncs,
        )

    def check(self) -> None:
        super().check()
        self.kv.check()
