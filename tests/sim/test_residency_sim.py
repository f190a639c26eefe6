"""Residency simulated: the live scenario (tests/control/residency_scenario.py) on the fleet
simulator — the same controller, the modelled engines' sleep and wake times — takes the
same decisions in the same order, serves every request, and replays to the same commands."""

from __future__ import annotations

import io

import pytest

from gpufleet.catalog import get_gpu, get_model
from gpufleet.config import parse_fleet
from gpufleet.control import read_recording, replay
from gpufleet.perf import residency_times
from gpufleet.sim import FleetSimulation, SimOptions, TraceRequest
from tests.control.residency_scenario import EXPECTED, PHASES, residency_commands
from tests.control.residency_scenario import fleet as scenario_fleet

CLIENTS, PER_CLIENT = 4, 3
PHASE_S = 3.0
"""Seconds between two phases' starts (a phase's 12 requests take well under it)."""


def _trace() -> list[TraceRequest]:
    out = []
    for p, (model,) in enumerate(PHASES):
        for i in range(CLIENTS * PER_CLIENT):
            out.append(TraceRequest(p * PHASE_S + 0.05 * i, 12, 16, model=model))
    return out


def test_the_alternating_scenario_takes_the_live_decisions() -> None:
    sim = FleetSimulation(parse_fleet(scenario_fleet(["--max-num-seqs", "8"])), SimOptions())
    out = io.StringIO()
    sim.control.record(out)
    sim.start(_trace())
    sim.run()
    assert residency_commands(out.getvalue()) == EXPECTED
    log = list(sim.harness.recorder.log)
    assert len(log) == len(PHASES) * CLIENTS * PER_CLIENT
    assert not any(row.rejected or row.failed for row in log)
    # each swap's wake took the modelled level-1 wake, and its first request waited for it
    wake = residency_times(get_model("llama-3.1-8b"), get_gpu("h100-sxm")).wake(1)
    assert sim.routing.wake_seconds == pytest.approx([wake] * 4)
    # each phase's first request waited for the swap: the other model's sleep (its weights
    # copied down), then this one's wake — not a cold start (startup.load: 60 s)
    times = residency_times(get_model("llama-3.1-8b"), get_gpu("h100-sxm"))
    swap = times.sleep(1) + times.wake(1)
    for p in range(1, len(PHASES)):
        phase = [r for r in log if p * PHASE_S <= r.arrival_s < (p + 1) * PHASE_S]
        first = min(phase, key=lambda r: r.arrival_s)
        assert first.first_token_s is not None
        assert swap <= first.first_token_s - first.arrival_s < swap + 0.5
    head, lines = read_recording(out.getvalue().splitlines())
    for line, commands in replay(head, lines):
        assert commands == line.commands
