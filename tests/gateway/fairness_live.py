"""The fairness experiment live: two tenants' keys, a 10× heavy one, through the real gateway.

Used by ``tests/gateway/test_fairness_live.py`` and ``bench/fairness.py --live``. Sim replicas
(uvicorn, real time scaled by ``time_scale``) behind the gateway with auth on (keys in a real
SQLite store) and admission on; an asyncio client streams ``/v1/chat/completions`` with each
tenant's key at Poisson times and measures time to the first content chunk.
"""

from __future__ import annotations

import asyncio
import random
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gpufleet.engine.server import SimEngineConfig, create_app
from gpufleet.store import TenantSettings
from tests.gateway.conftest import MODEL, serve_app
from tests.gateway.tenants import serve_tenant_gateway, tenant_fleet


@dataclass
class Outcome:
    ttft: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)

    def p(self, q: float) -> float | None:
        values = sorted(self.ttft)
        return values[int(q * (len(values) - 1))] if values else None

    def summary(self) -> dict[str, Any]:
        def ms(v: float | None) -> float | None:
            return None if v is None else round(v * 1000, 1)

        return {
            "served": len(self.ttft),
            "statuses": dict(sorted(self.statuses.items())),
            "ttft_ms": {"p50": ms(self.p(0.5)), "p99": ms(self.p(0.99))},
        }


async def _one(http: httpx.AsyncClient, key: str, words: int, tokens: int, out: Outcome) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": " ".join(["word"] * words)}],
        "max_tokens": tokens,
        "stream": True,
    }
    sent = time.perf_counter()
    async with http.stream(
        "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as response:
        out.statuses[response.status_code] = out.statuses.get(response.status_code, 0) + 1
        if response.status_code != 200:
            await response.aread()
            return
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter() - sent
        if first is not None:
            out.ttft.append(first)


async def _send(
    url: str, plan: list[tuple[float, str, str]], words: int, tokens: int
) -> dict[str, Outcome]:
    outcomes: dict[str, Outcome] = {}
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        start = time.perf_counter()
        tasks = []
        for at, tenant, key in plan:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            out = outcomes.setdefault(tenant, Outcome())
            tasks.append(asyncio.create_task(_one(http, key, words, tokens, out)))
        await asyncio.gather(*tasks)
    return outcomes


def run_live(
    tmp: Path,
    *,
    light_rate: float = 2.0,
    duration: float = 6.0,
    replicas: int = 1,
    max_num_seqs: int = 4,
    time_scale: float = 2.0,
    words: int = 200,
    tokens: int = 60,
    seed: int = 0,
) -> dict[str, Any]:
    """Light alone, then light + a heavy tenant at 10× its rate; each phase ``duration`` s."""
    engine = SimEngineConfig(
        time_scale=time_scale, max_model_len=4096, max_num_seqs=max_num_seqs, seed=seed
    )
    config = tenant_fleet(admission={"max_num_seqs": max_num_seqs, "max_wait": 30.0})
    with ExitStack() as stack:
        urls = [stack.enter_context(serve_app(create_app(engine))) for _ in range(replicas)]
        gw = stack.enter_context(serve_tenant_gateway(tmp, config, urls))
        keys = {}
        for tenant in ("light", "heavy"):
            _, keys[tenant] = gw.store.create_key(tenant, TenantSettings())
        gw.tenancy.reload()

        def arrivals(tenant: str, rate: float) -> list[tuple[float, str, str]]:
            rng = random.Random(f"{tenant}-{seed}")
            t, out = 0.0, []
            while (t := t + rng.expovariate(rate)) < duration:
                out.append((t, tenant, keys[tenant]))
            return out

        light = arrivals("light", light_rate)
        heavy = arrivals("heavy", 10 * light_rate)
        alone = asyncio.run(_send(gw.url, light, words, tokens))
        both = asyncio.run(_send(gw.url, sorted(light + heavy), words, tokens))
    a, b = alone["light"].p(0.99), both["light"].p(0.99)
    return {
        "inputs": {
            "light_rate": light_rate,
            "heavy_rate": 10 * light_rate,
            "duration_s": duration,
            "replicas": replicas,
            "max_num_seqs": max_num_seqs,
            "time_scale": time_scale,
            "prompt_words": words,
            "max_tokens": tokens,
        },
        "light_alone": alone["light"].summary(),
        "light_with_heavy": both["light"].summary(),
        "heavy_with_light": both["heavy"].summary(),
        "light_ttft_p99_ratio": None if not a or b is None else round(b / a, 3),
    }
