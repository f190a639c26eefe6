"""The gateway's routers over simulated replicas: the same policy objects, fed by the sim.

``PolicyRouting`` is the fleet simulator's twin of the gateway's routing shell. It holds one
router per model, made by the same :func:`gpufleet.policy.make_router` from the same fleet
file entry and seeded as the gateway seeds it, and feeds it the same three things::

    arrival ─► RouteRequest(model, prefix hashes, prompt tokens, session)
            ─► router.rank(now, request, view) ─► first replica ─► on_request_start
    finish  ─► on_request_end(now, request, replica, SUCCESS)  (refused: CLIENT_ERROR)
    scrape  ─► every scrape_interval: view = replicas' running / waiting / KV usage, as of now

What each input knows, and when, is modelled as in the gateway:

* **In-flight counts are fresh.** The router keeps its own count, moved by every
  ``on_request_start`` / ``on_request_end``, at the instant they happen.
* **Engine metrics are stale.** ``kv_aware`` and ``prefix_aware`` read running, waiting and
  KV-cache usage from a :class:`~gpufleet.fleet.FleetView` rebuilt only at each scrape, every
  ``scrape_interval`` simulated seconds (the fleet file's ``gateway.scrape_interval``), with
  ``observed_at`` set to the scrape's time. Between scrapes every ranking sees the same view
  object, as the gateway's routers do. Pools whose router reads no scrape (its config has
  no ``max_scrape_age``) are never scraped, as in the gateway.
* **Prefix hashes name token blocks.** The gateway hashes the prompt *text* in blocks of 512
  characters, each hash chained over the blocks before it (:func:`text_prefix_hashes`). The
  simulator has token ids, not text, so it chains hashes over blocks of
  :data:`PREFIX_HASH_TOKENS` = 128 token ids (512 characters at ~4 characters per token),
  at most 256 blocks, tail dropped. Equal prompt prefixes give equal hash chains in both,
  and a difference in a block changes that block's hash and every one after it: the
  property the prefix index relies on. Trace prefix blocks (``hash_ids``, 512 tokens) are
  whole multiples of 128, so requests that share ``k`` trace blocks share ``4k`` hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain, islice
from random import Random
from typing import Final

from gpufleet.config import RetryConfig
from gpufleet.fleet import (
    NO_LOAD,
    FleetView,
    Outcome,
    ProbeResult,
    ReplicaId,
    ReplicaLoad,
    ReplicaState,
    ReplicaView,
    RequestFinished,
    RouteRequest,
)
from gpufleet.policy import (
    EjectionRecord,
    HealthConfig,
    HealthDecision,
    HealthPolicy,
    PrefixAwareConfig,
    Router,
    RouterConfig,
    make_router,
    retry_allowed,
)
from gpufleet.sim._harness import FleetHarness
from gpufleet.sim._kernel import URGENT, Event, ScheduledEvent
from gpufleet.sim._replica_driver import ReplicaDriver
from gpufleet.sim._traces import TraceRequest

PREFIX_HASH_TOKENS: Final = 128
"""Token ids per prefix-hash block: the token count of the gateway's 512-character block."""
PREFIX_HASH_MAX_BLOCKS: Final = 256
"""At most this many blocks are hashed, as in the gateway."""
_LEAVING: Final = frozenset({ReplicaState.DRAINING, ReplicaState.STOPPED})
"""Runtime states of a replica that will not take new requests again."""


def token_prefix_hashes(
    ids: Sequence[int],
    block_tokens: int = PREFIX_HASH_TOKENS,
    max_blocks: int = PREFIX_HASH_MAX_BLOCKS,
) -> tuple[int, ...]:
    """Chained hashes of the first ``max_blocks`` full ``block_tokens``-id blocks of ``ids``.

    The token-id twin of :func:`gpufleet.fleet.text_prefix_hashes`: ``h0 = H(0, b0)``,
    ``h1 = H(h0, b1)``, … Hashes of integer tuples are not salted, so the chain is the same
    in every process (a seeded run stays one run).
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
    ids = tuple(ids)
    end = min(len(ids) // block_tokens, max_blocks) * block_tokens
    hashes: list[int] = []
    chained = 0
    for start in range(0, end, block_tokens):
        chained = hash((chained, ids[start : start + block_tokens]))
        hashes.append(chained)
    return tuple(hashes)


@dataclass(frozen=True, slots=True)
class SimPool:
    """One model's pool as the simulator lays it out: ``replicas`` drivers in a row."""

    name: str
    routing: RouterConfig
    replicas: int
    health: HealthConfig = field(default_factory=HealthConfig)
    scraped: bool = False
    """Scrape its engine metrics even if the router reads none (an autoscaled pool)."""


class _Pool:
    __slots__ = (
        "arrivals",
        "decision",
        "hashes",
        "health",
        "ids",
        "members",
        "name",
        "named",
        "router",
        "scraped",
    )

    def __init__(
        self,
        name: str,
        router: Router,
        config: RouterConfig,
        *,
        health: HealthPolicy,
        scraped: bool,
    ):
        self.name = name
        self.router = router
        self.ids: list[ReplicaId] = []
        """The pool's replicas (not stopped), oldest first: the runtime appends."""
        self.members: list[int] = []
        """Their driver indices, in the same order."""
        self.named = 0
        """Replicas ever named: the next one is ``<name>-<named>``."""
        self.health = health
        self.decision: HealthDecision | None = None
        self.scraped = scraped or hasattr(config, "max_scrape_age")
        """The router (or the autoscaler) reads engine metrics: the gateway scrapes it."""
        self.arrivals = 0
        """Requests routed to this pool so far (the autoscaler's demand)."""
        self.hashes = isinstance(config, PrefixAwareConfig)
        """The router reads prefix hashes (only then are they computed)."""


@dataclass(slots=True)
class _Open:
    """A request's attempt in flight, and the rest of its ranking (for retries)."""

    pool: _Pool
    request: RouteRequest
    replica: ReplicaId
    candidates: list[ReplicaId]
    retry: bool


@dataclass(frozen=True, slots=True)
class HealthWake:
    """Decide health again (a probe falls due, a breaker half-opens)."""

    target: PolicyRouting


class PolicyRouting:
    """A :class:`~gpufleet.sim.Routing` that asks the fleet file's routers and health policies.

    The initial drivers are laid out pool after pool, in the order of ``pools``; replica
    ``i`` of pool ``name`` is ``"<name>-<i>"``, the gateway's names. The replica set may
    change during a run (the autoscaler, ``gpufleet.sim._autoscale``): :meth:`add_replica`
    appends a driver to a pool, :meth:`drain_replica` stops routing to one and
    :meth:`remove_replica` takes it out of every view (its driver index stays, unused). A
    request goes to the pool its trace
    names (``TraceRequest.model``) when the fleet serves it, else to the first pool: traces
    name one model or none. Router ``i`` draws from ``Random(seed * 1000 + 2 * i)`` and
    health policy ``i`` from ``Random(seed * 1000 + 2 * i + 1)``, the gateway's seeding.

    Health is in the loop as in the gateway: every attempt's outcome goes to the pool's
    :class:`~gpufleet.policy.HealthPolicy` (``RequestFinished``), its decisions ask for
    probes, which are answered at once (``ProbeResult``: ok unless the replica is down),
    and routers read ``decision.apply(view)``. A request lost before its first token is
    retried on the next replica of its ranking, within ``retry.max_retries`` and the retry
    budget; one lost mid-stream is an error.

    Call :meth:`attach` after ``FleetHarness.start``.
    """

    __slots__ = (
        "_by_name",
        "_harness",
        "_index",
        "_last_end",
        "_loads",
        "_open",
        "_pool_index",
        "_pools",
        "_restarted",
        "_runtime",
        "_views",
        "_wake_at",
        "active_retries",
        "blackout",
        "ejections",
        "lost_mid_stream",
        "matched_blocks",
        "no_replica",
        "refused_pool",
        "retries",
        "retries_refused",
        "retry",
        "routed",
        "scrape_interval",
        "scrapes",
        "view",
    )

    def __init__(
        self,
        pools: Sequence[SimPool],
        *,
        seed: int,
        scrape_interval: float,
        retry: RetryConfig | None = None,
    ) -> None:
        if not pools:
            raise ValueError("a fleet needs at least one model")
        self._pools: list[_Pool] = []
        self._index: dict[ReplicaId, int] = {}
        self._views: list[ReplicaView] = []
        """Every replica ever, by driver index (a stopped one keeps its slot)."""
        self._pool_index: list[_Pool] = []
        self._loads: list[ReplicaLoad] = []
        self._runtime: list[ReplicaState] = []
        """What the runtime says of each replica: READY; STARTING from a crash to the end
        of its restart; DRAINING (scale-in: no new requests); STOPPED (gone)."""
        self._last_end: list[float] = []
        """When each replica's last request ended (a drained replica leaves then)."""
        for i, pool in enumerate(pools):
            if pool.replicas < 1:
                raise ValueError(f"model {pool.name!r} has no replicas to simulate")
            router = make_router(pool.routing, Random(seed * 1000 + 2 * i))
            health = HealthPolicy(pool.health, Random(seed * 1000 + 2 * i + 1))
            self._pools.append(
                _Pool(pool.name, router, pool.routing, health=health, scraped=pool.scraped)
            )
        self._by_name = {p.name: p for p in self._pools}
        for made, spec in zip(self._pools, pools, strict=True):
            for _ in range(spec.replicas):
                self._add(made, ReplicaState.READY)
        self._restarted: set[int] = set()
        self.blackout: set[int] = set()
        """Replicas whose scrapes do not update (a metric blackout)."""
        self.view = FleetView.of(0.0, self._views)
        """What the routers see: rebuilt at each scrape and health decision."""
        self.scrape_interval = scrape_interval
        self.retry = retry if retry is not None else RetryConfig()
        self._open: dict[int, _Open] = {}
        self._harness: FleetHarness | None = None
        self._wake_at: float | None = None
        self.scrapes = 0
        self.routed = 0
        self.matched_blocks = 0
        """Prefix blocks the router believed cached on the replicas it picked (prefix_aware)."""
        self.active_retries = 0
        self.retries = 0
        """Attempts after a failure before the first token."""
        self.retries_refused = 0
        """Retries not made: the retry budget was used up."""
        self.lost_mid_stream = 0
        self.no_replica = 0
        """Requests no replica could take (at arrival or on retry): the gateway's 503."""
        self.refused_pool: dict[int, str] = {}
        """The pool of each request that failed without ever reaching a replica."""
        self.ejections: list[EjectionRecord] = []
        """Every ejection record of every health decision, in order."""

    @property
    def replica_ids(self) -> list[ReplicaId]:
        """Every replica's name, in driver order (stopped ones included)."""
        return [r.id for r in self._views]

    def pool_names(self) -> list[str]:
        return [p.name for p in self._pools]

    def arrivals(self, model: str) -> int:
        """Requests routed to ``model``'s pool so far."""
        return self._by_name[model].arrivals

    def members(self, model: str) -> list[int]:
        """Driver indices of ``model``'s replicas that are not stopped, oldest first."""
        return list(self._by_name[model].members)

    def state(self, replica: int) -> ReplicaState:
        """What the runtime says of driver ``replica``."""
        return self._runtime[replica]

    def last_end(self, replica: int) -> float:
        return self._last_end[replica]

    def pool_of(self, request: TraceRequest) -> str:
        """The model that serves ``request``."""
        model = request.model
        return model if model is not None and model in self._by_name else self._pools[0].name

    def attach(self, harness: FleetHarness) -> None:
        """Scrape the routers' pools every ``scrape_interval`` and decide health now."""
        self._harness = harness
        if any(p.scraped for p in self._pools):
            drivers = harness.drivers
            harness.every(self.scrape_interval, lambda now: self.scrape(now, drivers))
        self.decide(harness.kernel.now)

    # -- the runtime's picture ----------------------------------------------------------

    def _add(self, pool: _Pool, state: ReplicaState, replica: ReplicaId | None = None) -> int:
        k = len(self._views)
        if replica is None:
            replica = ReplicaId(f"{pool.name}-{pool.named}")
            pool.named += 1
        if replica in self._index:
            raise ValueError(f"replica {replica!r} exists already")
        pool.ids.append(replica)
        pool.members.append(k)
        self._index[replica] = k
        self._views.append(ReplicaView(replica, pool.name, state))
        self._pool_index.append(pool)
        self._loads.append(NO_LOAD)
        self._runtime.append(state)
        self._last_end.append(0.0)
        return k

    def add_replica(self, now: float, model: str, replica: ReplicaId) -> int:
        """A new replica of ``model`` is up, as the harness's next driver (its index is
        returned): like a restart, its checks start over, so it is routable after its
        first probe (answered at once)."""
        k = self._add(self._by_name[model], ReplicaState.READY, replica)
        self._last_end[k] = now
        self._restarted.add(k)
        self.decide(now)
        self.decide(now)
        return k

    def drain_replica(self, now: float, replica: int) -> None:
        """Scale-in: ``replica`` takes no new request; it finishes those it has."""
        if self._runtime[replica] is not ReplicaState.STOPPED:
            self._runtime[replica] = ReplicaState.DRAINING
            self.decide(now)

    def remove_replica(self, now: float, replica: int) -> None:
        """``replica`` is gone (drained): out of the pool and of every view."""
        if self._runtime[replica] is ReplicaState.STOPPED:
            return
        self._runtime[replica] = ReplicaState.STOPPED
        pool = self._pool_index[replica]
        at = pool.members.index(replica)
        del pool.members[at]
        del pool.ids[at]
        self.decide(now)

    def replica_down(self, now: float, replica: int) -> None:
        """The runtime saw ``replica`` die; it is STARTING until :meth:`replica_up`
        (a draining or stopped replica stays so: it will not serve again)."""
        if self._runtime[replica] in _LEAVING:
            self.decide(now)
            return
        self._runtime[replica] = ReplicaState.STARTING
        self.decide(now)

    def replica_up(self, now: float, replica: int) -> None:
        """``replica`` restarted: a new process, whose checks start over.

        The first decision resets its checks (it is ``STARTING`` to it); the second sends
        the new process its first probe at once, as the gateway's health loop does when
        the runtime reports a new address.
        """
        if self._runtime[replica] in _LEAVING:
            return
        self._runtime[replica] = ReplicaState.READY
        self._restarted.add(replica)
        self.decide(now)
        self.decide(now)

    def scrape(self, now: float, drivers: Sequence[ReplicaDriver]) -> None:
        """One scrape round: every scraped replica's metrics as of ``now``.

        A replica that is down or blacked out keeps its last load (and its age).
        """
        loads = self._loads
        for pool in self._pools:
            if not pool.scraped:
                continue
            for k in pool.members:
                driver = drivers[k]
                if driver.down or k in self.blackout:
                    continue
                stats = driver.model.stats()
                loads[k] = ReplicaLoad(
                    running=stats.num_running,
                    waiting=stats.num_waiting,
                    kv_cache_usage=min(1.0, stats.kv_cache_usage),
                    observed_at=now,
                )
        self.scrapes += 1
        self._refresh(now)

    def _refresh(self, now: float) -> None:
        """Rebuild the routing view: runtime states, last loads, health decisions."""
        views = self._views
        loads, runtime = self._loads, self._runtime
        current: list[ReplicaView] = []
        for pool in self._pools:
            decision = pool.decision
            for k in pool.members:
                old = views[k]
                load, state = loads[k], runtime[k]
                if state is ReplicaState.READY:
                    decided = None if decision is None else decision.states.get(old.id)
                    state = decided if decided is not None else ReplicaState.STARTING
                if old.load is not load or old.state is not state:
                    old = views[k] = ReplicaView(old.id, old.model, state, load)
                current.append(old)
        self.view = FleetView.of(now, current)

    # -- health ---------------------------------------------------------------------------

    def decide(self, now: float) -> None:
        """Every pool's health decision at ``now``; probes answered; the next wake set."""
        wake: list[float] = []
        for pool in self._pools:
            wake_at = self._decide_pool(now, pool)
            if wake_at is not None:
                wake.append(wake_at)
        self._restarted.clear()
        self._refresh(now)
        harness = self._harness
        if harness is None or not wake or not harness.active:
            return
        at = max(min(wake), now)
        if self._wake_at is None or at < self._wake_at or self._wake_at < now:
            self._wake_at = at
            harness.kernel.schedule(at, URGENT, HealthWake(self))

    def _decide_pool(self, now: float, pool: _Pool) -> float | None:
        """One pool's decision, as the gateway's health loop makes it.

        A restarted replica is ``STARTING`` to the first decision after its restart, so its
        checks start over. Probes are answered at once (ok unless the replica is down); an
        answer that changes a verdict is decided on at once, as the gateway's prober wakes
        its loop.
        """
        runtime, restarted, health = self._runtime, self._restarted, pool.health
        first = True
        decision: HealthDecision | None = None
        for _ in range(3):
            members = []
            for k, replica in zip(pool.members, pool.ids, strict=True):
                state = runtime[k]
                if first and k in restarted and state is ReplicaState.READY:
                    state = ReplicaState.STARTING
                members.append(ReplicaView(replica, pool.name, state))
            decision = health.decide(now, FleetView(now, {pool.name: tuple(members)}))
            self.ejections.extend(decision.ejections)
            first = False
            again = False
            for replica in decision.probes:
                ok = runtime[self._index[replica]] is ReplicaState.READY
                again |= health.on_event(now, ProbeResult(replica, ok))
            if not again:
                break
        pool.decision = decision
        return None if decision is None else decision.next_at

    def on_event(self, now: float, event: Event) -> list[ScheduledEvent]:
        assert isinstance(event, HealthWake), event
        if self._wake_at is not None and now >= self._wake_at:
            self._wake_at = None
            self.decide(now)
        return []

    # -- requests -------------------------------------------------------------------------

    def route(
        self,
        now: float,
        index: int,
        request: TraceRequest,
        prompt: tuple[int, ...],
        replicas: Sequence[ReplicaDriver],
    ) -> int | None:
        pool = self._by_name[self.pool_of(request)]
        pool.arrivals += 1
        routed = RouteRequest(
            str(index),
            pool.name,
            prefix_hashes=token_prefix_hashes(prompt) if pool.hashes else (),
            prompt_tokens=len(prompt),
            session_key=request.session,
        )
        ranking = pool.router.rank(now, routed, self.view)
        self.routed += 1
        candidates = [
            r
            for r in islice(chain.from_iterable(ranking.tiers), 1 + self.retry.max_retries)
            if self._up(r, replicas)
        ]
        if not candidates:
            self.no_replica += 1
            self.refused_pool[index] = pool.name
            return None
        replica = candidates.pop(0)
        pool.router.on_request_start(now, routed, replica)
        self._open[index] = _Open(pool, routed, replica, candidates, False)
        self.matched_blocks += ranking.matched(replica)
        return self._index[replica]

    def _up(self, replica: ReplicaId, drivers: Sequence[ReplicaDriver]) -> bool:
        """The gateway skips replicas it has no address for (the process is gone) and,
        on a retry, one that began to drain since the ranking."""
        k = self._index[replica]
        return not drivers[k].down and self._runtime[k] not in _LEAVING

    def _close(self, now: float, index: int, outcome: Outcome) -> _Open:
        attempt = self._open.pop(index)
        if attempt.retry:
            self.active_retries -= 1
        attempt.pool.router.on_request_end(now, attempt.request, attempt.replica, outcome)
        attempt.pool.health.on_event(now, RequestFinished(attempt.replica, outcome))
        return attempt

    def on_end(self, now: float, index: int, replica: int, rejected: bool) -> None:
        self._last_end[replica] = now
        self._close(now, index, Outcome.CLIENT_ERROR if rejected else Outcome.SUCCESS)

    def on_lost(self, now: float, index: int, replica: int, started: bool) -> int | None:
        attempt = self._close(now, index, Outcome.REPLICA_ERROR)
        if started:
            self.lost_mid_stream += 1
            return None
        harness = self._harness
        drivers = harness.drivers if harness is not None else []
        while attempt.candidates:
            nxt = attempt.candidates.pop(0)
            if drivers and not self._up(nxt, drivers):
                continue
            retry = self.retry
            in_flight = harness.live if harness is not None else 0
            if not retry_allowed(
                self.active_retries,
                in_flight,
                budget_percent=retry.budget_percent,
                min_retry_concurrency=retry.min_retry_concurrency,
            ):
                self.retries_refused += 1
                break
            self.active_retries += 1
            self.retries += 1
            attempt.pool.router.on_request_start(now, attempt.request, nxt)
            self._open[index] = _Open(attempt.pool, attempt.request, nxt, attempt.candidates, True)
            return self._index[nxt]
        self.no_replica += 1
        return None

    def router(self, model: str) -> Router:
        """The router of ``model``'s pool (for tests: its ``snapshot()``)."""
        return self._by_name[model].router
