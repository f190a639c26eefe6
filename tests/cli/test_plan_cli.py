"""``gpufleet plan`` as a user runs it: tables, JSON, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpufleet.cli import app
from gpufleet.planner import PlanReport

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_issue_example_plans_70b_fp8_on_two_gpu_types() -> None:
    code, out, _ = _run(
        "plan", "--model", "llama-3.1-70b", "--gpu", "h100-sxm,a100-80gb-sxm",
        "--weights-dtype", "fp8", "--kv-dtype", "fp16", "--rps", "20",
        "--input-tokens", "1000", "--output-tokens", "200",
        "--ttft-p99-ms", "500", "--tpot-ms", "50", "--json",
    )  # fmt: skip
    assert code == 0
    report = PlanReport.model_validate_json(out)
    assert {p.gpu for p in report.plans} == {"h100-sxm", "a100-80gb-sxm"}
    h100 = next(p for p in report.plans if p.gpu == "h100-sxm")
    assert h100.min_gpus_per_replica == 1  # 70B in fp8 is ~70 GB: one 80 GB GPU holds it
    a100 = next(p for p in report.plans if p.gpu == "a100-80gb-sxm")
    assert any("FP8" in w for w in a100.warnings)


def test_human_table_names_every_gpu() -> None:
    code, out, _ = _run("plan", "--gpu", "h100-sxm,l4", "--rps", "5")
    assert code == 0
    assert "h100-sxm" in out
    assert "l4" in out
    assert "memory per GPU" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "llama-9000"], "unknown model 'llama-9000'"),
        (["--gpu", "h100-sxm,tpu-v5"], "unknown GPU 'tpu-v5'"),
        (["--rps", "-3"], "--rps: Input should be greater than 0"),
        (["--input-tokens", "0"], "--input-tokens: Input should be greater than 0"),
        (["--weights-dtype", "fp4"], "unknown dtype 'fp4'"),
        (["--kv-dtype", "int4"], "unknown KV-cache dtype 'int4'"),
        (["--target-utilization", "1.5"], "--target-utilization"),
        (["--price", "h100-sxm"], "--price expects GPU=USD_PER_HOUR"),
        (["--price", "h100-sxm=cheap"], "is not a number"),
        (["--rps", "1", "--tokens-per-s", "5"], "not both"),
        (
            ["--model", "llama-3.1-405b", "--gpu", "l4", "--gpus-per-node", "1"],
            "fits on none of: l4",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    code, out, err = _run("plan", *args)
    assert code == 2
    assert message in err
    assert "Traceback" not in err + out
    assert len(err.strip().splitlines()) == 1


def test_json_schema_is_documented_and_current() -> None:
    code, out, _ = _run("plan", "--json-schema")
    assert code == 0
    documented = json.loads((REPO / "docs" / "plan-schema.json").read_text())
    assert json.loads(out) == documented, "regenerate: gpufleet plan --json-schema"


def test_installed_command_exits_2_on_bad_input() -> None:
    command = [sys.executable, "-m", "gpufleet", "plan", "--model", "nope"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert result.stderr.startswith("error: unknown model 'nope'")
