"""Residency in the controller, with scripted events (no shell): two models share one GPU
slot; the one at the back sleeps at start, a request for it is held while the controller
evicts (drains) the other and wakes it; idle sleeps; record and replay."""

from __future__ import annotations

import io
import json

from gpufleet.config import parse_fleet
from gpufleet.control import (
    Arrived,
    Finished,
    FleetController,
    Reject,
    Replicas,
    ReplicaSeen,
    Residency,
    Resident,
    Route,
    Sleep,
    Tick,
    Wake,
    command_to_json,
    event_from_json,
    event_to_json,
    read_recording,
    replay,
)
from gpufleet.fleet import ReplicaId, ReplicaState, RouteRequest

A, B = "chat-a", "chat-b"
A0, B0 = ReplicaId("chat-a-0"), ReplicaId("chat-b-0")


def fleet(**residency: object) -> FleetController:
    on_demand = {"mode": "on_demand", "slots": "gpu", "idle": 30.0, **residency}
    models = [
        {"name": name, "model": "llama-3.1-8b", "replicas": 1, "routing": "least_request",
         "residency": on_demand, "startup": {"load": 20.0}}
        for name in (A, B)
    ]  # fmt: skip
    return FleetController.of(parse_fleet({"models": models}))


def start(control: FleetController, now: float = 0.0) -> list[object]:
    out: list[object] = []
    for pool, rid in ((A, A0), (B, B0)):
        seen = Replicas(pool, (ReplicaSeen(rid, ReplicaState.READY, "p1"),))
        out += control.handle(now, seen)
    return out


def arrive(control: FleetController, now: float, rid: str, pool: str) -> list[object]:
    return list(control.handle(now, Arrived(RouteRequest(rid, pool, prompt_tokens=10))))


def of(kind: type, out: list[object]) -> list[object]:
    return [c for c in out if isinstance(c, kind)]


def test_engines_started_awake_on_one_slot_put_all_but_one_to_sleep() -> None:
    control = fleet()
    out = start(control)
    (sleep,) = of(Sleep, out)
    assert sleep.replica == A0  # both unused: the least recently used (A, first seen)
    assert (sleep.level, sleep.reason) == (1, "overcommit")
    assert control.pools[A].routable() == ()  # it takes no request while it falls asleep
    assert len(control.pools[B].routable()) == 1


def test_a_request_for_a_sleeping_model_is_held_then_served_after_a_swap() -> None:
    control = fleet(min_awake=0.0)
    start(control)
    control.handle(0.5, Resident(A, A0, Residency.SLEEPING_1))
    # B serves a request; then one comes for A: held, and B (busy) drains instead of sleeping
    assert of(Route, arrive(control, 1.0, "b1", B))
    out = arrive(control, 2.0, "a1", A)
    assert not of(Route, out)
    assert not of(Reject, out)
    assert control.pools[A].held == 1
    assert not of(Sleep, out)  # B has a request in flight: it drains first
    assert control.pools[B].routable() == ()  # no new request goes to a draining replica
    held_b = arrive(control, 2.1, "b2", B)
    assert not of(Route, held_b)  # B's next request waits too
    # B's request ends: now it sleeps; A wakes only once B's memory is free
    out = list(control.handle(3.0, Finished(B, "b1")))
    assert [(s.replica, s.reason) for s in of(Sleep, out)] == [(B0, "evicted")]
    assert not of(Wake, out)
    out = list(control.handle(3.4, Resident(B, B0, Residency.SLEEPING_1)))
    assert [w.replica for w in of(Wake, out)] == [A0]
    # A is awake: its held request is routed to it, in that event
    out = list(control.handle(3.9, Resident(A, A0, Residency.SERVING)))
    routes = of(Route, out)
    assert [(r.request_id, r.replica, r.held) for r in routes] == [("a1", A0, True)]
    assert control.residency is not None
    assert control.residency.counters.wakes == 1
    assert abs(control.residency.counters.wake_seconds - 0.5) < 1e-9


def test_min_awake_makes_the_other_model_wait_its_turn() -> None:
    control = fleet(min_awake=5.0)
    start(control)
    control.handle(0.5, Resident(A, A0, Residency.SLEEPING_1))
    # B started awake, woken for no one: min_awake does not hold it, a1 evicts it at once
    out = arrive(control, 1.0, "a1", A)
    assert [(s.replica, s.reason) for s in of(Sleep, out)] == [(B0, "evicted")]
    assert [
        w.replica
        for w in of(Wake, list(control.handle(1.4, Resident(B, B0, Residency.SLEEPING_1))))
    ] == [A0]
    control.handle(1.8, Resident(A, A0, Residency.SERVING))
    control.handle(1.9, Finished(A, "a1"))
    # A was woken at 1.8: B's request waits until A's min_awake is over
    out = arrive(control, 2.0, "b1", B)
    assert not of(Sleep, out)
    assert control.residency is not None
    assert control.residency.next_wakeup() == 6.8
    assert not of(Sleep, list(control.handle(6.7, Tick())))
    out = list(control.handle(6.8, Tick()))
    assert [(s.replica, s.reason) for s in of(Sleep, out)] == [(A0, "evicted")]


def test_engines_started_awake_are_evicted_at_once_for_the_first_requests() -> None:
    # every engine starts awake; the one left on the slot was woken for no one, so the
    # first request for the other model does not wait min_awake from the engines' start
    # (the bench's first requests waited up to 1.9 s for it: 20 models, 8 slots)
    control = fleet(min_awake=2.0)
    start(control)
    control.handle(0.4, Resident(A, A0, Residency.SLEEPING_1))
    out = arrive(control, 0.5, "a1", A)
    assert [(s.replica, s.reason) for s in of(Sleep, out)] == [(B0, "evicted")]


def test_an_idle_replica_sleeps_after_idle_seconds_and_wakes_on_the_next_request() -> None:
    models = [{"name": A, "model": "llama-3.1-8b", "replicas": 1,
               "residency": {"mode": "on_demand", "idle": 30.0, "level": 2}}]  # fmt: skip
    control = FleetController.of(parse_fleet({"models": models}))
    control.handle(0.0, Replicas(A, (ReplicaSeen(A0, ReplicaState.READY, "p1"),)))
    assert of(Route, arrive(control, 1.0, "a1", A))
    control.handle(2.0, Finished(A, "a1"))
    assert control.residency is not None
    assert control.residency.next_wakeup() == 32.0
    assert not of(Sleep, list(control.handle(31.0, Tick())))
    (sleep,) = of(Sleep, list(control.handle(32.0, Tick())))
    assert (sleep.replica, sleep.level, sleep.reason) == (A0, 2, "idle")
    control.handle(32.1, Resident(A, A0, Residency.SLEEPING_2))
    out = arrive(control, 40.0, "a2", A)
    assert [w.replica for w in of(Wake, out)] == [A0]
    out = list(control.handle(44.0, Resident(A, A0, Residency.SERVING)))
    assert [r.request_id for r in of(Route, out)] == ["a2"]


def test_a_held_request_times_out_if_no_wake_comes() -> None:
    control = fleet(min_awake=0.0)
    start(control)
    control.handle(0.5, Resident(A, A0, Residency.SLEEPING_1))
    arrive(control, 1.0, "a1", A)
    timeout = control.pools[A].settings.hold_timeout
    out = list(control.handle(1.0 + timeout, Tick()))
    assert [(r.request_id, r.reason) for r in of(Reject, out)] == [("a1", "hold_timeout")]


def test_the_events_and_commands_round_trip_through_json() -> None:
    event = Resident(A, A0, Residency.SLEEPING_2)
    assert event_from_json(json.loads(json.dumps(event_to_json(event)))) == event
    assert command_to_json(Sleep(A, A0, 2, "idle")) == {
        "do": "sleep", "model": A, "replica": A0, "level": 2, "reason": "idle"
    }  # fmt: skip
    assert command_to_json(Wake(A, A0)) == {"do": "wake", "model": A, "replica": A0}


def test_a_recorded_swap_replays_to_the_same_decisions() -> None:
    control = fleet(min_awake=0.0)
    out = io.StringIO()
    control.record(out)
    start(control)
    control.handle(0.5, Resident(A, A0, Residency.SLEEPING_1))
    arrive(control, 1.0, "b1", B)
    arrive(control, 2.0, "a1", A)
    control.handle(3.0, Finished(B, "b1"))
    control.handle(3.4, Resident(B, B0, Residency.SLEEPING_1))
    control.handle(3.9, Resident(A, A0, Residency.SERVING))
    control.handle(4.0, Finished(A, "a1"))
    control.handle(40.0, Tick())
    head, lines = read_recording(out.getvalue().splitlines())
    checked = 0
    kinds: set[str] = set()
    for line, commands in replay(head, lines):
        assert commands == line.commands
        kinds |= {c["do"] for c in commands}
        checked += 1
    assert checked == 10
    assert {"sleep", "wake", "route"} <= kinds


def test_a_wake_seen_values_every_pool_with_the_same_weights() -> None:
    # A and B serve the same model on the same GPU: B's wake takes what A's took, though
    # B never woke (a prior per pool would value B's miss at startup.load / 20 = 1 s and
    # make A, seen to wake in 0.5 s, the cheaper to evict however busy it is)
    control = fleet(min_awake=0.0)
    start(control)
    residency = control.residency
    assert residency is not None
    assert residency.wake_seconds(A) == residency.wake_seconds(B) == 1.0  # the prior
    control.handle(0.5, Resident(A, A0, Residency.SLEEPING_1))
    arrive(control, 2.0, "a1", A)
    assert control.pools[A].held_since == 2.0
    control.handle(2.4, Resident(B, B0, Residency.SLEEPING_1))
    control.handle(2.9, Resident(A, A0, Residency.SERVING))
    assert control.pools[A].held_since is None
    assert residency.wake_seconds(A) == residency.wake_seconds(B) == 0.5


def test_a_busy_replicas_drain_is_timed_and_charged_to_the_next_eviction() -> None:
    # B is evicted with a request in flight at 2.0 and sleeps when it ends at 3.0: a 1 s
    # drain, what the policy charges for evicting a busy B next (and A, none of its own seen)
    control = fleet(min_awake=0.0)
    start(control)
    residency = control.residency
    assert residency is not None
    assert residency.drain_seconds(A) == residency.drain_seconds(B) == 0.0
    control.handle(0.5, Resident(A, A0, Residency.SLEEPING_1))
    arrive(control, 1.0, "b1", B)
    arrive(control, 2.0, "a1", A)
    assert residency.drain_seconds(B) == 0.0  # draining, not over yet
    control.handle(3.0, Finished(B, "b1"))
    assert residency.drain_seconds(B) == residency.drain_seconds(A) == 1.0


def test_a_wake_that_fails_is_tried_again_after_a_back_off_that_doubles() -> None:
    control = fleet(min_awake=0.0)
    start(control)
    control.handle(0.5, Resident(A, A0, Residency.SLEEPING_1))
    control.handle(0.6, Resident(B, B0, Residency.SLEEPING_1))  # both asleep: room for A
    (wake,) = of(Wake, arrive(control, 1.0, "a1", A))
    assert wake.replica == A0
    # the engine answered the wake with an error and says it is still asleep
    assert not of(Wake, list(control.handle(1.2, Resident(A, A0, Residency.SLEEPING_1))))
    residency = control.residency
    assert residency is not None
    assert residency.counters.failed_wakes == 1
    assert residency.next_wakeup() == 2.2  # a second later (WAKE_BACKOFF)
    assert not of(Wake, arrive(control, 1.5, "a2", A))  # more held requests: no hammering
    assert not of(Wake, list(control.handle(2.1, Tick())))
    (again,) = of(Wake, list(control.handle(2.2, Tick())))
    assert again.replica == A0
    control.handle(2.3, Resident(A, A0, Residency.SLEEPING_1))  # fails again: 2 s now
    assert residency.next_wakeup() == 4.3
    (third,) = of(Wake, list(control.handle(4.3, Tick())))
    assert third.replica == A0
    # it wakes: the held requests are served, and the next failure starts at 1 s again
    out = list(control.handle(4.6, Resident(A, A0, Residency.SERVING)))
    assert sorted(r.request_id for r in of(Route, out)) == ["a1", "a2"]
    assert residency.counters.failed_wakes == 2
