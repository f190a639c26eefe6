"""``gpufleet simulate --sweep FIELD=V1,V2,…``: the cheapest combination that meets the SLO
is the pick of an exhaustive run too, and bad input is one line with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet.config import load_fleet
from tests.cli.test_plan_simulate import run, trace


def fleet_file(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "models:\n  - name: llama-3.1-8b\n    replicas: 1\n    routing: least_request\n"
    )
    return path


def test_sweep_picks_the_cheapest_combination_that_meets(tmp_path: Path) -> None:
    base = [
        "simulate", "--fleet", str(fleet_file(tmp_path)), "--trace", str(trace(tmp_path)),
        "--sweep", "models[0].replicas=1,2,3", "--sweep", "models[0].gpu=h100-sxm,l40s",
        "--ttft-slo-ms", "500", "--tpot-slo-ms", "40", "--jobs", "1",
    ]  # fmt: skip
    code, out, err = run(*base, "--out", str(tmp_path / "a"))
    assert code == 0, out + err
    code, _, err = run(*base, "--no-prune", "--no-plots", "--out", str(tmp_path / "b"))
    assert code == 0, err
    pruned = json.loads((tmp_path / "a" / "sweep.json").read_text())
    full = json.loads((tmp_path / "b" / "sweep.json").read_text())
    rows = full["combinations"]
    assert len(rows) == 6
    met = [r for r in rows if r["status"] == "met"]
    assert met
    assert len(met) < len(rows)
    cheapest = min(met, key=lambda r: (r["usd_per_hour"], r["ttft_s"]["p99"], r["name"]))
    assert pruned["pick"] == full["pick"] == cheapest["name"]
    assert "models[0].replicas" in out
    written = load_fleet(tmp_path / "a" / "fleet.yaml")
    values = cheapest["values"]
    assert written.models[0].replicas == values["models[0].replicas"]
    assert written.models[0].gpu == values["models[0].gpu"]
    assert (tmp_path / "a" / "pareto.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sweep", "models[0].colour=red,blue"], "models[0].colour: Extra inputs"),
        (["--sweep", "models[0].replicas"], "--sweep expects FIELD=V1,V2"),
        (["--sweep", "models[2].tp=1,2"], "models has 1 entries, no [2]"),
        (["--sweep", "models[0].replicas=1,,2"], "an empty value"),
        (["--sweep", "models[0].gpu=h100-sxm,tpu"], "unknown GPU 'tpu'"),
        (["--sweep", "models[0].replicas=1", "--compare"], "--compare"),
        (["--sweep", "models[0].replicas=1", "--attainment", "0.9"], "--attainment needs"),
        (["--sweep", "models[0].replicas=1", "--ttft-slo-ms", "-1"], "--ttft-slo-ms must be"),
    ],
)
def test_sweep_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    code, out, err = run(
        "simulate", "--fleet", str(fleet_file(tmp_path)), "--trace", str(trace(tmp_path, 10)),
        "--out", str(tmp_path / "o"), *args,
    )  # fmt: skip
    assert code == 2, out + err
    assert message in err
    assert len(err.strip().splitlines()) == 1
