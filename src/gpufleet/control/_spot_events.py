"""Spot capacity's events and command (docs/spot.md, "When spot GPUs run out")::

    shell ──► Reclaimed(model, replica)       the provider took the replica's GPUs
              SpotMarket(model, available)    spot GPUs for the pool can (not) be had
    controller ──► Replace(model, replica, capacity)
                                              start the replica again on ``spot`` or
                                              ``on_demand`` GPUs (one running on
                                              on-demand GPUs: move it back to spot)

The runtime carries out ``Replace`` by provisioning the replica's new node of that capacity
(the simulator: a restart ``startup_s`` later, billed at that capacity's price).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpufleet.config import Capacity
from gpufleet.fleet import ReplicaId


@dataclass(frozen=True, slots=True)
class Reclaimed:
    """The provider took ``replica``'s GPUs (a preemption's deadline came): it needs a new
    node, which the controller says the capacity of (:class:`Replace`)."""

    model: str
    replica: ReplicaId


@dataclass(frozen=True, slots=True)
class SpotMarket:
    """Whether pool ``model``'s spot GPUs can be had now (a provider's capacity error, a
    node pool that cannot scale; simulated: a ``spot_outage``)."""

    model: str
    available: bool


@dataclass(frozen=True, slots=True)
class Replace:
    """Give ``replica`` a node of ``capacity``: a reclaimed one its replacement; one that
    stands in on on-demand GPUs a spot node, which takes over once it serves."""

    model: str
    replica: ReplicaId
    capacity: Capacity


def reclaimed_to_json(event: Reclaimed) -> dict[str, Any]:
    return {"kind": "reclaimed", "model": event.model, "replica": event.replica}


def reclaimed_from_json(d: dict[str, Any]) -> Reclaimed:
    return Reclaimed(str(d["model"]), ReplicaId(d["replica"]))


def spot_market_to_json(event: SpotMarket) -> dict[str, Any]:
    return {"kind": "spot_market", "model": event.model, "available": event.available}


def spot_market_from_json(d: dict[str, Any]) -> SpotMarket:
    return SpotMarket(str(d["model"]), bool(d["available"]))


def replace_to_json(command: Replace) -> dict[str, Any]:
    return {
        "do": "replace",
        "model": command.model,
        "replica": command.replica,
        "capacity": command.capacity.value,
    }
