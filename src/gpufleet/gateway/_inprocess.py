"""A request to the gateway's own ASGI app without a socket: how the batch runner sends a
line through exactly the path an HTTP request takes (auth context, quotas, admission,
routing, retries, the ledger and the metrics).

::

    answer = await call_app(app, "POST", "/v1/chat/completions", body,
                            headers=[(b"x-request-id", b"batch_req_…")],
                            scope={PRINCIPAL: principal, BATCH_LINE: line})
    answer.status, answer.json()

The seam is the ASGI callable itself (as httpx's ``ASGITransport`` uses it): a scope, a
``receive`` that hands over the body once and then waits (the client never leaves; the
caller cancels the task to stop), and a ``send`` that collects the answer. Nothing in the
gateway knows the caller is not a socket, except what the caller puts in the scope.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Answer:
    """What the app answered: its status, headers and whole body."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    def header(self, name: bytes) -> str | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value.decode("latin-1")
        return None

    def json(self) -> Any:
        return json.loads(self.body)


class NoAnswerError(Exception):
    """The app returned without starting a response (a bug)."""


async def call_app(
    app: App,
    method: str,
    path: str,
    body: bytes,
    *,
    headers: Sequence[tuple[bytes, bytes]] = (),
    scope: Mapping[str, Any] | None = None,
) -> Answer:
    """Call ``app`` with one request and collect its answer (a stream's frames joined)."""
    full: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode("ascii"),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": None,
        "server": None,
        "state": {},
        "extensions": {},
        **(scope or {}),
    }
    given = False
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    status: int | None = None
    answer_headers: tuple[tuple[bytes, bytes], ...] = ()
    parts: list[bytes] = []

    async def receive() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.shield(never)  # the caller is no client that can leave
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        nonlocal status, answer_headers
        if message["type"] == "http.response.start":
            status = int(message["status"])
            answer_headers = tuple(message.get("headers", ()))
        elif message["type"] == "http.response.body":
            parts.append(bytes(message.get("body", b"")))

    try:
        await app(full, receive, send)
    finally:
        never.cancel()
    if status is None:
        raise NoAnswerError(f"{method} {path}: the app returned without an answer")
    return Answer(status, answer_headers, b"".join(parts))
