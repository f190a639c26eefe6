"""Failures before the first byte are retried on another replica; none reaches the client."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from gpufleet.engine.server import FaultConfig
from tests.gateway.conftest import (
    MODEL,
    Running,
    closed_port_url,
    fleet,
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
