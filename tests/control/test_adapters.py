"""LoRA adapters in the controller (L0, explicit ``now``): a request for an adapter goes to a
replica that holds it, within a load guard; a load evicts the least valuable idle adapter,
never one in flight; a restarted replica holds none; the fleet file's rules; replay."""

from __future__ import annotations

import io

import pytest

from gpufleet.config import FleetFileError, parse_fleet
from gpufleet.control import (
    AdapterAdded,
    Arrived,
    AttemptFailed,
    Finished,
    FleetController,
    Reject,
    RejectReason,
    Replicas,
    ReplicaSeen,
    Route,
    Tick,
    UnloadAdapter,
    command_to_json,
    read_recording,
    replay,
)
from gpufleet.fleet import Outcome, ReplicaId, ReplicaState, RouteRequest
from gpufleet.policy import LoraConfig, place_adapter
from tests.control.test_pool_controller import POOL, up


def lora_fleet(
    adapters: int = 6, replicas: int = 3, **lora: object
) -> tuple[FleetController, list[str]]:
    names = [f"ad-{i}" for i in range(adapters)]
    config: dict[str, object] = {
        "max_loras": 2,
        "adapters": [{"name": n, "path": f"/adapters/{n}"} for n in names],
        **lora,
    }
    model = {"name": POOL, "replicas": replicas, "routing": "least_request", "lora": config}
    return FleetController.of(parse_fleet({"models": [model]})), names


def ask(control: FleetController, now: float, rid: str, model: str) -> tuple[Route, list[object]]:
    out = control.handle(now, Arrived(RouteRequest(rid, model, prompt_tokens=100)))
    (route,) = [c for c in out if isinstance(c, Route)]
    return route, [c for c in out if isinstance(c, UnloadAdapter)]


def done(control: FleetController, now: float, rid: str) -> None:
    control.handle(now, Finished(POOL, rid, Outcome.SUCCESS))


def test_an_adapter_is_loaded_once_then_its_requests_go_where_it_is() -> None:
    control, (a, *_) = lora_fleet()
    up(control, 0.0, 3)
    first, _ = ask(control, 1.0, "r0", a)
    assert first.load == a  # nobody holds it: the router's pick loads it
    assert first.model == POOL  # sent to the pool (the shell names the adapter to the engine)
    done(control, 1.5, "r0")
    for i in range(1, 6):
        route, unloads = ask(control, 2.0 + i, f"r{i}", a)
        assert (route.replica, route.load, unloads) == (first.replica, "", [])
        done(control, 2.5 + i, f"r{i}")
    adapters = control.pools[POOL].adapters
    assert adapters is not None
    assert (adapters.counters.loads, adapters.counters.requests) == (1, 6)


def test_a_busy_holder_past_the_load_guard_gets_a_second_copy_elsewhere() -> None:
    control, (a, *_) = lora_fleet(load_guard=2)
    up(control, 0.0, 3)
    routes = [ask(control, 1.0, f"r{i}", a)[0] for i in range(8)]  # none ends
    by_replica = {r.replica for r in routes}
    loads = [r for r in routes if r.load]
    # 8 in flight over 3 replicas with a guard of 2: the adapter spread to every replica
    assert len(by_replica) == 3
    assert len(loads) == 3
    counts = [sum(r.replica == x for r in routes) for x in by_replica]
    assert max(counts) - min(counts) <= 3  # within the guard (+1 for the one just sent)


def test_without_affinity_the_router_pick_loads_it_every_time_it_lacks_it() -> None:
    control, names = lora_fleet(affinity=False)
    up(control, 0.0, 3)
    loads_affinity, loads_any = 0, 0
    for i in range(30):  # one at a time: least_request rotates among idle replicas
        route, _ = ask(control, 1.0 + i, f"r{i}", names[i % 3])
        loads_any += bool(route.load)
        done(control, 1.5 + i, f"r{i}")
    control2, names2 = lora_fleet(affinity=True)
    up(control2, 0.0, 3)
    for i in range(30):
        route, _ = ask(control2, 1.0 + i, f"r{i}", names2[i % 3])
        loads_affinity += bool(route.load)
        done(control2, 1.5 + i, f"r{i}")
    assert loads_affinity == 3  # each adapter once
    assert loads_any > 3 * loads_affinity


def test_a_load_evicts_the_least_valuable_idle_adapter_never_one_in_flight() -> None:
    control, names = lora_fleet(replicas=1)
    up(control, 0.0, 1)
    hot, cold, new = names[0], names[1], names[2]
    for i in range(5):  # hot asked 5 times, cold once: both held (max_loras 2)
        ask(control, 1.0 + i * 0.1, f"h{i}", hot)
        done(control, 1.05 + i * 0.1, f"h{i}")
    ask(control, 2.0, "c0", cold)
    done(control, 2.1, "c0")
    # hot is the least recently used, but cold is worth less: cold goes
    route, unloads = ask(control, 3.0, "n0", new)
    assert route.load == new
    assert unloads == [UnloadAdapter(POOL, ReplicaId(f"{POOL}-0"), cold)]
    # both held adapters busy now (n0 in flight, hot asked again): a third adapter's
    # request waits for a slot instead of evicting one in flight
    ask(control, 3.1, "h9", hot)
    out = control.handle(3.2, Arrived(RouteRequest("c1", cold, prompt_tokens=100)))
    assert [c for c in out if isinstance(c, Route)] == []
    pool = control.pools[POOL]
    adapters = pool.adapters
    assert adapters is not None
    assert (adapters.counters.waits, pool.held) == (1, 1)
    # n0 ends: its slot frees, and the held request loads its adapter there at once
    out = control.handle(4.0, Finished(POOL, "n0", Outcome.SUCCESS))
    (route,) = [c for c in out if isinstance(c, Route)]
    assert (route.request_id, route.load, route.held) == ("c1", cold, True)
    assert [c for c in out if isinstance(c, UnloadAdapter)] == [
        UnloadAdapter(POOL, ReplicaId(f"{POOL}-0"), new)
    ]
    assert adapters.counters.over_cap == 0
    assert set(adapters.held()[ReplicaId(f"{POOL}-0")]) == {hot, cold}


def test_a_request_waiting_for_a_slot_times_out_as_a_held_request_does() -> None:
    names = ["ad-0", "ad-1"]
    control = FleetController.of(
        parse_fleet(
            {
                "gateway": {"autoscaler": {"hold_timeout": 5}},
                "models": [
                    {
                        "name": POOL,
                        "replicas": 1,
                        "lora": {
                            "max_loras": 1,
                            "adapters": [{"name": n, "path": "/a"} for n in names],
                        },
                    }
                ],
            }
        )
    )
    up(control, 0.0, 1)
    ask(control, 1.0, "a0", names[0])  # in flight, holding the one slot
    control.handle(1.5, Arrived(RouteRequest("b0", names[1], prompt_tokens=100)))
    wake = control.next_wakeup()
    assert wake is not None
    assert wake <= 6.5
    assert not [c for c in control.handle(6.4, Tick()) if isinstance(c, Reject)]
    (reject,) = [c for c in control.handle(6.5, Tick()) if isinstance(c, Reject)]
    assert (reject.request_id, reject.reason) == ("b0", RejectReason.HOLD_TIMEOUT)


def test_a_restarted_replica_holds_no_adapter() -> None:
    control, (a, *_) = lora_fleet(replicas=1)
    up(control, 0.0, 1)
    first, _ = ask(control, 1.0, "r0", a)
    done(control, 1.1, "r0")
    assert first.load == a
    control.handle(
        2.0, Replicas(POOL, (ReplicaSeen(ReplicaId(f"{POOL}-0"), ReplicaState.READY, "b"),))
    )
    up(control, 2.0, 1, incarnation="b")
    again, _ = ask(control, 3.0, "r1", a)
    assert again.load == a  # the new process must load it again


def test_placement_prefers_a_free_slot_and_a_holder_within_the_guard() -> None:
    config = LoraConfig(max_loras=1, load_guard=1)
    r0, r1, r2 = ReplicaId("p-0"), ReplicaId("p-1"), ReplicaId("p-2")
    slots = {r0: {"x": 0}, r1: {}, r2: {"a": 0}}
    placed = place_adapter("a", [r0, r1, r2], slots, {r2: 1}, value=lambda _: 1.0, config=config)
    assert placed is not None
    assert (placed.replica, placed.load) == (r2, False)  # within the guard
    placed = place_adapter("a", [r0, r1, r2], slots, {r2: 5}, value=lambda _: 1.0, config=config)
    # the holder is 5 busier than the least busy: a new copy, on the free slot, not on r0
    assert placed is not None
    assert (placed.replica, placed.load, placed.evict) == (r1, True, None)
    assert place_adapter("a", [], slots, {}, value=lambda _: 1.0, config=config) is None


def test_adapter_names_are_served_names_and_the_fleet_file_checks_them() -> None:
    control, names = lora_fleet(adapters=2)
    assert set(names) <= set(control.served)
    with pytest.raises(FleetFileError, match="already a pool"):
        parse_fleet(
            {"models": [{"name": POOL, "lora": {"adapters": [{"name": POOL, "path": "/x"}]}}]}
        )
    with pytest.raises(FleetFileError, match="above max_lora_rank"):
        parse_fleet(
            {
                "models": [
                    {"name": POOL, "lora": {"adapters": [{"name": "a", "path": "/x", "rank": 64}]}}
                ]
            }
        )


def test_a_recording_of_adapter_placement_replays_to_the_same_commands() -> None:
    control, names = lora_fleet(replicas=2, load_guard=1)
    recording = io.StringIO()
    control.record(recording)
    up(control, 0.0, 2)
    for i in range(40):
        ask(control, 1.0 + i * 0.05, f"r{i}", names[(i * 7) % 5])
        if i >= 3:
            done(control, 1.0 + i * 0.05, f"r{i - 3}")
    head, lines = read_recording(io.StringIO(recording.getvalue()).readlines())
    n = 0
    for line, commands in replay(head, lines):
        assert commands == line.commands
        n += 1
    assert n > 40
    assert any('"unload_adapter"' in text for text in recording.getvalue().splitlines())
    assert command_to_json(UnloadAdapter(POOL, ReplicaId("x"), "a"))["do"] == "unload_adapter"


def test_an_adapter_added_at_run_time_is_served_and_replays() -> None:
    control, _ = lora_fleet(adapters=0, replicas=2)
    recording = io.StringIO()
    control.record(recording)
    up(control, 0.0, 2)
    with pytest.raises(ValueError, match="already a served name"):
        control.handle(0.5, AdapterAdded(POOL, POOL, "/x", 8))
    with pytest.raises(ValueError, match="max_lora_rank"):
        control.handle(0.5, AdapterAdded(POOL, "big", "/x", 64))
    control.handle(1.0, AdapterAdded(POOL, "late", "/adapters/late", 8))
    assert control.served["late"].adapter
    first, _ = ask(control, 2.0, "r0", "late")
    assert first.load == "late"
    done(control, 2.5, "r0")
    second, _ = ask(control, 3.0, "r1", "late")
    assert (second.replica, second.load) == (first.replica, "")
    head, lines = read_recording(io.StringIO(recording.getvalue()).readlines())
    for line, commands in replay(head, lines):
        assert commands == line.commands


def test_the_prefix_index_keys_an_adapters_prompts_by_the_adapter() -> None:
    """vLLM caches a prompt per adapter: a prompt cached for the base model is no hit for an
    adapter, nor one adapter's for another; the same adapter's is."""
    adapters = [{"name": n, "path": f"/a/{n}"} for n in ("sql", "poet")]
    model = {
        "name": POOL,
        "replicas": 2,
        "routing": "prefix_aware",
        "lora": {"max_loras": 2, "adapters": adapters},
    }
    control = FleetController.of(parse_fleet({"models": [model]}))
    up(control, 0.0, 2)
    hashes = tuple(range(1, 9))

    def send(now: float, rid: str, name: str) -> Route:
        request = RouteRequest(rid, name, prefix_hashes=hashes, prompt_tokens=800)
        (route,) = [c for c in control.handle(now, Arrived(request)) if isinstance(c, Route)]
        control.handle(now + 0.1, Finished(POOL, rid, Outcome.SUCCESS))
        return route

    assert send(1.0, "base", POOL).matched == 0
    assert send(2.0, "sql-1", "sql").matched == 0  # the base model's blocks are not sql's
    assert send(3.0, "poet-1", "poet").matched == 0  # nor sql's poet's
    assert send(4.0, "sql-2", "sql").matched == 8  # sql's own are


def test_an_attempt_whose_load_failed_leaves_the_adapter_not_held_there() -> None:
    control, (a, *_) = lora_fleet(replicas=2)
    up(control, 0.0, 2)
    first, _ = ask(control, 1.0, "r0", a)
    assert first.load == a
    # the load (or the attempt before its first byte) failed: retried elsewhere, loading it
    out = control.handle(1.2, AttemptFailed(POOL, "r0", Outcome.REPLICA_ERROR))
    (retry,) = [c for c in out if isinstance(c, Route)]
    assert (retry.replica != first.replica, retry.load) == (True, a)
    adapters = control.pools[POOL].adapters
    assert adapters is not None
    assert first.replica not in adapters.held()  # not counted as held where it failed
    done(control, 1.5, "r0")
    # where the retry loaded it, it is held: the next request goes there, no load
    second, _ = ask(control, 2.0, "r1", a)
    assert (second.replica, second.load) == (retry.replica, "")
