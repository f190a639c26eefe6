"""The router's contract: candidates in, preference tiers out.

A router answers one question per request, ``rank(now, request, view) -> Ranking``, and is
told what became of its answer, ``on_request_start`` / ``on_request_end``. The shell walks
the tiers in order, and each tier's replicas in order, applying admission, backoff and
retries the same way for every router::

    view.pool(request.model)                      the model's pool (the model filter)
      │  filters, in order: routable (or the whole pool in panic), then any others
      ▼
    candidates ──► router's core rule ──► Ranking.tiers = ((best, …), (fallback, …), …)

A ranking never names a replica twice, and never one outside the candidates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from random import Random
from types import MappingProxyType
from typing import ClassVar, Final, Protocol

from gpufleet.fleet import (
    IN_SERVICE,
    ROUTABLE,
    FleetView,
    Outcome,
    ReplicaId,
    ReplicaView,
    RouteRequest,
)

_NO_MATCHES: Final[Mapping[ReplicaId, int]] = MappingProxyType({})


@dataclass(slots=True)  # made per request: not frozen (cheaper); never changed
class Ranking:
    """A routing decision: replicas to try, best first, grouped in tiers.

    ``tiers`` is empty when no replica can take the request (the shell answers 503).
    ``matched_blocks`` gives, for each candidate with a cached prefix in the router's index,
    how many leading prefix blocks matched (prefix-aware routing only; metrics read it for
    the replica the request actually went to).
    """

    tiers: tuple[tuple[ReplicaId, ...], ...]
    policy: str
    panic: bool = False
    """The pool was below its panic threshold, so the tiers include unhealthy replicas."""
    matched_blocks: Mapping[ReplicaId, int] = field(default_factory=lambda: _NO_MATCHES)

    def first(self) -> ReplicaId | None:
        """The preferred replica, or ``None`` when there is none."""
        return self.tiers[0][0] if self.tiers else None

    def replicas(self) -> tuple[ReplicaId, ...]:
        """Every replica in preference order (tiers flattened)."""
        return tuple(r for tier in self.tiers for r in tier)

    def matched(self, replica: ReplicaId) -> int:
        """Prefix blocks of the request the index believes ``replica`` holds."""
        return self.matched_blocks.get(replica, 0)


class Router(Protocol):
    """A routing policy: pure, synchronous, clock-injected; its memory lives in its fields."""

    @property
    def name(self) -> str: ...

    def rank(self, now: float, request: RouteRequest, view: FleetView) -> Ranking:
        """Preference tiers for ``request`` among ``view``'s replicas of its model."""
        ...

    def on_request_start(self, now: float, request: RouteRequest, replica: ReplicaId) -> None:
        """The shell sent ``request`` to ``replica`` (once per attempt, retries included)."""
        ...

    def on_request_end(
        self, now: float, request: RouteRequest, replica: ReplicaId, outcome: Outcome
    ) -> None:
        """The attempt started on ``replica`` ended, however it ended."""
        ...

    def snapshot(self) -> object:
        """The router's memory as a frozen value (for tests and debugging)."""
        ...


# -- candidate filters ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Candidates:
    """Replicas still in the running for a request, and whether the pool is in panic."""

    replicas: tuple[ReplicaView, ...]
    panic: bool = False


CandidateFilter = Callable[[RouteRequest, FleetView, Candidates], Candidates]
"""One step of the candidate pipeline; filters run in the order they are listed."""


def in_panic(routable: int, in_service: int, threshold: float) -> bool:
    """Whether fewer than ``threshold`` of a pool's in-service replicas are routable.

    In-service replicas are the pool's capacity, healthy or not (``IN_SERVICE``); a pool with
    none is empty, not in panic.
    """
    return in_service > 0 and routable < threshold * in_service


@dataclass(frozen=True, slots=True)
class RoutableFilter:
    """Keep routable replicas, or, in panic, every in-service replica of the pool (Envoy).

    Below the panic threshold the healthy few would take the whole load and fall over too;
    spreading it over all in-service replicas lets some requests fail (and be retried)
    instead.
    """

    panic_threshold: float
    per_view: ClassVar[bool] = True
    """It reads only the request's model and the view (:class:`CandidateMemo` may keep its
    answer for the view's life)."""

    def __call__(
        self, request: RouteRequest, view: FleetView, candidates: Candidates
    ) -> Candidates:
        pool = candidates.replicas
        if pool is view.pool(request.model):  # untouched so far: the view has the answers
            ready, in_service = view.routable(request.model), view.in_service(request.model)
        else:
            ready = tuple(r for r in pool if r.state in ROUTABLE)
            in_service = tuple(r for r in pool if r.state in IN_SERVICE)
        if in_panic(len(ready), len(in_service), self.panic_threshold):
            return Candidates(in_service, panic=True)
        return Candidates(ready, candidates.panic)


def select_candidates(
    request: RouteRequest, view: FleetView, filters: Sequence[CandidateFilter]
) -> Candidates:
    """The request's model pool, narrowed by ``filters`` in order."""
    candidates = Candidates(view.pool(request.model))
    for keep in filters:
        if not candidates.replicas:
            break
        candidates = keep(request, view, candidates)
    return candidates


class CandidateMemo:
    """:func:`select_candidates` with a router's ``filters``, worked out once per view and
    model when every filter reads only those (``per_view``, as the default pipeline does),
    not once per request: a view lives for a scrape interval."""

    __slots__ = ("_by_model", "_filters", "_per_view", "_view")

    def __init__(self, filters: Sequence[CandidateFilter]) -> None:
        self._filters = filters
        self._per_view = all(getattr(f, "per_view", False) for f in filters)
        self._view: FleetView | None = None
        self._by_model: dict[str, Candidates] = {}

    def __call__(self, request: RouteRequest, view: FleetView) -> Candidates:
        if not self._per_view:
            return select_candidates(request, view, self._filters)
        if view is not self._view:
            self._view, self._by_model = view, {}
        found = self._by_model.get(request.model)
        if found is None:
            found = self._by_model[request.model] = select_candidates(request, view, self._filters)
        return found


# -- load the routers share -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    in_flight: Mapping[ReplicaId, int]
    in_flight_tokens: Mapping[ReplicaId, int]


class LoadTracker:
    """Gateway-side in-flight requests (and their prompt tokens) per replica.

    Moved by ``on_request_start`` / ``on_request_end``, so it is fresher than any scrape: a
    burst of requests between two scrapes sees each one it already placed.
    """

    __slots__ = ("_in_flight", "_tokens")

    def __init__(self) -> None:
        self._in_flight: dict[ReplicaId, int] = {}
        self._tokens: dict[ReplicaId, int] = {}

    @property
    def counts(self) -> Mapping[ReplicaId, int]:
        """In-flight requests by replica (replicas with none are absent); read-only."""
        return self._in_flight

    def in_flight(self, replica: ReplicaId) -> int:
        return self._in_flight.get(replica, 0)

    def start(self, request: RouteRequest, replica: ReplicaId) -> None:
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1
        self._tokens[replica] = self._tokens.get(replica, 0) + request.prompt_tokens

    def end(self, request: RouteRequest, replica: ReplicaId) -> None:
        count = self._in_flight.get(replica, 0)
        if count < 1:
            raise ValueError(f"request {request.request_id!r} ended on {replica!r}: none started")
        if count == 1:
            del self._in_flight[replica]
            del self._tokens[replica]
        else:
            self._in_flight[replica] = count - 1
            self._tokens[replica] -= request.prompt_tokens

    def snapshot(self) -> LoadSnapshot:
        return LoadSnapshot(
            MappingProxyType(dict(self._in_flight)), MappingProxyType(dict(self._tokens))
        )


class PoolShape:
    """What a router derives from one candidate tuple, kept while it stays the same object.

    A view works out each pool's routable replicas once, so between two views (a scrape
    interval) every ranking of a model sees the very same tuple, and the ids, positions and
    scraped loads below are computed once per view instead of once per request. The shape
    holds a reference to its tuple, so the identity cannot be reused by another.
    """

    __slots__ = ("ids", "kv", "oldest_scrape", "position", "replicas", "scraped", "seen", "waiting")

    def __init__(self, replicas: tuple[ReplicaView, ...]) -> None:
        self.replicas = replicas
        self.ids = tuple(r.id for r in replicas)
        self.position = {r.id: i for i, r in enumerate(replicas)}
        loads = [r.load for r in replicas]
        self.scraped = [load.running + load.waiting for load in loads]
        self.waiting = [load.waiting for load in loads]
        self.kv = [load.kv_cache_usage for load in loads]
        self.seen = [load.observed_at for load in loads]
        never = any(seen is None for seen in self.seen)
        self.oldest_scrape = (
            None if never or not loads else min(s for s in self.seen if s is not None)
        )

    def fresh(self, now: float, max_age: float) -> list[bool]:
        """Per replica, whether its scrape is at most ``max_age`` old."""
        return [seen is not None and now - seen <= max_age for seen in self.seen]

    def all_fresh(self, now: float, max_age: float) -> bool:
        oldest = self.oldest_scrape
        return oldest is not None and now - oldest <= max_age


def shape_of(
    shapes: dict[str, PoolShape], model: str, replicas: tuple[ReplicaView, ...]
) -> PoolShape:
    """The cached shape of ``replicas`` (one per model), rebuilt when the tuple changes."""
    shape = shapes.get(model)
    if shape is None or shape.replicas is not replicas:
        shape = shapes[model] = PoolShape(replicas)
    return shape


def outstanding(
    shape: PoolShape, in_flight: Mapping[ReplicaId, int], now: float, max_age: float
) -> list[int]:
    """Requests each replica holds: the larger of our fresh count and its last fresh scrape.

    With one gateway the two agree up to the scrape's age; with several gateways (or
    requests that bypass this one) the scrape sees traffic our count cannot. A scrape older
    than ``max_age`` seconds is ignored.
    """
    counts = [in_flight.get(i, 0) for i in shape.ids]
    if shape.all_fresh(now, max_age):
        return [s if s > c else c for c, s in zip(counts, shape.scraped, strict=True)]
    fresh = shape.fresh(now, max_age)
    return [s if f and s > c else c for c, s, f in zip(counts, shape.scraped, fresh, strict=True)]


def order_by_key(
    ids: Sequence[ReplicaId], keys: Sequence[float], rng: Random
) -> tuple[ReplicaId, ...]:
    """``ids`` sorted by ``keys`` (ascending), ties broken by a random rotation.

    One draw per decision: the list is rotated by a random offset, then stably sorted, so
    equal keys come out in an order that changes from call to call (no herding on the
    first replica of the pool) yet is fixed by the seed.
    """
    n = len(ids)
    if n == 1:
        return (ids[0],)
    shift = rng.randrange(n)
    order = [*range(shift, n), *range(shift)]
    order.sort(key=keys.__getitem__)
    return tuple(map(ids.__getitem__, order))
