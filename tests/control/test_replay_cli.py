"""``gpufleet simulate --record`` then ``gpufleet replay``: the same decisions, or exit 1."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from gpufleet.cli import app

runner = CliRunner()


def _trace(path: Path) -> Path:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [
        f"2023-11-16 18:15:{i // 10:02d}.{i % 10}00000,{200 + 7 * i},{20 + i % 30}"
        for i in range(300)
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_a_recorded_simulation_replays_to_the_same_decisions(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "models:\n  - name: llama-3.1-8b\n    replicas: 2\n    routing: {policy: kv_aware}\n"
    )
    out = tmp_path / "run"
    args = ["simulate", "--fleet", str(fleet), "--trace", str(_trace(tmp_path / "t.csv"))]
    result = runner.invoke(app, [*args, "--out", str(out), "--record", "--no-plots"])
    assert result.exit_code == 0, result.output
    recording = out / "recording.jsonl"
    lines = recording.read_text().splitlines()
    assert sum('"kind": "arrived"' in line for line in lines) == 300

    result = runner.invoke(app, ["replay", str(recording), "--out", str(tmp_path / "d.jsonl")])
    assert result.exit_code == 0, result.output
    assert "every decision equals the recorded one" in result.output
    assert len((tmp_path / "d.jsonl").read_text().splitlines()) == len(lines) - 1

    # a recording whose decision was changed is caught, with its line
    n, line = next((n, json.loads(x)) for n, x in enumerate(lines) if '"do": "route"' in x)
    route = next(c for c in line["commands"] if c["do"] == "route")
    route["replica"] = "llama-3.1-8b-9"
    lines[n] = json.dumps(line)
    recording.write_text("\n".join(lines) + "\n")
    result = runner.invoke(app, ["replay", str(recording)])
    assert result.exit_code == 1
    assert f"line {n + 1}:" in result.output


def test_replay_refuses_a_file_that_is_not_a_recording(tmp_path: Path) -> None:
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"hello": 1}\n')
    result = runner.invoke(app, ["replay", str(bad)])
    assert result.exit_code == 2
    assert "not a gpufleet recording" in result.output
    result = runner.invoke(app, ["replay", str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 2
