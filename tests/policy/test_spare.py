"""The spare-capacity gate of the batch class alone (L0, explicit ``now``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.fleet import ReplicaLoad
from gpufleet.policy import SpareCapacity, SpareConfig, SpareView


def view(**kw: object) -> SpareView:
    """Two replicas of 10 slots, nothing running, one batch line waiting."""
    base = SpareView(
        replicas=2,
        max_num_seqs=10,
        in_flight=0,
        batch_in_flight=0,
        batch_waiting=1,
        gateway_waiting=0,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def scraped(running: int = 0, waiting: int = 0, kv: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(running=running, waiting=waiting, kv_cache_usage=kv, observed_at=0.0)


def test_the_limit_grows_by_increase_per_replica_once_per_interval() -> None:
    gate = SpareCapacity(SpareConfig(interval=1.0, increase=2.0))
    first = gate.decide(0.0, view(batch_waiting=50))
    assert (first.limit, first.room, first.next_at) == (4.0, 4, 1.0)  # the first step at once
    assert gate.decide(0.5, view(batch_waiting=50, batch_in_flight=4)).room == 0  # not yet
    grown = gate.decide(1.0, view(batch_waiting=50, batch_in_flight=4, in_flight=4))
    assert (grown.limit, grown.room, grown.next_at) == (8.0, 4, 2.0)
    # a look long after (no line waited in between) grows one step, not one per interval:
    # doubled (the slow start: no pressure yet)
    assert gate.decide(60.0, view(batch_waiting=50, batch_in_flight=8, in_flight=8)).limit == 16.0


def test_the_slow_start_doubles_until_the_first_pressure_then_the_climb_is_additive() -> None:
    gate = SpareCapacity(SpareConfig(interval=1.0, increase=1.0, target=1.0))
    big = view(max_num_seqs=100, batch_waiting=500)
    limits = [gate.decide(float(t), big).limit for t in range(5)]
    assert limits == [2.0, 4.0, 8.0, 16.0, 32.0]  # 2 replicas: +2 at first, then x2
    hot = replace(big, batch_in_flight=32, in_flight=32, loads=(scraped(kv=0.95),))
    assert gate.decide(5.0, hot).limit == 16.0  # cut by half
    calm = replace(big, batch_in_flight=16, in_flight=16)
    assert [gate.decide(float(t), calm).limit for t in (6, 7)] == [18.0, 20.0]


def test_the_limit_stays_put_while_no_line_waits() -> None:
    gate = SpareCapacity(SpareConfig(interval=1.0))
    gate.decide(0.0, view())
    for t in (1.0, 2.0, 3.0):
        decision = gate.decide(t, view(batch_waiting=0, batch_in_flight=1, in_flight=1))
        assert decision.limit == 2.0
        assert decision.next_at is None


def test_batch_fills_the_pool_to_its_target_share_of_the_slots() -> None:
    gate = SpareCapacity(SpareConfig(target=0.8, increase=100.0))
    # 2 × 10 slots, target 16; 9 interactive requests in flight: 7 batch lines fit
    assert gate.decide(0.0, view(batch_waiting=50, in_flight=9)).room == 7
    # a scrape that shows more than the own count (another gateway's requests) counts
    loads = (scraped(running=7, waiting=0), scraped(running=6))
    assert gate.decide(0.0, view(batch_waiting=50, in_flight=9, loads=loads)).room == 3


def test_per_replica_caps_the_batch_lines_in_flight() -> None:
    gate = SpareCapacity(SpareConfig(target=1.0, per_replica=3, increase=100.0))
    decision = gate.decide(0.0, view(batch_waiting=50))
    assert (decision.limit, decision.room) == (6.0, 6)
    assert gate.decide(0.0, view(batch_waiting=50, batch_in_flight=5, in_flight=5)).room == 1


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"gateway_waiting": 1}, "gateway"),
        ({"loads": (scraped(running=10, waiting=1), scraped())}, "queueing"),
        ({"loads": (scraped(running=2), scraped(kv=0.95))}, "kv"),
    ],
)
def test_pressure_stops_new_lines_and_cuts_the_limit_once_per_interval(
    kw: dict[str, object], why: str
) -> None:
    gate = SpareCapacity(SpareConfig(interval=1.0, increase=4.0, decrease=0.5))
    assert gate.decide(0.0, view(batch_waiting=50)).limit == 8.0
    running = view(batch_waiting=50, batch_in_flight=6, in_flight=12)
    cut = gate.decide(2.0, replace(running, **kw))  # type: ignore[arg-type]
    # halved from what runs (6), not from the limit (8); nothing starts; no timed look
    assert (cut.room, cut.limit, cut.pressure, cut.next_at) == (0, 3.0, why, None)
    assert gate.decide(2.5, replace(running, **kw)).limit == 3.0  # type: ignore[arg-type]
    assert gate.decide(3.0, replace(running, **kw)).limit == 1.5  # type: ignore[arg-type]
    # pressure gone: it grows again from there, an interval after the cut
    calm = gate.decide(4.0, view(batch_waiting=50, batch_in_flight=1, in_flight=7))
    assert (calm.limit, calm.room, calm.pressure) == (9.5, 8, None)


def test_requests_waiting_in_the_engine_for_free_slots_are_no_pressure() -> None:
    # a request just arrived shows as waiting until the next step: with slots free it runs
    gate = SpareCapacity(SpareConfig())
    loads = (scraped(running=4, waiting=3), scraped(running=9, waiting=1))
    assert gate.decide(0.0, view(loads=loads)).pressure is None
    unscraped = (ReplicaLoad(waiting=50), scraped())  # never scraped: its fields mean nothing
    assert gate.decide(0.0, view(loads=unscraped)).pressure is None


def test_no_routable_replica_lets_nothing_through() -> None:
    decision = SpareCapacity(SpareConfig()).decide(0.0, view(replicas=0))
    assert (decision.room, decision.next_at) == (0, None)


def test_a_look_at_next_at_grows_the_limit_despite_float_time() -> None:
    # the controller wakes exactly at next_at; a float sum must not land just short of it
    gate = SpareCapacity(SpareConfig(interval=0.1, increase=1.0, target=1.0))
    gate.decide(0.0, view(gateway_waiting=1))  # a pressure ends the slow start: +2 a step
    now, limit = 0.1, 0.0
    for _ in range(50):
        decision = gate.decide(now, view(batch_waiting=100, max_num_seqs=1000))
        assert decision.limit > limit
        assert decision.next_at is not None
        assert decision.next_at > now
        now, limit = decision.next_at, decision.limit


looks = st.lists(
    st.tuples(
        st.floats(0.0, 2.0),  # time since the last look
        st.integers(0, 30),  # interactive in flight
        st.integers(0, 40),  # batch waiting
        st.integers(0, 12),  # engine running on replica 0
        st.integers(0, 5),  # engine waiting on replica 0
        st.integers(0, 2),  # requests waiting at the gateway
    ),
    max_size=60,
)


@given(looks)
def test_the_gate_never_overfills_and_never_starts_a_line_under_pressure(
    steps: list[tuple[float, int, int, int, int, int]],
) -> None:
    config = SpareConfig(target=0.75, per_replica=6, interval=0.3, increase=2.0)
    gate = SpareCapacity(config)
    now, batch = 0.0, 0
    for dt, interactive, waiting, running, queued, gateway in steps:
        now += dt
        loads = (scraped(running=running, waiting=queued), scraped())
        v = view(
            replicas=2,
            in_flight=interactive + batch,
            batch_in_flight=batch,
            batch_waiting=waiting,
            gateway_waiting=gateway,
            loads=loads,
        )
        decision = gate.decide(now, v)
        assert 0.0 <= decision.limit <= 12.0
        assert decision.room >= 0
        if decision.pressure is not None:
            assert decision.room == 0
        if decision.room:
            assert batch + decision.room <= min(decision.limit, 12.0)
            assert interactive + batch + decision.room <= 15  # 0.75 × 2 × 10
        if decision.next_at is not None:
            assert decision.next_at > now
        batch = max(0, batch + min(decision.room, waiting) - (1 if dt > 1.0 else 0))
