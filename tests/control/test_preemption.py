"""A spot replica's preemption notice in the pool controller (L0, explicit ``now``): the
replica takes no new attempt from the notice on, and what is still on it ``abandon_before``
seconds ahead of the deadline is abandoned, to resume or retry elsewhere for free."""

from __future__ import annotations

import io

import pytest

from gpufleet.config import SPOT_DISCOUNT, FleetFileError, parse_fleet
from gpufleet.control import (
    Abandon,
    AttemptFailed,
    FleetController,
    Preempting,
    Replicas,
    ReplicaSeen,
    Route,
    Tick,
    event_from_json,
    event_to_json,
    read_recording,
    replay,
)
from gpufleet.fleet import Outcome, ReplicaId, ReplicaState
from tests.control.test_pool_controller import (
    POOL,
    arrive,
    arrive_resumable,
    routed_all,
    up,
)


def spot_pool(replicas: int = 2, **spot: object) -> FleetController:
    model: dict[str, object] = {
        "name": POOL,
        "replicas": replicas,
        "routing": "round_robin",
        "capacity": "spot",
    }
    if spot:
        model["spot"] = spot
    return FleetController.of(parse_fleet({"models": [model]}))


def test_a_noticed_replica_takes_nothing_new_and_its_attempts_leave_before_the_deadline() -> None:
    control = spot_pool(abandon_before=10.0)
    recording = io.StringIO()
    control.record(recording)
    up(control, 0.0, 2)
    sent = {c.request_id: c.replica for i in range(4) for c in routed_all(arrive(control, 1.0, i))}
    sent["r4"] = arrive_resumable(control, 1.0, 4).replica
    victim = sent["r0"]
    on_victim = sorted(rid for rid, replica in sent.items() if replica == victim)
    assert 0 < len(on_victim) < len(sent)  # round robin: both replicas have some
    pool = control.pools[POOL]
    # the notice: two minutes to go; nothing abandoned yet, nothing new goes there
    assert control.handle(2.0, Preempting(POOL, ReplicaId(victim), 122.0)) == []
    assert pool.view.replica(ReplicaId(victim)).state is ReplicaState.DRAINING
    for i in range(5, 11):
        assert [c.replica for c in routed_all(arrive(control, 3.0, i))] != [victim]
    wake = control.next_wakeup()
    assert wake is not None
    assert wake <= 112.0  # the deadline less abandon_before, or sooner (a health check)
    assert not [c for c in control.handle(111.0, Tick()) if isinstance(c, Abandon)]
    (abandon,) = [c for c in control.handle(112.0, Tick()) if isinstance(c, Abandon)]
    assert (abandon.model, abandon.replica) == (POOL, victim)
    assert sorted(abandon.request_ids) == on_victim
    # each, ended as a timeout by the shell, goes on elsewhere without the retry budget
    for rid in abandon.request_ids:
        streamed = rid == "r4"
        out = control.handle(112.5, AttemptFailed(POOL, rid, Outcome.TIMEOUT, streamed))
        (route,) = [c for c in out if isinstance(c, Route)]
        assert route.replica != victim
        assert route.resume == streamed
    assert pool.counters.retries_refused == 0
    assert pool.counters.free_retries + pool.counters.resumes == len(on_victim)
    assert not [c for c in control.handle(130.0, Tick()) if isinstance(c, Abandon)]  # once
    # the recording carries the notice and the abandon; a replay decides them again
    head, lines = read_recording(io.StringIO(recording.getvalue()))
    recorded = list(lines)
    kinds = [line.event for line in recorded]
    assert Preempting(POOL, ReplicaId(victim), 122.0) in kinds
    for line, commands in replay(head, recorded):
        assert commands == line.commands


def test_a_replacement_process_ends_the_notice() -> None:
    """The runtime reports the replica again with a new process (a new spot node, or the
    same one after the provider relented): it takes attempts again."""
    control = spot_pool()
    up(control, 0.0, 2)
    victim = ReplicaId(f"{POOL}-1")
    routed_all(arrive(control, 0.5, 99))  # an attempt in flight somewhere
    control.handle(1.0, Preempting(POOL, victim, 60.0))
    assert all(c.replica != victim for i in range(4) for c in routed_all(arrive(control, 2.0, i)))
    fresh = tuple(
        ReplicaSeen(ReplicaId(f"{POOL}-{i}"), ReplicaState.READY, "b" if i == 1 else "a")
        for i in range(2)
    )
    control.handle(70.0, Replicas(POOL, fresh))
    view = control.pools[POOL].view.replica(victim)
    assert view is not None
    assert view.state is not ReplicaState.DRAINING
    assert not [c for c in control.handle(55.0, Tick()) if isinstance(c, Abandon)]


def test_a_repeated_or_unknown_notice_changes_nothing() -> None:
    control = spot_pool()
    up(control, 0.0, 2)
    (route,) = routed_all(arrive(control, 1.0, 0))
    victim = route.replica
    control.handle(2.0, Preempting(POOL, victim, 60.0))
    control.handle(3.0, Preempting(POOL, victim, 90.0))  # the same taint seen again, later
    (abandon,) = [c for c in control.handle(55.0, Tick()) if isinstance(c, Abandon)]
    assert abandon.request_ids == ("r0",)
    control.handle(56.0, Preempting(POOL, victim, 120.0))
    assert not [c for c in control.handle(115.0, Tick()) if isinstance(c, Abandon)]
    assert control.handle(4.0, Preempting(POOL, ReplicaId("nobody"), 60.0)) == []


def test_a_notice_with_no_time_left_abandons_at_once() -> None:
    control = spot_pool()
    up(control, 0.0, 2)
    (route,) = routed_all(arrive(control, 1.0, 0))
    out = control.handle(2.0, Preempting(POOL, route.replica, 4.0))
    assert [c for c in out if isinstance(c, Abandon)] == [Abandon(POOL, route.replica, ("r0",))]


def test_the_notice_round_trips_through_json() -> None:
    event = Preempting(POOL, ReplicaId(f"{POOL}-0"), 1234.5)
    line = event_to_json(event)
    assert line == {"kind": "preempting", "model": POOL, "replica": f"{POOL}-0", "at": 1234.5}
    assert event_from_json(line) == event


def test_a_spot_pool_costs_less_unless_it_names_its_price() -> None:
    models = [
        {"name": "od", "model": POOL},
        {"name": "spot", "model": POOL, "capacity": "spot"},
        {"name": "priced", "model": POOL, "capacity": "spot", "spot": {"usd_per_gpu_hour": 1}},
    ]
    od, spot, priced = parse_fleet({"models": models}).models
    assert spot.usd_per_gpu_hour() == pytest.approx(od.usd_per_gpu_hour() * (1 - SPOT_DISCOUNT))
    assert priced.usd_per_gpu_hour() == 1.0
    assert od.spot_settings is None
    assert spot.spot_settings is not None
    with pytest.raises(FleetFileError, match="capacity: spot"):
        parse_fleet({"models": [{"name": POOL, "spot": {"abandon_before": 3}}]})
    with pytest.raises(FleetFileError, match="capacity"):
        parse_fleet({"models": [{"name": POOL, "capacity": "reserved"}]})
