"""The one upstream seam: ``ReplicaClient.send(request)`` → a streamed response.

The proxy (``_proxy``) enforces the timeouts and classifies failures the same way for every
client; a client only moves bytes and turns its transport's errors into
:class:`~gpufleet.gateway._errors.LocalOriginError`. Two implementations: HTTP over a pooled
keep-alive ``httpx.AsyncClient`` (:class:`HttpReplicaClient`), and the tests' ASGI transport
through the same class.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, Self

import httpx

from gpufleet.fleet import Outcome
from gpufleet.gateway._errors import LocalOriginError

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


class HttpReplicaClient:
    """The HTTP implementation: one pooled, keep-alive ``httpx.AsyncClient`` for all replicas.

    ``connect`` bounds opening a connection (and waiting for a pooled one); reads have no
    httpx timeout, since the proxy bounds the first byte and the idle stream itself.
    """

    def __init__(
        self,
        *,
        connect: float,
        max_connections: int = 1000,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=connect, read=None, write=connect, pool=connect),
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=30.0,
            ),
            transport=transport,
            follow_redirects=False,
        )

    async def __aenter__(self) -> Self:
        await self._client.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._client.__aexit__(exc_type, exc, tb)

    @asynccontextmanager
    async def send(self, request: UpstreamRequest) -> AsyncIterator[UpstreamResponse]:
        built = self._client.build_request(
            "POST", request.url + request.path, content=request.body, headers=request.headers
        )
        try:
            response = await self._client.send(built, stream=True)
        except httpx.TimeoutException as error:
            raise LocalOriginError(f"connect timeout: {error!r}", Outcome.TIMEOUT) from None
        except httpx.TransportError as error:
            raise LocalOriginError(f"cannot reach replica: {error!r}") from None
        try:
            headers = [(k, v) for k, v in response.headers.raw if k.lower() in _PASSED_HEADERS]
            yield UpstreamResponse(response.status_code, headers, _chunks(response))
        finally:
            await response.aclose()

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        try:
            response = await self._client.get(url, timeout=timeout)
        except httpx.TimeoutException as error:
            raise LocalOriginError(f"timeout: {error!r}", Outcome.TIMEOUT) from None
        except httpx.TransportError as error:
            raise LocalOriginError(f"cannot reach replica: {error!r}") from None
        return response.status_code, response.content


async def _chunks(response: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.TransportError as error:
        raise LocalOriginError(f"connection lost: {error!r}") from None
