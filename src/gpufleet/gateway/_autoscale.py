"""The live autoscaler's hands: carrying out the pool controller's ``Scale`` commands.

The decisions are the pool controller's (``gpufleet.control``: when to decide, on what
view, with which standbys and held requests); the gateway only acts on them and shows them::

    Scale(decision, view) ──► actuator.promote(model, decision.promote)  # standbys join
                          ──► actuator.scale(model, decision.desired, decision.drain)
                          ──► gauges, counters, one JSON log line, the scale-up lag

It acts through :class:`ScaleActuator`, which ``gpufleet up`` implements on the local runtime
(the runtime may not import the policy, so plain counts and ids cross). Which standbys
exist comes from the actuator too (the shell reports them to the controller as ``Standbys``):
the gateway never routes to them, so it does not list them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpufleet.config import FleetConfig
from gpufleet.control import (
    PoolView,
    Scale,
    ScaleDecision,
    ScaleDirection,
    Standby,
    decision_record,
)
from gpufleet.fleet import ReplicaId

logger = logging.getLogger("gpufleet.autoscale")

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
class _Lag:
    up_since: float | None = None
    """When a still unmet scale-up was first decided."""
    up_target: int = 0


class ScaleExecutor:
    """Carries out one fleet's ``Scale`` commands through the actuator, and shows them."""

    def __init__(
        self, config: FleetConfig, actuator: ScaleActuator, registry: CollectorRegistry
    ) -> None:
        self.actuator = actuator
        self.metrics = AutoscaleMetrics(registry)
        self._lags = {m.name: _Lag() for m in config.models if m.autoscale is not None}
        self._models = tuple(self._lags)
        for model in self._lags:
            self.metrics.add_pool(model)

    @property
    def models(self) -> tuple[str, ...]:
        """The autoscaled pools."""
        return self._models

    def carry_out(self, now: float, scale: Scale) -> None:
        """Act on one decision, log it and export it; a failing actuator is logged (one
        pool's trouble must not stop the control loop)."""
        decision, view = scale.decision, scale.view
        model = view.model
        try:
            self._act(model, decision)
        except Exception:
            logger.exception("autoscaling %r failed", model)
        self._log(decision, view)
        self._export(model, decision, len(view.standbys), now)

    def held(self, model: str, held: int) -> None:
        self.metrics.held.labels(model).set(held)

    def hold_ended(self, model: str, outcome: str) -> None:
        """A held request was routed (``served``), timed out, or found the hold full."""
        self.metrics.held_outcomes.labels(model, outcome).inc()

    def _act(self, model: str, decision: ScaleDecision) -> None:
        if decision.promote:
            self.actuator.promote(model, decision.promote)
            self.metrics.actions.labels(model, "promote").inc(len(decision.promote))
        if decision.direction is not ScaleDirection.HOLD:
            self.actuator.scale(model, decision.desired, decision.drain)
            self.metrics.actions.labels(model, "cold_start").inc(decision.cold_starts)
            self.metrics.actions.labels(model, "drain").inc(len(decision.drain))

    def _export(self, model: str, decision: ScaleDecision, standbys: int, now: float) -> None:
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
        self._track_lag(model, decision, now)

    def _track_lag(self, model: str, decision: ScaleDecision, now: float) -> None:
        """Scale-up lag: from the first decision of a scale-up to as many routable replicas."""
        lag = self._lags[model]
        if decision.direction is ScaleDirection.UP:
            if lag.up_since is None:
                lag.up_since = now
            lag.up_target = max(lag.up_target, decision.desired)
        if lag.up_since is None:
            return
        if decision.inputs.ready >= lag.up_target:
            seconds = now - lag.up_since
            self.metrics.scale_up_lag.labels(model).observe(seconds)
            record = {"model": model, "event": "scaled_up", "replicas": lag.up_target}
            logger.info("autoscale %s", json.dumps({**record, "lag_s": round(seconds, 3)}))
            lag.up_since, lag.up_target = None, 0
        elif decision.desired < lag.up_target:
            lag.up_since, lag.up_target = None, 0  # no longer wanted: not a lag

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
