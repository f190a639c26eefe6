"""Injected faults: error rate, unhealthy, hang, slow, crash, and the admin endpoint."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import httpx
import pytest

from gpufleet.engine.server import CRASH_EXIT_STATUS, FaultConfig, Faults, SimEngineConfig
from tests.engine.conftest import serve

MODEL = "llama-3.1-8b"
BODY = {"model": MODEL, "prompt": "fault", "max_tokens": 2, "ignore_eos": True}


def _config(**faults: object) -> SimEngineConfig:
    return SimEngineConfig(time_scale=200, max_model_len=2048, faults=FaultConfig(**faults))


def test_error_rate_one_answers_every_completion_with_500() -> None:
    with serve(_config(error_rate=1.0)) as sim:
        for path in ("/completions", "/chat/completions"):
            response = httpx.post(sim.v1 + path, json=BODY)
            assert response.status_code == 500
            error = response.json()["error"]
            assert error["type"] == "InternalServerError"
            assert error["code"] == 500
        assert httpx.get(sim.url + "/health").status_code == 200


def test_error_status_503_answers_as_an_overloaded_engine() -> None:
    with serve(_config(error_rate=1.0, error_status=503)) as sim:
        response = httpx.post(sim.v1 + "/chat/completions", json={**BODY, "messages": []})
        assert response.status_code == 503
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("ServiceUnavailableError", 503)
        assert httpx.get(sim.url + "/health").status_code == 200


def test_error_rate_applies_to_every_route_that_runs_the_model() -> None:
    with serve(_config(error_rate=1.0)) as sim:
        assert httpx.post(sim.v1 + "/embeddings", json={"input": "x"}).status_code == 500
        assert httpx.post(sim.v1 + "/responses", json={"input": "x"}).status_code == 500
        tokenized = httpx.post(sim.url + "/tokenize", json={"prompt": "x"})
        assert tokenized.status_code == 200  # no model work: no injected errors


def test_error_rate_is_a_seeded_share() -> None:
    with serve(_config(error_rate=0.3)) as sim, httpx.Client(base_url=sim.v1) as http:
        statuses = [http.post("/completions", json=BODY).status_code for _ in range(60)]
    assert set(statuses) == {200, 500}
    assert 8 <= statuses.count(500) <= 30


def test_error_draws_repeat_for_a_seed() -> None:
    def draws(seed: int) -> list[bool]:
        faults = Faults(FaultConfig(error_rate=0.5), random.Random(seed))
        return [faults.draw_error() for _ in range(50)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_unhealthy_health_answers_503_and_completions_still_work() -> None:
    with serve(_config(unhealthy=True)) as sim:
        response = httpx.get(sim.url + "/health")
        assert response.status_code == 503
        assert response.json()["error"]["code"] == 503
        assert httpx.post(sim.v1 + "/completions", json=BODY).status_code == 200


def test_hang_accepts_and_never_answers() -> None:
    with serve(_config(hang=True)) as sim:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(sim.v1 + "/completions", json=BODY, timeout=0.3)
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(sim.url + "/health", timeout=0.3)
        assert httpx.get(sim.url + "/metrics").status_code == 200


def _value(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def _e2e_sum(url: str, scale: float) -> float:
    """Modelled e2e latency so far, less what CPU lag added (re-anchors on a busy machine)."""
    text = httpx.get(url + "/metrics").text
    lag = _value(text, "gpufleet:sim_engine_lag_seconds_total") * scale
    return _value(text, "vllm:e2e_request_latency_seconds_sum") - lag


def test_admin_endpoint_sets_faults_at_run_time() -> None:
    # A modest time scale: the loop must keep up, or CPU lag would blur the 3x.
    config = SimEngineConfig(time_scale=5, max_model_len=2048, enable_admin=True)
    with serve(config) as sim:
        admin = sim.url + "/admin/faults"
        assert httpx.get(admin).json() == FaultConfig().model_dump()
        body = {**BODY, "max_tokens": 20, "prompt": "the same length"}
        httpx.post(sim.v1 + "/completions", json=body).raise_for_status()
        normal = _e2e_sum(sim.url, config.time_scale)

        assert httpx.post(admin, json={"slowdown": 3.0}).json()["slowdown"] == 3.0
        httpx.post(sim.v1 + "/completions", json={**body, "prompt": "also equal length"})
        slow = _e2e_sum(sim.url, config.time_scale) - normal
        assert slow == pytest.approx(3 * normal, rel=0.05)

        httpx.post(admin, json={"unhealthy": True}).raise_for_status()
        assert httpx.get(sim.url + "/health").status_code == 503
        httpx.post(admin, json={"unhealthy": False, "error_rate": 1.0}).raise_for_status()
        assert httpx.get(sim.url + "/health").status_code == 200
        assert httpx.post(sim.v1 + "/completions", json=BODY).status_code == 500

        bad = httpx.post(admin, json={"error_rate": 2})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "error_rate"
        assert httpx.post(admin, json={"no_such_fault": 1}).status_code == 400
        assert httpx.post(admin, content=b"[").status_code == 400


def _sim_process(*flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "gpufleet", "engine", "sim", "--port", "0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_crash_flag_exits_the_process() -> None:
    started = time.monotonic()
    process = _sim_process("--fault-crash-after", "0.5", "--max-model-len", "2048")
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "listening on http://127.0.0.1:" in line
        assert process.wait(timeout=30) == CRASH_EXIT_STATUS
    finally:
        process.kill()
        process.communicate()
    assert time.monotonic() - started >= 0.5


def test_admin_crash_exits_the_process_at_once() -> None:
    process = _sim_process("--enable-admin", "--max-model-len", "2048")
    try:
        assert process.stdout is not None
        url = process.stdout.readline().split("listening on ")[1].split(",")[0]
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.get(url + "/health", timeout=1).raise_for_status()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        httpx.post(url + "/admin/faults", json={"crash_after_s": 0})
        assert process.wait(timeout=10) == CRASH_EXIT_STATUS
    finally:
        process.kill()
        process.communicate()
