"""The batch class's spare-capacity gate in the pool controller (L0, explicit ``now``), and
in a simulated run recorded and replayed (the simulator gates its batch tenant by the same
rule)."""

from __future__ import annotations

import io
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.config import parse_fleet
from gpufleet.control import (
    BATCH,
    Arrived,
    AttemptFailed,
    ClientGone,
    Finished,
    FleetController,
    Recall,
    Reject,
    RejectReason,
    Route,
    Scraped,
    ScrapedLoad,
    Tick,
    command_to_json,
    event_from_json,
    event_to_json,
    read_recording,
    replay,
)
from gpufleet.fleet import Outcome, ReplicaId, RouteRequest
from gpufleet.sim import FleetSimulation, SimOptions, SimTenant, TraceRequest
from tests.control.test_pool_controller import POOL, up


def gated(*, auth: bool = False, seqs: int = 10, **spare: Any) -> FleetController:
    """Two replicas of ``seqs`` slots; the gate grows 1 line per replica per second."""
    spare = {"interval": 1.0, "increase": 1.0, **spare}
    fleet = parse_fleet(
        {
            "models": [
                {
                    "name": POOL,
                    "replicas": 2,
                    "routing": "least_request",
                    "args": [f"--max-num-seqs={seqs}"],
                }
            ],
            "gateway": {"batch": {"spare": spare}},
            "tenants": {"auth": auth},
        }
    )
    control = FleetController.of(fleet)
    up(control, 0.0, 2)
    return control


def batch(control: FleetController, now: float, i: int, deadline: float | None = None) -> list[Any]:
    request = RouteRequest(f"b{i}", POOL, prompt_tokens=100, tenant="team")
    return list(control.handle(now, Arrived(request, BATCH, deadline=deadline)))


def interactive(control: FleetController, now: float, i: int) -> list[Any]:
    request = RouteRequest(f"i{i}", POOL, prompt_tokens=100, tenant="team")
    return list(control.handle(now, Arrived(request)))


def routes(out: list[Any]) -> list[str]:
    return [c.request_id for c in out if isinstance(c, Route)]


def test_batch_lines_start_as_the_limit_grows_and_interactive_passes_at_once() -> None:
    control = gated()
    pool = control.pools[POOL]
    started = [rid for i in range(10) for rid in routes(batch(control, 0.0, i))]
    assert started == ["b0", "b1"]  # the first step at once: one line per replica
    assert (pool.gated, pool.batch_in_flight) == (8, 2)
    assert routes(interactive(control, 0.1, 0)) == ["i0"]  # never behind the batch
    assert control.next_wakeup() == 1.0  # the limit's next step
    assert routes(control.handle(1.0, Tick())) == ["b2", "b3"]
    assert routes(control.handle(1.5, Finished(POOL, "b0"))) == ["b4"]  # a line ended: room
    assert (pool.gated, pool.batch_in_flight, pool.in_flight) == (5, 4, 5)


def test_batch_fills_to_the_target_and_no_further() -> None:
    control = gated(increase=100.0, target=0.5)  # 2 × 10 slots: 10 in flight at most
    pool = control.pools[POOL]
    for i in range(6):
        interactive(control, 0.0, i)
    started = [rid for i in range(20) for rid in routes(batch(control, 0.0, i))]
    assert len(started) == 4
    assert pool.in_flight == 10
    assert routes(control.handle(0.5, Finished(POOL, "i0"))) == ["b4"]


def test_a_scrape_showing_engine_queueing_stops_new_lines_until_it_clears() -> None:
    control = gated(increase=4.0)
    pool = control.pools[POOL]
    assert len([r for i in range(20) for r in routes(batch(control, 0.0, i))]) == 8
    full = (
        ScrapedLoad(ReplicaId(f"{POOL}-0"), 10, 3, 0.5),
        ScrapedLoad(ReplicaId(f"{POOL}-1"), 2, 0, 0.1),
    )
    control.handle(0.5, Scraped(POOL, full))
    assert pool.spare is not None
    assert pool.spare.limit == 4.0  # halved from the 8 lines running
    assert routes(control.handle(0.6, Finished(POOL, "b0"))) == []  # pressure: none starts
    last = pool.spare.last
    assert last is not None
    assert (last.pressure, last.next_at) == ("queueing", None)  # no timed look: a scrape ends it
    calm = tuple(ScrapedLoad(ReplicaId(f"{POOL}-{i}"), 3, 0, 0.2) for i in range(2))
    out = control.handle(1.6, Scraped(POOL, calm))
    assert len(routes(out)) == 12 - 7 - 0  # the limit grew to 12; 7 lines run
    assert pool.batch_in_flight == 12


def test_a_gated_line_is_refused_at_its_deadline_and_can_leave_before() -> None:
    control = gated(increase=1.0, target=0.1)  # 2 slots for batch
    pool = control.pools[POOL]
    for i in range(4):
        batch(control, 0.0, i, deadline=5.0 if i == 2 else None)
    control.handle(1.0, ClientGone(POOL, "b3"))
    assert pool.gated == 1
    out: list[Any] = []
    while (t := control.next_wakeup()) is not None and t <= 5.0:  # the gate looks each second
        out += control.handle(t, Tick())
    assert [(c.request_id, c.reason) for c in out if isinstance(c, Reject)] == [
        ("b2", RejectReason.EXPIRED)
    ]
    assert routes(out) == []  # the target (2 slots) binds, not the limit
    assert (pool.gated, pool.batch_in_flight, pool.counters.gate_expired) == (0, 2, 1)
    assert pool.spare is not None
    assert pool.spare.last is not None
    assert control.next_wakeup() != pool.spare.last.next_at  # nothing waits: no gate look


def test_with_admission_a_released_line_enters_the_batch_class() -> None:
    control = gated(auth=True, increase=1.0)
    pool = control.pools[POOL]
    assert pool.admission is not None
    assert routes(batch(control, 0.0, 0)) == ["b0"]
    assert pool.admission.queue.running == {"team": 1}
    control.handle(1.0, Finished(POOL, "b0", work=(100, 10)))
    assert (pool.batch_in_flight, pool.in_flight, pool.admission.in_flight) == (0, 0, 0)


def test_without_a_gate_batch_lines_start_like_any_request() -> None:
    control = gated()
    fleet = control.fleet.model_copy(deep=True)
    ungated = FleetController.of(
        fleet.model_copy(
            update={
                "gateway": fleet.gateway.model_copy(
                    update={"batch": fleet.gateway.batch.model_copy(update={"spare": None})}
                )
            }
        )
    )
    up(ungated, 0.0, 2)
    assert len([r for i in range(10) for r in routes(batch(ungated, 0.0, i))]) == 10


def test_a_simulated_interactive_and_batch_run_replays_to_the_same_decisions() -> None:
    """A batch tenant beside an interactive one, simulated with admission on: the gate holds
    and releases the batch requests, every request ends, and the recorded run replays into
    a fresh controller command for command."""
    fleet = parse_fleet(
        {
            "models": [
                {
                    "name": POOL,
                    "replicas": 2,
                    "routing": "least_request",
                    "args": ["--max-num-seqs", "16"],
                }
            ],
            "gateway": {"scrape_interval": 0.2},
            "tenants": {"admission": {"max_wait": 60.0}},
        }
    )
    trace = [TraceRequest(0.05 * i, 200, 60, tenant="chat") for i in range(200)]
    trace += [TraceRequest(0.0, 200, 60, tenant="nightly") for _ in range(300)]
    trace.sort(key=lambda r: r.arrival_s)
    options = SimOptions(
        seed=1,
        admission=True,
        tenants=(SimTenant("chat"), SimTenant("nightly", priority="batch")),
    )
    sim = FleetSimulation(fleet, options)
    out = io.StringIO()
    sim.control.record(out)
    sim.start(trace)
    sim.run()
    pool = sim.control.pools[POOL]
    assert pool.counters.gated == 300
    assert (pool.gated, pool.batch_in_flight, pool.in_flight) == (0, 0, 0)
    head, lines = read_recording(io.StringIO(out.getvalue()))
    replayed = list(replay(head, lines))
    routed = {c["id"] for line, _ in replayed for c in line.commands if c["do"] == "route"}
    assert len(routed) == 500  # every request ran: none expired at the gate
    for line, commands in replayed:
        assert commands == line.commands, line
    # the batch waited for room: at no scrape did the engines queue past their slots
    events = [json.loads(x)["event"] for x in out.getvalue().splitlines()[1:]]
    assert any(e["kind"] == "scraped" for e in events)


# -- recall: an interactive request takes a batch line's slot back ---------------------------


def line(control: FleetController, now: float, i: int, *, recallable: bool = True) -> list[Any]:
    """A batch line whose answer comes whole (a Batch API line): recallable."""
    request = RouteRequest(f"b{i}", POOL, prompt_tokens=100, tenant="team")
    return list(control.handle(now, Arrived(request, BATCH, recallable=recallable)))


def recalls(out: list[Any]) -> list[tuple[str, str]]:
    return [(c.request_id, c.replica) for c in out if isinstance(c, Recall)]


def full(control: FleetController, **kwargs: bool) -> dict[str, ReplicaId]:
    """Batch lines in every slot of both replicas (2 × 4); where each line runs."""
    where: dict[str, ReplicaId] = {}
    for i in range(8):
        for c in line(control, 0.0, i, **kwargs):
            if isinstance(c, Route):
                where[c.request_id] = c.replica
    assert len(where) == 8
    return where


def test_an_interactive_request_recalls_the_newest_line_on_a_full_replica() -> None:
    control = gated(seqs=4, increase=100.0, target=1.0)
    pool = control.pools[POOL]
    where = full(control)
    out = interactive(control, 1.0, 0)
    (route,) = [c for c in out if isinstance(c, Route)]
    newest = [rid for rid, r in where.items() if r == route.replica][-1]
    # the recall comes before the interactive request's own Route: its slot is free first
    assert recalls(out) == [(newest, route.replica)]
    assert out.index(next(c for c in out if isinstance(c, Recall))) < out.index(route)
    assert pool.attempts[route.replica] == 4  # the engine's slots, no more
    assert (pool.batch_in_flight, pool.in_flight, pool.counters.recalled) == (7, 8, 1)
    # the shell ends the attempt: the line waits at the gate (no room: the pool is full)
    assert routes(control.handle(1.1, AttemptFailed(POOL, newest, Outcome.CANCELLED))) == []
    assert pool.gated == 1
    # the interactive request ends: the line runs again, from its start
    out = control.handle(2.0, Finished(POOL, "i0"))
    assert routes(out) == [newest]
    assert (pool.batch_in_flight, pool.in_flight, pool.gated) == (8, 8, 0)


def test_no_recall_while_the_replica_has_a_free_slot_or_no_line() -> None:
    control = gated(seqs=4, increase=100.0, target=1.0)
    for i in range(6):
        line(control, 0.0, i)  # 3 on each replica: one slot free on each
    assert recalls(interactive(control, 1.0, 0)) == []
    assert recalls(interactive(control, 1.0, 1)) == []
    # both full now: the next interactive request recalls a line
    assert len(recalls(interactive(control, 1.0, 2))) == 1
    # a replica full of interactive requests has nothing to recall: it queues in the engine
    control = gated(seqs=2, increase=100.0, target=1.0)
    for i in range(4):
        interactive(control, 0.0, i)
    assert recalls(interactive(control, 0.5, 9)) == []


def test_streamed_lines_and_a_gate_without_recall_keep_their_slots() -> None:
    control = gated(seqs=4, increase=100.0, target=1.0)
    full(control, recallable=False)  # a client's own batch-class streams
    assert recalls(interactive(control, 1.0, 0)) == []
    control = gated(seqs=4, increase=100.0, target=1.0, recall=False)
    full(control)
    assert recalls(interactive(control, 1.0, 0)) == []
    assert control.pools[POOL].attempts == {
        ReplicaId(f"{POOL}-0"): 5,
        ReplicaId(f"{POOL}-1"): 4,
    } or control.pools[POOL].attempts == {
        ReplicaId(f"{POOL}-0"): 4,
        ReplicaId(f"{POOL}-1"): 5,
    }


def test_a_recalled_line_answered_first_or_left_by_its_client_ends_once() -> None:
    control = gated(seqs=4, increase=100.0, target=1.0)
    pool = control.pools[POOL]
    full(control)
    ((first, _),) = recalls(interactive(control, 1.0, 0))
    ((second, _),) = recalls(interactive(control, 1.0, 1))
    # the answer came before the recall reached the engine: the line is done, not re-run
    assert routes(control.handle(1.1, Finished(POOL, first))) == []
    # the batch runner stopped (its batch was cancelled) before the attempt's end was told
    control.handle(1.1, ClientGone(POOL, second))
    assert control.handle(1.2, AttemptFailed(POOL, second, Outcome.CANCELLED)) == []
    assert (pool.gated, pool.batch_in_flight, pool.in_flight) == (0, 6, 8)
    for rid in [f"b{i}" for i in range(8) if f"b{i}" not in (first, second)] + ["i0", "i1"]:
        control.handle(2.0, Finished(POOL, rid))
    assert (pool.batch_in_flight, pool.in_flight, pool.attempts) == (0, 0, {})


def test_with_admission_an_interactive_request_that_would_queue_recalls_a_line() -> None:
    """With admission on, a full pool queues requests at the gateway: an interactive one
    recalls a line there (from the busiest replica), and the pump starts it at once."""
    control = gated(auth=True, seqs=4, increase=100.0, target=1.0)
    pool = control.pools[POOL]
    admission = pool.admission
    assert admission is not None
    for i in range(8):
        line(control, 0.0, i)
    assert admission.saturated(pool.routable())
    running = pool.batch_in_flight - len(admission.queue)  # the rest wait in admission
    out = interactive(control, 1.0, 0)
    ((rid, replica),) = recalls(out)
    assert routes(out) == ["i0"]  # not queued: it took the recalled line's place
    assert pool.attempts[replica] <= 4
    assert admission.in_flight == running  # the line left, the interactive request came
    control.handle(1.1, AttemptFailed(POOL, rid, Outcome.CANCELLED))
    assert pool.gated == 1
    for other in [f"b{i}" for i in range(8) if f"b{i}" != rid] + ["i0"]:
        control.handle(2.0, Finished(POOL, other))
    assert (pool.batch_in_flight, pool.gated) == (1, 0)  # the recalled line ran again
    control.handle(3.0, Finished(POOL, rid))
    assert (pool.in_flight, admission.in_flight, pool.batch_in_flight) == (0, 0, 0)


def test_recall_and_recallable_are_recorded() -> None:
    request = RouteRequest("b1", POOL, prompt_tokens=3)
    arrived = Arrived(request, BATCH, recallable=True)
    assert event_from_json(json.loads(json.dumps(event_to_json(arrived)))) == arrived
    assert "recallable" not in event_to_json(Arrived(request))  # old recordings read the same
    recall = Recall(POOL, ReplicaId(f"{POOL}-0"), "b1")
    assert command_to_json(recall) == {
        "do": "recall",
        "model": POOL,
        "replica": f"{POOL}-0",
        "id": "b1",
    }


class _Shell:
    """A stand-in shell for the property below: it answers a Route some steps later
    (``Finished``, or ``AttemptFailed`` for a recalled attempt), and keeps the books a real
    shell would: which requests run where, and how each one ended."""

    def __init__(self, control: FleetController) -> None:
        self.control = control
        self.running: dict[str, str] = {}
        """Request id → replica of its attempt in flight (as the shell has it)."""
        self.recalled: list[str] = []
        """Attempts the controller recalled, whose end the shell has not reported yet."""
        self.endings: list[str] = []
        """Request ids, once per ending: finished, rejected, or its client gone."""

    def take(self, out: list[Any]) -> None:
        for command in out:
            if isinstance(command, Route):
                assert command.request_id not in self.running, command
                self.running[command.request_id] = command.replica
            elif isinstance(command, Recall):
                assert self.running.pop(command.request_id) == command.replica
                self.recalled.append(command.request_id)
            elif isinstance(command, Reject):
                assert command.request_id not in self.running
                self.endings.append(command.request_id)

    def handle(self, now: float, event: Any) -> None:
        self.take(list(self.control.handle(now, event)))

    def finish(self, now: float, rid: str) -> None:
        del self.running[rid]
        self.endings.append(rid)
        self.handle(now, Finished(POOL, rid))


@settings(max_examples=60, deadline=None)
@given(
    auth=st.booleans(),
    steps=st.lists(
        st.tuples(
            # arrivals weigh more than ends: the pool fills, and interactive requests find
            # replicas full of lines
            st.sampled_from(
                ["line"] * 3 + ["interactive"] * 2 + ["finish", "recalled", "gone", "tick"]
            ),
            st.integers(0, 1000),
        ),
        min_size=10,
        max_size=80,
    ),
)
def test_recall_keeps_every_count_and_ends_every_request_once(
    auth: bool, steps: list[tuple[str, int]]
) -> None:
    """Random arrivals, ends, recalls reported late and clients leaving: no replica holds a
    batch line while its own attempts pass its slots; at the end, with every attempt
    reported, every request ended exactly once and every count is back to zero."""
    control = gated(auth=auth, seqs=3, increase=100.0, target=1.0, max_wait=5.0)
    pool = control.pools[POOL]
    shell = _Shell(control)
    now, ids = 0.0, []
    for op, pick in steps:
        now += 0.1
        if op in ("line", "interactive"):
            rid = f"{op[0]}{len(ids)}"
            ids.append(rid)
            request = RouteRequest(rid, POOL, prompt_tokens=50, tenant="t")
            event = Arrived(request, BATCH, recallable=True) if op == "line" else Arrived(request)
            shell.handle(now, event)
        elif op == "finish" and shell.running:
            shell.finish(now, sorted(shell.running)[pick % len(shell.running)])
        elif op == "recalled" and shell.recalled:
            rid = shell.recalled.pop(pick % len(shell.recalled))
            shell.handle(now, AttemptFailed(POOL, rid, Outcome.CANCELLED))
        elif op == "gone" and ids:
            rid = ids[pick % len(ids)]
            if rid not in shell.endings and rid not in shell.running:
                shell.endings.append(rid)  # waiting (gate, queue) or recalled: it leaves
                if rid in shell.recalled:
                    shell.recalled.remove(rid)
                shell.handle(now, ClientGone(POOL, rid))
        else:
            shell.handle(now, Tick())
        for replica, lines in pool._batch_on.items():
            assert pool.attempts.get(replica, 0) <= 3 or not lines
    _drain(shell, now)
    assert (pool.in_flight, pool.batch_in_flight, pool.gated, pool.queued) == (0, 0, 0, 0)
    assert pool.attempts == {}
    assert pool._batch_on == {}
    assert sorted(shell.endings) == sorted(ids)  # each once


def _drain(shell: _Shell, now: float) -> None:
    """The shell reports every recalled attempt and finishes everything, until quiet."""
    pool = shell.control.pools[POOL]
    for _ in range(1000):
        if not (shell.recalled or shell.running or pool.gated or pool.queued):
            return
        now += 1.0
        for rid in list(shell.recalled):
            shell.recalled.remove(rid)
            shell.handle(now, AttemptFailed(POOL, rid, Outcome.CANCELLED))
        for rid in list(shell.running):
            shell.finish(now, rid)
        shell.handle(now, Tick())


def test_a_line_that_leaves_while_queued_in_admission_frees_its_room() -> None:
    """Found by the property above: a line let through the gate that waits in admission and
    whose client leaves (its batch cancelled) kept its place in ``batch_in_flight`` for
    good, and the gate's room shrank by one each time."""
    control = gated(auth=True, seqs=3, increase=100.0, target=1.0, recall=False)
    pool = control.pools[POOL]
    for i in range(7):
        line(control, 0.0, i)
    assert (pool.batch_in_flight, pool.queued, pool.gated) == (6, 1, 1)
    out = control.handle(1.0, ClientGone(POOL, "b5"))  # the one queued in admission
    assert pool.batch_in_flight == 6  # b6 came through the gate in its place
    assert (pool.queued, pool.gated) == (1, 0)
    assert routes(out) == []  # it waits in admission as b5 did


def test_a_batch_line_to_a_priority_pool_carries_an_engine_priority() -> None:
    """The controller says which requests reach their engines with vLLM's ``priority``
    (both shells send what the Route says): batch-class ones, where the pool's engines
    schedule by priority; none elsewhere, and never an interactive request."""
    for policy, expected in (("priority", BATCH), ("fcfs", 0)):
        fleet = parse_fleet(
            {
                "models": [
                    {
                        "name": POOL,
                        "replicas": 2,
                        "args": ["--max-num-seqs=4", "--scheduling-policy", policy],
                    }
                ]
            }
        )
        control = FleetController.of(fleet)
        up(control, 0.0, 2)
        (line_route,) = [c for c in line(control, 0.0, 0) if isinstance(c, Route)]
        (chat_route,) = [c for c in interactive(control, 0.0, 0) if isinstance(c, Route)]
        assert (line_route.priority, chat_route.priority) == (expected, 0)
        assert command_to_json(line_route).get("priority", 0) == expected
