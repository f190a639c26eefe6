"""Session affinity: consistent hashing with bounded load (Mirrokni, Thorup, Zadimoghaddam).

Each candidate owns ``vnodes`` points on a 64-bit ring; a session key hashes to a point and
walks clockwise to the first replica whose in-flight count is under the bound::

    bound = ceil(load_factor × (in-flight over all candidates + 1) / candidates)

    ring   ──●a────●c──●b──────●a───●c────●b──
                 ▲ key            (a is full: the walk goes on to c)

So a session keeps its replica while that replica carries no more than ``load_factor`` times
its share, and when a replica leaves only its sessions move. Hashes are BLAKE2b, stable
across processes and gateway restarts (Python's ``hash`` is salted per process).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from random import Random

from gpufleet.fleet import FleetView, Outcome, ReplicaId, RouteRequest
from gpufleet.policy._config import SessionConfig
from gpufleet.policy._ranking import (
    CandidateFilter,
    CandidateMemo,
    LoadSnapshot,
    LoadTracker,
    PoolShape,
    Ranking,
    order_by_key,
    shape_of,
)
from gpufleet.policy._routers import default_filters

_RING_CACHE = 8
"""Rings kept, one per candidate set seen lately (the set changes only on health changes)."""


def stable_hash(key: str) -> int:
    """A 64-bit hash of ``key``, the same in every process."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """``vnodes`` points per replica on a 64-bit ring, in clockwise order."""

    __slots__ = ("_owners", "_points")

    def __init__(self, replicas: Sequence[ReplicaId], vnodes: int) -> None:
        if not replicas:
            raise ValueError("a hash ring needs at least one replica")
        points = sorted(
            (stable_hash(f"{replica}#{i}"), replica) for replica in replicas for i in range(vnodes)
        )
        self._points = [p for p, _ in points]
        self._owners = [r for _, r in points]

    def walk(self, key_hash: int) -> Iterator[ReplicaId]:
        """Owners of the points from ``key_hash`` clockwise, once round the ring."""
        owners = self._owners
        start = bisect.bisect_left(self._points, key_hash)
        yield from owners[start:]
        yield from owners[:start]


@dataclass(frozen=True, slots=True)
class SessionSnapshot:
    rings: int
    """Hash rings cached (one per recent candidate set)."""
    load: LoadSnapshot


class SessionRouter:
    """Sticky by session key with bounded load; requests without a key go least-loaded.

    Tier 0 is the session's replica; tier 1 the other candidates by in-flight count (where a
    retry goes).
    """

    name = "session"

    def __init__(
        self,
        config: SessionConfig,
        rng: Random,
        filters: tuple[CandidateFilter, ...] | None = None,
    ) -> None:
        self.config = config
        self._rng = rng
        self._candidates = CandidateMemo(
            default_filters(config.panic_threshold) if filters is None else filters
        )
        self._load = LoadTracker()
        self._rings: dict[tuple[ReplicaId, ...], HashRing] = {}
        self._shapes: dict[str, PoolShape] = {}

    def rank(self, now: float, request: RouteRequest, view: FleetView) -> Ranking:
        candidates = self._candidates(request, view)
        replicas = candidates.replicas
        if not replicas:
            return Ranking((), self.name, candidates.panic)
        ids = shape_of(self._shapes, request.model, replicas).ids
        counts = self._load.counts
        loads = [counts.get(i, 0) for i in ids]
        if request.session_key is None:
            return Ranking((order_by_key(ids, loads, self._rng),), self.name, candidates.panic)

        bound = math.ceil(self.config.load_factor * (sum(loads) + 1) / len(ids))
        walk = self._ring(ids).walk(stable_hash(request.session_key))
        chosen = next(r for r in walk if counts.get(r, 0) < bound)
        others = [i for i, r in enumerate(ids) if r != chosen]
        if not others:
            return Ranking(((chosen,),), self.name, candidates.panic)
        rest = order_by_key([ids[i] for i in others], [loads[i] for i in others], self._rng)
        return Ranking(((chosen,), rest), self.name, candidates.panic)

    def _ring(self, ids: tuple[ReplicaId, ...]) -> HashRing:
        ring = self._rings.get(ids)
        if ring is None:
            if len(self._rings) >= _RING_CACHE:
                del self._rings[next(iter(self._rings))]
            ring = self._rings[ids] = HashRing(ids, self.config.vnodes)
        return ring

    def on_request_start(self, now: float, request: RouteRequest, replica: ReplicaId) -> None:
        self._load.start(request, replica)

    def on_request_end(
        self, now: float, request: RouteRequest, replica: ReplicaId, outcome: Outcome
    ) -> None:
        self._load.end(request, replica)

    def snapshot(self) -> SessionSnapshot:
        return SessionSnapshot(len(self._rings), self._load.snapshot())
