"""Quotas shared by two gateways through a real Redis (``gateway.redis_url``): one tenant
hammering both is held to one limit, not one per gateway; Redis away, each falls back to its
own limits and says so."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from gpufleet.engine.server import SimEngineConfig, create_app
from gpufleet.gateway._quotas import Lease
from gpufleet.gateway._quotas_redis import RedisQuotas
from gpufleet.gateway._tenant_quota import Denial, QuotaLimits
from gpufleet.store import TenantSettings
from tests.gateway.conftest import MODEL, closed_port_url, serve_app, sim_replica
from tests.gateway.redis_server import redis_server, unavailable
from tests.gateway.tenants import TenantGateway, serve_tenant_gateway, tenant_fleet

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    with redis_server() as url:
        yield url


def two_gateways(
    stack: ExitStack, tmp: Path, redis_url: str, replica: str
) -> tuple[TenantGateway, TenantGateway]:
    """Two gateways over one store (one home) and one Redis."""
    config = tenant_fleet(gateway={"redis_url": redis_url})
    a = stack.enter_context(serve_tenant_gateway(tmp, config, [replica]))
    b = stack.enter_context(serve_tenant_gateway(tmp, config, [replica]))
    return a, b


def new_key(gateways: tuple[TenantGateway, ...], tenant: str, **settings: object) -> str:
    _, key = gateways[0].store.create_key(tenant, TenantSettings(**settings))  # type: ignore[arg-type]
    for gw in gateways:
        gw.tenancy.reload()
    return key


def post(client: httpx.Client, gw: TenantGateway, key: str, **body: object) -> httpx.Response:
    return client.post(
        gw.v1 + "/chat/completions",
        json={**BODY, **body},
        headers={"authorization": f"Bearer {key}"},
    )


def test_two_gateways_hold_one_tenant_to_one_rpm(tmp_path: Path, redis_url: str) -> None:
    rpm, attempts = 100, 300
    with ExitStack() as stack:
        replica = stack.enter_context(sim_replica(seed=3))
        gateways = two_gateways(stack, tmp_path, redis_url, replica)
        assert all(isinstance(gw.tenancy.quotas, RedisQuotas) for gw in gateways)
        key = new_key(gateways, "hammer", rpm=rpm)

        def worker(n: int) -> Counter[tuple[int, int]]:
            seen: Counter[tuple[int, int]] = Counter()
            with httpx.Client(timeout=10) as client:
                for i in range(n, attempts, 8):  # each worker alternates the gateways
                    answer = post(client, gateways[i % 2], key)
                    seen[(i % 2, answer.status_code)] += 1
                    if answer.status_code == 429:
                        assert 1 <= int(answer.headers["retry-after"]) <= 60
            return seen

        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            seen = sum(pool.map(worker, range(8)), Counter[tuple[int, int]]())
        elapsed = time.monotonic() - started
    accepted = seen[(0, 200)] + seen[(1, 200)]
    print(
        f"\ntwo gateways, one Redis: {accepted} of {attempts} accepted in {elapsed:.1f} s "
        f"(rpm {rpm}; via A {seen[(0, 200)]}, via B {seen[(1, 200)]})"
    )
    assert elapsed < 60  # all inside one window
    assert set(seen) <= {(0, 200), (1, 200), (0, 429), (1, 429)}
    assert abs(accepted - rpm) <= 0.1 * rpm
    assert seen[(0, 200)] > 0
    assert seen[(1, 200)] > 0


def test_concurrency_and_tpm_are_shared(tmp_path: Path, redis_url: str) -> None:
    slow = SimEngineConfig(time_scale=1.0, max_model_len=4096)  # a stream that stays open
    with ExitStack() as stack:
        replica = stack.enter_context(serve_app(create_app(slow)))
        a, b = gateways = two_gateways(stack, tmp_path, redis_url, replica)
        one = new_key(gateways, "one-at-a-time", concurrency=1)
        tokens = new_key(gateways, "few-tokens", tpm=20)
        with httpx.Client(timeout=30) as client:
            body = {**BODY, "max_tokens": 2000, "stream": True}
            headers = {"authorization": f"Bearer {one}"}
            with client.stream("POST", a.v1 + "/chat/completions", json=body, headers=headers):
                denied = post(client, b, one)
                assert denied.status_code == 429
                assert "concurrency" in denied.json()["error"]["message"]
            deadline = time.monotonic() + 2  # the slot is given back off the request's path
            while (answer := post(client, b, one)).status_code == 429:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert answer.status_code == 200

            charged = post(client, a, tokens, max_tokens=30)  # over 20 tokens, charged at the end
            assert charged.status_code == 200
            # the charge reaches Redis off the request's path too: B sees it within moments
            deadline = time.monotonic() + 2
            while (denied := post(client, b, tokens)).status_code == 200:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert denied.status_code == 429
            assert "tpm" in denied.json()["error"]["message"]


def test_without_redis_each_gateway_keeps_its_own_limits(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fail open, to per-gateway limits: Redis away is no outage, and quotas still hold."""
    down = "redis://" + closed_port_url().removeprefix("http://") + "/0"
    caplog.set_level(logging.WARNING, logger="gpufleet.gateway")
    with ExitStack() as stack:
        replica = stack.enter_context(sim_replica(seed=4))
        gw = stack.enter_context(
            serve_tenant_gateway(tmp_path, tenant_fleet(gateway={"redis_url": down}), [replica])
        )
        key = new_key((gw,), "alone", rpm=3)
        with httpx.Client(timeout=10) as client:
            codes = [post(client, gw, key).status_code for _ in range(5)]
        quotas = gw.tenancy.quotas
        assert isinstance(quotas, RedisQuotas)
        assert not quotas.shared
    assert codes == [200, 200, 200, 429, 429]
    warnings = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1  # once per outage, not once per request
    assert "fall back to this gateway's own limits" in warnings[0]


@pytest.mark.asyncio
async def test_a_dead_gateways_slots_free_themselves(redis_url: str) -> None:
    """A running request's concurrency slot is a lease its gateway renews; a gateway that
    dies stops renewing, and the slot frees itself (20 s in production, 1 s here)."""
    a, b = (RedisQuotas(redis_url, time.monotonic, lease=1.0, renew=0.2) for _ in range(2))
    for quotas in (a, b):
        quotas.set_limits("leased", QuotaLimits(concurrency=1))
    try:
        assert isinstance(await a.acquire("leased", "first"), Lease)
        renewing = asyncio.create_task(a.run())
        await asyncio.sleep(1.5)  # past the lease: held because a renews it
        assert isinstance(await b.acquire("leased", "second"), Denial)
        renewing.cancel()  # a "dies" with its request running
        await asyncio.sleep(1.3)
        assert isinstance(await b.acquire("leased", "third"), Lease)
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.asyncio
async def test_redis_away_and_back(caplog: pytest.LogCaptureFixture) -> None:
    """Redis stops: the gateway decides alone on its own book, which saw the shared starts
    too; Redis returns: shared again, and both changes are logged."""
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    caplog.set_level(logging.WARNING, logger="gpufleet.gateway")
    with redis_server() as url:
        quotas = RedisQuotas(url, time.monotonic, retry=0.2)
        quotas.set_limits("flaky", QuotaLimits(rpm=3))
        for n in range(2):
            assert isinstance(await quotas.acquire("flaky", f"shared-{n}"), Lease)
        assert quotas.shared
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    try:
        assert isinstance(await quotas.acquire("flaky", "local-0"), Lease)  # 3rd of 3
        assert not quotas.shared
        denied = await quotas.acquire("flaky", "local-1")  # the local book counted all 3
        assert isinstance(denied, Denial)
        assert denied.limit == "rpm"
        with redis_server(port):  # back (empty: a restarted Redis forgot the window)
            await asyncio.sleep(0.3)
            assert isinstance(await quotas.acquire("flaky", "shared-again"), Lease)
            assert quotas.shared
    finally:
        await quotas.aclose()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in m for m in messages) == 1
    assert sum("quotas are shared again" in m for m in messages) == 1
