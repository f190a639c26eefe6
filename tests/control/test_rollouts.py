"""Rollouts in the controller (no shell, explicit ``now``): the fleet file's block starts one,
the weights it sets move new sessions, request outcomes and reported latencies fill its
windows, and a Tick at its deadline gives the verdict; a recording replays to the same
decisions."""

from __future__ import annotations

import io
import json
import random
from typing import Any

import pytest

from gpufleet.config import FleetFileError
from gpufleet.control import (
    AttemptFailed,
    Command,
    Finished,
    FleetController,
    Latencies,
    RolloutAct,
    RolloutAction,
    RolloutConfig,
    RolloutStart,
    RolloutStep,
    Route,
    Tick,
    command_to_json,
    event_from_json,
    event_to_json,
    read_recording,
    replay,
)
from gpufleet.fleet import Outcome
from tests.control.test_served import arrive, controller, pool, pool_of, up

ROLLOUT = {"to": "v2", "steps": [5, 20, 100], "step_seconds": 10, "analysis": {"min_samples": 20}}


def rolling(out: io.StringIO | None = None, **rollout: Any) -> FleetController:
    """Two pools of two replicas, served as ``chat`` with a rollout block; ``out``: record
    from the start."""
    served = [{"name": "chat", "variants": {"v1": 100, "v2": 0}, "rollout": ROLLOUT | rollout}]
    control = controller([pool("v1"), pool("v2")], served)
    if out is not None:
        control.record(out)
    up(control)
    return control


def steps(commands: list[Command]) -> list[RolloutStep]:
    return [c for c in commands if isinstance(c, RolloutStep)]


def traffic(
    control: FleetController,
    start: float,
    end: float,
    rng: random.Random,
    *,
    slow: dict[str, float] | None = None,
    rate: float = 100.0,
) -> dict[str, int]:
    """``rate`` requests a second from fresh sessions between ``start`` and ``end``, each
    answered at once; their TTFTs reported per pool once a second, as a shell does. Counts
    the requests each pool got."""
    got: dict[str, int] = {}
    ttfts: dict[str, list[float]] = {}
    n = int((end - start) * rate)
    for i in range(n):
        now = start + i / rate
        rid = f"r{start:g}-{i}"
        (route,) = [c for c in arrive(control, now, rid, "chat") if isinstance(c, Route)]
        name = pool_of(route)
        got[name] = got.get(name, 0) + 1
        control.handle(now, Finished("chat", rid, Outcome.SUCCESS))
        ttft = rng.lognormvariate(-1.6, 0.5) * (slow or {}).get(name, 1.0)
        ttfts.setdefault(name, []).append(ttft)
        if i % int(rate) == int(rate) - 1:
            for name, values in ttfts.items():
                control.handle(now, Latencies(name, tuple(values)))
            ttfts = {}
    for name, values in ttfts.items():
        control.handle(end, Latencies(name, tuple(values)))
    return got


def _route(control: FleetController, now: float, session: str) -> Route:
    rid = f"{session}@{now:g}"
    (route,) = [
        c for c in arrive(control, now, rid, "chat", session=session) if isinstance(c, Route)
    ]
    control.handle(now, Finished("chat", rid, Outcome.SUCCESS))
    return route


def tick(control: FleetController, now: float) -> list[RolloutStep]:
    return steps(control.handle(now, Tick()))


def start(control: FleetController, now: float = 0.0) -> RolloutStep:
    (event,) = control.fleet_rollouts()
    (step,) = steps(control.handle(now, event))
    return step


def test_a_fleet_files_canary_walks_to_100_moving_sessions_old_to_new_only() -> None:
    control = rolling()
    rng = random.Random(1)
    first = start(control)
    assert first.decision.share == 5.0
    assert control.served["chat"].weights() == {"v1": 95.0, "v2": 5.0}
    assert control.rollouts.next_wakeup() == 10.0
    users = [f"user-{i}" for i in range(300)]
    on_new = {u for u in users if pool_of(_route(control, 0.0, u)) == "v2"}
    got = traffic(control, 0.0, 10.0, rng)
    assert got["v2"] / sum(got.values()) == pytest.approx(0.05, abs=0.025)
    (promoted,) = tick(control, 10.0)
    assert (promoted.decision.verdict, promoted.decision.share) == ("promote", 20.0)
    later = {u for u in users if pool_of(_route(control, 10.0, u)) == "v2"}
    assert on_new < later  # sessions moved old → new only, none back
    got = traffic(control, 10.0, 20.0, rng)
    assert got["v2"] / sum(got.values()) == pytest.approx(0.20, abs=0.05)
    (done,) = tick(control, 20.0)
    assert (done.decision.verdict, done.decision.phase) == ("promote", "promoted")
    assert control.served["chat"].weights() == {"v1": 0.0, "v2": 100.0}
    assert traffic(control, 20.0, 21.0, rng) == {"v2": 100}
    assert control.rollouts.watched == {}  # over: the request path no longer counts
    status = control.rollouts.status("chat")
    assert status is not None
    assert status["phase"] == "promoted"
    assert status["next_decision_at"] is None


def test_a_three_times_slower_version_is_rolled_back_at_the_first_window() -> None:
    control = rolling()
    rng = random.Random(2)
    start(control)
    got = traffic(control, 0.0, 10.0, rng, slow={"v2": 3.0})
    (verdict,) = tick(control, 10.0)
    decision = verdict.decision
    assert (decision.verdict, decision.phase, decision.share) == (
        "rollback",
        "rolled_back",
        0.0,
    )
    assert [c.metric for c in decision.checks if c.result == "fail"] == ["ttft_p99"]
    assert control.served["chat"].weights() == {"v1": 100.0, "v2": 0.0}
    after = traffic(control, 10.0, 12.0, rng)
    assert after == {"v1": 200}  # no new request reaches the bad version
    assert got["v2"] / (sum(got.values()) + 200) < 0.10
    assert verdict.state["phase"] == "rolled_back"  # what the shell persists


def test_replica_errors_on_the_new_version_roll_it_back() -> None:
    control = rolling()
    start(control)
    failures = 0
    for i in range(2000):
        now = i / 200
        rid = f"e{i}"
        (route,) = [c for c in arrive(control, now, rid, "chat") if isinstance(c, Route)]
        if pool_of(route) == "v2" and i % 4 == 0:  # a quarter of its attempts: 5xx
            failures += 1
            retried = control.handle(now, AttemptFailed("chat", rid, Outcome.REPLICA_ERROR))
            assert any(isinstance(c, Route) for c in retried)  # retried on its other replica
        control.handle(now, Finished("chat", rid, Outcome.SUCCESS))
        control.handle(now, Latencies(pool_of(route), (0.1,)))
    assert failures > 5
    (verdict,) = tick(control, 10.0)
    assert verdict.decision.verdict == "rollback"
    assert verdict.decision.reason == "worse: error_rate"


def test_operators_act_through_events_and_bad_ones_are_refused() -> None:
    control = rolling()
    start(control)
    with pytest.raises(ValueError, match="rolling out to 'v2' already"):
        control.handle(1.0, RolloutStart("chat", RolloutConfig(to="v2")))
    (paused,) = steps(control.handle(2.0, RolloutAct("chat", RolloutAction.PAUSE)))
    assert paused.decision.verdict == "pause"
    assert control.rollouts.next_wakeup() is None  # paused: no verdict is due
    (promoted,) = steps(control.handle(3.0, RolloutAct("chat", RolloutAction.PROMOTE)))
    assert promoted.decision.share == 20.0
    (aborted,) = steps(control.handle(4.0, RolloutAct("chat", RolloutAction.ABORT)))
    assert aborted.decision.phase == "aborted"
    assert control.served["chat"].weights() == {"v1": 100.0, "v2": 0.0}
    with pytest.raises(ValueError, match="over"):
        control.handle(5.0, RolloutAct("chat", RolloutAction.RESUME))
    with pytest.raises(ValueError, match="no served model 'nope'"):
        control.handle(5.0, RolloutStart("nope", RolloutConfig(to="v2")))
    with pytest.raises(ValueError, match="not one of its variants"):
        control.handle(5.0, RolloutStart("chat", RolloutConfig(to="v3")))
    # a new rollout after the last one ended
    (again,) = steps(control.handle(6.0, RolloutStart("chat", RolloutConfig(to="v2"))))
    assert again.decision.share == 5.0


def test_a_restored_rollout_resumes_at_its_step() -> None:
    control = rolling()
    start(control)
    (promoted,) = steps(control.handle(3.0, RolloutAct("chat", RolloutAction.PROMOTE)))
    state = promoted.state
    fresh = rolling()  # a restarted gateway: its store's state, not the fleet file's block
    restore = RolloutStart(
        state["model"],
        RolloutConfig.model_validate(state["config"]),
        state["step"],
        state["phase"],
        tuple(state["base"].items()),
    )
    stale = RolloutStart("chat", restore.config, 1, "running", (("v0", 100.0), ("v2", 0.0)))
    with pytest.raises(ValueError, match="'v0' is not a variant of 'chat'"):
        fresh.handle(100.0, stale)  # a state the fleet file no longer fits: nothing changes
    assert fresh.rollouts.watched == {}
    assert fresh.served["chat"].weights() == {"v1": 100.0, "v2": 0.0}
    (resumed,) = steps(fresh.handle(100.0, restore))
    assert resumed.decision.share == 20.0
    assert fresh.served["chat"].weights() == {"v1": 80.0, "v2": 20.0}
    assert fresh.rollouts.next_wakeup() == 110.0


@pytest.mark.parametrize(
    ("rollout", "error"),
    [
        ({"to": "v3"}, "rollout.to: 'v3' is not one of its variants"),
        ({"to": "v1"}, "no other variant of positive weight"),
        ({"to": "v2", "steps": [50, 20]}, "must increase"),
        ({"to": "v2", "strategy": "yolo"}, "strategy"),
    ],
)
def test_bad_rollout_blocks_are_refused(rollout: dict[str, Any], error: str) -> None:
    served = [{"name": "chat", "variants": {"v1": 100, "v2": 0}, "rollout": rollout}]
    with pytest.raises(FleetFileError, match=error):
        controller([pool("v1"), pool("v2")], served)


def test_a_recorded_rollout_replays_to_the_same_decisions() -> None:
    out = io.StringIO()
    control = rolling(out)
    rng = random.Random(3)
    start(control)
    traffic(control, 0.0, 10.0, rng, slow={"v2": 3.0})
    tick(control, 10.0)
    control.handle(11.0, RolloutStart("chat", RolloutConfig(to="v2", step_seconds=5)))
    control.handle(12.0, RolloutAct("chat", RolloutAction.PAUSE))
    lines = out.getvalue().splitlines()
    kinds = {json.loads(line)["event"]["kind"] for line in lines[1:]}
    assert {"rollout_start", "rollout_act", "latencies"} <= kinds
    head, body = read_recording(io.StringIO(out.getvalue()))
    compared = 0
    for line, commands in replay(head, body):
        assert commands == line.commands, line
        compared += 1
    assert compared == len(lines) - 1
    # every new event survives its JSON round trip
    for event in (
        RolloutStart("chat", RolloutConfig(to="v2"), 2, "paused", (("v1", 1.0), ("v2", 0.0))),
        RolloutAct("chat", RolloutAction.ABORT),
        Latencies("v2", (0.1, 0.2), (0.01,)),
    ):
        assert event_from_json(json.loads(json.dumps(event_to_json(event)))) == event
    (aborted,) = steps(control.handle(13.0, RolloutAct("chat", RolloutAction.ABORT)))
    line = command_to_json(aborted)
    assert (line["do"], line["verdict"], line["weights"]) == (
        "rollout",
        "abort",
        {"v1": 100.0, "v2": 0.0},
    )
