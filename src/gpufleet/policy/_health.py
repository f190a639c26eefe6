"""Replica health: passive outlier detection, circuit breakers and active checks, after Envoy.

The shell reports what happened and asks for a decision; the policy never sends anything::

    health = HealthPolicy(HealthConfig(), rng)
    if health.on_event(now, RequestFinished(replica, Outcome.REPLICA_ERROR)):
        decision = health.decide(now, runtime_view)     # a threshold was crossed: decide now
    decision.probes          # GET /health on these now; report each as ProbeResult
    decision.ejections       # new ejection records (enforced or not): log them, count them
    routing_view = decision.apply(runtime_view)         # what the routers see
    decision.next_at         # call decide again no later than this

``decide`` is level-triggered: it looks at every replica of the view and at the memory the
events built up, and moves each breaker and probe schedule to where it belongs at ``now``,
whatever woke it up. Its input is the runtime's view (``STARTING``, ``READY``, ``DRAINING``,
``FAILED``, ``STOPPED``); the routing states ``EJECTED``, ``FAILED`` (probes failing) and
``STARTING`` (not yet probed) are its output, through :meth:`HealthDecision.apply`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from random import Random
from types import MappingProxyType

from gpufleet.fleet import (
    IN_SERVICE,
    FleetEvent,
    FleetView,
    Outcome,
    ProbeResult,
    ReplicaId,
    ReplicaState,
    ReplicaView,
    RequestFinished,
)
from gpufleet.policy._breaker import (
    EJECTED_PHASES,
    BreakerPhase,
    BreakerState,
    EjectionCause,
    close,
    decay,
    eject,
    forgive,
    half_open_if_due,
    record_outcome,
    tripped,
)
from gpufleet.policy._config import ActiveCheckConfig, HealthConfig
from gpufleet.policy._probe import (
    NEW_PROBE_STATE,
    ProbeState,
    ProbeStatus,
    answered,
    in_flight,
    periodic_due,
    sent,
)

_UP = frozenset({ReplicaState.READY, ReplicaState.EJECTED})
"""Runtime states of a process that serves (``EJECTED`` only if a routing view is fed back)."""
_FRESH = frozenset({ReplicaState.STARTING, ReplicaState.STOPPED, ReplicaState.FAILED})
"""Runtime states after which a replica must prove itself again to the active checks."""


@dataclass(frozen=True, slots=True)
class ReplicaHealth:
    """One replica's health memory: its circuit breaker and its active-check state."""

    breaker: BreakerState
    probe: ProbeState = NEW_PROBE_STATE

    def routing_state(self, runtime: ReplicaState, active: ActiveCheckConfig) -> ReplicaState:
        """The state routers should see, given what the runtime says."""
        if runtime not in _UP:
            return runtime
        if self.breaker.phase in EJECTED_PHASES:
            return ReplicaState.EJECTED
        if active.enabled:
            if self.probe.status is ProbeStatus.UNHEALTHY:
                return ReplicaState.FAILED
            if self.probe.status is ProbeStatus.UNKNOWN:
                return ReplicaState.STARTING
        return ReplicaState.READY


@dataclass(frozen=True, slots=True)
class EjectionRecord:
    """One line of the ejection log: an ejection made, dry-run, or refused by the limit."""

    at: float
    replica: ReplicaId
    model: str
    cause: EjectionCause
    enforced: bool
    """Carried out. ``False`` for a dry run (``enforcing``) or an ``overflow``."""
    overflow: bool
    """Refused because the pool already had ``max_ejection_percent`` ejected."""
    ejections: int
    """The replica's ejection count after this record."""
    duration: float
    """Seconds ejected (0 when not enforced)."""


@dataclass(frozen=True, slots=True)
class HealthDecision:
    """What the health policy decided at ``now``."""

    now: float
    replicas: Mapping[ReplicaId, ReplicaHealth]
    states: Mapping[ReplicaId, ReplicaState]
    """The routing state of each replica of the view."""
    probes: tuple[ReplicaId, ...]
    """Probe these now (``GET /health`` within ``active.timeout``); report ``ProbeResult``."""
    ejections: tuple[EjectionRecord, ...]
    """Ejection records made by this decision."""
    next_at: float | None
    """Decide again no later than this (a breaker half-opens, a probe falls due)."""

    def apply(self, view: FleetView) -> FleetView:
        """``view`` with each replica in its routing state: what the routers read."""
        return view.with_states(self.states, view.now)

    def ejected(self) -> frozenset[ReplicaId]:
        return frozenset(r for r, s in self.states.items() if s is ReplicaState.EJECTED)


@dataclass(frozen=True, slots=True)
class HealthSnapshot:
    replicas: Mapping[ReplicaId, ReplicaHealth]


def ejection_limit(pool: tuple[ReplicaView, ...], max_ejection_percent: float) -> int:
    """How many of the pool's replicas may be ejected at once (floor of the share)."""
    in_service = sum(1 for r in pool if r.state in IN_SERVICE)
    return math.floor(in_service * max_ejection_percent / 100.0 + 1e-9)


class HealthPolicy:
    """Outlier detection, circuit breakers and active checks for every replica of a fleet.

    Memory: one :class:`ReplicaHealth` per replica of the last view (replicas that leave
    the view are forgotten). Randomness: only the ``enforcing`` draw, from ``rng``.
    """

    def __init__(self, config: HealthConfig, rng: Random) -> None:
        self.config = config
        self._rng = rng
        self._replicas: dict[ReplicaId, ReplicaHealth] = {}

    def on_event(self, now: float, event: FleetEvent) -> bool:
        """Remember ``event``; ``True`` when a decision now would differ (decide soon)."""
        match event:
            case RequestFinished(outcome=outcome):
                return self.finished(now, event.replica, outcome)
            case ProbeResult(ok=ok):
                health = self._replicas.get(event.replica) or ReplicaHealth(BreakerState(since=now))
                probe = answered(health.probe, ok, now, self.config.active)
                self._replicas[event.replica] = ReplicaHealth(health.breaker, probe)
                return (
                    probe.status is not health.probe.status
                    or health.breaker.phase is BreakerPhase.HALF_OPEN
                )

    def finished(self, now: float, replica: ReplicaId, outcome: Outcome) -> bool:
        """:meth:`on_event` for a :class:`RequestFinished` (once per request: no event is
        built for it)."""
        health = self._replicas.get(replica) or ReplicaHealth(BreakerState(since=now))
        breaker = record_outcome(health.breaker, outcome)
        if breaker is not health.breaker:
            self._replicas[replica] = ReplicaHealth(breaker, health.probe)
        return tripped(breaker, self.config.outlier) is not None

    def decide(self, now: float, view: FleetView) -> HealthDecision:
        """Bring every replica of the runtime's ``view`` up to date at ``now``."""
        replicas: dict[ReplicaId, ReplicaHealth] = {}
        states: dict[ReplicaId, ReplicaState] = {}
        probes: list[ReplicaId] = []
        records: list[EjectionRecord] = []
        wake: list[float] = []
        active = self.config.active
        for pool in view.pools.values():
            # 1. time and probe answers move each breaker (half-open, close, reopen, decay)
            stepped = [self._advance(now, r, records) for r in pool]
            # 2. then failure runs may trip breakers, within the pool's ejection limit
            limit = ejection_limit(pool, self.config.outlier.max_ejection_percent)
            ejected = sum(
                1
                for r, b in zip(pool, stepped, strict=True)
                if r.state in IN_SERVICE and b.phase in EJECTED_PHASES
            )
            for replica, advanced in zip(pool, stepped, strict=True):
                breaker = advanced
                if replica.state in IN_SERVICE:
                    breaker = self._trip(now, replica, advanced, limit - ejected, records)
                    if breaker.phase is not advanced.phase:
                        ejected += 1
                # 3. probes: periodic checks, and the recovery probe of a half-open breaker
                old_probe = self._health(now, replica.id).probe
                probe, probe_now = self._probe(now, replica, breaker, old_probe)
                if probe_now:
                    probes.append(replica.id)
                health = ReplicaHealth(breaker, probe)
                replicas[replica.id] = health
                states[replica.id] = health.routing_state(replica.state, active)
                wake.extend(self._wake_times(now, replica, health))
        self._replicas = replicas
        return HealthDecision(
            now=now,
            replicas=MappingProxyType(replicas),
            states=MappingProxyType(states),
            probes=tuple(probes),
            ejections=tuple(records),
            next_at=min(wake, default=None),
        )

    def _health(self, now: float, replica: ReplicaId) -> ReplicaHealth:
        return self._replicas.get(replica) or ReplicaHealth(BreakerState(since=now))

    def _advance(
        self, now: float, replica: ReplicaView, records: list[EjectionRecord]
    ) -> BreakerState:
        """The breaker at ``now`` before new trips: half-open when due, then closed or
        reopened by a probe answered since, and decayed while closed."""
        outlier = self.config.outlier
        health = self._health(now, replica.id)
        if replica.state in _FRESH:
            # a new process (or none): the old one's ejection and failure runs are not its
            # own; the count is kept, so a process that fails again is ejected for longer
            fresh = health.breaker
            fresh = close(fresh, now) if fresh.phase in EJECTED_PHASES else forgive(fresh)
            return decay(fresh, now, outlier)  # its count decays (and wakes) as any closed
        breaker = half_open_if_due(health.breaker, now)
        answered_at = health.probe.answered_at
        if (
            breaker.phase is BreakerPhase.HALF_OPEN
            and answered_at is not None
            and answered_at >= breaker.since
        ):
            if health.probe.last_ok:
                return close(breaker, now)
            breaker = eject(breaker, now, outlier)
            cause = EjectionCause.RECOVERY_PROBE_FAILED
            records.append(_record(now, replica, breaker, cause, enforced=True))
            return breaker
        return decay(breaker, now, outlier)

    def _trip(
        self,
        now: float,
        replica: ReplicaView,
        breaker: BreakerState,
        room: int,
        records: list[EjectionRecord],
    ) -> BreakerState:
        """Open the breaker if a failure run crossed its threshold and the pool has ``room``
        for one more ejection."""
        outlier = self.config.outlier
        cause = tripped(breaker, outlier)
        if cause is None:
            return breaker
        overflow = room < 1
        if overflow or not self._enforce():
            records.append(_record(now, replica, breaker, cause, enforced=False, overflow=overflow))
            return forgive(breaker)
        breaker = eject(breaker, now, outlier)
        records.append(_record(now, replica, breaker, cause, enforced=True))
        return breaker

    def _enforce(self) -> bool:
        enforcing = self.config.outlier.enforcing
        if enforcing >= 1.0:
            return True
        return enforcing > 0.0 and self._rng.random() < enforcing

    def _probe(
        self, now: float, replica: ReplicaView, breaker: BreakerState, probe: ProbeState
    ) -> tuple[ProbeState, bool]:
        """The probe schedule at ``now``, and whether to probe now."""
        active = self.config.active
        if replica.state in _FRESH:
            return NEW_PROBE_STATE, False
        if replica.state not in _UP:
            return probe, False
        recovery = breaker.phase is BreakerPhase.HALF_OPEN and not (
            in_flight(probe, now, active)
            and probe.pending_since is not None
            and probe.pending_since >= breaker.since
        )
        if recovery or periodic_due(probe, now, active):
            return sent(probe, now, active), True
        return probe, False

    def _wake_times(self, now: float, replica: ReplicaView, health: ReplicaHealth) -> list[float]:
        breaker, probe, active = health.breaker, health.probe, self.config.active
        times: list[float] = []
        if breaker.phase is BreakerPhase.OPEN and breaker.open_until is not None:
            times.append(breaker.open_until)
        if breaker.phase is BreakerPhase.CLOSED and breaker.ejections > 0:
            times.append(breaker.since + self.config.outlier.base_ejection_time)
        if replica.state in _UP:
            if probe.pending_since is not None:
                times.append(probe.pending_since + 2 * active.timeout)
            elif active.enabled and probe.next_at is not None:
                times.append(probe.next_at)
        return [max(t, now) for t in times]

    def snapshot(self) -> HealthSnapshot:
        return HealthSnapshot(MappingProxyType(dict(self._replicas)))


def _record(
    now: float,
    replica: ReplicaView,
    breaker: BreakerState,
    cause: EjectionCause,
    *,
    enforced: bool,
    overflow: bool = False,
) -> EjectionRecord:
    duration = breaker.open_until - now if enforced and breaker.open_until is not None else 0.0
    return EjectionRecord(
        now, replica.id, replica.model, cause, enforced, overflow, breaker.ejections, duration
    )
