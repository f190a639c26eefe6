"""The circuit breaker of one replica, opened by passive outlier detection.

A value with pure transitions; :class:`~gpufleet.policy.HealthPolicy` strings them together::

              consecutive failures ≥ threshold (and the pool may lose one more)
    CLOSED ───────────────────────────────────────────────► OPEN   for min(n × base, max)
      ▲                                                       │    (n = ejections so far)
      │ a probe answered OK                                   │ now ≥ open_until
      │ after entering half-open                              ▼
      └──────────────────────────────────────────────── HALF_OPEN ── probe fails ──► OPEN
                                                                                    (n + 1)

Failures are counted in two runs, replica-origin (5xx) and local-origin (connect failure,
timeout), each reset by the outcomes that prove it wrong: any response resets both; a 5xx
proves the connection works, so it resets the local-origin run. The ejection count ``n``
decays by one for each ``base_ejection_time`` spent closed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from gpufleet.fleet import LOCAL_ORIGIN_FAILURES, Outcome
from gpufleet.policy._config import OutlierConfig


class BreakerPhase(StrEnum):
    CLOSED = "closed"
    """Takes traffic; failures are being counted."""
    OPEN = "open"
    """Ejected until ``open_until``."""
    HALF_OPEN = "half_open"
    """Ejection time over; no traffic until a recovery probe answers."""


EJECTED_PHASES: Final = frozenset({BreakerPhase.OPEN, BreakerPhase.HALF_OPEN})
"""Phases in which the replica is ejected (and counts against ``max_ejection_percent``)."""


class EjectionCause(StrEnum):
    CONSECUTIVE_5XX = "consecutive_5xx"
    CONSECUTIVE_LOCAL_ORIGIN = "consecutive_local_origin_failure"
    RECOVERY_PROBE_FAILED = "recovery_probe_failed"


@dataclass(frozen=True, slots=True)
class BreakerState:
    since: float
    """When the phase (or the ejection count) last changed."""
    phase: BreakerPhase = BreakerPhase.CLOSED
    ejections: int = 0
    """Ejections so far, less the decay: the multiplier of the next ejection's length."""
    open_until: float | None = None
    consecutive_5xx: int = 0
    consecutive_local: int = 0


def ejection_time(ejections: int, config: OutlierConfig) -> float:
    """Length of the ``ejections``-th ejection: grows linearly, capped."""
    return min(config.base_ejection_time * ejections, config.max_ejection_time)


def record_outcome(state: BreakerState, outcome: Outcome) -> BreakerState:
    """Count one finished request (ignored unless closed: an ejected replica is judged by
    its recovery probe, not by requests that were already on their way)."""
    if state.phase is not BreakerPhase.CLOSED:
        return state
    if outcome is Outcome.REPLICA_ERROR:
        return dataclasses.replace(
            state, consecutive_5xx=state.consecutive_5xx + 1, consecutive_local=0
        )
    if outcome in LOCAL_ORIGIN_FAILURES:
        return dataclasses.replace(state, consecutive_local=state.consecutive_local + 1)
    if outcome is Outcome.CANCELLED or (state.consecutive_5xx == state.consecutive_local == 0):
        return state
    return dataclasses.replace(state, consecutive_5xx=0, consecutive_local=0)


def tripped(state: BreakerState, config: OutlierConfig) -> EjectionCause | None:
    """Why a closed breaker should open now, or ``None``."""
    if state.phase is not BreakerPhase.CLOSED:
        return None
    if state.consecutive_5xx >= config.consecutive_5xx:
        return EjectionCause.CONSECUTIVE_5XX
    if state.consecutive_local >= config.consecutive_local_origin_failure:
        return EjectionCause.CONSECUTIVE_LOCAL_ORIGIN
    return None


def eject(state: BreakerState, now: float, config: OutlierConfig) -> BreakerState:
    """Open the breaker for the next, longer ejection."""
    ejections = state.ejections + 1
    return BreakerState(
        since=now,
        phase=BreakerPhase.OPEN,
        ejections=ejections,
        open_until=now + ejection_time(ejections, config),
    )


def forgive(state: BreakerState) -> BreakerState:
    """Clear the failure runs without ejecting (a dry run, or the pool could not spare it)."""
    return dataclasses.replace(state, consecutive_5xx=0, consecutive_local=0)


def half_open_if_due(state: BreakerState, now: float) -> BreakerState:
    if (
        state.phase is BreakerPhase.OPEN
        and state.open_until is not None
        and now >= state.open_until
    ):
        return dataclasses.replace(state, phase=BreakerPhase.HALF_OPEN, since=now)
    return state


def close(state: BreakerState, now: float) -> BreakerState:
    """A recovery probe answered: traffic returns, with the ejection count kept."""
    return BreakerState(since=now, ejections=state.ejections)


def decay(state: BreakerState, now: float, config: OutlierConfig) -> BreakerState:
    """Closed for a whole ``base_ejection_time``: the next ejection is one step shorter."""
    if (
        state.phase is BreakerPhase.CLOSED
        and state.ejections > 0
        and now >= state.since + config.base_ejection_time  # the wake time's sum, to the bit
    ):
        return dataclasses.replace(state, ejections=state.ejections - 1, since=now)
    return state
