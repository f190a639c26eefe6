"""The pool controller alone: events in, commands out, no shell (L0, explicit ``now``)."""

from __future__ import annotations

import io
import json

from gpufleet.config import parse_fleet
from gpufleet.control import (
    Abandon,
    Arrived,
    AttemptFailed,
    ClientGone,
    Ejected,
    Finished,
    FleetController,
    Probe,
    ProbeAnswered,
    QueueReport,
    Reject,
    RejectReason,
    Replicas,
    ReplicaSeen,
    Route,
    Scale,
    Tick,
    event_from_json,
    event_to_json,
    read_recording,
    replay,
)
from gpufleet.fleet import Outcome, ReplicaId, ReplicaState, RouteRequest
from gpufleet.sim import FleetSimulation, SimOptions, TraceRequest

POOL = "llama-3.1-8b"


def controller(
    replicas: int = 3, health: dict[str, object] | None = None, **gateway: object
) -> FleetController:
    model: dict[str, object] = {"name": POOL, "replicas": replicas, "routing": "least_request"}
    if health is not None:
        model["health"] = health
    return FleetController.of(parse_fleet({"models": [model], "gateway": gateway}))


def seen(*replicas: tuple[int, ReplicaState, str | None]) -> Replicas:
    """The runtime's list: (index, state, incarnation) per replica."""
    return Replicas(
        POOL, tuple(ReplicaSeen(ReplicaId(f"{POOL}-{i}"), s, n) for i, s, n in replicas)
    )


def routed(out: list[object]) -> list[tuple[str, str, bool]]:
    return [(c.request_id, c.replica, c.retry) for c in out if isinstance(c, Route)]


def up(control: FleetController, now: float, n: int, incarnation: str = "a") -> list[object]:
    """Tell the controller of ``n`` READY replicas and answer their first probes."""
    seen = tuple(
        ReplicaSeen(ReplicaId(f"{POOL}-{i}"), ReplicaState.READY, incarnation) for i in range(n)
    )
    out: list[object] = list(control.handle(now, Replicas(POOL, seen)))
    for command in list(out):
        if isinstance(command, Probe):
            out += control.handle(now, ProbeAnswered(POOL, command.replica, True))
    return out


def arrive(control: FleetController, now: float, i: int) -> list[object]:
    return list(control.handle(now, Arrived(RouteRequest(f"r{i}", POOL, prompt_tokens=100))))


def test_a_new_process_is_probed_at_once_and_routable_after_it_answers() -> None:
    control = controller()
    out = up(control, 0.0, 2)
    assert {c.replica for c in out if isinstance(c, Probe)} == {f"{POOL}-0", f"{POOL}-1"}
    assert len(control.pools[POOL].routable()) == 2
    (route,) = arrive(control, 0.1, 0)
    assert isinstance(route, Route)
    assert not route.retry


def test_a_failure_before_the_first_byte_is_retried_on_the_next_candidate() -> None:
    control = controller()
    up(control, 0.0, 3)
    (first,) = arrive(control, 1.0, 0)
    assert isinstance(first, Route)
    out = control.handle(1.1, AttemptFailed(POOL, "r0", Outcome.TIMEOUT))
    retry = next(c for c in out if isinstance(c, Route))
    assert retry.retry
    assert retry.replica != first.replica
    pool = control.pools[POOL]
    assert pool.active_retries == 1
    assert pool.counters.retries == 1
    control.handle(1.2, Finished(POOL, "r0"))
    assert pool.in_flight == pool.active_retries == 0
    assert pool.attempts == {}


def test_a_replica_the_runtime_saw_healthy_is_routable_from_the_first_request() -> None:
    # no probe answered yet: the runtime's READY (its own /health check) is the first pass
    control = controller()
    out = control.handle(0.0, seen((0, ReplicaState.READY, "a"), (1, ReplicaState.READY, "b")))
    assert {c.replica for c in out if isinstance(c, Probe)} == {f"{POOL}-0", f"{POOL}-1"}
    assert len(control.pools[POOL].routable()) == 2
    (route,) = arrive(control, 0.0, 0)
    assert isinstance(route, Route)


def test_a_replica_becomes_routable_when_the_runtime_reports_it_ready() -> None:
    control = controller()
    control.handle(0.0, seen((0, ReplicaState.STARTING, "a")))
    assert control.pools[POOL].routable() == ()
    control.handle(2.0, seen((0, ReplicaState.READY, "a")))
    assert len(control.pools[POOL].routable()) == 1


def test_a_restart_starts_the_checks_over_and_a_repeated_ready_is_no_new_pass() -> None:
    control = controller(health={"active": {"healthy_threshold": 3, "unhealthy_threshold": 1}})
    pool = control.pools[POOL]
    control.handle(0.0, seen((0, ReplicaState.READY, "a"), (1, ReplicaState.READY, "b")))
    control.handle(1.0, ProbeAnswered(POOL, ReplicaId(f"{POOL}-0"), False))
    assert [r.id for r in pool.routable()] == [f"{POOL}-1"]  # failing its checks
    # the runtime says READY again (level-triggered, same process): not a new check
    control.handle(1.5, seen((0, ReplicaState.READY, "a"), (1, ReplicaState.READY, "b")))
    assert [r.id for r in pool.routable()] == [f"{POOL}-1"]
    # a new process: starting (not routable), then READY, its first pass, is enough:
    # the old process's failed checks (3 passes to come back) are forgotten
    control.handle(2.0, seen((0, ReplicaState.STARTING, "a2"), (1, ReplicaState.READY, "b")))
    assert [r.id for r in pool.routable()] == [f"{POOL}-1"]
    control.handle(3.0, seen((0, ReplicaState.READY, "a2"), (1, ReplicaState.READY, "b")))
    assert len(pool.routable()) == 2


def test_a_restarted_replica_takes_traffic_again_though_its_old_process_was_ejected() -> None:
    # 16 clients: replica 0's process answers 5xx and is ejected (for 30 s); the runtime
    # replaces the process, and the new one is routed to once it is READY, not 30 s later
    control = controller(2, health={"outlier": {"consecutive_5xx": 3, "max_ejection_percent": 50}})
    pool = control.pools[POOL]
    up(control, 0.0, 2)
    zero = f"{POOL}-0"
    first = {c.request_id: c.replica for i in range(16) for c in arrive(control, 1.0, i)}
    failed = [r for r, x in first.items() if x == zero]
    out = [
        c
        for r in failed
        for c in control.handle(1.1, AttemptFailed(POOL, r, Outcome.REPLICA_ERROR))
    ]
    assert any(isinstance(c, Ejected) and c.record.enforced for c in out)
    assert [r.id for r in pool.routable()] == [f"{POOL}-1"]
    for rid, replica in first.items():
        if replica != zero:
            control.handle(1.2, Finished(POOL, rid))
    for c in out:
        if isinstance(c, Route):
            control.handle(1.2, Finished(POOL, c.request_id))
    # the runtime restarted it: a new process, starting, then ready (its first probe passes)
    control.handle(2.0, seen((0, ReplicaState.STARTING, "a2"), (1, ReplicaState.READY, "a")))
    for c in control.handle(3.0, seen((0, ReplicaState.READY, "a2"), (1, ReplicaState.READY, "a"))):
        if isinstance(c, Probe):
            control.handle(3.0, ProbeAnswered(POOL, c.replica, True))
    assert len(pool.routable()) == 2
    second = [c.replica for i in range(16, 32) for c in arrive(control, 3.1, i)]
    assert second.count(zero) == 8  # least_request: half of 16 concurrent requests


def test_a_request_waits_for_a_starting_replica_instead_of_a_503() -> None:
    control = controller(autoscaler={"hold_timeout": 5.0})
    pool = control.pools[POOL]
    control.handle(0.0, seen((0, ReplicaState.STARTING, "a"), (1, ReplicaState.STARTING, None)))
    assert arrive(control, 0.1, 0) == []  # held, not refused
    assert pool.held == 1
    out = control.handle(0.4, seen((0, ReplicaState.READY, "a"), (1, ReplicaState.STARTING, None)))
    assert routed(out) == [("r0", f"{POOL}-0", False)]
    assert pool.held == 0
    assert pool.counters.hold_served == 1


def test_a_request_held_for_a_starting_replica_times_out() -> None:
    control = controller(autoscaler={"hold_timeout": 5.0})
    control.handle(0.0, seen((0, ReplicaState.STARTING, "a")))
    arrive(control, 1.0, 0)
    assert control.next_wakeup() == 6.0
    assert control.handle(6.0, Tick()) == [Reject("r0", RejectReason.HOLD_TIMEOUT)]
    assert control.pools[POOL].in_flight == 0


def test_a_pool_with_nothing_starting_refuses_at_once() -> None:
    control = controller(autoscaler={"hold_timeout": 5.0})
    control.handle(0.0, seen((0, ReplicaState.DRAINING, "a")))
    assert arrive(control, 1.0, 0) == [Reject("r0", RejectReason.NO_REPLICA)]
    held = controller(autoscaler={"hold_requests": 0})  # holding off
    held.handle(0.0, seen((0, ReplicaState.STARTING, "a")))
    assert arrive(held, 1.0, 0) == [Reject("r0", RejectReason.NO_REPLICA)]


def test_a_gone_replica_is_retried_without_drawing_on_the_budget() -> None:
    # a budget that allows no retry at all: only free retries can happen
    control = controller(2, retry={"budget_percent": 0.0, "min_retry_concurrency": 0})
    pool = control.pools[POOL]
    up(control, 0.0, 2)
    first = {c.request_id: c.replica for i in range(8) for c in arrive(control, 1.0, i)}
    dead = ReplicaId(f"{POOL}-0")
    on_dead = sorted(r for r, replica in first.items() if replica == dead)
    assert len(on_dead) == 4
    for rid in on_dead:  # killed under four requests: refused or reset before a byte
        out = control.handle(1.1, AttemptFailed(POOL, rid, Outcome.CONNECT_FAILURE))
        assert routed(out) == [(rid, f"{POOL}-1", True)]
    assert pool.counters.free_retries == 4
    assert pool.counters.retries_refused == 0
    assert pool.active_retries == 0  # the budget's count did not move
    # a slow replica (a timeout) or a 5xx from one in service still draws on the budget
    rid = next(r for r, replica in first.items() if replica != dead)
    out = control.handle(1.2, AttemptFailed(POOL, rid, Outcome.TIMEOUT))
    assert out == [Reject(rid, RejectReason.EXHAUSTED, budget=True)]


def test_a_failure_on_a_replica_known_dead_or_ejected_is_free() -> None:
    control = controller(
        3,
        health={"outlier": {"consecutive_5xx": 1, "max_ejection_percent": 50}},
        retry={"budget_percent": 0.0, "min_retry_concurrency": 0},
    )
    pool = control.pools[POOL]
    up(control, 0.0, 3)
    first = {c.request_id: c.replica for i in range(6) for c in arrive(control, 1.0, i)}
    a, b = (sorted(r for r, x in first.items() if x == f"{POOL}-{k}") for k in (0, 1))
    # replica 0's process is gone (the runtime says so): a timeout there is free
    others = ((k, ReplicaState.READY, "a") for k in (1, 2))
    control.handle(1.1, seen((0, ReplicaState.FAILED, None), *others))
    out = control.handle(1.2, AttemptFailed(POOL, a[0], Outcome.TIMEOUT))
    ((rid, replica, retry),) = routed(out)
    assert (rid, retry) == (a[0], True)
    assert replica != f"{POOL}-0"
    assert pool.counters.free_retries == 1
    # replica 1 answers a 5xx: a retry from the budget (refused: none), and health ejects it
    out = control.handle(1.3, AttemptFailed(POOL, b[0], Outcome.REPLICA_ERROR))
    assert Reject(b[0], RejectReason.EXHAUSTED, budget=True) in out
    assert any(isinstance(c, Ejected) and c.record.enforced for c in out)
    # the next 5xx from the ejected replica is free
    out = control.handle(1.4, AttemptFailed(POOL, b[1], Outcome.REPLICA_ERROR))
    assert [(r, retry) for r, _, retry in routed(out)] == [(b[1], True)]
    assert pool.counters.free_retries == 2
    assert pool.counters.retries_refused == 1


def test_free_retries_try_each_replica_once_within_max_retries() -> None:
    for max_retries, attempts in ((5, 3), (1, 2)):
        control = controller(3, retry={"max_retries": max_retries})
        up(control, 0.0, 3)
        (route,) = arrive(control, 1.0, 0)
        assert isinstance(route, Route)
        tried = [route.replica]
        out: list[object] = []
        while True:
            out = control.handle(1.1, AttemptFailed(POOL, "r0", Outcome.CONNECT_FAILURE))
            if not routed(out):
                break
            tried += [replica for _, replica, _ in routed(out)]
        assert len(tried) == len(set(tried)) == attempts
        assert out == [Reject("r0", RejectReason.EXHAUSTED)]


def test_a_retry_finds_a_replica_that_became_routable_after_the_request_was_ranked() -> None:
    control = controller(2, retry={"budget_percent": 0.0, "min_retry_concurrency": 0})
    control.handle(0.0, seen((0, ReplicaState.READY, "a"), (1, ReplicaState.STARTING, "b")))
    (route,) = arrive(control, 1.0, 0)  # ranked over replica 0 alone
    assert isinstance(route, Route)
    control.handle(1.5, seen((0, ReplicaState.READY, "a"), (1, ReplicaState.READY, "b")))
    out = control.handle(2.0, AttemptFailed(POOL, "r0", Outcome.CONNECT_FAILURE))
    assert routed(out) == [("r0", f"{POOL}-1", True)]


def test_a_broken_stream_is_not_retried() -> None:
    control = controller()
    up(control, 0.0, 3)
    arrive(control, 1.0, 0)
    out = control.handle(1.5, AttemptFailed(POOL, "r0", Outcome.CONNECT_FAILURE, streamed=True))
    assert [c for c in out if isinstance(c, Reject)] == [Reject("r0", RejectReason.BROKEN)]
    assert control.pools[POOL].in_flight == 0


def arrive_resumable(control: FleetController, now: float, i: int) -> Route:
    request = RouteRequest(f"r{i}", POOL, prompt_tokens=100)
    (route,) = control.handle(now, Arrived(request, resumable=True))
    assert isinstance(route, Route)
    return route


def broke(control: FleetController, now: float, i: int) -> list[object]:
    return list(
        control.handle(now, AttemptFailed(POOL, f"r{i}", Outcome.CONNECT_FAILURE, streamed=True))
    )


def test_a_resumable_stream_that_broke_resumes_on_another_replica() -> None:
    control = controller()
    up(control, 0.0, 3)
    first = arrive_resumable(control, 1.0, 0)
    out = broke(control, 1.5, 0)
    resume = next(c for c in out if isinstance(c, Route))
    assert resume.resume
    assert not resume.retry
    assert resume.replica != first.replica
    pool = control.pools[POOL]
    assert pool.counters.resumes == 1
    assert pool.counters.broken == 0
    assert pool.active_retries == 0  # resumes do not draw on the retry budget
    assert pool.attempts == {resume.replica: 1}
    control.handle(2.0, Finished(POOL, "r0"))
    assert pool.in_flight == 0
    assert pool.attempts == {}


def test_resumes_are_bounded_per_request() -> None:
    control = controller(retry={"max_resumes": 2})
    up(control, 0.0, 3)
    arrive_resumable(control, 1.0, 0)
    routes = []
    for t in (1.1, 1.2):
        routes += [c for c in broke(control, t, 0) if isinstance(c, Route)]
    assert [r.resume for r in routes] == [True, True]
    out = broke(control, 1.3, 0)
    assert [c for c in out if isinstance(c, Reject)] == [Reject("r0", RejectReason.BROKEN)]
    pool = control.pools[POOL]
    assert (pool.counters.resumes, pool.counters.broken) == (2, 1)
    assert pool.in_flight == 0
    assert pool.attempts == {}


def test_a_stream_is_not_resumed_past_its_deadline() -> None:
    control = controller(retry={"resume_within": 10.0})
    up(control, 0.0, 3)
    arrive_resumable(control, 1.0, 0)
    out = broke(control, 11.5, 0)
    assert [c for c in out if isinstance(c, Reject)] == [Reject("r0", RejectReason.BROKEN)]


def test_a_stream_that_is_not_resumable_ends_in_an_error_event() -> None:
    control = controller()
    up(control, 0.0, 3)
    arrive(control, 1.0, 0)  # resumable=False: n > 1, say
    out = broke(control, 1.5, 0)
    assert [c for c in out if isinstance(c, Reject)] == [Reject("r0", RejectReason.BROKEN)]
    assert control.pools[POOL].counters.resumes == 0


def test_max_resumes_zero_turns_resumes_off() -> None:
    control = controller(retry={"max_resumes": 0})
    up(control, 0.0, 3)
    arrive_resumable(control, 1.0, 0)
    out = broke(control, 1.5, 0)
    assert [c for c in out if isinstance(c, Reject)] == [Reject("r0", RejectReason.BROKEN)]


def test_a_stream_is_not_resumed_on_the_replica_it_broke_on() -> None:
    control = controller()
    up(control, 0.0, 1)  # the only replica is the one that broke
    arrive_resumable(control, 1.0, 0)
    out = broke(control, 1.5, 0)
    assert [c for c in out if isinstance(c, Reject)] == [Reject("r0", RejectReason.BROKEN)]


def test_a_resume_goes_only_to_a_reachable_replica() -> None:
    control = controller()
    up(control, 0.0, 2)
    first = arrive_resumable(control, 1.0, 0)
    other = next(r for r in (f"{POOL}-0", f"{POOL}-1") if r != first.replica)
    # the other replica's process is gone (the runtime has no address for it)
    seen = tuple(
        ReplicaSeen(ReplicaId(r), ReplicaState.READY, None if r == other else "a")
        for r in (f"{POOL}-0", f"{POOL}-1")
    )
    control.handle(1.2, Replicas(POOL, seen))
    out = broke(control, 1.5, 0)
    assert [c for c in out if isinstance(c, Reject)] == [Reject("r0", RejectReason.BROKEN)]


def test_resumes_round_trip_through_json_and_replay() -> None:
    fleet = parse_fleet({"models": [{"name": POOL, "replicas": 3, "routing": "least_request"}]})
    live = FleetController.of(fleet)
    out = io.StringIO()
    live.record(out)
    up(live, 0.0, 3)
    arrive_resumable(live, 1.0, 0)
    arrive(live, 1.0, 1)
    broke(live, 1.5, 0)
    broke(live, 1.5, 1)
    live.handle(2.0, Finished(POOL, "r0"))
    lines = [json.loads(line) for line in out.getvalue().splitlines()[1:]]
    arrivals = {e["id"]: e for line in lines if (e := line["event"])["kind"] == "arrived"}
    assert arrivals["r0"]["resumable"] is True
    assert "resumable" not in arrivals["r1"]
    routes = [c for line in lines for c in line["commands"] if c["do"] == "route"]
    assert [c.get("resume", False) for c in routes] == [False, False, True]
    for line in lines:
        assert event_to_json(event_from_json(line["event"])) == line["event"]
    head, recorded = read_recording(io.StringIO(out.getvalue()))
    for line, commands in replay(head, recorded):
        assert commands == line.commands


def fail_checks(control: FleetController, now: float, replica: str) -> list[object]:
    """Probe ``replica`` until health fails it (each due probe answered: a timeout)."""
    out: list[object] = []
    for k in range(10):
        t = now + k
        commands = list(control.handle(t, Tick()))
        out += commands
        for command in commands:
            if isinstance(command, Probe) and command.replica == replica:
                out += control.handle(t + 1.0, ProbeAnswered(POOL, replica, False))
        view = control.pools[POOL].view.replica(ReplicaId(replica))
        if view is not None and view.state is ReplicaState.FAILED:
            return out
    raise AssertionError(f"{replica} never failed its checks")


def test_the_attempts_on_a_replica_that_fails_its_checks_are_abandoned_once() -> None:
    """A hung replica answers no probe: once health fails it, one Abandon names every
    attempt in flight there (not the others'), once while it stays failed; each, reported
    as a TIMEOUT, is retried on another replica without the retry budget (or resumed, for a
    stream); the recording carries the Abandon, and a replay decides it again."""
    fleet = parse_fleet({"models": [{"name": POOL, "replicas": 2, "routing": "round_robin"}]})
    control = FleetController.of(fleet)
    recording = io.StringIO()
    control.record(recording)
    up(control, 0.0, 2)
    sent = {c.request_id: c.replica for i in range(4) for c in routed_all(arrive(control, 1.0, i))}
    sent["r4"] = arrive_resumable(control, 1.0, 4).replica
    hung = sent["r0"]
    on_hung = sorted(rid for rid, replica in sent.items() if replica == hung)
    out = fail_checks(control, 2.0, hung)
    (abandon,) = [c for c in out if isinstance(c, Abandon)]
    assert (abandon.model, abandon.replica) == (POOL, hung)
    assert sorted(abandon.request_ids) == on_hung
    # the shell ends each attempt as a timeout: retried elsewhere, free (the replica is out)
    now = 20.0
    for rid in abandon.request_ids:
        streamed = rid == "r4"
        commands = control.handle(now, AttemptFailed(POOL, rid, Outcome.TIMEOUT, streamed))
        (route,) = [c for c in commands if isinstance(c, Route)]
        assert route.replica != hung
        assert route.resume == streamed
    counters = control.pools[POOL].counters
    assert counters.retries_refused == 0
    assert counters.free_retries + counters.resumes == len(on_hung)
    # still failing: no second Abandon for the same failure
    assert not [c for c in fail_checks(control, 21.0, hung) if isinstance(c, Abandon)]
    # the log carries it, and a replay decides it again
    lines = [json.loads(line) for line in recording.getvalue().splitlines()[1:]]
    logged = [c for line in lines for c in line["commands"] if c["do"] == "abandon"]
    assert logged == [{"do": "abandon", "model": POOL, "replica": hung, "ids": on_hung}]
    head, recorded = read_recording(io.StringIO(recording.getvalue()))
    for line, commands in replay(head, recorded):
        assert commands == line.commands


def test_abandon_off_leaves_the_attempts_to_their_timeouts() -> None:
    control = controller(2, health={"active": {"abandon": False}})
    up(control, 0.0, 2)
    (route,) = routed_all(arrive(control, 1.0, 0))
    out = fail_checks(control, 2.0, route.replica)
    assert not [c for c in out if isinstance(c, Abandon)]


def routed_all(out: list[object]) -> list[Route]:
    return [c for c in out if isinstance(c, Route)]


def test_the_retry_budget_counts_admitted_requests() -> None:
    # min 1 retry at once, 0 %: the second concurrent retry is refused
    control = controller(retry={"budget_percent": 0.0, "min_retry_concurrency": 1})
    up(control, 0.0, 3)
    arrive(control, 1.0, 0)
    arrive(control, 1.0, 1)
    control.handle(1.1, AttemptFailed(POOL, "r0", Outcome.TIMEOUT))
    out = control.handle(1.1, AttemptFailed(POOL, "r1", Outcome.TIMEOUT))
    assert Reject("r1", RejectReason.EXHAUSTED, budget=True) in out
    assert control.pools[POOL].counters.retries_refused == 1


def test_a_client_that_leaves_mid_answer_frees_its_counts() -> None:
    control = controller()
    up(control, 0.0, 1)
    arrive(control, 1.0, 0)
    control.handle(2.0, ClientGone(POOL, "r0"))
    pool = control.pools[POOL]
    assert pool.in_flight == 0
    assert pool.attempts == {}
    assert control.handle(2.1, ClientGone(POOL, "r0")) == []  # twice: nothing


def test_no_replica_is_a_reject_not_a_hang() -> None:
    control = controller()
    (reject,) = arrive(control, 0.0, 0)
    assert reject == Reject("r0", RejectReason.NO_REPLICA)
    assert control.pools[POOL].in_flight == 0


def test_an_autoscaled_pool_holds_a_request_until_a_replica_is_routable() -> None:
    fleet = parse_fleet(
        {
            "models": [
                {
                    "name": POOL,
                    "replicas": 1,
                    "autoscale": {"min_replicas": 0, "scale_to_zero": True},
                }
            ],
            "gateway": {"autoscaler": {"hold_timeout": 5.0}},
        }
    )
    control = FleetController.of(fleet)
    control.handle(0.0, Tick())
    first = arrive(control, 0.5, 0)  # held, not refused: and a pool at zero scales now
    assert [c.decision.desired for c in first if isinstance(c, Scale)] == [1]
    assert not any(isinstance(c, Route | Reject) for c in first)
    assert arrive(control, 0.6, 1) == []
    assert control.pools[POOL].held == 2
    control.handle(0.7, ClientGone(POOL, "r1"))  # a held client leaves: its place goes
    assert control.pools[POOL].held == 1
    out = up(control, 1.0, 1)
    routes = [c for c in out if isinstance(c, Route)]
    assert [(r.request_id, r.replica) for r in routes] == [("r0", f"{POOL}-0")]
    assert control.pools[POOL].held == 0


def test_a_held_request_times_out() -> None:
    fleet = parse_fleet(
        {
            "models": [
                {
                    "name": POOL,
                    "replicas": 1,
                    "autoscale": {"min_replicas": 0, "scale_to_zero": True},
                }
            ],
            "gateway": {"autoscaler": {"hold_timeout": 5.0}},
        }
    )
    control = FleetController.of(fleet)
    arrive(control, 0.0, 0)
    assert control.next_wakeup() is not None
    assert control.next_wakeup() <= 5.0
    out = control.handle(5.0, Tick())
    assert Reject("r0", RejectReason.HOLD_TIMEOUT) in out
    assert control.pools[POOL].in_flight == 0


def test_the_admission_queue_is_read_through_the_controller() -> None:
    """What the simulator's report reads: the gate's numbers, or an empty queue without one."""
    fleet = parse_fleet({"models": [{"name": POOL, "args": ["--max-num-seqs", "8"]}]})
    assert FleetController.of(fleet, admission=False).queues() == {POOL: QueueReport(8, 0, {})}
    control = FleetController.of(fleet, admission=True)
    up(control, 0.0, 2)
    for i in range(3):
        request = RouteRequest(f"r{i}", POOL, prompt_tokens=100, tenant="t")
        control.handle(0.1 * i, Arrived(request))
        control.handle(0.1 * i + 0.05, Finished(POOL, f"r{i}", Outcome.SUCCESS, (100, 20)))
    gate = control.pools[POOL].admission
    assert gate is not None
    report = control.queues()[POOL]
    assert report == QueueReport(8, gate.queue_max, gate.queue.counters)
    assert report.counters["t"] > 0
    assert report.counters is not gate.queue.counters  # a copy: the report cannot move the gate


def test_a_simulated_run_replays_to_the_same_decisions() -> None:
    """Record a simulated run (faults, admission, prefix routing), replay it into a fresh
    controller: every line's commands are the recorded ones."""
    fleet = parse_fleet(
        {
            "models": [
                {
                    "name": POOL,
                    "replicas": 3,
                    "routing": "prefix_aware",
                    "args": ["--max-num-seqs", "8"],
                }
            ],
            "tenants": {"admission": {"max_queue": 20, "max_wait": 2.0}},
        }
    )
    from gpufleet.sim import parse_fault  # noqa: PLC0415

    options = SimOptions(
        seed=3, admission=True, faults=(parse_fault(f"crash:replica={POOL}-1,at=2,startup_s=3"),)
    )
    sim = FleetSimulation(fleet, options)
    out = io.StringIO()
    sim.control.record(out)
    sim.start(
        [TraceRequest(0.02 * i, 300 + i % 500, 20 + i % 40, (i % 5, i % 3)) for i in range(400)]
    )
    sim.run()
    head, lines = read_recording(io.StringIO(out.getvalue()))
    replayed = list(replay(head, lines))
    assert len(replayed) > 800
    kinds = {json.dumps(line.commands) != "[]" for line, _ in replayed}
    assert kinds == {True, False}
    for line, commands in replayed:
        assert commands == line.commands, line
    # the crash's started streams resumed elsewhere
    assert any(c.get("resume") for line, _ in replayed for c in line.commands)
    done = {c["do"] for line, _ in replayed for c in line.commands}
    assert {"route", "probe"} <= done
    assert {line.event.__class__.__name__ for line, _ in replayed} >= {
        "Arrived",
        "Finished",
        "Scraped",
        "Replicas",
        "ProbeAnswered",
        "Tick",
    }
