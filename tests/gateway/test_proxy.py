"""The gateway over two real sim replicas, driven by the official openai client."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.gateway.conftest import (
    MODEL,
    Running,
    eventually,
    fleet,
    serve_gateway,
    sim_replica,
)

REPLICAS = {f"{MODEL}-0", f"{MODEL}-1"}
"""The replicas' names (``serve_gateway`` names them after the model)."""


@pytest.fixture(scope="module", params=["own", "uvicorn"])
def gateway(request: pytest.FixtureRequest) -> Iterator[Running]:
    """The gateway under its own server (as ``gpufleet up`` serves it) and under uvicorn:
    it stays a plain ASGI app."""
    config = fleet(
        routing="prefix_aware",
        health={"active": {"interval": 0.2}},
        gateway={"scrape_interval": 0.1},
    )
    with (
        sim_replica(seed=1) as a,
        sim_replica(seed=2) as b,
        serve_gateway(config, [a, b], server=request.param) as gw,
    ):
        yield gw


@pytest.fixture
def client(gateway: Running) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.v1, api_key="none", max_retries=0) as client:
        yield client


def test_models_lists_the_fleet(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_completion(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=5,
        extra_headers={"x-request-id": "req-42"},
    )
    assert raw.headers["x-request-id"] == "req-42"
    assert raw.headers["x-gpufleet-replica"] in REPLICAS  # which one answered
    reply = raw.parse()
    assert reply.id.endswith("req-42")  # the replica saw the same id
    assert reply.choices[0].message.content
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 5


def test_chat_completion_streams(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count"}],
        max_tokens=8,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert raw.headers["x-gpufleet-replica"] in REPLICAS  # named before the first chunk
    stream = raw.parse()
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert len(text.split()) == 8


def test_completion_and_its_stream(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4)
    assert reply.choices[0].text
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=4, stream=True,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) == 4


def test_every_response_has_a_request_id(gateway: Running) -> None:
    for path in ("/health", "/ready", "/v1/models", "/metrics", "/nope"):
        assert httpx.get(gateway.url + path).headers["x-request-id"]


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 404
    assert "gpt-4" in caught.value.message


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/chat/completions", b"{not json", "not valid JSON"),
        ("/v1/chat/completions", b"[1, 2]", "JSON object"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        ("/v1/chat/completions", b'{"model": "llama-3.1-8b"}', "messages"),
        ("/v1/completions", b'{"model": "llama-3.1-8b"}', "prompt"),
    ],
)
def test_bad_input_is_400(gateway: Running, path: str, body: bytes, message: str) -> None:
    response = httpx.post(gateway.url + path, content=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == 400
    assert message in error["message"]


def test_replica_4xx_is_passed_through(gateway: Running) -> None:
    response = httpx.post(gateway.v1 + "/completions", json={"model": MODEL, "prompt": "x", "n": 0})
    assert response.status_code == 400
    assert "error" in response.json()


def test_wrong_method_and_route(gateway: Running) -> None:
    assert httpx.get(gateway.v1 + "/chat/completions").status_code == 405
    assert httpx.post(gateway.url + "/nowhere").status_code == 404


def test_health_ready_and_metrics(gateway: Running, client: openai.OpenAI) -> None:
    assert httpx.get(gateway.url + "/health").status_code == 200
    ready = httpx.get(gateway.url + "/ready")
    assert ready.status_code == 200
    assert ready.json() == {"ready": True, "routable": {MODEL: 2}}
    client.completions.create(model=MODEL, prompt="metrics please", max_tokens=2)
    text = httpx.get(gateway.url + "/metrics").text
    for name in (
        "gpufleet:gateway_requests_total",
        "gpufleet:gateway_time_to_first_token_seconds_bucket",
        "gpufleet:gateway_e2e_request_latency_seconds_bucket",
        "gpufleet:gateway_routing_decisions_total",
        "gpufleet:gateway_prefix_match_blocks_bucket",
        "gpufleet:gateway_replica_state",
        "gpufleet:gateway_in_flight_requests",
    ):
        assert name in text
    eventually(
        lambda: min(
            gateway.sample("gpufleet:gateway_requests_total", model=MODEL, status="200"), 1
        ),
        1,
    )


def test_prefix_aware_keeps_a_conversation_on_one_replica(
    gateway: Running, client: openai.OpenAI
) -> None:
    system = "You are a helpful assistant. " * 100  # several 512-character blocks
    before = {
        r: gateway.sample("gpufleet:gateway_upstream_attempts_total", replica=r, outcome="success")
        for r in (f"{MODEL}-0", f"{MODEL}-1")
    }
    for turn in range(4):
        client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": f"question {turn}"},
            ],
            max_tokens=2,
        )

    def successes() -> float:
        return sum(
            gateway.sample("gpufleet:gateway_upstream_attempts_total", replica=r, outcome="success")
            for r in before
        )

    eventually(successes, sum(before.values()) + 4)
    after = {
        r: gateway.sample("gpufleet:gateway_upstream_attempts_total", replica=r, outcome="success")
        - before[r]
        for r in before
    }
    assert sorted(after.values()) == [0, 4]
