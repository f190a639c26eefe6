"""LoRA adapters simulated: the controller's placement carried out on the modelled engines.
A Zipf mix over many adapters: every request served, affinity loads each adapter a few
times where load-on-any-replica loads it again and again, a load's wait is the modelled
load time, and the run replays to the same commands."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpufleet.catalog import get_gpu, get_model
from gpufleet.cli import app
from gpufleet.config import FleetConfig, load_fleet, parse_fleet
from gpufleet.control import read_recording, replay
from gpufleet.perf import lora_load_seconds
from gpufleet.sim import (
    SAMPLE_TRACE,
    DiurnalCurve,
    FleetSimulation,
    SimOptions,
    TraceRequest,
    load_trace,
    synth_requests,
    zipf_models,
)

ADAPTERS = [f"sql-{k:02d}" for k in range(1, 31)]


def fleet(affinity: bool, replicas: int = 4) -> FleetConfig:
    return parse_fleet(
        {
            "models": [
                {
                    "name": "base",
                    "model": "llama-3.1-8b",
                    "replicas": replicas,
                    "routing": "least_request",
                    "lora": {
                        "max_loras": 8,
                        "affinity": affinity,
                        "adapters": [{"name": a, "path": f"/adapters/{a}"} for a in ADAPTERS],
                    },
                }
            ]
        }
    )


def trace(seconds: float, rps: float) -> list[TraceRequest]:
    sizes = [(r.input_tokens, r.output_tokens) for r in load_trace(SAMPLE_TRACE)][:2000]
    curve = DiurnalCurve(peak_rps=rps, hours=seconds / 3600, trough=1.0, spikes=())
    return list(zipf_models(synth_requests(curve, sizes, seed=1), ADAPTERS, s=1.1, seed=1))


def run(affinity: bool, requests: list[TraceRequest]) -> tuple[FleetSimulation, str]:
    sim = FleetSimulation(fleet(affinity), SimOptions(seed=1))
    out = io.StringIO()
    sim.control.record(out)
    sim.start(requests)
    sim.run()
    assert sim.check() == []
    return sim, out.getvalue()


def test_affinity_loads_each_adapter_a_few_times_load_on_any_again_and_again() -> None:
    requests = trace(120.0, 4.0)
    counts = {}
    for affinity in (True, False):
        sim, _ = run(affinity, requests)
        log = list(sim.harness.recorder.log)
        assert len(log) == len(requests)
        assert not any(r.failed or r.rejected for r in log)
        adapters = sim.control.pools["base"].adapters
        assert adapters is not None
        counts[affinity] = adapters.counters.loads
        report = sim.report({})["adapters"]["pools"]["base"]
        assert report["loads"] == adapters.counters.loads
        assert report["requests"] >= len(requests)
        modelled = sim.routing.adapters
        assert modelled is not None
        assert modelled.stats.loads == adapters.counters.loads  # each load carried out once
    # 30 adapters over 4 × 8 slots: with affinity, few more loads than adapters
    assert counts[True] <= 2 * len(ADAPTERS)
    assert counts[False] >= 5 * counts[True]


def test_a_request_that_loads_its_adapter_waits_the_modelled_load_time() -> None:
    one = [TraceRequest(0.5, 64, 4, model=ADAPTERS[0])]
    then = [TraceRequest(5.0, 64, 4, model=ADAPTERS[0])]
    sim, recording = run(True, one + then)
    log = sorted(sim.harness.recorder.log, key=lambda r: r.arrival_s)
    load = lora_load_seconds(get_model("llama-3.1-8b"), get_gpu("h100-sxm"), rank=8)
    cold, warm = (r.first_token_s - r.arrival_s for r in log if r.first_token_s is not None)
    assert cold - warm == pytest.approx(load, rel=0.05)  # the second found it loaded
    head, lines = read_recording(recording.splitlines())
    for line, commands in replay(head, lines):
        assert commands == line.commands


def test_the_lora_example_serves_its_adapters_and_base_model() -> None:
    """``examples/lora-adapters.yaml``, simulated: a mix of its adapters and its base model
    is answered, each adapter loaded once (one replica holds it: affinity), the base model's
    requests loading nothing."""
    example = load_fleet(Path(__file__).parents[2] / "examples" / "lora-adapters.yaml")
    names = ["llama-8b", "sql-expert", "support-fr", "legal-summary"]
    requests = [TraceRequest(0.05 * i, 200, 20, model=names[i % 4]) for i in range(200)]
    sim = FleetSimulation(example, SimOptions(seed=0))
    sim.start(requests)
    sim.run()
    assert sim.check() == []
    log = list(sim.harness.recorder.log)
    assert len(log) == 200
    assert not any(r.failed or r.rejected for r in log)
    adapters = sim.control.pools["llama-8b"].adapters
    assert adapters is not None
    assert adapters.counters.requests == 150
    assert adapters.counters.loads == 3


def test_gpufleet_simulate_reports_the_adapters_loads(tmp_path: Path) -> None:
    """The CLI on the example: the summary has a row per pool with adapters, and
    report.json an ``adapters`` section."""
    names = ["llama-8b", "sql-expert", "support-fr", "legal-summary"]
    trace = tmp_path / "mix.jsonl"
    rows = [
        {"arrival_s": 0.05 * i, "input_tokens": 200, "output_tokens": 30, "model": names[i % 4]}
        for i in range(120)
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    example = Path(__file__).parents[2] / "examples" / "lora-adapters.yaml"
    out = tmp_path / "run"
    args = ["simulate", "--fleet", str(example), "--trace", str(trace), "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--no-plots"])
    assert result.exit_code == 0, result.output
    assert "LoRA adapters (llama-8b)" in result.output
    pool = json.loads((out / "report.json").read_text())["adapters"]["pools"]["llama-8b"]
    assert (pool["requests"], pool["loads"]) == (90, 3)
