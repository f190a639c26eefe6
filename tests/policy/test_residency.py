"""The residency policy with scripted views: idle sleeps, wakes on held requests, evictions
by value, ``min_awake`` hysteresis, overcommit at start, never an ``always`` resident."""

from __future__ import annotations

import pytest

from gpufleet.policy import (
    DemandMeter,
    PoolDemand,
    Residency,
    ResidencyDecision,
    ResidencyPolicy,
    ResidencyView,
    Resident,
    SleepReason,
)
from tests.policy.residents import ALWAYS, ON_DEMAND, resident


def demand(held: int = 0, rate: float = 0.0, wake: float = 1.0) -> PoolDemand:
    return PoolDemand(held, rate, wake)


def decide(now: float, *residents: Resident, **demands: PoolDemand) -> ResidencyDecision:
    return ResidencyPolicy().decide(now, ResidencyView(residents, demands))


def test_an_idle_on_demand_replica_sleeps_after_idle_seconds_not_before() -> None:
    a = resident("a", Residency.SERVING, last_used=10.0)
    early = decide(309.0, a)
    assert early.sleep == ()
    assert early.next_at == 310.0
    late = decide(310.0, a)
    assert late.sleep == ((a.replica, 1, SleepReason.IDLE),)


def test_a_busy_or_always_replica_never_sleeps_for_idleness() -> None:
    busy = resident("a", Residency.SERVING, in_flight=1)
    kept = resident("b", Residency.SERVING, config=ALWAYS, memory=0.05)
    decision = decide(1_000.0, busy, kept)
    assert decision.sleep == ()
    assert decision.next_at is None


def test_a_held_request_wakes_a_sleeping_replica_on_a_slot_with_room() -> None:
    a = resident("a", Residency.SLEEPING_1)
    decision = decide(5.0, a, a=demand(held=1))
    assert decision.wake == (a.replica,)
    assert decision.sleep == ()


def test_no_wake_without_held_requests_or_when_one_is_already_waking() -> None:
    a0 = resident("a", Residency.SLEEPING_1)
    a1 = resident("a", Residency.WAKING, slot=1)
    assert decide(5.0, a0, a=demand(held=0)).wake == ()
    assert decide(5.0, a0, a1, a=demand(held=3)).wake == ()


def test_waking_into_a_full_slot_evicts_the_resident_then_wakes_once_it_sleeps() -> None:
    a = resident("a", Residency.SERVING, since=0.0)
    b = resident("b", Residency.SLEEPING_1)
    first = decide(10.0, a, b, b=demand(held=2))
    assert first.sleep == ((a.replica, 1, SleepReason.EVICTED),)
    assert first.wake == ()  # a still holds the memory
    # the controller drains a; while it drains the wake still waits
    draining = resident("a", Residency.DRAINING, in_flight=1)
    assert decide(10.5, draining, b, b=demand(held=2)).wake == ()
    # a sleeps: now b wakes, and nothing more is evicted
    asleep = resident("a", Residency.SLEEPING_1, since=11.0)
    done = decide(11.0, asleep, b, b=demand(held=2))
    assert done.wake == (b.replica,)
    assert done.sleep == ()


def test_min_awake_holds_off_an_eviction_and_says_when_to_decide_again() -> None:
    a = resident("a", Residency.SERVING, since=9.0)  # woken at 9, min_awake 2
    b = resident("b", Residency.SLEEPING_1)
    held = decide(10.0, a, b, b=demand(held=1))
    assert held.sleep == ()
    assert held.wake == ()
    assert held.next_at == 11.0
    assert decide(11.0, a, b, b=demand(held=1)).sleep[0][0] == a.replica


def test_an_always_resident_is_never_evicted_so_a_model_that_does_not_fit_waits() -> None:
    big = resident("big", Residency.SERVING, config=ALWAYS, memory=0.6)
    b = resident("b", Residency.SLEEPING_1, memory=0.5)
    decision = decide(100.0, big, b, b=demand(held=1))
    assert decision.sleep == ()
    assert decision.wake == ()


def test_two_small_models_share_a_slot_without_evicting_each_other() -> None:
    a = resident("a", Residency.SERVING, memory=0.45)
    b = resident("b", Residency.SLEEPING_1, memory=0.45)
    decision = decide(100.0, a, b, b=demand(held=1))
    assert decision.wake == (b.replica,)
    assert decision.sleep == ()


def test_the_least_valuable_resident_is_evicted_demand_times_reload_cost() -> None:
    # three models share a slot that holds two; c wants in
    hot = resident("hot", Residency.SERVING, memory=0.5, last_used=1.0)
    slow = resident("slow", Residency.SERVING, memory=0.5, last_used=0.0)  # LRU, but costly
    c = resident("c", Residency.SLEEPING_1, memory=0.5)
    demands = {
        "hot": demand(rate=1.0, wake=0.4),  # busy, cheap to reload: value 0.8
        "slow": demand(rate=0.1, wake=37.0),  # quiet, a 70B-class reload: value 7.4
        "c": demand(held=1),
    }
    decision = decide(50.0, hot, slow, c, **demands)
    assert decision.sleep == ((hot.replica, 1, SleepReason.EVICTED),)
    # with no recent demand anywhere the rule is least recently used
    quiet = {"hot": demand(), "slow": demand(), "c": demand(held=1)}
    assert decide(50.0, hot, slow, c, **quiet).sleep[0][0] == slow.replica


def test_miss_cost_protects_a_resident() -> None:
    a = resident("a", Residency.SERVING, memory=0.5, last_used=5.0)
    vip = resident(
        "vip",
        Residency.SERVING,
        memory=0.5,
        config=ON_DEMAND.model_copy(update={"miss_cost": 10.0}),
    )
    c = resident("c", Residency.SLEEPING_1, memory=0.5)
    demands = {"a": demand(rate=1.0), "vip": demand(rate=0.2), "c": demand(held=1)}
    assert decide(50.0, a, vip, c, **demands).sleep[0][0] == a.replica


def test_the_wake_goes_to_the_slot_that_needs_no_eviction() -> None:
    a0 = resident("a", Residency.SERVING, slot=0)
    b0 = resident("b", Residency.SLEEPING_1, slot=0)
    b1 = resident("b", Residency.SLEEPING_1, slot=1)  # slot 1 is empty
    decision = decide(50.0, a0, b0, b1, b=demand(held=1))
    assert decision.wake == (b1.replica,)
    assert decision.sleep == ()


def test_engines_started_awake_on_one_slot_are_put_to_sleep_until_it_fits() -> None:
    a = resident("a", Residency.SERVING, last_used=2.0)
    b = resident("b", Residency.SERVING, last_used=1.0)
    decision = decide(3.0, a, b)
    assert decision.sleep == ((b.replica, 1, SleepReason.OVERCOMMIT),)


def test_two_pools_wanting_one_slot_do_not_both_take_the_memory_it_frees() -> None:
    a = resident("a", Residency.SLEEPING_1, memory=0.6)
    b = resident("b", Residency.SLEEPING_1, memory=0.6)
    decision = decide(1.0, a, b, a=demand(held=1), b=demand(held=5))
    assert decision.wake == (b.replica,)


@pytest.mark.parametrize("level", [1, 2])
def test_the_sleep_level_is_the_pools(level: int) -> None:
    config = ON_DEMAND.model_copy(update={"level": level})
    a = resident("a", Residency.SERVING, config=config)
    assert decide(300.0, a).sleep == ((a.replica, level, SleepReason.IDLE),)


def test_the_demand_meter_decays_with_its_half_life() -> None:
    meter = DemandMeter()
    assert meter.rate(0.0) == 0.0
    for t in range(10):
        meter.arrive(float(t))
    now = meter.rate(9.0)
    assert now > 0
    assert meter.rate(69.0) == pytest.approx(now / 2)


def test_min_awake_delays_an_eviction_it_does_not_move_it_onto_a_busier_model() -> None:
    # a slot holding two: hot has served long, cold woke a second ago; c wants in
    hot = resident("hot", Residency.SERVING, memory=0.5, since=0.0)
    cold = resident("cold", Residency.SERVING, memory=0.5, since=9.0)  # min_awake 2
    c = resident("c", Residency.SLEEPING_1, memory=0.5)
    demands = {"hot": demand(rate=1.0), "cold": demand(rate=0.1), "c": demand(held=1)}
    wait = decide(10.0, hot, cold, c, **demands)
    assert (wait.sleep, wait.wake) == ((), ())  # not hot, though it may be evicted now
    assert wait.next_at == 11.0
    assert decide(11.0, hot, cold, c, **demands).sleep == ((cold.replica, 1, SleepReason.EVICTED),)


def test_pools_wanting_one_slot_take_turns_instead_of_evicting_the_busiest() -> None:
    # a slot holding three: hot and warm serve, one place is free; b and c want in
    hot = resident("hot", Residency.SERVING, memory=0.3)
    warm = resident("warm", Residency.SERVING, memory=0.3)
    b = resident("b", Residency.SLEEPING_1, memory=0.3)
    c = resident("c", Residency.SLEEPING_1, memory=0.3)
    demands = {
        "hot": demand(rate=1.0),
        "warm": demand(rate=0.5),
        "b": PoolDemand(1, 0.05, 1.0, held_since=1.0),
        "c": PoolDemand(1, 0.05, 1.0, held_since=2.0),
    }
    first = decide(10.0, hot, warm, b, c, **demands)
    assert first.wake == (b.replica,)  # b came first: the free place
    assert first.sleep == ()  # c waits for b's turn to end, warm and hot stay
    waking = resident("b", Residency.WAKING, memory=0.3, since=10.0)
    assert decide(10.2, hot, warm, waking, c, **demands).sleep == ()
    served = resident("b", Residency.SERVING, memory=0.3, since=10.4)
    assert decide(11.0, hot, warm, served, c, **demands).next_at == 12.4
    assert decide(12.4, hot, warm, served, c, **demands).sleep == (
        (served.replica, 1, SleepReason.EVICTED),
    )


def test_the_pool_whose_held_request_waited_longest_wakes_first() -> None:
    a = resident("a", Residency.SLEEPING_1, memory=0.6)
    b = resident("b", Residency.SLEEPING_1, memory=0.6)
    decision = decide(
        10.0,
        a,
        b,
        a=PoolDemand(1, 0.0, 1.0, held_since=2.0),
        b=PoolDemand(5, 0.0, 1.0, held_since=7.0),
    )
    assert decision.wake == (a.replica,)  # one request held 8 s before five held 3 s


def test_an_eviction_is_due_at_the_time_asked_for_not_a_rounding_later() -> None:
    # 4.957496396690706 - 2.9574963966907064 < 2.0 in floating point: a policy that asked
    # to be called at since + min_awake and then compared now - since would ask again for
    # the same instant, and the shell would spin
    since = 2.9574963966907064
    assert (since + 2.0) - since < 2.0
    a = resident("a", Residency.SERVING, since=since)
    b = resident("b", Residency.SLEEPING_1)
    held = decide(since + 1.0, a, b, b=demand(held=1))
    assert held.next_at == since + 2.0
    due = decide(held.next_at, a, b, b=demand(held=1))
    assert due.sleep == ((a.replica, 1, SleepReason.EVICTED),)
