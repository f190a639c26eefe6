"""Which resident a wake evicts when one has requests in flight (it must drain first, and
the held requests wait that out), and ``min_awake`` for engines that started awake.

Found on bench/residency_many_models.py (20 models, 8 slots): the held requests that
waited longest (up to 5.0 s, against a 0.82 s sleep plus wake) all waited for a busy
victim's last request, while a resident of nearly the same value sat idle on another slot;
and the first requests waited min_awake (2 s) from the engines' start."""

from __future__ import annotations

from gpufleet.fleet import ReplicaId
from gpufleet.policy import (
    PoolDemand,
    Residency,
    ResidencyDecision,
    ResidencyPolicy,
    ResidencyView,
    Resident,
    SleepReason,
)
from tests.policy.residents import resident


def decide(now: float, *residents: Resident, **demands: PoolDemand) -> ResidencyDecision:
    return ResidencyPolicy().decide(now, ResidencyView(residents, demands))


def fleet(busy_rate: float, idle_rate: float) -> tuple[list[Resident], dict[str, PoolDemand]]:
    """Two slots: ``busy`` (a request in flight) on 0, ``idle`` on 1; ``new`` wants one;
    ``tail`` asleep elsewhere misses at 0.5/s (a wake every 2 s, whatever this one does)."""
    residents = [
        resident("busy", Residency.SERVING, slot=0, in_flight=1),
        resident("new", Residency.SLEEPING_1, slot=0),
        resident("idle", Residency.SERVING, slot=1),
        resident("new", Residency.SLEEPING_1, slot=1),
        resident("tail", Residency.SLEEPING_1, slot=2),
    ]
    demands = {
        "busy": PoolDemand(0, busy_rate, 0.4, drain_seconds=1.5),
        "idle": PoolDemand(0, idle_rate, 0.4, drain_seconds=1.5),
        "new": PoolDemand(1, 0.01, 0.4, held_since=9.0),
        "tail": PoolDemand(0, 0.5, 0.4),
    }
    return residents, demands


def test_a_wake_evicts_an_idle_resident_rather_than_wait_for_a_busy_one_of_like_value() -> None:
    residents, demands = fleet(busy_rate=0.03, idle_rate=0.05)
    decision = decide(10.0, *residents, **demands)
    assert decision.sleep == ((ReplicaId("idle-1"), 1, SleepReason.EVICTED),)


def test_a_much_more_valuable_idle_resident_is_kept_and_the_busy_one_drains() -> None:
    residents, demands = fleet(busy_rate=0.03, idle_rate=2.0)
    decision = decide(10.0, *residents, **demands)
    assert decision.sleep == ((ReplicaId("busy-0"), 1, SleepReason.EVICTED),)


def test_with_no_drain_seen_or_no_other_misses_the_least_valuable_goes_busy_or_not() -> None:
    residents, demands = fleet(busy_rate=0.03, idle_rate=0.05)
    unseen = {
        k: PoolDemand(d.held, d.rate, d.wake_seconds, d.held_since) for k, d in demands.items()
    }
    assert decide(10.0, *residents, **unseen).sleep[0][0] == ReplicaId("busy-0")
    no_tail = [r for r in residents if r.pool != "tail"]
    assert decide(10.0, *no_tail, **demands).sleep[0][0] == ReplicaId("busy-0")


def test_min_awake_does_not_hold_an_engine_that_started_awake() -> None:
    started = resident("a", Residency.SERVING, since=0.0, woken=False)
    b = resident("b", Residency.SLEEPING_1)
    held = {"b": PoolDemand(1, 0.0, 0.4, held_since=0.5)}
    assert decide(0.5, started, b, **held).sleep == ((started.replica, 1, SleepReason.EVICTED),)
    woken = resident("a", Residency.SERVING, since=0.0)
    waits = decide(0.5, woken, b, **held)
    assert (waits.sleep, waits.next_at) == ((), 2.0)
