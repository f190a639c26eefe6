"""Served names in the controller: the weighted, sticky variant and the fallbacks (no shell,
explicit ``now``)."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from gpufleet.config import FleetFileError, parse_fleet
from gpufleet.control import (
    Arrived,
    AttemptFailed,
    ClientGone,
    Command,
    Fallback,
    Finished,
    FleetController,
    Probe,
    ProbeAnswered,
    Reject,
    RejectReason,
    Replicas,
    ReplicaSeen,
    Route,
    Scraped,
    ScrapedLoad,
    Tick,
    Weights,
    command_to_json,
    event_from_json,
    event_to_json,
    read_recording,
    replay,
)
from gpufleet.fleet import Outcome, ReplicaId, ReplicaState, RouteRequest

MODEL = "llama-3.1-8b"


def pool(name: str, replicas: int = 2, **extra: Any) -> dict[str, Any]:
    return {"name": name, "model": MODEL, "replicas": replicas, "routing": "least_request", **extra}


def controller(
    models: list[dict[str, Any]], served: list[dict[str, Any]] | None = None, **fleet: Any
) -> FleetController:
    data: dict[str, Any] = {"models": models, **fleet}
    if served is not None:
        data["served"] = served
    return FleetController.of(parse_fleet(data))


def up(control: FleetController, now: float = 0.0) -> None:
    """Every pool's replicas READY and answering their probes."""
    for name, p in control.pools.items():
        count = next(m.replica_count for m in control.fleet.models if m.name == name)
        seen = tuple(
            ReplicaSeen(ReplicaId(f"{name}-{i}"), ReplicaState.READY, f"{name}:{i}")
            for i in range(count)
        )
        for command in control.handle(now, Replicas(name, seen)):
            if isinstance(command, Probe):
                control.handle(now, ProbeAnswered(name, command.replica, True))
        assert len(p.routable()) == count


def arrive(
    control: FleetController,
    now: float,
    rid: str,
    model: str,
    *,
    session: str | None = None,
    tokens: int = 100,
) -> list[Command]:
    request = RouteRequest(rid, model, prompt_tokens=tokens, session_key=session)
    return control.handle(now, Arrived(request))


def pool_of(route: Command) -> str:
    assert isinstance(route, Route), route
    return route.replica.rsplit("-", 1)[0]


# -- the weighted, sticky choice --------------------------------------------------------------


def split_control() -> FleetController:
    control = controller(
        [pool("v1"), pool("v2")],
        [{"name": "chat", "variants": {"v1": 80, "v2": 20}}],
    )
    up(control)
    return control


def test_weights_are_honoured_and_each_session_stays_on_its_variant() -> None:
    control = split_control()
    first: dict[str, str] = {}
    n = 0
    for rounds in range(3):
        for user in range(1000):
            n += 1
            (route,) = arrive(control, 1.0 + n * 1e-3, f"r{n}", "chat", session=f"user-{user}")
            assert isinstance(route, Route)
            assert route.model == pool_of(route)  # the log says which variant
            control.handle(1.0 + n * 1e-3, Finished("chat", f"r{n}"))
            chosen = first.setdefault(f"user-{user}", route.model)
            assert chosen == route.model, f"user-{user} flipped in round {rounds}"
    on_v2 = sum(1 for v in first.values() if v == "v2") / len(first)
    assert on_v2 == pytest.approx(0.20, abs=0.04)
    served = control.served["chat"]
    assert served.arrived == 3000
    assert served.chosen["v1"] + served.chosen["v2"] == 3000
    assert control.pools["v1"].in_flight == control.pools["v2"].in_flight == 0
    assert not control._flights  # every request ended: no bookkeeping left


def test_requests_without_a_session_are_split_by_their_id() -> None:
    control = split_control()
    routes = [arrive(control, 1.0, f"r{i}", "chat")[0] for i in range(2000)]
    on_v2 = sum(1 for r in routes if isinstance(r, Route) and r.model == "v2") / len(routes)
    assert on_v2 == pytest.approx(0.20, abs=0.03)
    again = FleetController.of(control.fleet)
    up(again)
    assert [arrive(again, 1.0, f"r{i}", "chat")[0] for i in range(50)] == routes[:50]


def test_a_weights_event_moves_sessions_only_to_the_raised_variant() -> None:
    control = split_control()
    before = {
        u: pool_of(arrive(control, 1.0, f"a{u}", "chat", session=f"u{u}")[0]) for u in range(800)
    }
    assert control.handle(2.0, Weights("chat", (("v1", 50.0), ("v2", 50.0)))) == []
    after = {
        u: pool_of(arrive(control, 3.0, f"b{u}", "chat", session=f"u{u}")[0]) for u in range(800)
    }
    moved = [(before[u], after[u]) for u in before if before[u] != after[u]]
    assert moved
    assert all(m == ("v1", "v2") for m in moved)
    assert sum(1 for v in after.values() if v == "v2") / 800 == pytest.approx(0.5, abs=0.06)
    control.handle(4.0, Weights("chat", (("v2", 0.0),)))  # a rollback: no new request on v2
    assert {
        pool_of(arrive(control, 5.0, f"c{u}", "chat", session=f"u{u}")[0]) for u in range(200)
    } == {"v1"}
    with pytest.raises(ValueError, match="positive"):
        control.handle(6.0, Weights("chat", (("v1", 0.0),)))
    with pytest.raises(ValueError, match="not a variant"):
        control.handle(6.0, Weights("chat", (("v3", 1.0),)))


def test_a_plain_pool_decides_and_logs_as_before() -> None:
    control = controller([pool("a", fallbacks=["b"]), pool("b")])
    up(control)
    (route,) = arrive(control, 1.0, "r1", "b")
    assert isinstance(route, Route)
    assert route.model == ""
    assert command_to_json(route) == {"do": "route", "id": "r1", "replica": "b-0", "retry": False}
    (route,) = arrive(control, 1.0, "r2", "a")
    assert route.model == "a"  # a has a fallback: its requests are followed
    assert control.served["b"].plain
    assert not control.served["a"].plain


def test_an_unknown_name_is_a_value_error() -> None:
    control = split_control()
    with pytest.raises(ValueError, match="no served model 'v3'"):
        arrive(control, 1.0, "r1", "v3")


# -- fallbacks --------------------------------------------------------------------------------


def fallback_control(*, ready: bool = True) -> FleetController:
    control = controller(
        [pool("small", max_model_len=1024), pool("medium", max_model_len=4096), pool("large")],
        [{"name": "chat", "variants": ["small"], "fallbacks": ["medium", "large"]}],
    )
    if ready:
        up(control)
    return control


def fail_every_attempt(
    control: FleetController, now: float, rid: str, first: Command
) -> list[Command]:
    """Fail each attempt of ``rid`` with a 5xx until a command is not a Route to ``first``'s
    pool; everything said on the way."""
    said: list[Command] = [first]
    command = first
    target = pool_of(first)
    while isinstance(command, Route) and pool_of(command) == target:
        out = control.handle(now, AttemptFailed("chat", rid, Outcome.REPLICA_ERROR))
        said += out
        command = next(c for c in out if isinstance(c, Route | Reject))
    return said


def test_5xx_on_every_attempt_falls_back_to_the_next_name_in_order() -> None:
    control = fallback_control()
    (first,) = arrive(control, 1.0, "r1", "chat")
    assert pool_of(first) == "small"
    said = fail_every_attempt(control, 1.1, "r1", first)
    fallback, route = said[-2:]
    assert fallback == Fallback("r1", "chat", "medium", "medium", RejectReason.EXHAUSTED)
    assert isinstance(route, Route)
    assert route.model == "medium"
    assert not route.retry
    assert pool_of(route) == "medium"
    # the pool it left counted its reject; the one it went to, an arrival
    assert control.pools["small"].counters.rejected == 1
    assert control.pools["medium"].counters.arrived == 1
    said = fail_every_attempt(control, 1.2, "r1", route)
    fallback, route = said[-2:]
    assert fallback == Fallback("r1", "medium", "large", "large", RejectReason.EXHAUSTED)
    said = fail_every_attempt(control, 1.3, "r1", route)
    final = said[-1]
    assert isinstance(final, Reject)
    assert final.reason == RejectReason.EXHAUSTED
    assert final.model == "large"  # the last pool it was in
    assert not control._flights
    assert control.fallbacks == {
        ("chat", "medium", RejectReason.EXHAUSTED): 1,
        ("medium", "large", RejectReason.EXHAUSTED): 1,
    }


def test_an_answer_after_a_fallback_ends_the_request_in_the_pool_it_is_in() -> None:
    control = fallback_control()
    (first,) = arrive(control, 1.0, "r1", "chat")
    route = fail_every_attempt(control, 1.1, "r1", first)[-1]
    assert pool_of(route) == "medium"
    # the shell may name the served name: the controller knows where the request is
    assert control.handle(1.2, Finished("chat", "r1")) == []
    assert control.pools["medium"].in_flight == 0
    assert control.pools["small"].in_flight == 0
    assert not control._flights


def test_a_prompt_longer_than_a_context_goes_to_the_first_name_that_holds_it() -> None:
    control = fallback_control()
    out = arrive(control, 1.0, "r1", "chat", tokens=2000)
    assert out[0] == Fallback("r1", "chat", "medium", "medium", "context")
    assert pool_of(out[1]) == "medium"
    out = arrive(control, 1.0, "r2", "chat", tokens=100_000)
    assert out[0] == Fallback("r2", "chat", "large", "large", "context")  # 128k context
    assert pool_of(out[1]) == "large"
    (route,) = arrive(control, 1.0, "r3", "chat", tokens=500)
    assert pool_of(route) == "small"


def test_a_prompt_no_pool_holds_goes_where_it_would_have() -> None:
    """Its engine answers the 400 (the client's own model's limit), as without fallbacks."""
    control = fallback_control()
    (route,) = arrive(control, 1.0, "r1", "chat", tokens=10**7)
    assert pool_of(route) == "small"


def test_after_a_reject_a_name_that_cannot_hold_the_prompt_is_skipped_too() -> None:
    control = controller(
        [pool("small", max_model_len=4096), pool("medium", max_model_len=1024), pool("large")],
        [{"name": "chat", "variants": ["small"], "fallbacks": ["medium", "large"]}],
    )
    up(control)
    (first,) = arrive(control, 1.0, "r1", "chat", tokens=2000)
    assert pool_of(first) == "small"
    fallback, route = fail_every_attempt(control, 1.1, "r1", first)[-2:]
    # medium (1024) cannot hold it: straight to large, for the reason small gave
    assert fallback == Fallback("r1", "chat", "large", "large", RejectReason.EXHAUSTED)
    assert pool_of(route) == "large"


def test_shed_by_a_full_queue_falls_back() -> None:
    control = controller(
        [pool("small", 1, args=["--max-num-seqs", "1"]), pool("large", 1)],
        [{"name": "chat", "variants": ["small"], "fallbacks": ["large"]}],
        tenants={"admission": {"max_queue": 1, "max_wait": 5.0}},
    )
    control = FleetController.of(control.fleet, admission=True)
    up(control)
    # small: one running, one queued; the third is shed there and served by large
    (r0,) = arrive(control, 1.0, "r0", "chat")
    assert pool_of(r0) == "small"
    control.handle(1.0, _scraped("small", running=1))
    assert arrive(control, 1.01, "r1", "chat") == []  # queued in small
    out = arrive(control, 1.02, "r2", "chat")
    fallbacks = [c for c in out if isinstance(c, Fallback)]
    assert len(fallbacks) == 1
    assert fallbacks[0].reason == RejectReason.SHED
    assert fallbacks[0].to == "large"
    routes = [c for c in out if isinstance(c, Route)]
    assert len(routes) == 1
    assert routes[0].model == "large"
    # the one shed may be the queued one (the fair queue's choice): it goes to large too


def test_a_queue_deadline_in_one_pool_falls_back_at_the_tick() -> None:
    control = controller(
        [pool("small", 1, args=["--max-num-seqs", "1"]), pool("large", 1)],
        [{"name": "chat", "variants": ["small"], "fallbacks": ["large"]}],
        tenants={"admission": {"max_queue": 8, "max_wait": 0.5}},
    )
    control = FleetController.of(control.fleet, admission=True)
    up(control)
    arrive(control, 1.0, "r0", "chat")
    control.handle(1.0, _scraped("small", running=1))
    assert arrive(control, 1.1, "r1", "chat") == []
    due = control.next_wakeup()
    assert due is not None
    out: list[Command] = []
    t = 1.1
    while not any(isinstance(c, Route) for c in out):
        t = max(t + 0.05, control.next_wakeup() or t + 0.05)
        out += control.handle(t, Tick())
    assert any(isinstance(c, Fallback) and c.reason == RejectReason.EXPIRED for c in out)
    assert [pool_of(c) for c in out if isinstance(c, Route)] == ["large"]


def test_no_replica_falls_back_and_a_broken_stream_does_not() -> None:
    control = controller(
        [pool("small", 2), pool("large", 2)],
        [{"name": "chat", "variants": ["small"], "fallbacks": ["large"]}],
        gateway={"retry": {"max_resumes": 0}},
    )
    up(control)
    control.handle(1.0, Replicas("small", ()))  # small's replicas are gone
    out = arrive(control, 1.1, "r1", "chat")
    assert isinstance(out[0], Fallback)
    assert out[0].reason == RejectReason.NO_REPLICA
    assert pool_of(out[1]) == "large"
    out = control.handle(1.2, AttemptFailed("chat", "r1", Outcome.CONNECT_FAILURE, streamed=True))
    assert out == [Reject("r1", RejectReason.BROKEN, model="large")]  # mid-stream: final


def test_a_client_that_leaves_while_queued_in_a_fallback_pool_leaves_that_queue() -> None:
    control = controller(
        [pool("small", 1), pool("large", 1, args=["--max-num-seqs", "1"])],
        [{"name": "chat", "variants": ["small"], "fallbacks": ["large"]}],
        tenants={"admission": {"max_queue": 8, "max_wait": 30.0}},
    )
    control = FleetController.of(control.fleet, admission=True)
    up(control)
    arrive(control, 1.0, "x", "large")
    control.handle(1.0, _scraped("large", running=1))
    control.handle(1.0, Replicas("small", ()))
    out = arrive(control, 1.1, "r1", "chat")
    assert [type(c) for c in out] == [Fallback]  # queued in large
    assert control.pools["large"].queued == 1
    assert control.handle(1.2, ClientGone("chat", "r1")) == []
    assert control.pools["large"].queued == 0
    assert not control._flights


def test_fallback_decisions_are_recorded_and_replay_to_the_same_commands() -> None:
    control = fallback_control(ready=False)
    log = io.StringIO()
    control.record(log)
    up(control, 0.5)
    (first,) = arrive(control, 1.0, "r1", "chat", session="s")
    fail_every_attempt(control, 1.1, "r1", first)
    arrive(control, 1.2, "r2", "chat", tokens=3000)
    control.handle(1.3, Weights("chat", (("small", 2.0),)))
    control.handle(1.4, Finished("chat", "r1"))
    lines = log.getvalue().splitlines()
    kinds = [c["do"] for line in lines[1:] for c in json.loads(line)["commands"]]
    assert kinds.count("fallback") == 2
    finished = json.loads(lines[-1])["event"]
    assert finished["model"] == "medium"  # the log keeps the pool the request was in
    head, body = read_recording(lines)
    for recorded, commands in replay(head, body):
        assert commands == recorded.commands


def test_events_and_commands_round_trip_through_json() -> None:
    weights = Weights("chat", (("a", 80.0), ("b", 20.0)))
    assert event_from_json(json.loads(json.dumps(event_to_json(weights)))) == weights
    assert command_to_json(Fallback("r", "chat", "big", "big-v2", "shed")) == {
        "do": "fallback",
        "id": "r",
        "model": "chat",
        "to": "big",
        "pool": "big-v2",
        "reason": "shed",
    }
    assert command_to_json(Reject("r", "exhausted", model="big"))["model"] == "big"
    assert "model" not in command_to_json(Reject("r", "exhausted"))


@pytest.mark.parametrize(
    ("served", "message"),
    [
        ([{"name": "chat", "variants": {"a": 0}}], "one variant at least needs a positive weight"),
        ([{"name": "chat", "variants": {"a": -1}}], "weight must be a number ≥ 0"),
        ([{"name": "chat", "variants": {"zz": 1}}], "variant 'zz' is not a pool"),
        ([{"name": "chat", "variants": ["a"], "fallbacks": ["nope"]}], "'nope' is not a served"),
        ([{"name": "chat", "variants": ["a"], "fallbacks": ["chat"]}], "falls back to itself"),
        ([{"name": "chat", "variants": ["a"], "fallbacks": ["b", "b"]}], "given twice"),
        ([{"name": "chat", "variants": []}], "at least one pool"),
        ([{"name": "chat", "variants": ["a", "a"]}], "pool 'a' is given twice"),
        ([{"name": "b", "variants": ["a"]}], "the name is a pool's"),
        ([{"name": "c", "variants": ["a"]}, {"name": "c", "variants": ["b"]}], "given twice"),
        (
            [
                {"name": "chat", "variants": ["a"]},
                {"name": "x", "variants": ["b"], "fallbacks": ["a"]},
            ],
            "'a' is not a served name",
        ),  # a is chat's variant now
    ],
)
def test_a_bad_served_block_is_a_clear_error(served: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(FleetFileError, match=message):
        parse_fleet({"models": [pool("a"), pool("b")], "served": served})


def test_fallbacks_of_a_pool_served_under_another_name_belong_to_that_name() -> None:
    with pytest.raises(FleetFileError, match="write its fallbacks on that served entry"):
        parse_fleet(
            {
                "models": [pool("a", fallbacks=["b"]), pool("b")],
                "served": [{"name": "chat", "variants": ["a"]}],
            }
        )


def test_two_names_may_fall_back_to_each_other() -> None:
    """Fallbacks are flat (a fallback's own are not followed): a ↔ b is no loop."""
    control = controller([pool("a", fallbacks=["b"]), pool("b", fallbacks=["a"])])
    up(control)
    control.handle(1.0, Replicas("a", ()))
    control.handle(1.0, Replicas("b", ()))
    out = arrive(control, 1.1, "r1", "a")
    assert [type(c) for c in out] == [Fallback, Reject]
    assert out[1] == Reject("r1", RejectReason.NO_REPLICA, model="b")


def _scraped(name: str, running: int) -> Scraped:
    loads = (ScrapedLoad(ReplicaId(f"{name}-0"), running, 0, 0.1),)
    return Scraped(name, loads)


# -- spot variants: the batch class apart -----------------------------------------------------


def spot_split(**spot: Any) -> FleetController:
    """``chat`` over an on-demand pool and a spot one, both of weight 1 (no batch gate:
    lines route at once)."""
    control = controller(
        [pool("od"), pool("spot", capacity="spot", **({"spot": spot} if spot else {}))],
        [{"name": "chat", "variants": {"od": 1, "spot": 1}}],
        gateway={"batch": {"spare": None}},
    )
    up(control)
    return control


def arrive_class(control: FleetController, rid: str, priority: int) -> Command:
    request = RouteRequest(rid, "chat", prompt_tokens=100)
    (route,) = control.handle(1.0, Arrived(request, priority))
    return route


def test_a_served_name_sends_batch_to_its_spot_variant_and_the_rest_on_demand() -> None:
    control = spot_split()
    interactive = {pool_of(arrive_class(control, f"i{n}", 0)) for n in range(200)}
    batch = {pool_of(arrive_class(control, f"b{n}", 1)) for n in range(200)}
    assert interactive == {"od"}  # weight 1 each, yet none on spot
    assert batch == {"spot"}


def test_a_spot_variant_open_to_interactive_work_is_an_ordinary_variant() -> None:
    control = spot_split(interactive=True)
    chosen = [pool_of(arrive_class(control, f"i{n}", 0)) for n in range(400)]
    assert chosen.count("spot") / len(chosen) == pytest.approx(0.5, abs=0.1)


def test_with_no_on_demand_weight_left_interactive_work_goes_to_spot() -> None:
    control = spot_split()
    control.handle(1.0, Weights("chat", (("od", 0.0),)))
    assert pool_of(arrive_class(control, "i", 0)) == "spot"
    assert pool_of(arrive_class(control, "b", 1)) == "spot"
