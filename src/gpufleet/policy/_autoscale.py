"""The autoscaling policy: how many replicas a model pool should have at ``now``, and which.

One ``decide(now, pool)`` records a utilisation sample, then composes guards around a core
rule, each a small named function over a :class:`ScaleProposal`::

    core (stable / panic window) → forecast floor → scale-down step → bounds (min, max, N+1)
      → hysteresis (cooldown, panic hold) → cold start (scale from / to zero)

and turns the result into actions: standbys to promote, cold starts, standbys to refill,
replicas to drain. The conserved quantity: ``current + promote + cold_starts - drain ==
desired``, where ``current`` counts the replicas that are or will be capacity (starting or in
service, not draining). See docs/design/autoscaling.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from gpufleet.fleet import IN_SERVICE, ROUTABLE, FleetView, ReplicaId, ReplicaState, ReplicaView
from gpufleet.policy._autoscale_config import AutoscaleConfig
from gpufleet.policy._autoscale_forecast import DemandForecaster, Forecast, ForecastSnapshot
from gpufleet.policy._autoscale_saturation import pool_utilisation

SCALED: Final = IN_SERVICE | {ReplicaState.STARTING}
"""States that count toward a pool's replicas: capacity now, or soon (not draining)."""

_EPS: Final = 1e-9


@dataclass(frozen=True, slots=True)
class Standby:
    """A prewarmed replica: initialised off the routing path, ready to join in seconds."""

    id: ReplicaId
    ready: bool
    """The model is loaded; ``False`` while it still warms."""
    since: float
    """When it became ready, or when it started warming."""


_NO_STANDBYS: tuple[Standby, ...] = ()


@dataclass(frozen=True, slots=True)
class PoolView:
    """One model pool as the autoscaler sees it at a decision."""

    model: str
    replicas: tuple[ReplicaView, ...]
    """The pool in the fleet view's order (oldest first: the runtime appends)."""
    demand: float = 0.0
    """Arrival rate at the gateway since the last decision (requests/s or tokens/s; one unit
    per pool, always the same)."""
    standbys: tuple[Standby, ...] = _NO_STANDBYS
    held: int = 0
    """Requests held at the gateway for want of a ready replica (scale from zero)."""

    @classmethod
    def of(
        cls,
        view: FleetView,
        model: str,
        *,
        in_flight: Callable[[ReplicaId], int] | None = None,
        starting: Iterable[ReplicaId] = (),
        demand: float = 0.0,
        standbys: tuple[Standby, ...] = _NO_STANDBYS,
        held: int = 0,
    ) -> PoolView:
        """The pool as every shell builds it: ``model``'s replicas in the routing view, each
        with the shell's own ``in_flight`` count (fresher than the view's, which is as of its
        last build), then the ``starting`` replicas the view does not list yet (the
        simulator's cold starts), as ``STARTING``."""
        replicas = view.pool(model)
        if in_flight is not None:
            replicas = tuple(
                dataclasses.replace(r, load=dataclasses.replace(r.load, in_flight=n))
                if (n := in_flight(r.id)) != r.load.in_flight
                else r
                for r in replicas
            )
        extra = tuple(ReplicaView(rid, model, ReplicaState.STARTING) for rid in starting)
        return cls(model, replicas + extra if extra else replicas, demand, standbys, held)


class ScaleGuard(StrEnum):
    """The step of the chain that set the decision's replica count."""

    STABLE = "stable"
    PANIC = "panic"
    NO_SIGNAL = "no_signal"
    FORECAST = "forecast"
    STEP = "step"
    MIN = "min"
    MAX = "max"
    REDUNDANCY = "redundancy"
    COOLDOWN = "cooldown"
    PANIC_HOLD = "panic_hold"
    COLD_START = "cold_start"
    IDLE = "idle"


class ScaleDirection(StrEnum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


@dataclass(frozen=True, slots=True)
class UtilisationSample:
    """The pool's mean saturation over ``ready`` replicas, with the demand, at ``at``."""

    at: float
    ready: int
    utilisation: float
    demand: float

    @property
    def load(self) -> float:
        """Total saturation: the replicas' worth of work the pool holds."""
        return self.ready * self.utilisation


@dataclass(frozen=True, slots=True)
class ScaleInputs:
    """What a decision was computed from (logged with it, exported as metrics)."""

    current: int
    ready: int
    utilisation: float | None
    """Mean saturation over ready replicas now (``None`` without one)."""
    panic_utilisation: float
    """Mean utilisation over the panic window."""
    stable_load: float
    panic_load: float
    demand: float
    capacity: float | None
    """Demand one replica serves at saturation 1, as last estimated."""
    panic: bool


@dataclass(frozen=True, slots=True)
class ScaleProposal:
    """A replica count on its way through the guards, with the guard that last set it."""

    replicas: int
    bound_by: ScaleGuard
    reason: str


@dataclass(frozen=True, slots=True)
class ScaleDecision:
    """What the autoscaler decided at ``now`` for one pool."""

    now: float
    model: str
    desired: int
    direction: ScaleDirection
    bound_by: ScaleGuard
    reason: str
    inputs: ScaleInputs
    forecast: Forecast | None
    forecast_replicas: int | None
    promote: tuple[ReplicaId, ...]
    """Standbys to route to now, best first (ready before warming, longest ready first)."""
    cold_starts: int
    """Replicas to launch from nothing (each costs the provisioning horizon)."""
    prewarm_starts: int
    """Standbys to start warming, to refill the prewarm pool."""
    drain: tuple[ReplicaId, ...]
    """Replicas to stop routing to; each leaves when its in-flight requests finish."""
    next_at: float | None
    """Decide again no later than this (a cooldown or panic hold ends)."""


@dataclass(frozen=True, slots=True)
class AutoscaleSnapshot:
    samples: tuple[UtilisationSample, ...]
    last_up: float | None
    last_down: float | None
    last_direction: ScaleDirection
    panic_until: float | None
    active_at: float | None
    capacity: float | None
    forecast: ForecastSnapshot


@dataclass(frozen=True, slots=True)
class ScaleHistory:
    """When the pool last grew or shrank, and until when it is in panic."""

    last_up: float | None = None
    last_down: float | None = None
    panic_until: float | None = None


@dataclass(slots=True)
class _State:
    samples: deque[UtilisationSample] = field(default_factory=deque)
    last_up: float | None = None
    last_down: float | None = None
    last_direction: ScaleDirection = ScaleDirection.HOLD
    panic_until: float | None = None
    active_at: float | None = None
    """Last time the pool had demand, load or held requests (first decision: start)."""
    capacity: float | None = None

    def history(self) -> ScaleHistory:
        return ScaleHistory(self.last_up, self.last_down, self.panic_until)


class AutoscalePolicy:
    """Pure autoscaler of one model pool: ``decide(now, pool)``, memory in named fields."""

    def __init__(self, config: AutoscaleConfig, max_num_seqs: int) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.config = config
        self.max_num_seqs = max_num_seqs
        """The pool's engines' running-batch cap (``ModelConfig.max_num_seqs``), for
        :func:`saturation`: the same value the pool's admission gate judges by."""
        self._state = _State()
        self._forecaster = DemandForecaster(config.forecast)

    def decide(self, now: float, pool: PoolView) -> ScaleDecision:
        config, state = self.config, self._state
        if state.samples and now < state.samples[-1].at:
            raise ValueError(f"now ({now}) is before the last decision ({state.samples[-1].at})")
        inputs = self._observe(now, pool)
        forecast = self._forecast(now)
        forecast_replicas = _forecast_replicas(forecast, state.capacity, config)
        idle = _idle(now, state.active_at, config)

        p = _core(inputs, config)
        p = _apply_forecast_floor(p, forecast_replicas)
        p = _apply_step(p, inputs.current, config)
        p = _apply_bounds(p, inputs.stable_load, config)
        p = _apply_hysteresis(p, inputs.current, now, state.history(), config)
        p = _apply_cold_start(p, inputs.current, pool, idle, config)

        direction = _direction(p.replicas, inputs.current)
        if direction is ScaleDirection.UP:
            state.last_up = now
        elif direction is ScaleDirection.DOWN:
            state.last_down = now
        if direction is not ScaleDirection.HOLD:
            state.last_direction = direction
        promote, cold = _scale_up(pool.standbys, max(0, p.replicas - inputs.current))
        return ScaleDecision(
            now=now,
            model=pool.model,
            desired=p.replicas,
            direction=direction,
            bound_by=p.bound_by,
            reason=p.reason,
            inputs=inputs,
            forecast=forecast,
            forecast_replicas=forecast_replicas,
            promote=promote,
            cold_starts=cold,
            prewarm_starts=max(0, config.prewarm - (len(pool.standbys) - len(promote))),
            drain=choose_drain(pool.replicas, max(0, inputs.current - p.replicas)),
            next_at=self._next_at(now),
        )

    def snapshot(self) -> AutoscaleSnapshot:
        s = self._state
        return AutoscaleSnapshot(
            tuple(s.samples),
            s.last_up,
            s.last_down,
            s.last_direction,
            s.panic_until,
            s.active_at,
            s.capacity,
            self._forecaster.snapshot(),
        )

    # -- memory ---------------------------------------------------------------------------

    def _observe(self, now: float, pool: PoolView) -> ScaleInputs:
        """Record this decision's sample and demand; return the windows' view of them."""
        config, state = self.config, self._state
        ready = [r for r in pool.replicas if r.state in ROUTABLE]
        current = sum(1 for r in pool.replicas if r.state in SCALED)
        utilisation = pool_utilisation(ready, self.max_num_seqs)
        if utilisation is not None:
            state.samples.append(UtilisationSample(now, len(ready), utilisation, pool.demand))
        while state.samples and state.samples[0].at <= now - config.stable_window:
            state.samples.popleft()
        self._forecaster.observe(now, pool.demand)
        stable = _window(state.samples, now, config.stable_window)
        panic_samples = _window(state.samples, now, config.panic_window)
        stable_load = _mean([s.load for s in stable])
        panic_load = _mean([s.load for s in panic_samples])
        panic_utilisation = _mean([s.utilisation for s in panic_samples])
        stable_demand = _mean([s.demand for s in stable])
        if stable_load > 0.05 and stable_demand > 0.0:
            state.capacity = stable_demand / stable_load
        if state.active_at is None or pool.demand > 0.0 or pool.held > 0 or stable_load > 0.0:
            state.active_at = now
        if utilisation is not None and _panic_trigger(panic_utilisation, config):
            state.panic_until = now + config.stable_window
        in_panic = state.panic_until is not None and now < state.panic_until
        return ScaleInputs(
            current,
            len(ready),
            utilisation,
            panic_utilisation,
            stable_load,
            panic_load,
            pool.demand,
            state.capacity,
            in_panic,
        )

    def _forecast(self, now: float) -> Forecast | None:
        if not self.config.forecast.enabled:
            return None
        return self._forecaster.forecast(now, self.config.provisioning_horizon)

    def _next_at(self, now: float) -> float | None:
        s, cooldown = self._state, self.config.scale_down_cooldown
        changes = [t for t in (s.last_up, s.last_down) if t is not None]
        due = [t + cooldown for t in changes if t + cooldown > now]
        if s.panic_until is not None and s.panic_until > now:
            due.append(s.panic_until)
        return max(due) if due else None


# -- the guards, in order ---------------------------------------------------------------------


def _core(inputs: ScaleInputs, config: AutoscaleConfig) -> ScaleProposal:
    """Replicas for the stable window's load at the target; the panic window's if larger."""
    if inputs.utilisation is None:
        return ScaleProposal(inputs.current, ScaleGuard.NO_SIGNAL, "no ready replica to measure")
    target = config.target_utilisation
    stable = _replicas_for(inputs.stable_load, target)
    if inputs.panic:
        panic = _replicas_for(inputs.panic_load, target)
        if panic > stable:
            return ScaleProposal(
                panic, ScaleGuard.PANIC, f"panic window load {inputs.panic_load:.2f}"
            )
    return ScaleProposal(stable, ScaleGuard.STABLE, f"stable window load {inputs.stable_load:.2f}")


def _apply_forecast_floor(p: ScaleProposal, forecast_replicas: int | None) -> ScaleProposal:
    """The forecast over the provisioning horizon is a floor under the reactive count."""
    if forecast_replicas is not None and forecast_replicas > p.replicas:
        return ScaleProposal(
            forecast_replicas, ScaleGuard.FORECAST, "forecast demand at the horizon"
        )
    return p


def _apply_step(p: ScaleProposal, current: int, config: AutoscaleConfig) -> ScaleProposal:
    """Scale in by at most ``scale_down_step`` at once; scale out by any amount."""
    if p.replicas < current - config.scale_down_step:
        return ScaleProposal(
            current - config.scale_down_step, ScaleGuard.STEP, "one scale-down step"
        )
    return p


def _apply_bounds(p: ScaleProposal, stable_load: float, config: AutoscaleConfig) -> ScaleProposal:
    """Within ``[lower, max_replicas]``; ``lower`` is ``min_replicas`` and N+1 for the load."""
    if p.replicas > config.max_replicas:
        return ScaleProposal(config.max_replicas, ScaleGuard.MAX, "max_replicas")
    floor = redundancy_floor(stable_load, config)
    if p.replicas < floor and floor > config.min_replicas:
        return ScaleProposal(floor, ScaleGuard.REDUNDANCY, f"N+1 for load {stable_load:.2f}")
    if p.replicas < config.min_replicas:
        return ScaleProposal(config.min_replicas, ScaleGuard.MIN, "min_replicas")
    return p


def _apply_hysteresis(
    p: ScaleProposal, current: int, now: float, history: ScaleHistory, config: AutoscaleConfig
) -> ScaleProposal:
    """No scale-in during a panic, nor within ``scale_down_cooldown`` of any scale decision."""
    if p.replicas >= current:
        return p
    held = min(current, config.max_replicas)
    until = history.panic_until
    if until is not None and now < until:
        return ScaleProposal(held, ScaleGuard.PANIC_HOLD, f"no scale-in in panic until {until:g}")
    last = max((t for t in (history.last_up, history.last_down) if t is not None), default=None)
    if last is not None and now - last < config.scale_down_cooldown:
        return ScaleProposal(held, ScaleGuard.COOLDOWN, f"cooldown since {last:g}")
    return p


def _apply_cold_start(
    p: ScaleProposal, current: int, pool: PoolView, idle: bool, config: AutoscaleConfig
) -> ScaleProposal:
    """Scale to zero only when idle; from zero at once when requests arrive."""
    if not config.scale_to_zero:
        return p
    waiting = pool.held > 0 or pool.demand > 0.0
    if p.replicas == 0 and current == 0 and waiting:
        return ScaleProposal(1, ScaleGuard.COLD_START, "requests with no replica")
    if p.replicas == 0 and current > 0 and not idle:
        return ScaleProposal(1, ScaleGuard.IDLE, "not idle long enough for zero")
    return p


# -- helpers ----------------------------------------------------------------------------------


def redundancy_floor(load: float, config: AutoscaleConfig) -> int:
    """N+1 replicas, N the replicas ``load`` fills at saturation 1 (capped at max); a
    scale-to-zero pool, which has chosen cost over a spare, gets N."""
    needed = math.ceil(load - _EPS) if load > 0.0 else 0
    spare = 0 if config.scale_to_zero or needed == 0 else 1
    return min(needed + spare, config.max_replicas)


def choose_drain(replicas: tuple[ReplicaView, ...], n: int) -> tuple[ReplicaId, ...]:
    """The ``n`` replicas to drain: those not serving first (failed, ejected, starting),
    then the fewest requests in flight, the emptiest KV cache, the newest."""
    if n <= 0:
        return ()
    counted = [(i, r) for i, r in enumerate(replicas) if r.state in SCALED]
    ranked = sorted(
        counted,
        key=lambda ir: (
            ir[1].state in ROUTABLE,
            ir[1].load.in_flight,
            ir[1].load.kv_cache_usage,
            -ir[0],
        ),
    )
    return tuple(r.id for _, r in ranked[:n])


def _scale_up(standbys: tuple[Standby, ...], n: int) -> tuple[tuple[ReplicaId, ...], int]:
    """Promote up to ``n`` standbys (ready first, longest ready first); cold-start the rest."""
    ranked = sorted(standbys, key=lambda s: (not s.ready, s.since, s.id))
    promote = tuple(s.id for s in ranked[:n])
    return promote, n - len(promote)


def _forecast_replicas(
    forecast: Forecast | None, capacity: float | None, config: AutoscaleConfig
) -> int | None:
    if forecast is None or capacity is None or capacity <= 0.0:
        return None
    load = min(forecast.demand / capacity, float(config.max_replicas))  # no inf from tiny rates
    return _replicas_for(load, config.target_utilisation)


def _panic_trigger(panic_utilisation: float, config: AutoscaleConfig) -> bool:
    """The panic window's utilisation reached ``panic_threshold`` × the target."""
    return panic_utilisation >= config.panic_threshold * config.target_utilisation


def _idle(now: float, active_at: float | None, config: AutoscaleConfig) -> bool:
    return active_at is not None and now - active_at >= config.idle_time


def _replicas_for(load: float, target: float) -> int:
    return max(0, math.ceil(load / target - _EPS))


def _direction(desired: int, current: int) -> ScaleDirection:
    if desired > current:
        return ScaleDirection.UP
    if desired < current:
        return ScaleDirection.DOWN
    return ScaleDirection.HOLD


def _window(
    samples: deque[UtilisationSample], now: float, window: float
) -> list[UtilisationSample]:
    return [s for s in samples if s.at > now - window]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
