"""``gpufleet plan --simulate`` as a user runs it: the pick is the cheapest candidate that
meets the SLO when every candidate is simulated, the winning fleet file loads, and bad input
is one line with exit status 2."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpufleet.catalog import get_gpu, get_model
from gpufleet.cli import app
from gpufleet.cli._plan_simulate import candidates_of
from gpufleet.config import load_fleet, parse_fleet
from gpufleet.planner import PlanRequest, plan

runner = CliRunner()


def trace(tmp_path: Path, rows: int = 80, rate: float = 12.0, seed: int = 3) -> Path:
    rng = random.Random(seed)
    path = tmp_path / "trace.jsonl"
    t = 0.0
    with path.open("w") as file:
        for _ in range(rows):
            t += rng.expovariate(rate)
            row = {
                "arrival_s": round(t, 4),
                "input_tokens": rng.randrange(100, 2500),
                "output_tokens": rng.randrange(10, 150),
            }
            file.write(json.dumps(row) + "\n")
    return path


def run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def plan_simulate(tmp_path: Path, out: str, *extra: str) -> tuple[dict[str, Any], str]:
    code, stdout, stderr = run(
        "plan", "--simulate", "--model", "llama-3.1-8b", "--gpus-per-node", "1",
        "--trace", str(trace(tmp_path)), "--jobs", "1", "--out", str(tmp_path / out), *extra,
    )  # fmt: skip
    assert code == 0, stdout + stderr
    return dict(json.loads((tmp_path / out / "plan-simulate.json").read_text())), stdout


SCENARIOS = {  # 80 requests at 12/s; TP1 only (--gpus-per-node 1)
    "one GPU type, tight SLO": (
        "--gpu", "a100-80gb-sxm", "--ttft-p99-ms", "400", "--tpot-ms", "25",
    ),
    "two GPU types, attainment": (
        "--gpu", "a100-80gb-sxm,l40s", "--ttft-p99-ms", "1000", "--tpot-ms", "40",
        "--attainment", "0.9",
    ),
}  # fmt: skip


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_pick_is_the_cheapest_that_meets_when_every_candidate_runs(
    tmp_path: Path, scenario: str
) -> None:
    pruned, out = plan_simulate(tmp_path, "pruned", *SCENARIOS[scenario])
    full, _ = plan_simulate(tmp_path, "full", *SCENARIOS[scenario], "--no-prune", "--no-plots")
    rows = full["candidates"]
    assert 3 <= len(rows) <= 7
    assert {r["status"] for r in rows} <= {"met", "missed"}
    met = [r for r in rows if r["status"] == "met"]
    assert met, "a scenario where nothing meets tests nothing"
    assert len(met) < len(rows), "nor one where everything does"
    cheapest = min(met, key=lambda r: (r["usd_per_hour"], r["ttft_s"]["p99"], r["name"]))
    assert full["pick"] == pruned["pick"] == cheapest["name"]
    assert sum(r["status"] in ("met", "missed") for r in pruned["candidates"]) < len(rows)
    for p, f in zip(pruned["candidates"], rows, strict=True):
        if p["status"] == "stopped":
            assert f["status"] == "missed", p["name"]
    # The winning fleet file: what the candidate simulated, with the N+1 spare added.
    winner = next(r for r in pruned["candidates"] if r["name"] == pruned["pick"])
    written = load_fleet(tmp_path / "pruned" / "fleet.yaml")
    model = written.models[0]
    assert (model.gpu, model.tp, model.replicas) == (
        winner["gpu"],
        winner["tp"],
        winner["serving"] + 1,
    )
    assert model.max_num_seqs == 256
    assert model.routing.policy == "prefix_aware"  # the packaged default fleet's
    assert (tmp_path / "pruned" / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "full" / "pareto.png").exists()
    # The table, and the plain planner's pick: simulated to the end whatever it costs.
    assert "← pick" in out
    assert "planner's pick" in out
    planned = next(r for r in pruned["candidates"] if r["name"] == pruned["planner_pick"])
    assert planned["status"] in ("met", "missed")
    if pruned["planner_pick"] != pruned["pick"]:
        assert pruned["planner_pick_verdict"]
        assert "the plain planner's pick" in out
    # The trace is the workload: its rate and lengths reached the planner.
    workload = pruned["plan"]["workload"]
    assert 8 < workload["rps"] < 16
    assert workload["peak_to_mean"] == 1.0  # a trace shorter than the peak window


def test_written_fleet_round_trips_through_the_loader(tmp_path: Path) -> None:
    template = tmp_path / "template.yaml"
    template.write_text(
        "gateway: {seed: 7, scrape_interval: 0.5}\n"
        "models:\n  - name: qwen2.5-7b\n    routing: {policy: kv_aware, kv_weight: 2}\n"
        "    startup: {load: 30}\n"
    )
    code, out, err = run(
        "plan", "--simulate", "--gpu", "h100-sxm", "--gpus-per-node", "1", "--jobs", "1",
        "--trace", str(trace(tmp_path, rows=40)), "--fleet", str(template), "--no-plots",
        "--redundancy", "0", "--max-num-seqs", "64", "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert code == 0, out + err
    written = load_fleet(tmp_path / "o" / "fleet.yaml")
    report = json.loads((tmp_path / "o" / "plan-simulate.json").read_text())
    assert report["inputs"]["seed"] == 7
    winner = next(r for r in report["candidates"] if r["name"] == report["pick"])
    expected = parse_fleet(
        {
            "gateway": {"seed": 7, "scrape_interval": 0.5},
            "models": [
                {
                    "name": "llama-3.1-8b",
                    "engine": "sim",
                    "gpu": "h100-sxm",
                    "tp": 1,
                    "replicas": winner["serving"],
                    "gpu_memory_utilization": 0.9,
                    "args": ["--max-num-seqs=64", "--max-num-batched-tokens=8192"],
                    "routing": {"policy": "kv_aware", "kv_weight": 2},
                    "startup": {"load": 30},
                }
            ],
        }
    )
    assert written == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rps", "5"], "--rps: with --simulate the trace is the workload"),
        (["--input-tokens", "500"], "--input-tokens: with --simulate"),
        (["--attainment", "1.5"], "--attainment must be in (0, 1]"),
        (["--ttft-p99-ms", "-5"], "--ttft-p99-ms: Input should be greater than 0"),
        (["--weights-dtype", "fp8"], "bf16 weights and KV cache"),
        (["--jobs", "0"], "--jobs must be at least 1"),
        (["--trace", "missing.jsonl"], "missing.jsonl: no such trace file"),
        (["--fleet", "examples/missing.yaml"], "missing.yaml"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    code, out, err = run("plan", "--simulate", "--out", str(tmp_path / "o"), *args)
    assert code == 2, out + err
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in out + err


def test_simulate_flags_need_simulate() -> None:
    code, _, err = run("plan", "--trace", "t.jsonl")
    assert code == 2
    assert "go with --simulate" in err
    code, _, err = run("plan", "--simulate")
    assert code == 2
    assert "--simulate needs --out" in err


def test_autoscale_adds_one_candidate_per_layout_charged_as_it_ran(tmp_path: Path) -> None:
    report, _ = plan_simulate(
        tmp_path, "o", "--gpu", "h100-sxm", "--autoscale", "--no-prune", "--no-plots"
    )
    scaled = [r for r in report["candidates"] if r["autoscale"]]
    assert len(scaled) == 1
    row = scaled[0]
    assert row["name"].startswith("h100-sxm TP1 autoscale 2-")
    assert row["status"] in ("met", "missed")
    assert row["usd_per_hour"] >= 2 * 3.0  # its lower bound: min_replicas × TP × price


def test_layouts_the_model_rejects_are_candidates_up_to_the_planners_cost() -> None:
    request = PlanRequest.model_validate(
        {
            "workload": {"rps": 5.5, "input_tokens": 1155, "output_tokens": 211,
                         "input_p99_tokens": 4142, "output_p99_tokens": 601},
            "slo": {"ttft_p99_ms": 500, "tpot_p50_ms": 25},
        }
    )  # fmt: skip
    report = plan(
        get_model("llama-3.1-8b"), [get_gpu("a100-40gb-pcie"), get_gpu("h100-sxm")], request
    )
    pcie = next(p for p in report.plans if p.gpu == "a100-40gb-pcie")
    assert not any(c.meets_slo for c in pcie.candidates)  # the model rejects every layout
    assert report.recommended == "h100-sxm"
    recommended = report.plans[0]
    assert recommended.cost is not None
    options, planner_pick, _ = candidates_of(
        report, request, {"models": [{"name": "x"}]}, autoscale=False
    )
    rejected = [o for o in options if o.gpu == "a100-40gb-pcie"]
    assert rejected
    assert all(not o.model_meets for o in rejected)
    assert max(o.candidate.usd_per_hour for o in rejected) <= recommended.cost.per_hour_usd
    assert {(o.tp, o.serving) for o in rejected} >= {(1, 1), (1, 2)}
    assert planner_pick is not None
