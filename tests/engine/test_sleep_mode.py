"""vLLM's sleep mode on the sim engine, over real HTTP: the dev-mode routes, the 503 while
asleep, the modelled wake time, the dropped prefix cache and ``vllm:engine_sleep_state``."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from gpufleet.catalog import get_gpu, get_model
from gpufleet.engine.server import SimEngineConfig
from gpufleet.perf import residency_times
from tests.engine.conftest import serve

SCALE = 4.0
"""Modelled seconds per real second: an 8B level-1 wake (~0.41 s) takes ~0.1 s here."""


def _state(sim: object, name: str) -> float:
    return sim.sample("vllm:engine_sleep_state", sleep_state=name)  # type: ignore[attr-defined]


def test_sleep_then_wake_takes_the_modelled_time_and_refuses_requests_while_asleep() -> None:
    config = SimEngineConfig(time_scale=SCALE, enable_sleep_mode=True, dev_mode=True, seed=1)
    times = residency_times(get_model("llama-3.1-8b"), get_gpu("h100-sxm"))
    with serve(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as http:
        client = sim.client()
        prompt = "the same long prefix " * 60
        client.completions.create(model=config.name, prompt=prompt, max_tokens=2)
        cached = client.completions.create(model=config.name, prompt=prompt, max_tokens=2)
        assert cached.usage.prompt_tokens_details.cached_tokens > 0
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert _state(sim, "awake") == 1.0

        assert http.post("/sleep", params={"level": 1}).status_code == 200
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert _state(sim, "awake") == 0.0
        assert _state(sim, "weights_offloaded") == 1.0
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=config.name, prompt="hi", max_tokens=2)
        assert refused.value.status_code == 503
        assert "sleeping" in refused.value.message
        assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 200  # no weights
        assert http.get("/health").status_code == 200

        started = time.monotonic()
        assert http.post("/wake_up").status_code == 200
        took = (time.monotonic() - started) * SCALE  # modelled seconds
        assert times.wake(1) <= took <= times.wake(1) * 1.5 + 0.05
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        again = client.completions.create(model=config.name, prompt=prompt, max_tokens=2)
        # the KV cache was dropped: the repeated prompt finds nothing cached
        details = again.usage.prompt_tokens_details
        assert details is None or not details.cached_tokens
        assert sim.sample("gpufleet:sim_engine_wakes", "gpufleet:sim_engine_wakes_total") == 1.0


def test_level_2_sleep_wakes_from_storage_slower_than_level_1() -> None:
    config = SimEngineConfig(time_scale=50.0, enable_sleep_mode=True, dev_mode=True)
    times = residency_times(get_model("llama-3.1-8b"), get_gpu("h100-sxm"))
    with serve(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as http:
        assert http.post("/sleep?level=2").status_code == 200
        assert _state(sim, "discard_all") == 1.0
        started = time.monotonic()
        assert http.post("/wake_up", params={"tags": "weights"}).status_code == 200
        took = (time.monotonic() - started) * 50.0
        assert times.wake(2) > 5 * times.wake(1)
        assert times.wake(2) <= took <= times.wake(2) * 1.2 + 0.2


def test_sleep_aborts_requests_in_flight() -> None:
    config = SimEngineConfig(time_scale=1.0, enable_sleep_mode=True, dev_mode=True)
    with serve(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as http:
        with http.stream(
            "POST",
            "/v1/completions",
            json={"model": config.name, "prompt": "x", "max_tokens": 5000, "stream": True},
        ) as streaming:
            lines = streaming.iter_lines()
            assert next(lines).startswith("data:")  # it runs
            assert http.post("/sleep").status_code == 200
            rest = list(lines)
        assert not any('"finish_reason":"length"' in line for line in rest)
        assert sim.sample("vllm:num_requests_running") == 0.0


@pytest.mark.parametrize(
    ("dev_mode", "enabled", "status"), [(False, True, 404), (True, False, 400)]
)
def test_the_routes_need_dev_mode_and_sleep_mode(
    dev_mode: bool, enabled: bool, status: int
) -> None:
    config = SimEngineConfig(time_scale=50.0, enable_sleep_mode=enabled, dev_mode=dev_mode)
    with serve(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as http:
        assert http.post("/sleep").status_code == status
        assert http.post("/wake_up").status_code == status


def test_a_bad_level_is_a_400() -> None:
    config = SimEngineConfig(time_scale=50.0, enable_sleep_mode=True, dev_mode=True)
    with serve(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as http:
        answer = http.post("/sleep?level=3")
        assert answer.status_code == 400
        assert answer.json()["error"]["type"] == "BadRequestError"
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
