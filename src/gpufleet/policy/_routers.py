"""The load-only routers: round robin, least request, KV-aware.

Each is a small object: its settings, the RNG it breaks ties with, the candidate filters,
and its memory in named fields (``snapshot()`` returns it as a value). None of them reads
a clock; ``now`` only ages scrapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import repeat
from random import Random
from types import MappingProxyType

from gpufleet.fleet import FleetView, Outcome, ReplicaId, ReplicaView, RouteRequest
from gpufleet.policy._config import KVAwareConfig, LeastRequestConfig, RoundRobinConfig
from gpufleet.policy._ranking import (
    CandidateFilter,
    CandidateMemo,
    LoadSnapshot,
    LoadTracker,
    PoolShape,
    Ranking,
    RoutableFilter,
    order_by_key,
    shape_of,
)


def default_filters(panic_threshold: float) -> tuple[CandidateFilter, ...]:
    """The pipeline every router starts from: routable replicas (or the pool in panic)."""
    return (RoutableFilter(panic_threshold),)


# -- round robin ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoundRobinSnapshot:
    cursors: Mapping[str, int]
    """Per model, how many rankings it has handed out."""
    load: LoadSnapshot


class RoundRobinRouter:
    """Each candidate in turn: over ``n`` calls with the same ``n`` candidates, each comes
    first exactly once. The rest of the tier follows in ring order, for retries."""

    name = "round_robin"

    def __init__(
        self,
        config: RoundRobinConfig,
        rng: Random,
        filters: tuple[CandidateFilter, ...] | None = None,
    ) -> None:
        self.config = config
        self._rng = rng
        self._candidates = CandidateMemo(
            default_filters(config.panic_threshold) if filters is None else filters
        )
        self._cursors: dict[str, int] = {}
        self._load = LoadTracker()
        self._shapes: dict[str, PoolShape] = {}

    def rank(self, now: float, request: RouteRequest, view: FleetView) -> Ranking:
        candidates = self._candidates(request, view)
        replicas = candidates.replicas
        if not replicas:
            return Ranking((), self.name, candidates.panic)
        cursor = self._cursors.get(request.model, 0)
        self._cursors[request.model] = cursor + 1
        ids = shape_of(self._shapes, request.model, replicas).ids
        start = cursor % len(ids)
        return Ranking((ids[start:] + ids[:start],), self.name, candidates.panic)

    def on_request_start(self, now: float, request: RouteRequest, replica: ReplicaId) -> None:
        self._load.start(request, replica)

    def on_request_end(
        self, now: float, request: RouteRequest, replica: ReplicaId, outcome: Outcome
    ) -> None:
        self._load.end(request, replica)

    def snapshot(self) -> RoundRobinSnapshot:
        return RoundRobinSnapshot(MappingProxyType(dict(self._cursors)), self._load.snapshot())


# -- least request ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadOnlySnapshot:
    load: LoadSnapshot


class LeastRequestRouter:
    """Candidates by gateway-side requests in flight, fewest first; ties in random order."""

    name = "least_request"

    def __init__(
        self,
        config: LeastRequestConfig,
        rng: Random,
        filters: tuple[CandidateFilter, ...] | None = None,
    ) -> None:
        self.config = config
        self._rng = rng
        self._candidates = CandidateMemo(
            default_filters(config.panic_threshold) if filters is None else filters
        )
        self._load = LoadTracker()
        self._shapes: dict[str, PoolShape] = {}

    def rank(self, now: float, request: RouteRequest, view: FleetView) -> Ranking:
        candidates = self._candidates(request, view)
        replicas = candidates.replicas
        if not replicas:
            return Ranking((), self.name, candidates.panic)
        ids = shape_of(self._shapes, request.model, replicas).ids
        counts = self._load.counts
        keys = list(map(counts.get, ids, repeat(0)))  # counts.get(i, 0), looped in C
        return Ranking((order_by_key(ids, keys, self._rng),), self.name, candidates.panic)

    def on_request_start(self, now: float, request: RouteRequest, replica: ReplicaId) -> None:
        self._load.start(request, replica)

    def on_request_end(
        self, now: float, request: RouteRequest, replica: ReplicaId, outcome: Outcome
    ) -> None:
        self._load.end(request, replica)

    def snapshot(self) -> LoadOnlySnapshot:
        return LoadOnlySnapshot(self._load.snapshot())


# -- KV-aware ---------------------------------------------------------------------------------


def kv_scores(
    replicas: tuple[ReplicaView, ...],
    in_flight: Mapping[ReplicaId, int],
    now: float,
    config: KVAwareConfig,
) -> list[float]:
    """Each replica's score, lower is better, in units of "requests"::

        score = outstanding + waiting_weight × waiting + kv_weight × kv_cache_usage

    ``outstanding`` is the larger of the gateway's fresh in-flight count and the scrape's
    running + waiting. Waiting requests count twice by default (once as outstanding, once as
    a sign the replica is saturated), and a full KV cache costs as much as ``kv_weight``
    more requests. A scrape older than ``max_scrape_age`` counts for nothing: the score is
    then the in-flight count alone.
    """
    return _kv_scores(PoolShape(replicas), in_flight, now, config)


def _kv_scores(
    shape: PoolShape, in_flight: Mapping[ReplicaId, int], now: float, config: KVAwareConfig
) -> list[float]:
    counts = [in_flight.get(i, 0) for i in shape.ids]
    waiting_weight, kv_weight = config.waiting_weight, config.kv_weight
    scores = [
        (s if s > c else c) + waiting_weight * w + kv_weight * k
        for c, s, w, k in zip(counts, shape.scraped, shape.waiting, shape.kv, strict=True)
    ]
    if shape.all_fresh(now, config.max_scrape_age):
        return scores
    fresh = shape.fresh(now, config.max_scrape_age)
    return [sc if f else float(c) for sc, c, f in zip(scores, counts, fresh, strict=True)]


class KVAwareRouter:
    """Candidates by :func:`kv_scores`, lowest first; ties in random order."""

    name = "kv_aware"

    def __init__(
        self,
        config: KVAwareConfig,
        rng: Random,
        filters: tuple[CandidateFilter, ...] | None = None,
    ) -> None:
        self.config = config
        self._rng = rng
        self._candidates = CandidateMemo(
            default_filters(config.panic_threshold) if filters is None else filters
        )
        self._load = LoadTracker()
        self._shapes: dict[str, PoolShape] = {}

    def rank(self, now: float, request: RouteRequest, view: FleetView) -> Ranking:
        candidates = self._candidates(request, view)
        replicas = candidates.replicas
        if not replicas:
            return Ranking((), self.name, candidates.panic)
        shape = shape_of(self._shapes, request.model, replicas)
        keys = _kv_scores(shape, self._load.counts, now, self.config)
        return Ranking((order_by_key(shape.ids, keys, self._rng),), self.name, candidates.panic)

    def on_request_start(self, now: float, request: RouteRequest, replica: ReplicaId) -> None:
        self._load.start(request, replica)

    def on_request_end(
        self, now: float, request: RouteRequest, replica: ReplicaId, outcome: Outcome
    ) -> None:
        self._load.end(request, replica)

    def snapshot(self) -> LoadOnlySnapshot:
        return LoadOnlySnapshot(self._load.snapshot())
