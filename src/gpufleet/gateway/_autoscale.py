"""The live autoscaler: the gateway's loop around the pure ``AutoscalePolicy`` of each pool.

The gateway owns what the policy needs — the fleet view with scraped saturation, its own
in-flight counts, the arrivals it counted, the requests it holds — so the loop lives here::

    every `autoscaler.interval` s (sooner at decision.next_at, or when a request is held
    at an empty pool):
        pool = PoolView.of(view, model, in_flight=…, demand=…, standbys=…, held=…)
        decision = policy.decide(now, pool)
        actuator.promote(model, decision.promote)            # standbys join in seconds
        actuator.scale(model, decision.desired, decision.drain)   # cold starts, drains
        log one JSON line; export gauges and counters

It acts through :class:`ScaleActuator`, which ``gpufleet up`` implements on the local runtime
(the runtime may not import the policy, so plain counts and ids cross). Which standbys
exist comes from the actuator too: the gateway never routes to them, so it does not list them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpufleet.config import FleetConfig
from gpufleet.fleet import ReplicaId
from gpufleet.gateway._errors import NoReplicaError
from gpufleet.gateway._state import FleetState
from gpufleet.policy import (
    AutoscaleConfig,
    AutoscalePolicy,
    PoolView,
    ScaleDecision,
    ScaleDirection,
    Standby,
    decision_record,
)

logger = logging.getLogger("gpufleet.autoscale")

_MIN_GAP: Final = 0.05
"""Seconds between two decisions at least, however often the loop is woken."""
_HOLD_POLL: Final = 0.05
"""Seconds between two looks of a held request at its pool."""
_LAG_BUCKETS: Final = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ScaleActuator(Protocol):
    """What acts on the autoscaler's decisions (``gpufleet up``: the local runtime)."""

    def scale(self, pool: str, count: int, remove: Sequence[ReplicaId] = ()) -> None:
        """Serve ``count`` replicas, retiring the ``remove``d ones first (drained: no new
        requests, stopped when their in-flight requests are done or a deadline passed)."""
        ...

    def promote(self, pool: str, replicas: Sequence[ReplicaId]) -> None:
        """Move these standbys into service, and refill the standby pool."""
        ...

    def standbys(self, pool: str) -> tuple[Standby, ...]:
        """The pool's prewarmed standbys now (ready or still warming)."""
        ...


class AutoscaleMetrics:
    """The autoscaler's gauges and counters (names in docs/gateway.md)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        p = "gpufleet:autoscale_"

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(p + name, doc, ["model"], registry=registry)

        self.desired = gauge("desired_replicas", "Replicas the last decision wants.")
        self.current = gauge(
            "current_replicas", "Replicas that are or will be capacity (starting or serving)."
        )
        self.ready = gauge("ready_replicas", "Replicas the pool routes to now.")
        self.standbys = gauge("standby_replicas", "Prewarmed standbys, ready or warming.")
        self.utilisation = gauge(
            "utilisation", "Mean saturation of the ready replicas (policy.saturation)."
        )
        self.panic_utilisation = gauge("panic_utilisation", "Mean over the panic window.")
        self.stable_load = gauge("stable_load", "Total saturation over the stable window.")
        self.demand = gauge("demand", "Requests per second arrived since the last decision.")
        self.forecast = gauge("forecast_demand", "Demand forecast at the provisioning horizon.")
        self.forecast_replicas = gauge(
            "forecast_replicas", "Replicas the forecast asks for (its floor)."
        )
        self.panic = gauge("panic", "1 while the pool is in panic mode.")
        self.held = gauge("held_requests", "Requests held for want of a ready replica.")
        self.decisions = Counter(
            p + "decisions",
            "Decisions, by direction and by the guard that set the count.",
            ["model", "direction", "bound_by"],
            registry=registry,
        )
        self.actions = Counter(
            p + "actions",
            "Replicas acted on: promoted standbys, cold starts, drains.",
            ["model", "action"],
            registry=registry,
        )
        self.held_outcomes = Counter(
            p + "held",
            "Held requests by outcome: served (a replica became ready), timeout, full.",
            ["model", "outcome"],
            registry=registry,
        )
        self.scale_up_lag = Histogram(
            p + "scale_up_lag_seconds",
            "From a decision to scale up to the pool routing to that many replicas.",
            ["model"],
            buckets=_LAG_BUCKETS,
            registry=registry,
        )

    def add_pool(self, model: str) -> None:
        for action in ("promote", "cold_start", "drain"):
            self.actions.labels(model, action)
        for outcome in ("served", "timeout", "full"):
            self.held_outcomes.labels(model, outcome)
        self.scale_up_lag.labels(model)


@dataclass(slots=True)
class _Pool:
    config: AutoscaleConfig
    policy: AutoscalePolicy
    arrivals: int = 0
    held: int = 0
    last_at: float | None = None
    up_since: float | None = None
    """When a still unmet scale-up was first decided."""
    up_target: int = 0
    last: ScaleDecision | None = None


class AutoscaleController:
    """One policy per autoscaled model; ``run()`` is the loop, ``hold()`` the held queue."""

    def __init__(
        self,
        config: FleetConfig,
        fleet: FleetState,
        actuator: ScaleActuator,
        registry: CollectorRegistry,
        *,
        clock: Callable[[], float],
        in_flight: Callable[[ReplicaId], int],
    ) -> None:
        settings = config.gateway.autoscaler
        self.interval = settings.interval
        self.hold_requests = settings.hold_requests
        self.hold_timeout = settings.hold_timeout
        self.retry_after = config.gateway.retry_after
        self.pools = {
            m.name: _Pool(m.autoscale, AutoscalePolicy(m.autoscale, m.max_num_seqs))
            for m in config.models
            if m.autoscale is not None
        }
        self.metrics = AutoscaleMetrics(registry)
        for model in self.pools:
            self.metrics.add_pool(model)
        self._fleet = fleet
        self._actuator = actuator
        self._clock = clock
        self._in_flight = in_flight
        self._wake = asyncio.Event()

    # -- what the request path calls --------------------------------------------------------

    def arrived(self, model: str) -> None:
        """Count one request for ``model``'s demand."""
        pool = self.pools.get(model)
        if pool is not None:
            pool.arrivals += 1

    def holds(self, model: str) -> bool:
        """Whether a request for ``model`` that finds no routable replica waits for one."""
        return model in self.pools and self.hold_requests > 0

    async def hold(self, model: str) -> None:
        """Wait until ``model`` has a routable replica; ``NoReplicaError`` (503 with
        ``Retry-After``) when the hold queue is full or ``hold_timeout`` passes first."""
        pool = self.pools[model]
        if pool.held >= self.hold_requests:
            self.metrics.held_outcomes.labels(model, "full").inc()
            raise NoReplicaError(
                f"no replica of `{model}` is ready and {pool.held} requests already wait for one",
                self.retry_after,
            )
        pool.held += 1
        self.metrics.held.labels(model).set(pool.held)
        if pool.held == 1:
            self._wake.set()  # a pool at zero cold-starts now, not at the next tick
        try:
            async with asyncio.timeout(self.hold_timeout):
                while not self._fleet.view.routable(model):
                    await asyncio.sleep(_HOLD_POLL)
        except TimeoutError:
            self.metrics.held_outcomes.labels(model, "timeout").inc()
            raise NoReplicaError(
                f"no replica of `{model}` became ready within {self.hold_timeout:g} s",
                self.retry_after,
            ) from None
        finally:
            pool.held -= 1
            self.metrics.held.labels(model).set(pool.held)
        self.metrics.held_outcomes.labels(model, "served").inc()

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Decide for every pool, act, sleep until the next decision is due or woken."""
        while True:
            self._wake.clear()
            now = self._clock()
            due = self.tick(now)
            delay = self.interval if due is None else min(self.interval, due - now)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(delay, _MIN_GAP)):
                    await self._wake.wait()

    def tick(self, now: float) -> float | None:
        """One decision per pool at ``now``, acted on; the earliest ``next_at``."""
        due: list[float] = []
        for model, pool in self.pools.items():
            try:
                decision = self._decide(now, model, pool)
            except Exception:  # one pool's bug must not stop the others' scaling
                logger.exception("autoscaling %r failed", model)
                continue
            if decision.next_at is not None:
                due.append(decision.next_at)
        return min(due, default=None)

    def _decide(self, now: float, model: str, pool: _Pool) -> ScaleDecision:
        elapsed = None if pool.last_at is None else now - pool.last_at
        demand = pool.arrivals / elapsed if elapsed and elapsed > 0 else 0.0
        pool.arrivals, pool.last_at = 0, now
        view = PoolView.of(
            self._fleet.view,
            model,
            in_flight=self._in_flight,
            demand=demand,
            standbys=self._actuator.standbys(model),
            held=pool.held,
        )
        decision = pool.policy.decide(now, view)
        pool.last = decision
        self._act(model, decision)
        self._log(decision, view)
        self._export(model, decision, pool, len(view.standbys), now)
        return decision

    def _act(self, model: str, decision: ScaleDecision) -> None:
        if decision.promote:
            self._actuator.promote(model, decision.promote)
            self.metrics.actions.labels(model, "promote").inc(len(decision.promote))
        if decision.direction is not ScaleDirection.HOLD:
            self._actuator.scale(model, decision.desired, decision.drain)
            self.metrics.actions.labels(model, "cold_start").inc(decision.cold_starts)
            self.metrics.actions.labels(model, "drain").inc(len(decision.drain))

    def _export(
        self, model: str, decision: ScaleDecision, pool: _Pool, standbys: int, now: float
    ) -> None:
        m, inputs = self.metrics, decision.inputs
        m.desired.labels(model).set(decision.desired)
        m.current.labels(model).set(inputs.current)
        m.ready.labels(model).set(inputs.ready)
        m.standbys.labels(model).set(standbys)
        m.utilisation.labels(model).set(inputs.utilisation or 0.0)
        m.panic_utilisation.labels(model).set(inputs.panic_utilisation)
        m.stable_load.labels(model).set(inputs.stable_load)
        m.demand.labels(model).set(inputs.demand)
        m.panic.labels(model).set(1 if inputs.panic else 0)
        if decision.forecast is not None:
            m.forecast.labels(model).set(decision.forecast.demand)
        if decision.forecast_replicas is not None:
            m.forecast_replicas.labels(model).set(decision.forecast_replicas)
        m.decisions.labels(model, decision.direction.value, decision.bound_by.value).inc()
        self._track_lag(model, decision, pool, now)

    def _track_lag(self, model: str, decision: ScaleDecision, pool: _Pool, now: float) -> None:
        """Scale-up lag: from the first decision of a scale-up to as many routable replicas."""
        if decision.direction is ScaleDirection.UP:
            if pool.up_since is None:
                pool.up_since = now
            pool.up_target = max(pool.up_target, decision.desired)
        if pool.up_since is None:
            return
        if decision.inputs.ready >= pool.up_target:
            lag = now - pool.up_since
            self.metrics.scale_up_lag.labels(model).observe(lag)
            record = {"model": model, "event": "scaled_up", "replicas": pool.up_target}
            logger.info("autoscale %s", json.dumps({**record, "lag_s": round(lag, 3)}))
            pool.up_since, pool.up_target = None, 0
        elif decision.desired < pool.up_target:
            pool.up_since, pool.up_target = None, 0  # no longer wanted: not a lag

    @staticmethod
    def _log(decision: ScaleDecision, view: PoolView) -> None:
        acted = (
            decision.direction is not ScaleDirection.HOLD
            or decision.promote
            or decision.drain
            or decision.cold_starts
        )
        level = logging.INFO if acted else logging.DEBUG
        if logger.isEnabledFor(level):
            logger.log(level, "autoscale %s", json.dumps(decision_record(decision, view)))
