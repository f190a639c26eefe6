"""dcgm-exporter's GPU gauges on the sim engine's ``/metrics``: the window arithmetic in
virtual time (L0), then real engines over loopback, idle and under 16 streaming clients (L4)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from gpufleet.catalog import get_gpu, get_model
from gpufleet.engine.server import DCGM_LABELS, GpuActivity, SimEngine, SimEngineConfig
from gpufleet.perf import BatchShape, StepTimeModel
from tests.engine.conftest import Served, serve
from tests.engine.test_server import MODEL

UTIL = "DCGM_FI_DEV_GPU_UTIL"
MEM = "DCGM_FI_DEV_MEM_COPY_UTIL"
USED = "DCGM_FI_DEV_FB_USED"
FREE = "DCGM_FI_DEV_FB_FREE"
POWER = "DCGM_FI_DEV_POWER_USAGE"
ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
GAUGES = (UTIL, MEM, USED, FREE, POWER, ACTIVE)
H100_MIB = 81559
H100_IDLE_W, H100_TDP_W = 120.0, 700.0

STEPS = StepTimeModel(get_model("llama-3.1-8b"), get_gpu("h100-sxm"))
DECODE = STEPS.step_time(BatchShape.uniform_decode(16, 600))
PREFILL = STEPS.step_time(BatchShape.prefill(8192))


# -- the window (L0, explicit now) --------------------------------------------------------------


def test_an_idle_gpu_is_not_busy() -> None:
    busy = GpuActivity().busy(5.0)
    assert (busy.gpu, busy.engine, busy.memory) == (0.0, 0.0, 0.0)


def test_busy_is_the_share_of_the_window_covered_by_steps() -> None:
    activity = GpuActivity(window_s=1.0)
    activity.record(0.0, 0.25, DECODE)
    activity.record(0.5, 0.75, DECODE)
    assert activity.busy(1.0).gpu == pytest.approx(0.5)
    assert activity.busy(1.5).gpu == pytest.approx(0.25)  # the first one left the window
    assert activity.busy(1.6).gpu == pytest.approx(0.15)  # the second one is leaving
    assert activity.busy(0.6).gpu == pytest.approx(0.35)  # the second one in flight
    assert activity.busy(0.1).gpu == pytest.approx(0.1)
    assert activity.busy(1.75).gpu == 0.0
    assert activity.busy(100.0).gpu == 0.0


def test_decode_streams_memory_and_prefill_computes() -> None:
    decode, prefill = GpuActivity(), GpuActivity()
    decode.record(0.0, 1.0, DECODE)
    prefill.record(0.0, 1.0, PREFILL)
    d, p = decode.busy(1.0), prefill.busy(1.0)
    assert d.gpu == p.gpu == 1.0
    assert d.memory > 0.7  # decode is bandwidth-bound
    assert 0.0 < p.memory < 0.3  # a long prefill is compute-bound
    # the step's CPU part (scheduling, sampling) is not kernel time
    assert d.engine == pytest.approx(1.0 - DECODE.overhead / DECODE.seconds)
    assert 0.8 < d.engine < 1.0


def test_a_slowed_step_keeps_its_shares() -> None:
    slowed = GpuActivity()
    slowed.record(0.0, 3 * DECODE.seconds, DECODE)  # --fault-slowdown 3
    busy = slowed.busy(1.0)
    assert busy.gpu == pytest.approx(3 * DECODE.seconds)
    assert busy.memory == pytest.approx(3 * DECODE.memory)


def test_old_steps_leave_the_window_however_many_ran() -> None:
    activity = GpuActivity(window_s=1.0)
    for i in range(20_000):  # 20 s of back-to-back 1 ms decode steps
        activity.record(i * 0.001, (i + 1) * 0.001, DECODE)
    assert activity.busy(20.0).gpu == pytest.approx(1.0)
    assert activity.busy(20.0).memory == pytest.approx(DECODE.memory / DECODE.seconds)
    assert activity.busy(20.5).gpu == pytest.approx(0.5)
    assert activity.busy(19.9995).gpu == pytest.approx(1.0)  # the last step, in flight
    # a pause, then one step: only that step is in the window
    activity.record(30.0, 30.25, PREFILL)
    assert activity.busy(30.5).gpu == pytest.approx(0.25)


@pytest.mark.parametrize("window", [0.0, -1.0, float("inf"), float("nan")])
def test_the_window_must_be_positive_and_finite(window: float) -> None:
    with pytest.raises(ValueError, match="window_s"):
        GpuActivity(window_s=window)


# -- over loopback (L4) -------------------------------------------------------------------------


def _gauges(sim: Served) -> dict[str, list[Any]]:
    """Each DCGM family's samples, and the vLLM gauges read in the same scrape."""
    families = sim.metrics()
    found = {name: families[name].samples for name in GAUGES}
    for name in GAUGES:
        assert families[name].type == "gauge", name
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        found[name] = families[name].samples
    return found


def _one(samples: list[Any]) -> float:
    (sample,) = samples
    return float(sample.value)


def _resident_mib(sim: Served) -> float:
    """Weights, workspace and overhead of one GPU, from the engine's own memory plan."""
    engine: SimEngine = sim.app.state.engine
    return engine.gpus.resident_bytes / 2**20


@contextmanager
def _streaming(
    sim: Served, clients: int, max_tokens: int, model: str = MODEL
) -> Iterator[Callable[[], None]]:
    """``clients`` streaming completions in threads; yields a join that checks they all ran
    to ``max_tokens``."""
    counts: list[int] = []
    errors: list[BaseException] = []

    def stream(i: int) -> None:
        body = {
            "model": model,
            "prompt": f"client {i} asks about the river and the old mill " * 4,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream("POST", sim.v1 + "/completions", json=body, timeout=60) as r:
                r.raise_for_status()
                counts.append(sum(1 for line in r.iter_lines() if '"text"' in line))
        except BaseException as error:  # reported by the join
            errors.append(error)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()

    def join() -> None:
        for thread in threads:
            thread.join(timeout=60)
        assert not errors, errors
        assert counts == [max_tokens] * clients

    try:
        yield join
    finally:
        for thread in threads:
            thread.join(timeout=60)


def _poll(sim: Served, ready: Callable[[dict[str, list[Any]]], bool], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gauges = _gauges(sim)
        if ready(gauges):
            return gauges
        time.sleep(0.02)
    raise AssertionError(f"not reached in {timeout} s: {_gauges(sim)}")


def test_an_idle_engine_reports_one_gpu_idle_with_its_weights_loaded() -> None:
    with serve(SimEngineConfig(max_model_len=4096)) as sim:
        gauges = _gauges(sim)
        (util,) = gauges[UTIL]
        assert set(util.labels) == set(DCGM_LABELS)
        assert util.labels["gpu"] == "0"
        assert util.labels["device"] == "nvidia0"
        assert util.labels["UUID"].startswith("GPU-")
        assert util.labels["modelName"] == "NVIDIA H100 SXM5 80GB"
        assert util.labels["Hostname"]
        for name in GAUGES:  # every family describes the same GPU
            assert [s.labels for s in gauges[name]] == [util.labels], name
        assert _one(gauges[UTIL]) == _one(gauges[MEM]) == _one(gauges[ACTIVE]) == 0.0
        assert _one(gauges[POWER]) == H100_IDLE_W
        used, free = _one(gauges[USED]), _one(gauges[FREE])
        weights = get_model(MODEL).param_count() * 2 / 2**20  # bf16
        assert used >= _resident_mib(sim) - 1 >= weights
        assert used + free == H100_MIB
        assert free > 0.5 * H100_MIB  # the KV pool is reserved, not in use


def test_sixteen_streaming_clients_raise_utilisation_power_and_memory_then_they_fall() -> None:
    with serve(SimEngineConfig(max_model_len=4096, time_scale=1.0)) as sim:
        idle = _gauges(sim)
        idle_used = _one(idle[USED])
        with _streaming(sim, clients=16, max_tokens=400) as join:
            first = _poll(sim, lambda g: _one(g["vllm:num_requests_running"]) == 16)
            assert _one(first[UTIL]) > 0.0
            assert _one(first[POWER]) > H100_IDLE_W
            time.sleep(1.0)  # one whole window of back-to-back decode steps
            busy = _gauges(sim)
            assert _one(busy["vllm:num_requests_running"]) == 16
            util = _one(busy[UTIL])
            assert 50.0 < util <= 100.0
            assert _one(busy[POWER]) == pytest.approx(
                H100_IDLE_W + (H100_TDP_W - H100_IDLE_W) * util / 100
            )
            assert _one(busy[POWER]) > H100_IDLE_W + 100
            assert 0.0 < _one(busy[MEM]) <= util  # HBM streams within the steps
            assert 0.0 < _one(busy[ACTIVE]) <= util / 100
            # FB used follows the KV blocks the requests hold, read in the same scrape
            kv = _one(busy["vllm:kv_cache_usage_perc"])
            engine: SimEngine = sim.app.state.engine
            kv_mib = kv * engine.model.num_gpu_blocks * 16 * 128 * 1024 / 2**20  # 128 KiB/token
            assert kv > 0.0
            assert _one(busy[USED]) == pytest.approx(idle_used + kv_mib, abs=1.0)
            assert _one(busy[USED]) > idle_used
            assert _one(busy[USED]) + _one(busy[FREE]) == H100_MIB
            join()
        after = _poll(sim, lambda g: _one(g[UTIL]) == 0.0, timeout=5.0)
        assert _one(after[POWER]) == H100_IDLE_W
        assert _one(after[MEM]) == _one(after[ACTIVE]) == 0.0
        assert _one(after[USED]) == idle_used  # finished requests hold no blocks


def test_tensor_parallel_gpus_each_get_a_series_and_work_together() -> None:
    config = SimEngineConfig(model="llama-3.1-70b", tp=4, max_model_len=4096, time_scale=1.0)
    with serve(config) as sim:
        idle = _gauges(sim)
        assert [s.labels["gpu"] for s in idle[UTIL]] == ["0", "1", "2", "3"]
        assert [s.labels["device"] for s in idle[UTIL]] == [f"nvidia{i}" for i in range(4)]
        assert len({s.labels["UUID"] for s in idle[UTIL]}) == 4
        used = {s.value for s in idle[USED]}
        assert len(used) == 1  # tensor-parallel shards are the same size
        weights_per_gpu = get_model("llama-3.1-70b").param_count() * 2 / 4 / 2**20
        assert used.pop() >= weights_per_gpu
        with _streaming(sim, 2, max_tokens=150, model="llama-3.1-70b") as join:
            busy = _poll(sim, lambda g: _one(g["vllm:num_requests_running"]) == 2)
            utils = [s.value for s in busy[UTIL]]
            assert len(utils) == 4
            assert len(set(utils)) == 1
            assert utils[0] > 0
            assert all(s.value > H100_IDLE_W for s in busy[POWER])
            join()
