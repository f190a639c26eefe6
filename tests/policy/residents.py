"""Scripted residents for the residency policy's tests."""

from __future__ import annotations

from gpufleet.fleet import ReplicaId
from gpufleet.policy import Residency, ResidencyConfig, Resident

ON_DEMAND = ResidencyConfig(mode="on_demand", idle=300.0, slots="gpu", min_awake=2.0)
ALWAYS = ResidencyConfig(slots="gpu")


def resident(
    pool: str,
    state: Residency,
    *,
    slot: int = 0,
    since: float = 0.0,
    in_flight: int = 0,
    last_used: float = 0.0,
    memory: float = 0.9,
    config: ResidencyConfig = ON_DEMAND,
    woken: bool = True,
) -> Resident:
    """Replica ``<pool>-<slot>`` of ``pool`` on GPU slot ``slot``."""
    return Resident(
        ReplicaId(f"{pool}-{slot}"),
        pool,
        ("gpu", slot),
        state,
        since,
        in_flight,
        last_used,
        memory,
        config,
        woken,
    )
