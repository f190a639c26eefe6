"""The console sampler's arithmetic: quantiles of a cumulative histogram (as Prometheus's
``histogram_quantile``) and an engine's ITL histogram read from its ``/metrics`` page."""

from __future__ import annotations

import math

import pytest

from gpufleet.engine.server import SimEngineConfig, create_app
from gpufleet.gateway._watch import quantile, read_histogram


def test_quantile_interpolates_within_the_bucket() -> None:
    cumulative = [(0.1, 10.0), (0.2, 30.0), (0.5, 40.0), (math.inf, 40.0)]
    assert quantile(cumulative, 0.5) == pytest.approx(0.15)  # rank 20: half-way in (0.1, 0.2]
    assert quantile(cumulative, 0.25) == pytest.approx(0.1)
    assert quantile(cumulative, 0.99) == pytest.approx(0.2 + 0.3 * (39.6 - 30) / 10)
    assert quantile([(0.1, 5.0), (math.inf, 10.0)], 0.99) == 0.1  # in +Inf: the last bound
    assert quantile([(0.1, 0.0), (math.inf, 0.0)], 0.5) is None
    assert quantile([], 0.5) is None


def test_an_engine_histogram_is_summed_over_its_series() -> None:
    page = "\n".join(
        [
            "# TYPE vllm:inter_token_latency_seconds histogram",
            'vllm:inter_token_latency_seconds_bucket{le="0.01",model_name="a"} 3.0',
            'vllm:inter_token_latency_seconds_bucket{le="+Inf",model_name="a"} 5.0',
            'vllm:inter_token_latency_seconds_bucket{model_name="b",le="0.01"} 1.0',
            'vllm:inter_token_latency_seconds_bucket{model_name="b",le="+Inf"} 2.0',
            "vllm:inter_token_latency_seconds_count 7.0",
        ]
    )
    assert read_histogram(page) == ((0.01, 4.0), (math.inf, 7.0))
    assert read_histogram("vllm:num_requests_running 1.0") is None


def test_the_sim_engine_exports_the_histogram_the_console_reads() -> None:
    import asyncio  # noqa: PLC0415

    import httpx  # noqa: PLC0415

    async def page() -> str:
        app = create_app(SimEngineConfig(time_scale=200.0, max_model_len=4096))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            return (await client.get("/metrics")).text

    histogram = read_histogram(asyncio.run(page()))
    assert histogram is not None
    assert histogram[-1][0] == math.inf
