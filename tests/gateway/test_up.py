"""``gpufleet up`` as a user runs it: a subprocess, a request, SIGTERM, nothing left behind."""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import httpx
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


def test_requests_sent_the_moment_the_gateway_answers_are_served(tmp_path: Path) -> None:
    """Issue 14: `gpufleet up` with the packaged default fleet (two sim replicas), then
    chats sent the moment ``/v1/models`` first answers: none gets a 503 while the gateway
    makes its first health decisions (the runtime's READY is the replicas' first check)."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text((resources.files("gpufleet.config") / "data/default-fleet.yaml").read_text())
    body = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "hi"}]}
    for run in range(3):
        process, base = start_up(fleet, tmp_path / f"up{run}.out", run_dir=tmp_path / f"r{run}")
        try:
            with httpx.Client(base_url=base, timeout=30) as http:
                while http.get("/v1/models").status_code != 200:
                    pass

                def chat(i: int, http: httpx.Client = http) -> int:
                    payload = {**body, "max_tokens": 2 + i % 3}
                    return http.post("/v1/chat/completions", json=payload).status_code

                with ThreadPoolExecutor(8) as pool:
                    statuses = list(pool.map(chat, range(16)))
            assert statuses == [200] * 16, f"run {run}: {statuses}"
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
            stop(process)


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
