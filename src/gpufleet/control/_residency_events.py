"""Residency's events and commands (docs/residency.md)::

    shell ──► Resident(model, replica, state)     an engine finished falling asleep or waking
    controller ──► Sleep(model, replica, level, reason) · Wake(model, replica)

The shell carries out ``Sleep`` as ``POST /sleep?level=N`` and ``Wake`` as ``POST
/wake_up`` (the simulator: the replica's modelled sleep and wake times), and reports the
state the engine is in when that ends with ``Resident`` (the state it is still in, if it
failed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpufleet.fleet import ReplicaId
from gpufleet.policy import Residency


@dataclass(frozen=True, slots=True)
class Resident:
    """``replica``'s engine is now ``state`` (``serving``, ``sleeping_1`` or ``sleeping_2``)."""

    model: str
    replica: ReplicaId
    state: Residency


@dataclass(frozen=True, slots=True)
class Sleep:
    """Put ``replica``'s engine to sleep at ``level`` (it has no request in flight);
    ``reason``: ``idle``, ``evicted`` or ``overcommit``. Report :class:`Resident` after."""

    model: str
    replica: ReplicaId
    level: int
    reason: str


@dataclass(frozen=True, slots=True)
class Wake:
    """Wake ``replica``'s engine (its slot has the memory). Report :class:`Resident` after."""

    model: str
    replica: ReplicaId


def resident_to_json(event: Resident) -> dict[str, Any]:
    return {
        "kind": "resident",
        "model": event.model,
        "replica": event.replica,
        "state": event.state.value,
    }


def resident_from_json(d: dict[str, Any]) -> Resident:
    return Resident(str(d["model"]), ReplicaId(d["replica"]), Residency(d["state"]))


def sleep_to_json(command: Sleep) -> dict[str, Any]:
    return {
        "do": "sleep",
        "model": command.model,
        "replica": command.replica,
        "level": command.level,
        "reason": command.reason,
    }


def wake_to_json(command: Wake) -> dict[str, Any]:
    return {"do": "wake", "model": command.model, "replica": command.replica}
