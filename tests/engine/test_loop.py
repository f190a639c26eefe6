"""L2: the real-time engine loop in virtual time (``VirtualClock``), with the real replica model.

With a virtual clock the loop must reproduce the model's own timeline exactly: the TTFT,
inter-token and end-to-end latencies it records are sums of the plans' durations.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from gpufleet.catalog import get_gpu, get_model
from gpufleet.engine.model import NewRequest, ReplicaConfig, ReplicaModel, StepPlan
from gpufleet.engine.server import EngineDeadError, EngineLoop, EngineMetrics, VirtualClock


def _model() -> ReplicaModel:
    return ReplicaModel(
        ReplicaConfig(get_model("llama-3.1-8b"), get_gpu("h100-sxm"), max_model_len=4096)
    )


def _metrics(model: ReplicaModel) -> EngineMetrics:
    return EngineMetrics("m", model.stats, {"block_size": "16"})


def _request(rid: str, prompt: int = 300, out: int = 6) -> NewRequest:
    return NewRequest(rid, tuple(range(1, prompt + 1)), max_tokens=out, ignore_eos=True)


def _histogram(metrics: EngineMetrics, name: str) -> tuple[float, float]:
    samples = {s.name: s.value for family in metrics.registry.collect() for s in family.samples}
    return samples[f"{name}_count"], samples[f"{name}_sum"]


@pytest_asyncio.fixture
async def running() -> AsyncIterator[tuple[EngineLoop, EngineMetrics, VirtualClock]]:
    model = _model()
    metrics = _metrics(model)
    clock = VirtualClock()
    loop = EngineLoop(model, clock, metrics)
    started = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        task = group.create_task(loop.run(started))
        await started.wait()
        yield loop, metrics, clock
        task.cancel()


def _replay(requests: list[NewRequest]) -> dict[str, list[float]]:
    """The shell contract in plain virtual time: each request's token times, per the model."""
    model = _model()
    for request in requests:
        model.add_request(request, 0.0)
    now, times = 0.0, {r.request_id: [] for r in requests}
    while (plan := model.plan_step(now)) is not None:
        now += plan.duration
        for output in model.finish_step(plan, now):
            times[output.request_id].append(now)
    return times


@pytest.mark.asyncio
async def test_latencies_are_the_models_own_step_times(
    running: tuple[EngineLoop, EngineMetrics, VirtualClock],
) -> None:
    loop, metrics, _ = running
    requests = [_request("a"), _request("b", prompt=700, out=9)]
    streams = [loop.submit(r) for r in requests]
    received = 0
    for stream in streams:
        while not stream.closed or stream.outputs:
            received += len(await stream.next())
    expected = _replay(requests)
    assert received == sum(len(t) for t in expected.values()) == 15
    ttft_count, ttft_sum = _histogram(metrics, "vllm:time_to_first_token_seconds")
    e2e_count, e2e_sum = _histogram(metrics, "vllm:e2e_request_latency_seconds")
    itl_count, itl_sum = _histogram(metrics, "vllm:inter_token_latency_seconds")
    assert (ttft_count, e2e_count, itl_count) == (2, 2, 13)
    a, b = expected["a"], expected["b"]
    assert ttft_sum == pytest.approx(a[0] + b[0], rel=1e-9)
    assert e2e_sum == pytest.approx(a[-1] + b[-1], rel=1e-9)
    assert itl_sum == pytest.approx(e2e_sum - ttft_sum, rel=1e-9)


@pytest.mark.asyncio
async def test_abort_frees_the_request_at_once(
    running: tuple[EngineLoop, EngineMetrics, VirtualClock],
) -> None:
    loop, _, _ = running
    stream = loop.submit(_request("a", out=1000))
    assert await stream.next()
    assert loop.model.stats().num_running == 1
    loop.abort("a")
    assert loop.model.stats().num_running == 0
    assert loop.model.stats().kv_cache_usage == 0
    assert stream.closed
    assert loop.model.stats().finished["abort"] == 1
    loop.abort("a")  # twice is harmless


@pytest.mark.asyncio
async def test_an_idle_loop_waits_for_work_without_advancing_time(
    running: tuple[EngineLoop, EngineMetrics, VirtualClock],
) -> None:
    loop, metrics, clock = running
    await asyncio.sleep(0.01)
    assert clock.now() == 0
    clock.advance(5.0)
    stream = loop.submit(_request("late", out=2))
    while not stream.closed:
        await stream.next()
    assert clock.now() == pytest.approx(5.0 + _replay([_request("late", out=2)])["late"][-1])
    assert _histogram(metrics, "vllm:e2e_request_latency_seconds")[1] == pytest.approx(
        clock.now() - 5.0
    )


class _Broken(ReplicaModel):
    def plan_step(self, now: float) -> StepPlan | None:
        if self.has_work():
            raise ZeroDivisionError("a bug")
        return super().plan_step(now)


@pytest.mark.asyncio
async def test_a_model_error_closes_streams_and_refuses_new_work() -> None:
    model = _Broken(ReplicaConfig(get_model("llama-3.1-8b"), get_gpu("h100-sxm")))
    loop = EngineLoop(model, VirtualClock(), _metrics(model))
    started = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        group.create_task(loop.run(started))
        await started.wait()
        stream = loop.submit(_request("a"))
        with pytest.raises(EngineDeadError):
            await stream.next()
    assert isinstance(loop.dead, ZeroDivisionError)
    with pytest.raises(EngineDeadError):
        loop.submit(_request("b"))
