"""The runtime's reconciler: desired replicas and observed processes in, actions out.

``reconcile(now, desired, observed)`` is pure and level-triggered (controller-runtime's
``Reconcile``): it looks at the whole state every time and never at what woke it, so a lost or
doubled wake-up changes nothing. The shell records facts (a process was launched, answered
``/health``, exited; a draining replica went idle) as ``ProcessState`` values and executes the
actions; every delay is a time stamp in ``ProcessState`` compared with ``now``, and the
earliest one still ahead is returned as ``requeue_after``.

One replica's life: ``Action`` = what ``reconcile`` returns, ``·fact`` = what the shell saw::

    desired (kept)                              retired (scaled in, or its spec changed)
    (absent) ─Create──────────► PENDING         READY    ─Drain───────────► DRAINING
    PENDING  ─Launch (delay)──► STARTING        DRAINING ─Terminate (·idle or
    STARTING ─·healthy────────► READY                      drain deadline)► STOPPING
    STARTING ─Abort (deadline)► ·exit: CRASHED  STARTING ─Terminate───────► STOPPING
    STARTING, READY ─·exit────► CRASHED         STOPPING ─Kill (deadline) ► ·exit: STOPPED
    CRASHED  ─Launch (backoff)► STARTING        STOPPING ─·exit───────────► STOPPED
    READY    ─ResetBackoff (healthy_after_s)    PENDING, CRASHED ─Forget──► (absent)
    STOPPED  ─Forget──────────► (absent)        STOPPED  ─Forget──────────► (absent)

A replica that is not desired (scaled in, or its spec changed) is retired: drained if it serves,
terminated if it only starts, forgotten if no process exists. Retiring is one-way: a replica
wanted again while it drains finishes stopping, then comes back as a new one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Literal, NamedTuple

from gpufleet.fleet import ReplicaId
from gpufleet.runtime._spec import ReplicaSpec


@dataclass(frozen=True, slots=True)
class RuntimeSettings:
    """Every timing of the local runtime, in seconds, with its default."""

    backoff_base_s: float = 0.5
    """Delay before the first restart after a crash; each further crash doubles it."""
    backoff_max_s: float = 30.0
    """The restart delay never exceeds this."""
    healthy_after_s: float = 10.0
    """A replica ready for this long has its crash count (and so its backoff) reset."""
    ready_timeout_s: float = 120.0
    """A launched process not answering ``/health`` with 200 by then is killed (a crash)."""
    drain_timeout_s: float = 30.0
    """Longest wait for a draining replica's in-flight requests before SIGTERM."""
    terminate_timeout_s: float = 10.0
    """Longest wait after SIGTERM before SIGKILL."""
    probe_interval_s: float = 0.1
    """Period of the readiness probe, the port read and the drain's ``/metrics`` poll."""
    probe_timeout_s: float = 2.0
    """Timeout of one probe request."""
    log_tail_lines: int = 20
    """Lines of a replica's log shown when it fails."""

    def __post_init__(self) -> None:
        for name in (
            "backoff_base_s",
            "backoff_max_s",
            "healthy_after_s",
            "ready_timeout_s",
            "drain_timeout_s",
            "terminate_timeout_s",
            "probe_interval_s",
            "probe_timeout_s",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value}")
        if self.backoff_max_s < self.backoff_base_s:
            raise ValueError("backoff_max_s must be >= backoff_base_s")
        if self.log_tail_lines < 0:
            raise ValueError(f"log_tail_lines must be >= 0, got {self.log_tail_lines}")


def ready_timeout(spec: ReplicaSpec, settings: RuntimeSettings) -> float:
    """A start's budget: the engine's own (``EngineSpec.ready_timeout_s``) or the runtime's."""
    return spec.engine.ready_timeout_s or settings.ready_timeout_s


def backoff_delay(crashes: int, settings: RuntimeSettings) -> float:
    """Wait before restarting after ``crashes`` consecutive crashes: base·2^(crashes-1), capped."""
    if crashes < 1:
        return 0.0
    # 2**n overflows float only for n > 1023; the cap is reached long before.
    exponent = min(crashes - 1, 64)
    return min(settings.backoff_max_s, settings.backoff_base_s * 2.0**exponent)


class Phase(StrEnum):
    """Where one replica's process is; who moves it is drawn in the module docstring."""

    PENDING = "pending"
    """Wanted, not launched yet (provisioning delay)."""
    STARTING = "starting"
    """Launched; not yet answering ``/health`` with 200."""
    READY = "ready"
    """Answered ``/health``; the process is alive."""
    DRAINING = "draining"
    """Retiring: no new work; waiting for in-flight requests to finish."""
    STOPPING = "stopping"
    """SIGTERM sent; waiting for the process to exit."""
    CRASHED = "crashed"
    """Exited unbidden or failed to start; restarts after the backoff."""
    STOPPED = "stopped"
    """Exited after being stopped."""


LIVE: Final = frozenset({Phase.STARTING, Phase.READY, Phase.DRAINING, Phase.STOPPING})
"""Phases in which a process (or, for external engines, a probed endpoint) exists."""


@dataclass(frozen=True, slots=True)
class ProcessState:
    """What the shell observed of one replica; ``since`` is when it entered ``phase``."""

    spec: ReplicaSpec
    """The spec it was created from (a different desired spec retires it)."""
    phase: Phase
    since: float
    crashes: int = 0
    """Consecutive crashes: the backoff exponent; reset after ``healthy_after_s`` ready."""
    idle: bool = False
    """DRAINING only: the engine reported no running or waiting request."""
    killed: bool = False
    """SIGKILL was sent (an aborted start or an overdue stop); only the exit is awaited."""


@dataclass(frozen=True, slots=True)
class Create:
    """Record a new replica as PENDING."""

    spec: ReplicaSpec

    @property
    def name(self) -> ReplicaId:
        return self.spec.name


@dataclass(frozen=True, slots=True)
class Launch:
    """Start the replica's process (or begin probing an external endpoint): → STARTING."""

    spec: ReplicaSpec
    restart: bool
    """True after a crash."""

    @property
    def name(self) -> ReplicaId:
        return self.spec.name


@dataclass(frozen=True, slots=True)
class Abort:
    """Kill a start that overran ``ready_timeout_s``; its exit counts as a crash."""

    name: ReplicaId


@dataclass(frozen=True, slots=True)
class Drain:
    """Take a serving replica out of routing and watch its in-flight count: → DRAINING."""

    name: ReplicaId


StopReason = Literal["drained", "drain_timeout", "not_serving"]


@dataclass(frozen=True, slots=True)
class Terminate:
    """SIGTERM the process group: → STOPPING. ``reason`` says why now."""

    name: ReplicaId
    reason: StopReason


@dataclass(frozen=True, slots=True)
class Kill:
    """SIGKILL the process group of a stop that overran ``terminate_timeout_s``."""

    name: ReplicaId


@dataclass(frozen=True, slots=True)
class ResetBackoff:
    """The replica has been ready for ``healthy_after_s``: forget its crashes."""

    name: ReplicaId


@dataclass(frozen=True, slots=True)
class Forget:
    """Drop the record of a replica that has no process and is not wanted as it is."""

    name: ReplicaId


Action = Create | Launch | Abort | Drain | Terminate | Kill | ResetBackoff | Forget


class Plan(NamedTuple):
    """``reconcile``'s answer: act now, then call again after ``requeue_after`` seconds at the
    latest (``None``: nothing is timed; wait for the next observed change)."""

    actions: tuple[Action, ...]
    requeue_after: float | None


class _Step(NamedTuple):
    action: Action | None
    due: float | None
    """Absolute time of the next timed transition, if any."""


_NOTHING: Final = _Step(None, None)


def reconcile(
    now: float,
    desired: Sequence[ReplicaSpec],
    observed: Mapping[str, ProcessState],
    settings: RuntimeSettings = RuntimeSettings(),
) -> Plan:
    """The actions that move ``observed`` toward ``desired`` at ``now``; at most one per replica.

    Pure: the same arguments give the same plan, and applying a plan's actions changes the
    observed state so that the next call does not repeat them.
    """
    wanted: dict[str, ReplicaSpec] = {}
    for spec in desired:
        if spec.name in wanted:
            raise ValueError(f"replica {spec.name!r} is desired twice")
        wanted[spec.name] = spec
    actions: list[Action] = []
    due: list[float] = []
    for name in sorted(wanted.keys() | observed.keys()):
        want, state = wanted.get(name), observed.get(name)
        if state is None:
            assert want is not None
            step = _Step(Create(want), None)
        elif want is None or want != state.spec:
            step = _retire(now, state, settings)
        else:
            step = _keep(now, state, settings)
        if step.action is not None:
            actions.append(step.action)
        if step.due is not None:
            due.append(step.due)
    if actions:
        return Plan(tuple(actions), 0.0)
    return Plan((), max(0.0, min(due) - now) if due else None)


def _at(now: float, due: float, action: Action) -> _Step:
    """``action`` if ``due`` has come, else wait for it."""
    return _Step(action, None) if now >= due else _Step(None, due)


def _keep(now: float, state: ProcessState, settings: RuntimeSettings) -> _Step:
    """A desired replica: launch it, restart it after its backoff, or watch its start."""
    spec, name = state.spec, state.spec.name
    match state.phase:
        case Phase.PENDING:
            step = _at(now, state.since + spec.start_delay_s, Launch(spec, restart=False))
        case Phase.CRASHED:
            due = state.since + backoff_delay(state.crashes, settings)
            step = _at(now, due, Launch(spec, restart=True))
        case Phase.STARTING if not state.killed:
            step = _at(now, state.since + ready_timeout(state.spec, settings), Abort(name))
        case Phase.READY if state.crashes > 0:
            step = _at(now, state.since + settings.healthy_after_s, ResetBackoff(name))
        case Phase.STOPPED:
            step = _Step(Forget(name), None)
        case Phase.DRAINING | Phase.STOPPING:
            step = _retire(now, state, settings)  # retiring is one-way
        case _:  # ready with no crash to forget; an aborted start awaiting its exit
            step = _NOTHING
    return step


def _retire(now: float, state: ProcessState, settings: RuntimeSettings) -> _Step:
    """A replica not desired as it is: drain what serves, stop what runs, forget the rest."""
    name = state.spec.name
    match state.phase:
        case Phase.PENDING | Phase.CRASHED | Phase.STOPPED:
            step = _Step(Forget(name), None)
        case Phase.STARTING if not state.killed:
            step = _Step(Terminate(name, "not_serving"), None)
        case Phase.READY:
            step = _Step(Drain(name), None)
        case Phase.DRAINING if state.idle:
            step = _Step(Terminate(name, "drained"), None)
        case Phase.DRAINING:
            deadline = state.since + settings.drain_timeout_s
            step = _at(now, deadline, Terminate(name, "drain_timeout"))
        case Phase.STOPPING if not state.killed:
            step = _at(now, state.since + settings.terminate_timeout_s, Kill(name))
        case _:  # killed: only its exit is awaited
            step = _NOTHING
    return step
