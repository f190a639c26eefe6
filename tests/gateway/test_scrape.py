"""Scraped engine load reaches the kv-aware router: a busy replica gets no new requests."""

from __future__ import annotations

import time
import types
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from prometheus_client import CollectorRegistry

import gpufleet.gateway as package
from gpufleet.fleet import ReplicaId
from gpufleet.gateway import (
    StaticReplicas,
    Upstream,
    UpstreamRequest,
    UpstreamResponse,
    create_gateway,
    parse_engine_metrics,
)
from tests.gateway.conftest import MODEL, fleet, serve_app, sim_replica

BUSY = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama-3.1-8b"} 12.0
vllm:num_requests_waiting{engine="0",model_name="llama-3.1-8b"} 6.0
vllm:kv_cache_usage_perc{engine="0",model_name="llama-3.1-8b"} 0.93
vllm:prefix_cache_hits_total{engine="0",model_name="llama-3.1-8b"} 100.0
"""
IDLE = BUSY.replace("12.0", "0.0").replace("6.0", "0.0").replace("0.93", "0.01")


def test_all_matches_public_names() -> None:
    public = {
        attr
        for attr, value in vars(package).items()
        if not attr.startswith("_")
        and not isinstance(value, types.ModuleType)
        and attr != "annotations"
    }
    assert set(package.__all__) == public
    assert list(package.__all__) == sorted(package.__all__, key=lambda n: (not n.isupper(), n))


def test_parse_engine_metrics() -> None:
    assert parse_engine_metrics(BUSY) == (12, 6, 0.93)
    assert parse_engine_metrics("# nothing\nother_metric 1\n") is None


def test_parse_the_sim_engines_own_page() -> None:
    with sim_replica() as url:
        assert parse_engine_metrics(httpx.get(url + "/metrics").text) == (0, 0, 0.0)


class MetricsClient:
    """Replica ``busy`` reports a full batch and KV cache; ``idle`` reports nothing running."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    @asynccontextmanager
    async def send(self, request: UpstreamRequest) -> AsyncIterator[UpstreamResponse]:
        self.sent.append(request.url)

        async def body() -> AsyncIterator[bytes]:
            yield b'{"choices": []}'

        yield UpstreamResponse(200, [(b"content-type", b"application/json")], body())

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        if url.endswith("/metrics"):
            return 200, (BUSY if "busy" in url else IDLE).encode()
        return 200, b""


@pytest.mark.parametrize("policy", ["kv_aware", "prefix_aware"])
def test_scraped_load_steers_requests_away_from_a_busy_replica(policy: str) -> None:
    client = MetricsClient()
    registry = CollectorRegistry()
    config = fleet(routing=policy, gateway={"scrape_interval": 0.05})
    replicas = StaticReplicas(
        [
            Upstream(ReplicaId(f"{MODEL}-0"), MODEL, "http://busy"),
            Upstream(ReplicaId(f"{MODEL}-1"), MODEL, "http://idle"),
        ]
    )
    app = create_gateway(config, replicas, registry, client=client)
    with serve_app(app, "own") as url:
        deadline = time.monotonic() + 5
        kv = {"replica": f"{MODEL}-0"}
        while registry.get_sample_value("gpufleet:gateway_replica_kv_cache_usage", kv) != 0.93:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for i in range(6):
            response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": f"p{i}"})
            assert response.status_code == 200
    assert client.sent == ["http://idle"] * 6
