"""``gpufleet up`` as a user runs it: a subprocess, a request, SIGTERM, nothing left behind."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import openai
import pytest
from typer.testing import CliRunner

from gpufleet.cli import app
from tests.up_process import start_up, stop, wait_ready

FLEET = """
models:
  - name: llama-3.1-8b
    replicas: 2
    args: ["--time-scale", "100", "--max-model-len", "2048"]
    health: {active: {interval: 0.2}}
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_up_serves_the_fleet_and_stops_cleanly(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    log = tmp_path / "up.out"
    process, base = start_up(fleet, log, run_dir=tmp_path / "run")
    try:
        text = log.read_text()
        pids = [int(p) for p in re.findall(r"pid (\d+)", text)]
        assert len(pids) == 2
        assert f"{base}/v1" in text
        assert f"{base}/metrics" in text
        with openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as client:
            wait_ready(base)
            reply = client.completions.create(model="llama-3.1-8b", prompt="Hello", max_tokens=3)
            assert reply.choices[0].text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log.read_text()
    finally:
        stop(process)
    assert all(_gone(pid) for pid in pids)
    assert "stopped" in log.read_text()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("models: [{name: llama-3.1-8b, gpu: nope}]", "models[0]"),
        ("models: [{name: llama-3.1-8b, routing: {policy: magic}}]", "models[0].routing"),
        ("gateway: {port: -1}\nmodels: [{name: llama-3.1-8b}]", "gateway.port"),
    ],
)
def test_invalid_fleet_file_exits_2_naming_the_field(
    tmp_path: Path, content: str, message: str
) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(content)
    result = CliRunner().invoke(app, ["up", "--fleet", str(fleet)])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_missing_fleet_file_exits_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["up", "--fleet", str(tmp_path / "none.yaml")])
    assert result.exit_code == 2
    assert "none.yaml" in result.output
