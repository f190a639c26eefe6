"""``min_awake`` for engines that started awake.

Found on bench/residency_many_models.py (20 models, 8 slots): every engine starts awake,
the overcommit left one per slot, and the first requests waited min_awake (2 s) from the
engines' start for it, though it was woken for no one."""

from __future__ import annotations

from gpufleet.fleet import ReplicaId
from gpufleet.policy import (
    PoolDemand,
    Residency,
    ResidencyConfig,
    ResidencyDecision,
    ResidencyPolicy,
    ResidencyView,
    Resident,
    SleepReason,
)

ON_DEMAND = ResidencyConfig(mode="on_demand", idle=300.0, slots="gpu", min_awake=2.0)


def resident(
    pool: str,
    state: Residency,
    *,
    slot: int = 0,
    since: float = 0.0,
    in_flight: int = 0,
    woken: bool = True,
) -> Resident:
    return Resident(
        ReplicaId(f"{pool}-{slot}"),
        pool,
        ("gpu", slot),
        state,
        since,
        in_flight,
        0.0,
        0.9,
        ON_DEMAND,
        woken,
    )


def decide(now: float, *residents: Resident, **demands: PoolDemand) -> ResidencyDecision:
    return ResidencyPolicy().decide(now, ResidencyView(residents, demands))


def test_min_awake_does_not_hold_an_engine_that_started_awake() -> None:
    started = resident("a", Residency.SERVING, since=0.0, woken=False)
    b = resident("b", Residency.SLEEPING_1)
    held = {"b": PoolDemand(1, 0.0, 0.4, held_since=0.5)}
    assert decide(0.5, started, b, **held).sleep == ((started.replica, 1, SleepReason.EVICTED),)
    woken = resident("a", Residency.SERVING, since=0.0)
    waits = decide(0.5, woken, b, **held)
    assert (waits.sleep, waits.next_at) == ((), 2.0)
