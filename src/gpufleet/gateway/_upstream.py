"""The one upstream seam: ``ReplicaClient.send(request)`` → a streamed response.

The proxy (``_proxy``) enforces the timeouts and classifies failures the same way for every
client; a client only moves bytes and turns its transport's errors into
:class:`~gpufleet.gateway._errors.LocalOriginError`. The gateway's is
:class:`~gpufleet.gateway._http11.Http11ReplicaClient` (its own HTTP/1.1 over pooled
keep-alive connections); tests stand fakes in its place.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

_PASSED_HEADERS = frozenset({b"content-type", b"content-encoding"})


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    """One attempt: where to, what path, the client's body and the headers to forward."""

    url: str
    """The replica's base URL (``http://127.0.0.1:41235``)."""
    path: str
    body: bytes
    headers: Sequence[tuple[str, str]] = ()


class FrameSink(Protocol):
    """Where a relayed stream's ``chunked`` frames go: the client's side of the proxy
    (``GatewayServer`` offers one through the ``gpufleet.relay`` ASGI extension)."""

    def write_frames(self, frames: bytes) -> bool:
        """Whole chunk frames as they go on the wire; ``False`` when the client reads slower
        than this writes (stop reading the replica until ``on_drained``'s callback runs)."""
        ...

    def on_drained(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` when the client has caught up (``None``: no longer)."""
        ...


class Relay(Protocol):
    """Passes the rest of a ``chunked`` answer to a :class:`FrameSink` as the replica sends
    it — its frames unchanged, no task woken per chunk — and returns at the body's end (its
    last chunk is not passed: the sink's owner ends the response). ``LocalOriginError`` when
    the replica's connection breaks; ``TimeoutError`` after ``idle`` seconds without a byte."""

    async def __call__(self, sink: FrameSink, idle: float) -> None: ...


@dataclass(slots=True)
class UpstreamResponse:
    """The replica's answer: status, the headers to pass on, and the body as it arrives.

    ``relay``, when the client offers one (a ``chunked`` answer over HTTP/1.1), passes the
    rest of the body on without iterating ``chunks`` (what is left of it after any
    ``chunks`` already read)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    chunks: AsyncIterator[bytes]
    relay: Relay | None = None


class ReplicaClient(Protocol):
    """Sends one request to one replica; the response streams within the context."""

    def send(self, request: UpstreamRequest) -> AbstractAsyncContextManager[UpstreamResponse]: ...

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        """A small ``GET`` (health probes, metrics scrapes): status and whole body."""
        ...
