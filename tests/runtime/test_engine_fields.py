"""The fleet file's engine fields reach a real sim engine process through its command line."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from gpufleet.fleet import ReplicaProfile
from gpufleet.runtime import EngineSpec, LocalRuntime, PoolSpec, RuntimeSettings, RuntimeSnapshot


@pytest.mark.asyncio
async def test_sim_engine_runs_with_the_fields_it_was_given(tmp_path: Path) -> None:
    profile = ReplicaProfile(
        max_model_len=2048,
        gpu_memory_utilization=0.6,
        enable_prefix_caching=False,
        extra=("--time-scale", "100"),
    )
    engine = EngineSpec(profile=profile, ready_timeout_s=60.0)
    pools = [PoolSpec("llama-3.1-8b", engine, replicas=1)]
    # no engine starts in 50 ms: the engine's own 60 s budget is what lets it start
    settings = RuntimeSettings(probe_interval_s=0.05, ready_timeout_s=0.05)
    async with LocalRuntime(
        pools, run_dir=tmp_path, settings=settings, registry=CollectorRegistry()
    ) as rt:
        async with asyncio.timeout(60):
            snapshot = await rt.wait_for(RuntimeSnapshot.all_ready)
        url = snapshot.replicas[0].url
        assert url is not None
        async with httpx.AsyncClient() as client:
            page = (await client.get(url + "/metrics")).text
    info = next(line for line in page.splitlines() if line.startswith("vllm:cache_config_info"))
    assert 'enable_prefix_caching="False"' in info
    assert 'gpu_memory_utilization="0.6"' in info
    assert snapshot.replicas[0].restarts == 0
