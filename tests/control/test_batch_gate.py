"""The batch class's spare-capacity gate in the pool controller (L0, explicit ``now``), and
in a simulated run recorded and replayed (the simulator gates its batch tenant by the same
rule)."""

from __future__ import annotations

import io
import json
from typing import Any

from gpufleet.config import parse_fleet
from gpufleet.control import (
    BATCH,
    Arrived,
    ClientGone,
    Finished,
    FleetController,
    Reject,
    RejectReason,
    Route,
    Scraped,
    ScrapedLoad,
    Tick,
    read_recording,
    replay,
)
from gpufleet.fleet import ReplicaId, RouteRequest
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
