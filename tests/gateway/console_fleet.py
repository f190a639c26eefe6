"""A fleet like ``make run``'s (two sim replicas of llama-3.1-8b behind prefix-aware routing)
with auth on, a real SQLite store, admin credentials of each role and a tenant's key: what
the console's tests drive, over the ``gpufleet up`` wiring of ``tests/gateway/live.py``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gpufleet.gateway import Tenancy
from gpufleet.store import Role, Store, TenantSettings
from tests.gateway.live import LiveFleet, fleet_file, live_fleet

MODEL = "llama-3.1-8b"
ENV_ADMIN = "console-env-admin-secret"
FLEET = {
    "tenants": {"auth": True, "refresh_interval": 0.2},
    "models": [{"name": MODEL, "engine": "sim", "replicas": 2, "routing": "prefix_aware"}],
}


@dataclass
class ConsoleFleet:
    fleet: LiveFleet
    store: Store
    tenancy: Tenancy
    credentials: dict[Role, str]
    tenant_key: str

    @property
    def url(self) -> str:
        return self.fleet.url

    def headers(self, role: Role) -> dict[str, str]:
        return {"authorization": f"Bearer {self.credentials[role]}"}


@contextlib.asynccontextmanager
async def console_fleet(
    tmp: Path, models: list[dict[str, Any]] | None = None
) -> AsyncIterator[ConsoleFleet]:
    """The console's fleet (``models``: other pools, one named ``MODEL`` of 2 replicas)."""
    config = fleet_file(FLEET if models is None else {**FLEET, "models": models})
    store = Store.open(f"sqlite:///{tmp / 'gpufleet.db'}")
    credentials = {role: store.admins.create(role, f"{role.value}-1")[1] for role in Role}
    _, tenant_key = store.create_key("team-a", TenantSettings(rpm=6000))
    journal = store.journal(tmp / "journal", flush_interval=0.02)
    tenancy = Tenancy(config, store, journal=journal, admin_key=ENV_ADMIN)
    try:
        async with live_fleet(config, tmp / "run", tenancy=tenancy) as fleet:
            await fleet.routable(MODEL, 2)
            yield ConsoleFleet(fleet, store, tenancy, credentials, tenant_key)
    finally:
        store.close()


async def load(url: str, key: str, *, requests: int = 24, concurrency: int = 8) -> int:
    """Streamed chat completions through the gateway; how many answered 200."""
    ok = 0
    gate = asyncio.Semaphore(concurrency)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me about GPUs " * 40}],
        "max_tokens": 24,
        "stream": True,
    }

    async def one(client: httpx.AsyncClient) -> None:
        nonlocal ok
        async with gate, client.stream("POST", "/v1/chat/completions", json=body) as answer:
            async for _ in answer.aiter_bytes():
                pass
            ok += answer.status_code == 200

    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        await asyncio.gather(*(one(client) for _ in range(requests)))
    return ok
