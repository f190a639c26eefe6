"""``gpufleet up``'s wiring of KV events: the local runtime starts sim engines that publish
them, the gateway subscribes to what the runtime reports, and a restarted engine leaves no
ghost in the index (real processes, loopback HTTP and ZMQ)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufleet.fleet import ReplicaState
from gpufleet.policy import PrecisePrefixRouter
from tests.gateway.live import LiveFleet, fleet_file, live_fleet

MODEL = "llama-3.1-8b"
FLEET = {
    "models": [
        {
            "name": MODEL,
            "replicas": 2,
            "routing": "prefix_precise",
            "args": ["--time-scale", "20", "--max-model-len", "2048"],
            "health": {"active": {"interval": 0.2}},
        }
    ],
}
PROMPT = " ".join(f"system{k}" for k in range(200))  # 201 tokens: 12 full blocks


async def _ask(client: httpx.AsyncClient, fleet: LiveFleet, suffix: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": f"{PROMPT} {suffix}", "max_tokens": 2, "ignore_eos": True}
    answer = await client.post(fleet.v1 + "/completions", json=body)
    assert answer.status_code == 200, answer.text
    usage: dict[str, Any] = answer.json()["usage"]
    return usage


async def _until(predicate: Any, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_up_subscribes_to_its_engines_and_a_restart_leaves_no_ghosts(tmp_path: Path) -> None:
    config = fleet_file(FLEET)
    async with live_fleet(config, tmp_path) as fleet, httpx.AsyncClient(timeout=30) as client:
        await fleet.routable(MODEL, 2)
        pool = fleet.gateway.control.pools[MODEL]
        router = pool.router
        assert isinstance(router, PrecisePrefixRouter)
        replicas = fleet.runtime.snapshot.replicas
        assert all(r.kv_events is not None for r in replicas)  # the runtime knows them
        await _ask(client, fleet, "first")
        holder = None

        def indexed() -> bool:
            nonlocal holder
            for r in replicas:
                if router.kv.size(r.name) > 0:
                    holder = r
            return holder is not None

        await _until(indexed)
        assert holder is not None
        again = await _ask(client, fleet, "second")
        assert again["prompt_tokens_details"]["cached_tokens"] >= 11 * 16  # routed to it
        # the holder's process dies; the runtime restarts it on a new address
        assert holder.pid is not None
        os.kill(holder.pid, signal.SIGKILL)

        def restarted(snapshot: Any) -> bool:
            now = {r.name: r for r in snapshot.replicas}[holder.name]
            return now.state is ReplicaState.READY and now.url not in (None, holder.url)

        await fleet.until(restarted, timeout=30)
        new = {r.name: r for r in fleet.runtime.snapshot.replicas}[holder.name]
        await _until(
            lambda: (
                router.snapshot().feeds.get(holder.name) is not None
                and router.snapshot().feeds[holder.name].incarnation == new.url
            )
        )
        await fleet.routable(MODEL, 2)
        assert router.kv.size(holder.name) == 0  # its old blocks are gone with its process
        matched = pool.counters.matched_blocks
        third = await _ask(client, fleet, "third")
        # nobody holds the prompt now: no match, nothing cached (no ghost drew it anywhere)
        assert pool.counters.matched_blocks == matched
        assert third["prompt_tokens_details"]["cached_tokens"] == 0
        # and the new process's events are indexed like the first one's
        await _until(lambda: any(router.kv.size(r.name) > 0 for r in replicas))
