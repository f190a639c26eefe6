"""L2: the disconnect watch tells a client that left from a response that is complete.

An ASGI server's ``receive()`` says ``http.disconnect`` both when the client leaves and,
once the app has sent its last body message, at once. A stream's last message goes out
before the gateway is done with the request (closing the replica's response may wait a
moment: it did with vLLM), and the watch must not take that ``http.disconnect`` for a client
gone: the answer was whole (200), the controller ends it ``Finished``, not ``ClientGone``.

The app is driven in-process, as a server calls it (``receive``/``send``), and the replica
is a stand-in client (no GPU and no engine needed for the timing this is about); the
``receive`` behaves as the ASGI spec says and as the gateway's own server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpufleet.fleet import ReplicaId
from gpufleet.gateway import create_gateway
from gpufleet.gateway._replicas import StaticReplicas, Upstream
from gpufleet.gateway._upstream import UpstreamRequest, UpstreamResponse
from tests.gateway.conftest import MODEL, fleet

EVENT = b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"x"}]}\n\n'


class SlowToClose:
    """A replica whose stream takes 80 ms (the watch starts at 50) and whose response
    takes a moment to close after its last byte."""

    @contextlib.asynccontextmanager
    async def send(self, request: UpstreamRequest) -> AsyncIterator[UpstreamResponse]:
        yield UpstreamResponse(200, [(b"content-type", b"text/event-stream")], self._chunks())
        await asyncio.sleep(0.01)  # closing the connection

    async def _chunks(self) -> AsyncIterator[bytes]:
        yield EVENT
        await asyncio.sleep(0.08)
        yield b"data: [DONE]\n\n"

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        return 200, b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"


async def call(app: Any, body: bytes) -> list[dict[str, Any]]:
    """One request, as a server makes it: ``receive`` gives the body, then waits, and
    says ``http.disconnect`` once the response is complete (the client is still there)."""
    sent: list[dict[str, Any]] = []
    complete = asyncio.Event()
    first = True

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await complete.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            complete.set()

    path = "/v1/completions"
    scope = {
        "type": "http", "http_version": "1.1", "method": "POST", "path": path,
        "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "extensions": {},
    }  # fmt: skip
    await app(scope, receive, send)
    return sent


@pytest.mark.asyncio
async def test_a_stream_whose_response_completes_is_not_a_client_gone() -> None:
    config = fleet(replicas=1, health={"active": {"enabled": False}})
    replicas = StaticReplicas([Upstream(ReplicaId(f"{MODEL}-0"), MODEL, "http://replica")])
    registry = CollectorRegistry()
    app = create_gateway(config, replicas, registry, client=SlowToClose())
    started = asyncio.Event()
    life_queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def life_send(message: dict[str, Any]) -> None:
        if message["type"] == "lifespan.startup.complete":
            started.set()

    life = asyncio.create_task(app({"type": "lifespan"}, life_queue.get, life_send))
    await life_queue.put({"type": "lifespan.startup"})
    await started.wait()
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
        answers = await asyncio.gather(*(call(app, json.dumps(body).encode()) for _ in range(8)))
    finally:
        await life_queue.put({"type": "lifespan.shutdown"})
        await life
    for sent in answers:
        assert sent[0]["status"] == 200
        assert b"[DONE]" in b"".join(m.get("body", b"") for m in sent[1:])

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    assert value("gpufleet:gateway_requests_total", model=MODEL, status="200") == 8
    assert value("gpufleet:gateway_requests_total", model=MODEL, status="499") == 0
    replica = f"{MODEL}-0"
    assert (
        value("gpufleet:gateway_upstream_attempts_total", replica=replica, outcome="success") == 8
    )
