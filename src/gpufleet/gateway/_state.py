"""The gateway's picture of the fleet: replicas, their scraped load, health, and routers.

Synchronous and owned by the event loop's thread; the background loops and the request
handlers call it, and it calls the pure policies::

    source listener ──► set_replicas ─┐
    scraper        ──► set_loads    ─┼─► runtime view ──► decisions' states ──► routing view
    health loop    ──► decide       ─┘        (what the owner says)     (what routers read)

The routing view is rebuilt when something changes, never per request. A replica the health
policy has not yet decided on is ``STARTING`` (not routable), so a new or restarted replica
takes traffic only after its first probe answers.

N+1: a pool of ``replicas: n`` needs N = max(n - 1, 1) routable replicas and one spare. The
``pool_without_spare`` gauge follows every view; a warning is logged (``gpufleet.gateway``)
once each time a pool loses its spare, and an info line when it has one again. Until a pool
has been judged (no replica still ``STARTING``, or a spare seen once) nothing is logged, so a
fleet starting up does not warn.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from random import Random

from gpufleet.config import FleetConfig, ModelConfig
from gpufleet.fleet import (
    FleetEvent,
    FleetView,
    ReplicaId,
    ReplicaLoad,
    ReplicaState,
    ReplicaView,
)
from gpufleet.gateway._metrics import GatewayMetrics
from gpufleet.gateway._replicas import Upstream
from gpufleet.policy import (
    HealthDecision,
    HealthPolicy,
    Redundancy,
    Router,
    make_router,
    redundancy,
)

logger = logging.getLogger("gpufleet.gateway")

_STATES = tuple(ReplicaState)


def required_replicas(model: ModelConfig) -> int:
    """N of N+1 for a pool: all of its replicas but the spare (at least one)."""
    return max(model.replica_count - 1, 1)


def no_spare_message(check: Redundancy) -> str:
    """The N+1 warning for a pool without a spare (logged, and printed by ``gpufleet up``)."""
    return (
        f"pool {check.model!r} has no spare replica for N+1 redundancy: "
        f"{check.routable} routable, {check.required} needed + 1 spare"
    )


@dataclass(slots=True)
class Pool:
    """One model's router and health policy, and the last health decision."""

    config: ModelConfig
    router: Router
    health: HealthPolicy
    decision: HealthDecision | None = None


class FleetState:
    """Replicas by name, their loads, each pool's policies, and the routing view."""

    def __init__(
        self,
        config: FleetConfig,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        wake: Callable[[], None],
        on_gone: Callable[[Upstream], None] | None = None,
    ) -> None:
        seed = config.gateway.seed
        self.pools: dict[str, Pool] = {
            m.name: Pool(
                m,
                make_router(m.routing, Random(seed * 1000 + 2 * i)),
                HealthPolicy(m.health, Random(seed * 1000 + 2 * i + 1)),
            )
            for i, m in enumerate(config.models)
        }
        self.upstreams: dict[ReplicaId, Upstream] = {}
        self.loads: dict[ReplicaId, ReplicaLoad] = {}
        self._restarted: set[ReplicaId] = set()
        self._metrics = metrics
        self._clock = clock
        self._wake = wake
        self._on_gone = on_gone
        """Told of each replica that left the replica set (after its state is dropped)."""
        self.view = FleetView.of(clock(), ())
        self.spare: dict[str, bool | None] = dict.fromkeys(self.pools)
        """Each pool's last judged N+1 state (``None`` until judged)."""
        for name in self.pools:
            metrics.routable.labels(name).set(0)

    # -- inputs ---------------------------------------------------------------------------

    def set_replicas(self, replicas: Sequence[Upstream]) -> None:
        """The owner's list of replicas (every one, every time)."""
        known = self.upstreams
        fresh = {r.name: r for r in replicas if r.model in self.pools}
        for name, replica in fresh.items():
            old = known.get(name)
            if old is None or old.url != replica.url:
                self._restarted.add(name)
        gone = [known[name] for name in known.keys() - fresh.keys()]
        for replica in gone:
            self.loads.pop(replica.name, None)
            self._restarted.discard(replica.name)
            for state in _STATES:
                self._metrics.replica_state.remove(replica.name, state.value)
            # its other series and cached children (queue, KV, attempts, in flight)
            self._metrics.forget_replica(replica.name)
        self.upstreams = fresh
        if self._on_gone is not None:
            for replica in gone:
                self._on_gone(replica)
        self.refresh()
        self._wake()

    def set_loads(self, loads: Mapping[ReplicaId, ReplicaLoad]) -> None:
        """A scrape round's results."""
        for name, load in loads.items():
            if name in self.upstreams:
                self.loads[name] = load
                self._metrics.queue.labels(name).set(load.waiting)
                self._metrics.kv_usage.labels(name).set(load.kv_cache_usage)
        self.refresh()

    def on_event(self, now: float, model: str, event: FleetEvent) -> None:
        """A request outcome or probe answer for the pool's health policy."""
        pool = self.pools.get(model)
        if pool is not None and pool.health.on_event(now, event):
            self._wake()

    # -- decisions ------------------------------------------------------------------------

    def decide(self, now: float) -> tuple[list[ReplicaId], float | None]:
        """Every pool's health decision at ``now``: the probes to send and the next wake."""
        runtime = self._runtime_view(now, for_health=True)
        self._restarted.clear()
        probes: list[ReplicaId] = []
        wake: list[float] = []
        for name, pool in self.pools.items():
            decision = pool.health.decide(now, FleetView(now, {name: runtime.pool(name)}))
            pool.decision = decision
            probes.extend(decision.probes)
            if decision.next_at is not None:
                wake.append(decision.next_at)
            for record in decision.ejections:
                self._metrics.ejections.labels(
                    name, record.cause.value, "true" if record.enforced else "false"
                ).inc()
        self.refresh(now)
        return probes, min(wake, default=None)

    def refresh(self, now: float | None = None) -> None:
        """Rebuild the routing view from the replicas, their loads and the decisions."""
        now = self._clock() if now is None else now
        runtime = self._runtime_view(now, for_health=False)
        states: dict[ReplicaId, ReplicaState] = {}
        for replica in runtime.replicas():
            if replica.state is not ReplicaState.READY:
                continue  # the owner's state wins when it is not READY
            decision = self.pools[replica.model].decision
            decided = None if decision is None else decision.states.get(replica.id)
            states[replica.id] = decided if decided is not None else ReplicaState.STARTING
        self.view = runtime.with_states(states, now)
        self._export(self.view)

    def _runtime_view(self, now: float, *, for_health: bool) -> FleetView:
        replicas = []
        for name, upstream in self.upstreams.items():
            state = upstream.state if upstream.url is not None else ReplicaState.STARTING
            if for_health and name in self._restarted and state is ReplicaState.READY:
                state = ReplicaState.STARTING  # a new process: the checks start over
            load = self.loads.get(name)
            view = ReplicaView(name, upstream.model, state)
            replicas.append(view if load is None else dataclasses.replace(view, load=load))
        return FleetView.of(now, replicas)

    def _export(self, view: FleetView) -> None:
        gauge = self._metrics.replica_state
        for replica in view.replicas():
            for state in _STATES:
                gauge.labels(replica.id, state.value).set(1 if replica.state is state else 0)
        for name, pool in self.pools.items():
            self._metrics.routable.labels(name).set(len(view.routable(name)))
            check = redundancy(view, name, required=required_replicas(pool.config))
            self._metrics.no_spare.labels(name).set(0 if check.spare else 1)
            self._judge_spare(check, view)

    def _judge_spare(self, check: Redundancy, view: FleetView) -> None:
        """Log a pool's N+1 transitions, once each."""
        last = self.spare[check.model]
        if last is check.spare:
            return
        if (
            last is None
            and not check.spare
            and any(r.state is ReplicaState.STARTING for r in view.pool(check.model))
        ):
            return  # still starting up: not judged yet
        self.spare[check.model] = check.spare
        if not check.spare:
            logger.warning(no_spare_message(check))
        elif last is not None:
            logger.info(
                "pool %r has a spare replica again (%d routable)", check.model, check.routable
            )

    # -- questions ------------------------------------------------------------------------

    def ready(self) -> dict[str, int]:
        """Routable replicas per model."""
        return {name: len(self.view.routable(name)) for name in self.pools}
