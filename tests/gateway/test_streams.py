"""Streams that break or stall after their first byte, and clients that leave: a scripted
upstream (STYLE 12's fake ``ReplicaClient``) behind the real gateway under uvicorn."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from gpufleet.fleet import Outcome, ReplicaId
from gpufleet.gateway import (
    LocalOriginError,
    StaticReplicas,
    Upstream,
    UpstreamRequest,
    UpstreamResponse,
    create_gateway,
)
from tests.gateway.conftest import MODEL, eventually, fleet, serve_app

CHUNK = (
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"llama-3.1-8b",'
    b'"choices":[{"index":0,"text":" word","logprobs":null,"finish_reason":null}]}\n\n'
)


class ScriptedClient:
    """Answers by the replica's URL: ``ok``, ``broken`` (2 chunks then a reset), ``stalled``
    (1 chunk, then nothing), and records every attempt that ended and how."""

    def __init__(self) -> None:
        self.ended: list[tuple[str, str]] = []

    @asynccontextmanager
    async def send(self, request: UpstreamRequest) -> AsyncIterator[UpstreamResponse]:
        kind = request.url.removeprefix("http://")
        how = "closed"
        try:
            yield UpstreamResponse(
                200, [(b"content-type", b"text/event-stream")], self._chunks(kind)
            )
        except asyncio.CancelledError:
            how = "cancelled"
            raise
        finally:
            self.ended.append((kind, how))

    async def _chunks(self, kind: str) -> AsyncIterator[bytes]:
        yield CHUNK
        if kind == "broken":
            yield CHUNK
            raise LocalOriginError("connection reset", Outcome.CONNECT_FAILURE)
        if kind == "stalled":
            await asyncio.sleep(3600)
        yield b"data: [DONE]\n\n"

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        return 200, b""


@contextmanager
def gateway_over(kind: str) -> Iterator[tuple[str, ScriptedClient, CollectorRegistry]]:
    client = ScriptedClient()
    registry = CollectorRegistry()
    config = fleet(
        routing="least_request",
        health={"active": {"enabled": False}},
        gateway={"timeouts": {"idle_stream": 0.3}},
    )
    replicas = StaticReplicas([Upstream(ReplicaId(f"{MODEL}-0"), MODEL, f"http://{kind}")])
    app = create_gateway(config, replicas, registry, client=client)
    with serve_app(app, "own") as url:
        deadline = time.monotonic() + 5
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        yield url, client, registry


BODY = {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True}


def test_a_stream_broken_mid_way_ends_with_an_error_event_and_done() -> None:
    with gateway_over("broken") as (url, _client, _):
        response = httpx.post(url + "/v1/completions", json=BODY)
        assert response.status_code == 200
        events = [e for e in response.text.split("\n\n") if e]
        assert events[:2] == [CHUNK.decode().strip()] * 2
        assert '"error"' in events[2]
        assert "connection reset" in events[2]
        assert events[3] == "data: [DONE]"
        with (
            openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as oai,
            pytest.raises(openai.APIError, match="stream broke"),
        ):
            for _ in oai.completions.create(model=MODEL, prompt="x", max_tokens=5, stream=True):
                pass


def test_a_stalled_stream_ends_after_the_idle_timeout() -> None:
    with gateway_over("stalled") as (url, _, registry):
        started = time.monotonic()
        response = httpx.post(url + "/v1/completions", json=BODY, timeout=5)
        assert time.monotonic() - started < 2
        assert "idle timeout" in response.text
        assert response.text.endswith("data: [DONE]\n\n")
        timeouts = {"replica": f"{MODEL}-0", "outcome": "timeout"}
        eventually(
            lambda: registry.get_sample_value("gpufleet:gateway_upstream_attempts_total", timeouts),
            1,
        )


def test_a_client_that_leaves_cancels_the_upstream_request() -> None:
    with gateway_over("stalled") as (url, client, registry):
        with httpx.stream("POST", url + "/v1/completions", json=BODY, timeout=5) as response:
            next(response.iter_raw())  # the first chunk arrived; now hang up
        deadline = time.monotonic() + 2
        while not client.ended:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert client.ended == [("stalled", "cancelled")]
        sample = registry.get_sample_value
        left = {"model": MODEL, "status": "499"}
        eventually(lambda: sample("gpufleet:gateway_requests_total", left), 1)
        assert sample("gpufleet:gateway_in_flight_requests", {"replica": f"{MODEL}-0"}) == 0
        cancelled = {"replica": f"{MODEL}-0", "outcome": "cancelled"}
        assert sample("gpufleet:gateway_upstream_attempts_total", cancelled) == 1


class BreaksFirst:
    """Two replicas; the first attempt (on whichever the router picks) breaks after its first
    chunks, every later one answers in full. Records each attempt's path and body."""

    def __init__(self, chunks: list[bytes], end: bytes) -> None:
        self.chunks = chunks
        self.end = end
        self.sent: list[tuple[str, str, bytes]] = []

    @asynccontextmanager
    async def send(self, request: UpstreamRequest) -> AsyncIterator[UpstreamResponse]:
        first = not self.sent
        self.sent.append((request.url, request.path, request.body))
        yield UpstreamResponse(
            200, [(b"content-type", b"text/event-stream")], self._chunks(broken=first)
        )

    async def _chunks(self, *, broken: bool) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if broken:
            raise LocalOriginError("connection reset", Outcome.CONNECT_FAILURE)
        yield self.end

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        return 200, b""


@contextmanager
def two_replicas(client: BreaksFirst) -> Iterator[tuple[str, CollectorRegistry]]:
    registry = CollectorRegistry()
    config = fleet(routing="least_request", health={"active": {"enabled": False}})
    replicas = StaticReplicas(
        [Upstream(ReplicaId(f"{MODEL}-{i}"), MODEL, f"http://replica-{i}") for i in (0, 1)]
    )
    app = create_gateway(config, replicas, registry, client=client)
    with serve_app(app, "own") as url:
        deadline = time.monotonic() + 5
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        yield url, registry


@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_of_n_choices_is_not_resumed(n: int) -> None:
    """Issue 19: a stream of one choice that breaks is resumed on the other replica (a second
    attempt, spliced in); one of ``n > 1`` choices cannot be (``_resume.resumable``): one
    attempt, no token ids asked for, and the client gets the error event."""
    client = BreaksFirst([CHUNK, CHUNK], b"data: [DONE]\n\n")
    with two_replicas(client) as (url, registry):
        response = httpx.post(url + "/v1/completions", json={**BODY, "n": n})
        resumes = {
            outcome: registry.get_sample_value(
                "gpufleet:gateway_stream_resumes_total", {"model": MODEL, "outcome": outcome}
            )
            for outcome in ("resumed", "broken")
        }
    assert response.status_code == 200
    if n == 1:
        assert len(client.sent) == 2
        assert client.sent[0][0] != client.sent[1][0]  # on the other replica
        assert b"return_token_ids" in client.sent[0][2]
        assert response.text.endswith("data: [DONE]\n\n")
        assert '"error"' not in response.text
        assert resumes["resumed"] == 1
    else:
        assert len(client.sent) == 1
        assert b"return_token_ids" not in client.sent[0][2]
        assert "connection reset" in response.text
        assert response.text.endswith("data: [DONE]\n\n")
        assert resumes == {"resumed": None, "broken": None}


def _response_event(type_: str, **fields: object) -> bytes:
    data = json.dumps({"type": type_, "sequence_number": 0, **fields})
    return f"event: {type_}\ndata: {data}\n\n".encode()


def test_a_broken_responses_stream_ends_with_its_error_event() -> None:
    """A Responses API stream is never resumed: broken after its first byte, it ends with that
    API's ``error`` event (no ``[DONE]``), on which the openai client raises."""
    created = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    chunks = [
        _response_event("response.created", response=created),
        _response_event("response.output_text.delta", item_id="msg_1", output_index=0,
                        content_index=0, delta=" word", logprobs=[]),
    ]  # fmt: skip
    client = BreaksFirst(chunks, _response_event("response.completed", response=created))
    body = {"model": MODEL, "input": "x", "stream": True}
    with two_replicas(client) as (url, _):
        response = httpx.post(url + "/v1/responses", json=body)
        assert len(client.sent) == 1
        assert client.sent[0][1] == "/v1/responses"
        events = [e for e in response.text.split("\n\n") if e]
        assert events[:2] == [c.decode().strip() for c in chunks]
        kind, data = events[2].split("\n")
        assert kind == "event: error"
        error = json.loads(data.removeprefix("data: "))
        assert error["type"] == "error"
        assert "connection reset" in error["message"]
        assert len(events) == 3  # no [DONE]
        client.sent.clear()  # the next attempt breaks again
        with (
            openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as oai,
            pytest.raises(openai.APIError, match="stream broke"),
        ):
            for _ in oai.responses.create(model=MODEL, input="x", stream=True):
                pass
