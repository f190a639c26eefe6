"""The pool controller with KV events: one rule for both shells (L0, explicit ``now``)."""

from __future__ import annotations

import io
import json

from gpufleet.config import parse_fleet
from gpufleet.control import (
    Arrived,
    Finished,
    FleetController,
    KvEvents,
    KvResync,
    Probe,
    ProbeAnswered,
    Replicas,
    ReplicaSeen,
    Route,
    command_to_json,
    event_from_json,
    event_to_json,
    read_recording,
    replay,
)
from gpufleet.fleet import (
    KvBatch,
    KvCleared,
    KvRemoved,
    KvStored,
    ReplicaId,
    ReplicaState,
    RouteRequest,
)

POOL = "llama-3.1-8b"
R0, R1 = ReplicaId(f"{POOL}-0"), ReplicaId(f"{POOL}-1")
PROMPT = (101, 102, 103, 104)


def controller() -> FleetController:
    model = {"name": POOL, "replicas": 2, "routing": "prefix_precise"}
    return FleetController.of(parse_fleet({"models": [model]}))


def up(control: FleetController, now: float, incarnations: tuple[str, str]) -> None:
    seen = tuple(
        ReplicaSeen(r, ReplicaState.READY, n) for r, n in zip((R0, R1), incarnations, strict=True)
    )
    for command in control.handle(now, Replicas(POOL, seen)):
        if isinstance(command, Probe):
            control.handle(now, ProbeAnswered(POOL, command.replica, True))


def route(control: FleetController, now: float, i: int) -> Route:
    request = RouteRequest(f"q{i}", POOL, prompt_tokens=64, block_hashes=PROMPT)
    (command,) = control.handle(now, Arrived(request))
    assert isinstance(command, Route)
    control.handle(now, Finished(POOL, f"q{i}"))
    return command


def kv(replica: ReplicaId, incarnation: str, *batches: KvBatch, replay: bool = False) -> KvEvents:
    return KvEvents(POOL, replica, incarnation, batches, replay)


def test_requests_follow_the_blocks_the_engines_report() -> None:
    control = controller()
    up(control, 0.0, ("a", "b"))
    control.handle(0.0, kv(R0, "a"))
    control.handle(0.0, kv(R1, "b", KvBatch(0, (KvStored(PROMPT[:3]),))))
    first = route(control, 0.1, 0)
    assert (first.replica, first.matched) == (R1, 3)
    # R1 evicts the prompt, R0 caches it: the next request follows
    control.handle(0.2, kv(R1, "b", KvBatch(1, (KvRemoved(PROMPT[:3]),))))
    control.handle(0.2, kv(R0, "a", KvBatch(0, (KvStored(PROMPT),))))
    second = route(control, 0.3, 1)
    assert (second.replica, second.matched) == (R0, 4)


def test_a_gap_asks_for_a_replay_and_a_restart_leaves_no_ghosts() -> None:
    control = controller()
    up(control, 0.0, ("a", "b"))
    control.handle(0.0, kv(R1, "b"))
    assert control.handle(0.0, kv(R0, "a", KvBatch(0, (KvStored(PROMPT),)))) == []
    # batch 1 lost: batch 2 opens a gap, the controller asks R0's replay socket from 1
    out = control.handle(0.1, kv(R0, "a", KvBatch(2, (KvCleared(),))))
    assert out == [KvResync(POOL, R0, 1)]
    assert command_to_json(out[0]) == {
        "do": "kv_resync",
        "model": POOL,
        "replica": R0,
        "from": 1,
    }
    control.handle(0.2, kv(R0, "a", KvBatch(1, (KvStored((9,)),)), replay=True))
    router = control.pools[POOL]._kv
    assert router is not None
    assert not router.kv.holds(R0, PROMPT[0])  # batch 2 cleared it, after the replayed 1
    control.handle(0.3, kv(R0, "a", KvBatch(3, (KvStored(PROMPT),))))
    assert route(control, 0.4, 0).replica == R0
    # R0 restarts (a new process): its old blocks must not draw the prompt
    up(control, 1.0, ("a2", "b"))
    control.handle(1.0, kv(R0, "a", KvBatch(4, (KvStored(PROMPT),))))  # the old process, late
    assert route(control, 1.1, 1).matched == 0


def test_kv_events_record_and_replay_to_the_same_commands() -> None:
    control = controller()
    out = io.StringIO()
    control.record(out)
    up(control, 0.0, ("a", "b"))
    control.handle(0.0, kv(R1, "b"))
    control.handle(0.0, kv(R0, "a", KvBatch(0, (KvStored(PROMPT), KvRemoved((7,))))))
    control.handle(0.1, kv(R0, "a", KvBatch(5, (KvCleared(),))))
    control.handle(0.2, kv(R0, "a", replay=True))
    for i in range(4):
        route(control, 0.3 + i, i)
    lines = out.getvalue().splitlines()
    kinds = [json.loads(line)["event"]["kind"] for line in lines[1:]]
    assert kinds.count("kv") == 4
    event = kv(R0, "a", KvBatch(3, (KvStored((1, 2)), KvRemoved((3,)), KvCleared())), replay=True)
    assert event_from_json(json.loads(json.dumps(event_to_json(event)))) == event
    arrived = Arrived(RouteRequest("q", POOL, (5,), 64, block_hashes=PROMPT))
    assert event_from_json(json.loads(json.dumps(event_to_json(arrived)))) == arrived
    head, body = read_recording(io.StringIO(out.getvalue()))
    replayed = list(replay(head, body))
    assert len(replayed) == len(lines) - 1
    assert any(r.commands for r, _ in replayed if isinstance(r.event, KvEvents))  # a resync
    for recorded, again in replayed:
        assert recorded.commands == again
