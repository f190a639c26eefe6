"""LoRA adapters live: the controller's placement carried out over real HTTP on loopback.

Three real sim engine processes of one base model (``--enable-lora``, two adapter slots
each, loads taking their modelled time), 10 adapters registered in the fleet file, 16
concurrent official ``openai`` clients sending a seeded Zipf(1.1) mix over the adapters and
the base model. In the middle one replica is killed with SIGKILL; the runtime restarts it.

Not one request fails; each answer names the adapter it asked for; the engines loaded
exactly what the controller told them to (their own load counters sum to the controller's
loads less those on the killed process, none of their own LRU reloads); with affinity, far
fewer loads than requests; the restarted replica loads again what it is sent (no ghost
adapter); ``/v1/models`` lists the adapters; the recording replays to the same commands.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import signal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gpufleet.control import read_recording, replay
from gpufleet.fleet import ReplicaState
from tests.gateway.live import LiveFleet, fleet_file, live_fleet

POOL = "base"
ADAPTERS = [f"ft-{k}" for k in range(1, 11)]
CLIENTS, PER_CLIENT = 16, 12
ENGINE = ["--time-scale", "1", "--max-num-seqs", "16", "--max-model-len", "2048"]


def fleet(tmp_path: Path) -> dict[str, Any]:
    adapters = []
    for name in ADAPTERS:
        where = tmp_path / "adapters" / name
        where.mkdir(parents=True)
        (where / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
        adapters.append({"name": name, "path": str(where), "rank": 8})
    return {
        "models": [
            {
                "name": POOL,
                "model": "llama-3.1-8b",
                "replicas": 3,
                "args": ENGINE,
                "routing": "least_request",
                "lora": {"max_loras": 2, "max_lora_rank": 8, "adapters": adapters},
            }
        ]
    }


def mix(n: int, rng: random.Random) -> list[str]:
    """``n`` model names: the base one time in five, else an adapter by Zipf(1.1)."""
    weights = [1.0 / k**1.1 for k in range(1, len(ADAPTERS) + 1)]
    return [
        POOL if rng.random() < 0.2 else rng.choices(ADAPTERS, weights=weights)[0] for _ in range(n)
    ]


async def _client(
    client: openai.AsyncOpenAI, c: int, models: list[str], answered: list[tuple[str, str]]
) -> None:
    for i, model in enumerate(models):
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"hello {c} {i}"}],
            max_tokens=24,
            stream=True,
            extra_headers={"x-request-id": f"lora-c{c}-{i}"},
        )
        text, named = "", None
        async for chunk in stream:
            named = chunk.model
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        assert text
        assert named is not None
        answered.append((model, named))


async def _engine_loads(fleet: LiveFleet, http: httpx.AsyncClient) -> float:
    total = 0.0
    for replica in fleet.runtime.snapshot.replicas:
        assert replica.url is not None
        page = (await http.get(replica.url + "/metrics")).text
        for line in page.splitlines():
            if line.startswith("gpufleet:sim_engine_lora_loads_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.asyncio
async def test_adapters_under_16_clients_with_a_replica_killed(tmp_path: Path) -> None:
    rng = random.Random(7)
    mixes = [mix(PER_CLIENT, rng) for _ in range(CLIENTS)]
    recording = io.StringIO()
    answered: list[tuple[str, str]] = []
    async with (
        live_fleet(fleet_file(fleet(tmp_path)), tmp_path, record=recording) as live,
        httpx.AsyncClient(timeout=5) as http,
    ):
        models = (await http.get(live.v1 + "/models")).json()
        assert {m["id"] for m in models["data"]} == {POOL, *ADAPTERS}
        pool = live.gateway.control.pools[POOL]
        adapters = pool.adapters
        assert adapters is not None
        async with openai.AsyncOpenAI(base_url=live.v1, api_key="x", max_retries=0) as client:
            work = asyncio.gather(*(_client(client, c, mixes[c], answered) for c in range(CLIENTS)))
            # in the middle: the replica holding the most adapters dies
            while len(answered) < CLIENTS * PER_CLIENT // 3:
                await asyncio.sleep(0.02)
            held = adapters.held()
            victim_name = max(held, key=lambda r: len(held[r]))
            victim = {r.name: r for r in live.runtime.snapshot.replicas}[victim_name]
            assert victim.url is not None
            page = (await http.get(victim.url + "/metrics")).text
            first_life = sum(
                float(line.rsplit(" ", 1)[1])
                for line in page.splitlines()
                if line.startswith("gpufleet:sim_engine_lora_loads_total")
            )
            assert victim.pid is not None
            os.kill(victim.pid, signal.SIGKILL)

            def restarted(snapshot: Any) -> bool:
                now = {r.name: r for r in snapshot.replicas}[victim.name]
                return now.state is ReplicaState.READY and now.url not in (None, victim.url)

            await live.until(restarted, timeout=30)
            await work
        after_restart = adapters.held().get(victim.name, ())
        ok = live.sample("gpufleet:adapter_loads_total", model=POOL, outcome="ok")
        failed = live.sample("gpufleet:adapter_loads_total", model=POOL, outcome="failed")
        # the live processes' (the victim in its second life)
        engine_loads = await _engine_loads(live, http)

    # 0 failed: every request answered (a failure raises in its client), under its own name
    assert len(answered) == CLIENTS * PER_CLIENT
    assert all(asked == named for asked, named in answered), answered
    counters = adapters.counters
    assert counters.requests >= sum(1 for asked, _ in answered if asked != POOL)
    # affinity: each load served many requests (10 adapters, 6 slots, a Zipf mix)
    assert counters.loads * 3 <= counters.requests, counters
    # every load the controller sent was carried out (or failed with the killed process)
    assert ok + failed == counters.loads
    # the engines loaded what they were told and nothing on their own (no reload of an
    # adapter their cache dropped): the survivors' and the restarted process's counters hold
    # every successful load but the victim's first life's (one may have ended between the
    # read of its counter and the kill)
    assert first_life >= 1  # it held adapters when it died
    assert ok - first_life - 1 <= engine_loads <= ok - first_life
    # after its restart it held only what it was sent since (it reloaded, no ghost)
    assert len(after_restart) <= 2
    print(
        f"\n{len(answered)} requests, {counters.requests} for adapters, {counters.loads} loads "
        f"({failed:g} failed with the kill), {counters.unloads} unloads, over cap "
        f"{counters.over_cap}; engines' loads now {engine_loads:g}"
    )
    head, lines = read_recording(recording.getvalue().splitlines())
    for line, commands in replay(head, lines):
        assert commands == line.commands, line
