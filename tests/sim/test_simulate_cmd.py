"""``gpufleet simulate``: a report, plots, byte-identical reruns, one-line errors, --compare."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpufleet.cli import app
from gpufleet.config import load_fleet

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "azure-conv-8x-h100.yaml"
AZURE = ROOT.parent / "shared" / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"

runner = CliRunner()


def trace(tmp_path: Path, rows: int = 60, seed: int = 5) -> Path:
    rng = random.Random(seed)
    path = tmp_path / "trace.jsonl"
    t = 0.0
    with path.open("w") as file:
        for _ in range(rows):
            t += rng.expovariate(20.0)
            row: dict[str, object] = {
                "arrival_s": round(t, 4),
                "input_tokens": rng.randrange(50, 1500),
                "output_tokens": rng.randrange(1, 60),
            }
            if rng.random() < 0.5:
                row["hash_ids"] = [0, rng.randrange(4)]
            file.write(json.dumps(row) + "\n")
    return path


def fleet(tmp_path: Path, name: str, policy: str, replicas: int = 2) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"models:\n  - name: llama-3.1-8b\n    replicas: {replicas}\n    routing: {policy}\n"
    )
    return path


def simulate(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["simulate", *args])
    return result.exit_code, result.output


def test_report_is_byte_identical_for_the_same_inputs_and_seed(tmp_path: Path) -> None:
    source = trace(tmp_path)
    args = ["--trace", str(source), "--seed", "3", "--sample-every", "0.5", "--ttft-slo-ms", "50"]
    code, output = simulate(*args, "--out", str(tmp_path / "a"))
    assert code == 0, output
    code, _ = simulate(*args, "--out", str(tmp_path / "b"), "--no-plots")
    assert code == 0
    first = (tmp_path / "a" / "report.json").read_bytes()
    assert first == (tmp_path / "b" / "report.json").read_bytes()
    code, _ = simulate(*args[:-4], "--seed", "4", "--out", str(tmp_path / "c"), "--no-plots")
    report = json.loads(first)
    assert report["overall"]["requests"] == 60
    assert report["overall"]["rejected"] == 0
    for key in ("ttft_s", "itl_s", "e2e_s"):
        q = report["overall"][key]
        assert 0 < q["p50"] <= q["p90"] <= q["p99"]
    assert 0 <= report["overall"]["slo"]["attainment"] <= 1
    assert report["overall"]["prefix_hit_rate"] > 0
    assert report["cost"]["usd"] > 0
    assert len(report["replicas"]) == 2
    assert len(report["timeline"]["kv_usage"]["llama-3.1-8b-0"]) == len(report["timeline"]["t"])
    assert "wall" not in first.decode()
    assert json.loads((tmp_path / "a" / "run.json").read_text())["wall_s"] >= 0
    for name in ("latency_cdf.png", "load.png", "kv_heatmap.png", "replicas.png"):
        assert (tmp_path / "a" / name).read_bytes()[:4] == b"\x89PNG"
    assert "TTFT p50 / p90 / p99" in output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "missing.jsonl"], "no such trace file"),
        (["--trace", "{trace}", "--format", "parquet"], "parquet"),
        (["--trace", "{trace}", "--fleet", "{bad}"], "models[0].routing"),
        (["--trace", "{trace}", "--format", "lengths"], "--arrival-rate"),
        (["--trace", "{trace}", "--compare", "{bad}"], "two or more"),
        (["--trace", "{trace}", "--rate-scale", "0"], "--rate-scale"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: llama-3.1-8b\n    routing: {policy: teleport}\n")
    values = {"trace": str(trace(tmp_path, rows=3)), "bad": str(bad)}
    filled = [a.format(**values) for a in args]
    code, output = simulate(*filled, "--out", str(tmp_path / "out"))
    assert code == 2, output
    assert message in output
    assert "Traceback" not in output


def test_compare_runs_every_fleet_on_the_same_trace(tmp_path: Path) -> None:
    source = trace(tmp_path, rows=40)
    a = fleet(tmp_path, "rr", "round_robin")
    b = fleet(tmp_path, "prefix", "prefix_aware")
    out = tmp_path / "out"
    code, output = simulate(
        "--compare", str(a), str(b), "--trace", str(source), "--out", str(out), "--no-plots"
    )
    assert code == 0, output
    compared = json.loads((out / "compare.json").read_text())
    assert list(compared["fleets"]) == ["rr", "prefix"]
    assert compared["inputs"]["requests"] == 40
    assert (out / "rr" / "report.json").exists()
    assert (out / "prefix" / "report.json").exists()
    rr, prefix = (compared["fleets"][n]["overall"]["prefix_hit_rate"] for n in ("rr", "prefix"))
    assert prefix >= rr
    assert "rr" in output
    assert "prefix" in output


def test_the_example_fleets_load() -> None:
    config = load_fleet(EXAMPLE)
    assert config.models[0].replica_count == 8
    assert config.models[0].gpu == "h100-sxm"
    load_fleet(ROOT / "examples" / "local-sim.yaml")


@pytest.mark.skipif(not AZURE.exists(), reason="the Azure trace is not beside the clone")
def test_the_example_fleet_on_a_slice_of_the_azure_trace(tmp_path: Path) -> None:
    code, output = simulate(
        "--fleet", str(EXAMPLE), "--trace", str(AZURE), "--duration", "60",
        "--out", str(tmp_path), "--no-plots",
    )  # fmt: skip
    assert code == 0, output
    report = json.loads((tmp_path / "report.json").read_text())
    overall = report["overall"]
    assert overall["requests"] == report["inputs"]["requests"] > 150
    assert overall["rejected"] == 0
    assert 0.01 < overall["ttft_s"]["p50"] < 0.2  # an unloaded 8B on an H100: tens of ms
    assert 0.003 < overall["itl_s"]["p50"] < 0.02
    assert report["routing"]["scrapes"] > 250  # kv_aware: a scrape every 0.2 s
    assert report["fleet"][0]["replicas"] == 8
