"""Failures before the first byte are retried on another replica; none reaches the client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from gpufleet.engine.server import FaultConfig
from gpufleet.fleet import ReplicaId
from gpufleet.gateway import (
    StaticReplicas,
    Upstream,
    UpstreamRequest,
    UpstreamResponse,
    create_gateway,
)
from tests.gateway.conftest import (
    MODEL,
    Running,
    closed_port_url,
    fleet,
    serve_app,
    serve_gateway,
    sim_replica,
)

BAD, CLOSED, GOOD = f"{MODEL}-0", f"{MODEL}-1", f"{MODEL}-2"


@pytest.fixture(scope="module")
def gateway() -> Iterator[Running]:
    """Three replicas: one answers 500 to every completion, one refuses connections."""
    config = fleet(
        routing="round_robin",
        health={
            # no active checks: the refused replica is routable until outlier detection acts
            "active": {"enabled": False},
            "outlier": {"consecutive_5xx": 3, "consecutive_local_origin_failure": 3},
        },
        gateway={"retry": {"max_retries": 2}},
    )
    with (
        sim_replica(FaultConfig(error_rate=1.0)) as bad,
        sim_replica(seed=3) as good,
        serve_gateway(config, [bad, closed_port_url(), good]) as gw,
    ):
        yield gw


def test_requests_succeed_despite_a_500_replica_and_a_dead_one(gateway: Running) -> None:
    with openai.OpenAI(base_url=gateway.v1, api_key="none", max_retries=0) as client:
        for i in range(9):
            if i % 2:
                reply = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=3
                )
                assert reply.choices[0].message.content
            else:
                stream = client.completions.create(
                    model=MODEL, prompt=f"hi {i}", max_tokens=3, stream=True
                )
                assert "".join(c.choices[0].text for c in stream if c.choices)
    sample = gateway.sample
    deadline = time.monotonic() + 2  # counted once the last byte was sent: may trail the client
    while sample("gpufleet:gateway_requests_total", model=MODEL, status="200") < 9:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sample("gpufleet:gateway_requests_total", model=MODEL, status="200") == 9
    assert sample("gpufleet:gateway_upstream_attempts_total", replica=GOOD, outcome="success") == 9
    assert sample("gpufleet:gateway_retries_total", model=MODEL, outcome="replica_error") >= 1
    assert sample("gpufleet:gateway_retries_total", model=MODEL, outcome="connect_failure") >= 1
    # three failures in a row eject the first bad replica; the 50 % limit keeps the other in
    assert (
        sample(
            "gpufleet:gateway_ejections_total",
            model=MODEL,
            cause="consecutive_5xx",
            enforced="true",
        )
        + sample(
            "gpufleet:gateway_ejections_total",
            model=MODEL,
            cause="consecutive_local_origin_failure",
            enforced="true",
        )
        == 1
    )


def test_no_replica_is_503_with_retry_after() -> None:
    with serve_gateway(fleet(), [], wait_ready=False) as gw:
        response = httpx.post(
            gw.v1 + "/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
        )
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(gw.url + "/ready").status_code == 503


class _SlowProbes:
    """A scripted upstream: completions answer at once, ``/health`` only after ``delay`` s
    (the gateway's own first health decision comes late)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    @asynccontextmanager
    async def send(self, request: UpstreamRequest) -> AsyncIterator[UpstreamResponse]:
        async def body() -> AsyncIterator[bytes]:
            yield b'{"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}'

        yield UpstreamResponse(200, [(b"content-type", b"application/json")], body())

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        if url.endswith("/health"):
            await asyncio.sleep(self.delay)
        return 200, b""


def test_replicas_the_runtime_reports_ready_serve_before_the_first_probe_answers() -> None:
    """Issue 14: no 503 at start. The runtime reports its replicas READY (it checked them);
    the gateway's own first probes take 2 s: requests sent at once are served, and
    ``/ready`` says so."""
    config = fleet(health={"active": {"timeout": 5.0}})
    replicas = StaticReplicas(
        [Upstream(ReplicaId(f"{MODEL}-{i}"), MODEL, f"http://replica-{i}") for i in range(2)]
    )
    app = create_gateway(config, replicas, CollectorRegistry(), client=_SlowProbes(2.0))
    with serve_app(app, "own") as url:
        started = time.monotonic()
        statuses = [
            httpx.post(
                url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
            ).status_code
            for _ in range(5)
        ]
        ready = httpx.get(url + "/ready")
        assert time.monotonic() - started < 1.5  # all before a probe answered
    assert statuses == [200] * 5
    assert ready.status_code == 200
    assert ready.json()["routable"] == {MODEL: 2}


def test_all_replicas_down_is_503_and_fast() -> None:
    config = fleet(health={"active": {"enabled": False}})
    with serve_gateway(config, [closed_port_url(), closed_port_url()]) as gw:
        started = time.monotonic()
        response = httpx.post(
            gw.v1 + "/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
        )
        assert response.status_code == 503
        assert "retry-after" in response.headers
        assert time.monotonic() - started < 2


def test_a_hung_replica_times_out_and_the_request_moves_on() -> None:
    config = fleet(
        routing="round_robin",
        health={"active": {"enabled": False}},
        gateway={"timeouts": {"first_byte": 0.3}},
    )
    with (
        sim_replica(FaultConfig(hang=True)) as hung,
        sim_replica() as good,
        serve_gateway(config, [hung, good]) as gw,
        openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0) as client,
    ):
        for _ in range(3):
            started = time.monotonic()
            client.completions.create(model=MODEL, prompt="hello", max_tokens=2)
            assert time.monotonic() - started < 1.5
        assert gw.sample("gpufleet:gateway_retries_total", model=MODEL, outcome="timeout") >= 1
