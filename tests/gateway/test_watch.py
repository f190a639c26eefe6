"""The console sampler's arithmetic: quantiles of a cumulative histogram (as Prometheus's
``histogram_quantile``) and an engine's ITL histogram read from its ``/metrics`` page."""

from __future__ import annotations

import math

import pytest

from gpufleet.engine.server import SimEngineConfig, create_app
from gpufleet.gateway._watch import GpuRead, quantile, read_gpus, read_histogram


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


def test_a_replicas_gpus_are_read_from_its_dcgm_gauges() -> None:
    """One series per GPU: utilisation averaged, power and memory summed (a TP-2 replica)."""
    labels = 'UUID="GPU-{u}",device="nvidia{i}",gpu="{i}",modelName="NVIDIA H100"'
    lines = []
    for i, (util, power, used, free) in enumerate(
        ((40.0, 300.0, 60.0, 20.0), (60.0, 400.0, 20.0, 20.0))
    ):
        series = "{" + labels.format(u=i, i=i) + "}"
        lines += [
            f"DCGM_FI_DEV_GPU_UTIL{series} {util}",
            f"DCGM_FI_DEV_POWER_USAGE{series} {power}",
            f"DCGM_FI_DEV_FB_USED{series} {used}",
            f"DCGM_FI_DEV_FB_FREE{series} {free}",
            f"DCGM_FI_DEV_MEM_COPY_UTIL{series} 5.0",
        ]
    gpus = read_gpus("\n".join(["# TYPE DCGM_FI_DEV_GPU_UTIL gauge", *lines]))
    assert gpus == GpuRead(count=2, util=0.5, power_w=700.0, memory=pytest.approx(80 / 120))
    assert read_gpus("vllm:num_requests_running 1.0") is None


def test_the_sim_engines_gpu_gauges_read_as_its_gpus() -> None:
    import asyncio  # noqa: PLC0415

    import httpx  # noqa: PLC0415

    async def page() -> str:
        app = create_app(SimEngineConfig(time_scale=200.0, max_model_len=4096, tp=2))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            return (await client.get("/metrics")).text

    gpus = read_gpus(asyncio.run(page()))
    assert gpus is not None
    assert gpus.count == 2
    assert gpus.util == 0.0  # idle
    assert gpus.power_w > 0  # idle draw
    assert gpus.memory is not None
    assert 0 < gpus.memory < 1  # the weights, no KV in use
