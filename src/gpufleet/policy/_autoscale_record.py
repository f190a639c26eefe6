"""A scale decision as one flat JSON-able record: the gateway's log line, the simulator's
report event. One function, so the live and the simulated autoscaler say the same thing."""

from __future__ import annotations

from gpufleet.policy._autoscale import PoolView, ScaleDecision


def decision_record(decision: ScaleDecision, pool: PoolView) -> dict[str, object]:
    """``decision`` and its inputs; ``pool`` is the view it was decided on (held requests,
    standbys). Floats rounded (times to ms, rates and loads to 4 digits)."""
    inputs, forecast = decision.inputs, decision.forecast
    return {
        "model": decision.model,
        "at": round(decision.now, 3),
        "direction": decision.direction.value,
        "desired": decision.desired,
        "current": inputs.current,
        "ready": inputs.ready,
        "bound_by": decision.bound_by.value,
        "reason": decision.reason,
        "utilisation": _r4(inputs.utilisation),
        "panic_utilisation": round(inputs.panic_utilisation, 4),
        "stable_load": round(inputs.stable_load, 4),
        "panic_load": round(inputs.panic_load, 4),
        "demand": round(inputs.demand, 4),
        "capacity": _r4(inputs.capacity),
        "panic": inputs.panic,
        "held": pool.held,
        "standbys": len(pool.standbys),
        "forecast": None if forecast is None else round(forecast.demand, 4),
        "forecast_replicas": decision.forecast_replicas,
        "promote": list(decision.promote),
        "cold_starts": decision.cold_starts,
        "prewarm_starts": decision.prewarm_starts,
        "drain": list(decision.drain),
        "next_at": None if decision.next_at is None else round(decision.next_at, 3),
    }


def _r4(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
