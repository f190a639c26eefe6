"""Rollouts simulated: the fleet file's rollout block over the Azure conversation trace, the
controller's own rule (the live gateway's), with the new version healthy and three times
slower; the verdicts match the live test's (tests/gateway/test_rollout_live.py), the report
and rollout.png show them, and a recording replays to the same decisions."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from gpufleet.config import load_fleet, parse_fleet
from gpufleet.control import read_recording, replay
from gpufleet.sim import (
    FleetSimulation,
    SimOptions,
    load_faults,
    load_trace,
    write_plots,
)

ROOT = Path(__file__).resolve().parents[2]
AZURE = ROOT.parent / "shared/traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv"
EXAMPLE = ROOT / "examples/rollout-canary.yaml"
SLOW = ROOT / "examples/faults/slow-canary.yaml"
STEP = 120.0
needs_trace = pytest.mark.skipif(not AZURE.exists(), reason=f"{AZURE} is not here")


def simulate(
    *, slow: bool, record: io.StringIO | None = None, fleet: Any = None
) -> FleetSimulation:
    options = SimOptions(seed=0, faults=tuple(load_faults(SLOW)) if slow else ())
    sim = FleetSimulation(fleet or load_fleet(EXAMPLE), options)
    if record is not None:
        sim.control.record(record)
    sim.start(load_trace(AZURE, duration=600.0))
    sim.run()
    assert sim.check() == []
    return sim


def verdicts(report: dict[str, Any]) -> list[tuple[str, float]]:
    (rollout,) = report["rollouts"].values()
    return [(d["verdict"], d["share"]) for d in rollout["decisions"]]


@needs_trace
def test_a_good_version_is_promoted_5_20_100(tmp_path: Path) -> None:
    sim = simulate(slow=False)
    report = sim.report({})
    steps = verdicts(report)
    # the live test's verdicts, holds aside (a window with too few requests at 5 %)
    assert [s for s in steps if s[0] != "hold"] == [
        ("start", 5.0),
        ("promote", 20.0),
        ("promote", 100.0),
    ]
    rollout = report["rollouts"]["llama-3.1-8b"]
    assert rollout["phase"] == "promoted"
    failed_requests = sum(1 for r in sim.harness.recorder.log if r.failed)
    assert failed_requests == 0
    assert rollout["requests"]["llama-8b-v2"] > rollout["requests"]["llama-8b-v1"] / 2
    paths = write_plots(tmp_path, report, sim.latencies())
    png = tmp_path / "rollout.png"
    assert png in paths
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_trace
def test_a_three_times_slower_version_is_rolled_back_within_two_windows() -> None:
    out = io.StringIO()
    sim = simulate(slow=True, record=out)
    report = sim.report({})
    steps = verdicts(report)
    assert steps[0] == ("start", 5.0)
    assert steps[-1] == ("rollback", 0.0)
    assert len(steps) - 1 <= 2, steps  # within two analysis windows
    rollout = report["rollouts"]["llama-3.1-8b"]
    rollback = rollout["decisions"][-1]
    assert rollback["at"] <= 2 * STEP
    failed = {c["metric"] for c in rollback["checks"] if c["result"] == "fail"}
    assert "ttft_p99" in failed
    assert sum(1 for r in sim.harness.recorder.log if r.failed) == 0
    assert rollout["share"]["llama-8b-v2"] < 0.10
    # after the rollback nothing reaches the slow version
    models = sim.replica_models
    late = [r for r in sim.harness.recorder.log if r.arrival_s > rollback["at"]]
    assert late
    assert all(models[r.replica] == "llama-8b-v1" for r in late)
    # the recording replays to the same decisions (rollout steps included)
    head, body = read_recording(io.StringIO(out.getvalue()))
    lines = 0
    for line, commands in replay(head, body):
        assert commands == line.commands, line
        lines += 1
    assert lines > 1000
    assert '"do": "rollout"' in out.getvalue()


@needs_trace
def test_blue_green_warms_switches_and_rolls_a_slow_version_back() -> None:
    data = load_fleet(EXAMPLE).model_dump(mode="json", exclude_none=True)
    data["served"][0]["rollout"] |= {"strategy": "blue-green", "step_seconds": 60.0}
    fleet = parse_fleet(data)
    good = [v for v, _ in verdicts(simulate(slow=False, fleet=fleet).report({}))]
    assert [v for v in good if v != "wait"] == ["start", "switch", "promote"]
    bad = simulate(slow=True, fleet=fleet).report({})
    steps = verdicts(bad)
    assert [v for v, _ in steps if v != "wait"] == ["start", "switch", "rollback"]
    assert steps[-1][1] == 0.0  # every request back on the old pool, kept warm
