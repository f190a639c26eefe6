"""``gpufleet up`` as a user runs it: a subprocess, a request, SIGTERM, nothing left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from typer.testing import CliRunner

from gpufleet.cli import app

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
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gpufleet", "up", "--fleet", str(fleet), "--port", "0",
             "--run-dir", str(tmp_path / "run")],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not (found := re.search(r"listening on (http://\S+)", log.read_text())):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        base = found.group(1)
        text = log.read_text()
        pids = [int(p) for p in re.findall(r"pid (\d+)", text)]
        assert len(pids) == 2
        assert f"{base}/v1" in text
        assert f"{base}/metrics" in text
        with openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as client:
            deadline = time.monotonic() + 10
            while httpx.get(base + "/ready").status_code != 200:  # first probes answered
                assert time.monotonic() < deadline
                time.sleep(0.05)
            reply = client.completions.create(model="llama-3.1-8b", prompt="Hello", max_tokens=3)
            assert reply.choices[0].text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
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
