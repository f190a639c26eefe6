"""Active health checks of one replica: when to probe, and what the answers mean.

A value with pure transitions::

    UNKNOWN ── first success ──► HEALTHY ── unhealthy_threshold failures in a row ──► UNHEALTHY
       ▲                           ▲                                                    │
       │ runtime restarts it       └──────── healthy_threshold successes in a row ──────┘

A replica new to the fleet (or restarted) is UNKNOWN, and not routable, until one probe
answers: one success is enough the first time, as in Envoy. Failures never make an
UNKNOWN replica UNHEALTHY: it is still starting.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gpufleet.policy._config import ActiveCheckConfig


class ProbeStatus(StrEnum):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


@dataclass(frozen=True, slots=True)
class ProbeState:
    status: ProbeStatus = ProbeStatus.UNKNOWN
    successes: int = 0
    """Successes in a row."""
    failures: int = 0
    """Failures in a row."""
    next_at: float | None = None
    """When the next periodic probe is due (``None``: now)."""
    pending_since: float | None = None
    """When the probe in flight was asked for, if one is."""
    answered_at: float | None = None
    """When the last probe answer (or failure) arrived."""
    last_ok: bool | None = None


NEW_PROBE_STATE = ProbeState()


def overdue(state: ProbeState, now: float, config: ActiveCheckConfig) -> bool:
    """Whether a probe is in flight and should have been reported by now.

    ``now >= since + 2·timeout``, not ``now - since >= 2·timeout``: the health policy wakes at
    ``since + 2·timeout``, and at that float the two forms can disagree (a wake-up that finds
    nothing due, then asks to wake at the same instant again, for ever)."""
    return state.pending_since is not None and now >= state.pending_since + 2 * config.timeout


def in_flight(state: ProbeState, now: float, config: ActiveCheckConfig) -> bool:
    return state.pending_since is not None and not overdue(state, now, config)


def periodic_due(state: ProbeState, now: float, config: ActiveCheckConfig) -> bool:
    """A periodic check is due: checks are on, none is in flight, and the interval passed."""
    if not config.enabled or in_flight(state, now, config):
        return False
    return state.next_at is None or now >= state.next_at


def sent(state: ProbeState, now: float, config: ActiveCheckConfig) -> ProbeState:
    """The decision asked for a probe at ``now``; the next periodic one is an interval on."""
    return ProbeState(
        state.status,
        state.successes,
        state.failures,
        next_at=now + config.interval,
        pending_since=now,
        answered_at=state.answered_at,
        last_ok=state.last_ok,
    )


def answered(state: ProbeState, ok: bool, now: float, config: ActiveCheckConfig) -> ProbeState:
    """A probe answered (``ok``), failed or timed out at ``now``."""
    status = state.status
    if ok:
        successes, failures = state.successes + 1, 0
        if status is ProbeStatus.UNKNOWN or (
            status is ProbeStatus.UNHEALTHY and successes >= config.healthy_threshold
        ):
            status = ProbeStatus.HEALTHY
    else:
        successes, failures = 0, state.failures + 1
        if status is ProbeStatus.HEALTHY and failures >= config.unhealthy_threshold:
            status = ProbeStatus.UNHEALTHY
    return ProbeState(
        status,
        successes,
        failures,
        next_at=state.next_at,
        pending_since=None,
        answered_at=now,
        last_ok=ok,
    )
