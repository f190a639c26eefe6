"""The console's JSON over real HTTP: ``/admin/fleet``, ``/admin/events``, ``/admin/quotas``
and an operator's drain, on a live two-replica sim fleet (``gpufleet up``'s wiring: the
local runtime with real engine processes)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufleet.fleet import ReplicaState
from gpufleet.store import Role
from tests.gateway.console_fleet import MODEL, ConsoleFleet, console_fleet, load


async def get(cf: ConsoleFleet, path: str, role: Role = Role.VIEWER) -> Any:
    async with httpx.AsyncClient(base_url=cf.url, headers=cf.headers(role)) as client:
        answer = await client.get(path)
    assert answer.status_code == 200, answer.text
    return answer.json()


async def until(check: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.2)


@pytest.mark.asyncio
async def test_the_fleet_its_load_and_an_operators_drain(tmp_path: Path) -> None:
    async with console_fleet(tmp_path) as cf:
        fleet = await get(cf, "/admin/fleet")
        (pool,) = fleet["pools"]
        assert pool["model"] == MODEL
        assert pool["router"] == "prefix_aware"
        assert [r["state"] for r in pool["replicas"]] == ["ready", "ready"]
        assert pool["routable"] == 2

        assert await load(cf.url, cf.tenant_key) == 24

        async def loaded() -> dict[str, Any] | None:
            pool = (await get(cf, "/admin/fleet"))["pools"][0]
            window = pool["window"]
            done = window and window["ttft_p50"] and window["itl_p50"] and window["rps"]
            return pool if done else None

        pool = await until(loaded)
        window = pool["window"]
        assert 0 < window["ttft_p50"] <= window["ttft_p99"] < 10
        assert 0 < window["itl_p50"] <= window["itl_p99"] < 1
        assert any(v is not None for v in pool["series"]["ttft_p99"])
        assert len(pool["series"]["t"]) == len(pool["series"]["kv"]) > 0
        assert all(r["kv"] is not None for r in pool["replicas"])  # read while watched

        quotas = await get(cf, "/admin/quotas")
        (team,) = quotas["tenants"]
        assert team["name"] == "team-a"
        assert team["rpm"] == {"used": 24, "limit": 6000}

        # a viewer may not drain (403, audited); an operator may
        name = pool["replicas"][1]["name"]
        path = f"/admin/replicas/{name}/drain"
        async with httpx.AsyncClient(base_url=cf.url) as client:
            refused = await client.post(path, headers=cf.headers(Role.VIEWER))
            assert refused.status_code == 403
            assert refused.json()["error"]["type"] == "permission_error"
            unknown = await client.post(
                "/admin/replicas/nope/drain", headers=cf.headers(Role.OPERATOR)
            )
            assert unknown.status_code == 404
            done = await client.post(path, headers=cf.headers(Role.OPERATOR))
            assert done.status_code == 202, done.text
            again = await client.post(path, headers=cf.headers(Role.OPERATOR))
            assert again.status_code in (404, 409)  # draining, or already gone
        status = cf.fleet.runtime.snapshot.get(name)
        assert status is None or status.state in (ReplicaState.DRAINING, ReplicaState.STOPPED)
        await cf.fleet.routable(MODEL, 1)
        last = pool["replicas"][0]["name"]
        async with httpx.AsyncClient(base_url=cf.url) as client:
            refused = await client.post(
                f"/admin/replicas/{last}/drain", headers=cf.headers(Role.OPERATOR)
            )
        assert refused.status_code == 409
        assert "last replica" in refused.json()["error"]["message"]

        async def drained() -> list[dict[str, Any]] | None:
            # the sampler notes state changes once a second
            events = (await get(cf, "/admin/events"))["events"]
            texts = [e["text"] for e in events]
            seen = f"{name}: ready → draining" in texts or f"{name}: gone" in texts
            return events if seen else None

        events = await until(drained)
        texts = [e["text"] for e in events]
        assert any(f"{name}: drain asked by admin:" in t for t in texts), texts
        newer = await get(cf, f"/admin/events?after={events[-1]['seq']}")
        assert all(e["seq"] > events[-1]["seq"] for e in newer["events"])

        cf.tenancy.journal.flush()
        audit = cf.store.audit_entries(1000)
        forbidden = [e for e in audit if e["action"] == "admin.forbidden"]
        assert [json.loads(e["detail"])["needs"] for e in forbidden] == ["operator"]
        drains = [e for e in audit if e["action"] == "admin.post" and e["target"] == path]
        assert {e["outcome"] for e in drains} == {"ok", "failed"}


@pytest.mark.asyncio
async def test_the_console_page_is_served_with_its_guards(tmp_path: Path) -> None:
    async with console_fleet(tmp_path) as cf, httpx.AsyncClient(base_url=cf.url) as client:
        page = await client.get("/console")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        assert "script-src 'self'" in policy
        assert "frame-ancestors 'none'" in policy
        assert '<script defer src="/console/console.js">' in page.text
        script = await client.get("/console/console.js")
        assert script.headers["content-type"].startswith("text/javascript")
        assert "sessionStorage" in script.text
        assert (await client.get("/console/console.css")).status_code == 200
        assert (await client.get("/console/nope.js")).status_code == 404
        assert (await client.post("/console")).status_code == 405
        # the page is public; its data is not
        assert (await client.get("/admin/fleet")).status_code == 401
