"""Served names live: real loopback sim engines behind the gateway, 16 concurrent clients
with the official ``openai`` client (no client retries).

Each pool's engines serve the pool's name (as ``gpufleet up`` starts them), so an answer's
``model`` says which pool served it. The controller chooses the variant and the fallbacks
(docs/fleet-file.md, "Served names, variants and fallbacks"); the gateway only carries them
out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from gpufleet.config import FleetConfig, parse_fleet
from gpufleet.engine.server import FaultConfig, SimEngineConfig, create_app
from gpufleet.fleet import ReplicaId
from gpufleet.gateway import StaticReplicas, Upstream, create_gateway
from gpufleet.policy import choose_variant
from tests.gateway.conftest import FAST, MODEL, Running, serve_app

CLIENTS = 16


def pools_fleet(
    pools: dict[str, dict[str, Any]], served: list[dict[str, Any]] | None = None
) -> FleetConfig:
    models = [
        {"name": name, "model": MODEL, "replicas": 2, "routing": "least_request", **extra}
        for name, extra in pools.items()
    ]
    return parse_fleet({"models": models, "served": served or []}, source="test")


@contextmanager
def fleet_of(
    config: FleetConfig,
    faults: dict[str, FaultConfig] | None = None,
    *,
    time_scale: float = FAST,
) -> Iterator[Running]:
    """Two sim engines per pool (serving the pool's name, its ``max_model_len``), and the
    gateway over them (``time_scale``: modelled seconds per real second)."""
    with ExitStack() as stack:
        upstreams = []
        for model in config.models:
            for i in range(model.replica_count):
                engine = SimEngineConfig(
                    time_scale=time_scale,
                    served_model_name=model.name,
                    max_model_len=model.max_model_len or 4096,
                    seed=i,
                    faults=(faults or {}).get(model.name, FaultConfig()),
                )
                url = stack.enter_context(serve_app(create_app(engine)))
                upstreams.append(Upstream(ReplicaId(f"{model.name}-{i}"), model.name, url))
        registry = CollectorRegistry()
        app = create_gateway(config, StaticReplicas(upstreams), registry)
        url = stack.enter_context(serve_app(app, "own"))
        deadline = time.monotonic() + 10
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "gateway not ready"
            time.sleep(0.02)
        yield Running(url, app, registry)


async def run_clients(
    running: Running, jobs: list[dict[str, Any]]
) -> list[tuple[dict[str, Any], str | BaseException]]:
    """Every job (``chat.completions.create`` keyword arguments) sent by one of 16
    concurrent clients; each job's answer's ``model``, or the error it raised."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    results: list[tuple[dict[str, Any], str | BaseException]] = []

    async def client() -> None:
        async with openai.AsyncOpenAI(
            base_url=running.v1, api_key="none", max_retries=0, timeout=30
        ) as api:
            while not queue.empty():
                job = queue.get_nowait()
                try:
                    answer = await api.chat.completions.create(max_tokens=8, **job)
                    results.append((job, answer.model))
                except openai.OpenAIError as error:
                    results.append((job, error))

    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return results


def ask(model: str, text: str = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def test_a_pool_whose_replicas_all_answer_503_is_served_by_its_fallback() -> None:
    config = pools_fleet({"flaky": {"fallbacks": ["steady"]}, "steady": {}})
    flaky = FaultConfig(error_rate=1.0, error_status=503)
    with fleet_of(config, {"flaky": flaky}) as running:
        models = httpx.get(running.v1 + "/models").json()["data"]
        assert [m["id"] for m in models] == ["flaky", "steady"]
        jobs = [ask("flaky", f"request {i}") for i in range(160)]
        results = asyncio.run(run_clients(running, jobs))
        errors = [r for _, r in results if isinstance(r, BaseException)]
        assert errors == []  # 0 client errors
        assert {r for _, r in results} == {"steady"}
        fallbacks = sum(
            running.sample(
                "gpufleet:gateway_fallbacks_total", model="flaky", to="steady", reason=reason
            )
            for reason in ("exhausted", "no_replica")
        )
        assert fallbacks == 160
        assert running.sample("gpufleet:gateway_requests_total", model="flaky", status="200") == 160


def test_a_prompt_past_the_first_models_context_is_served_by_a_longer_one() -> None:
    config = pools_fleet(
        {
            "short": {"max_model_len": 1024, "fallbacks": ["long"]},
            "long": {"max_model_len": 8192},
        }
    )
    long_text = " ".join(f"word{i % 50}" for i in range(1500))  # ~1,500 tokens, ~11 k chars
    with fleet_of(config) as running:
        # without the fallback the short model's engine refuses it
        direct = httpx.post(
            running.app.control.upstreams[ReplicaId("short-0")].url + "/v1/chat/completions",
            json=ask("short", long_text, max_tokens=8),
        )
        assert direct.status_code == 400
        jobs = [ask("short", long_text if i % 2 else f"short prompt {i}") for i in range(64)]
        results = asyncio.run(run_clients(running, jobs))
        errors = [r for _, r in results if isinstance(r, BaseException)]
        assert errors == []
        for job, model in results:
            long = job["messages"][0]["content"] == long_text
            assert model == ("long" if long else "short"), job["messages"][0]["content"][:20]
        assert (
            running.sample(
                "gpufleet:gateway_fallbacks_total", model="short", to="long", reason="context"
            )
            == 32
        )


def test_a_weighted_split_is_honoured_and_sticky_per_user() -> None:
    config = pools_fleet({"v1": {}, "v2": {}}, [{"name": "chat", "variants": {"v1": 80, "v2": 20}}])
    users = [f"user-{i}" for i in range(400)]
    with fleet_of(config) as running:
        models = httpx.get(running.v1 + "/models").json()["data"]
        assert [m["id"] for m in models] == ["chat"]  # the variants are not served names
        jobs = [
            ask("chat", f"turn {turn} of {user}", user=user) for turn in range(2) for user in users
        ]
        # a session header names a session too (it wins over `user`)
        jobs += [
            ask("chat", "hi", user="ignored", extra_headers={"x-session-id": user})
            for user in users[:100]
        ]
        results = asyncio.run(run_clients(running, jobs))
        assert [r for _, r in results if isinstance(r, BaseException)] == []
        by_user: dict[str, set[str]] = {}
        for job, model in results:
            headers = job.get("extra_headers") or {}
            key = headers.get("x-session-id", job["user"])
            by_user.setdefault(key, set()).add(str(model))
        assert all(len(models) == 1 for models in by_user.values()), "a user flipped variants"
        variants = [("v1", 80.0), ("v2", 20.0)]
        for user, (model,) in by_user.items():
            assert model == choose_variant(user, variants)  # the controller's pure choice
        on_v2 = sum(1 for (model,) in by_user.values() if model == "v2") / len(by_user)
        assert on_v2 == pytest.approx(0.2, abs=0.06)  # 400 users: 3 σ
        with httpx.Client() as http:
            unknown = http.post(running.v1 + "/chat/completions", json=ask("v1"))
        assert unknown.status_code == 404  # a variant is not a served name
