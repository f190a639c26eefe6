"""One tenant's client for the live fairness experiment, run as its own process.

``python -m tests.gateway.fairness_client`` reads a JSON job on stdin (gateway URL, a
wall-clock start, the model, the request plan, prompt words and answer tokens), streams each
request at its time and prints ``{tenant: {"ttft": [...], "statuses": {...}}}``. Each tenant
gets its own process so that parsing the heavy tenant's thousands of chunks a second stalls
neither the light tenant's clock nor the gateway's interpreter: the TTFT measured is the
gateway's and the engines', not the test client's.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import httpx


async def _one(http: httpx.AsyncClient, job: dict[str, Any], key: str, out: dict[str, Any]) -> None:
    body = {
        "model": job["model"],
        "messages": [{"role": "user", "content": " ".join(["word"] * job["words"])}],
        "max_tokens": job["tokens"],
        "stream": True,
    }
    sent = time.perf_counter()
    async with http.stream(
        "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as response:
        status = str(response.status_code)
        out["statuses"][status] = out["statuses"].get(status, 0) + 1
        if response.status_code != 200:
            await response.aread()
            return
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter() - sent
        if first is not None:
            out["ttft"].append(first)


async def run(job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    outcomes: dict[str, dict[str, Any]] = {}
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
    async with httpx.AsyncClient(base_url=job["url"], timeout=60, limits=limits) as http:
        # Wall time: every tenant's process starts its plan at the same instant.
        start = time.perf_counter() + (job["start_at"] - time.time())
        tasks = []
        for at, tenant, key in job["plan"]:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            out = outcomes.setdefault(tenant, {"ttft": [], "statuses": {}})
            tasks.append(asyncio.create_task(_one(http, job, key, out)))
        await asyncio.gather(*tasks)
    return outcomes


if __name__ == "__main__":
    print(json.dumps(asyncio.run(run(json.load(sys.stdin)))))
