"""A lean HTTP/1.1 upstream client: per-replica pools of kept-alive asyncio streams.

The gateway's default :class:`~gpufleet.gateway.ReplicaClient`. It speaks only what the
replicas speak (``POST`` / ``GET``, ``content-length`` or ``chunked`` answers) and does per
request only what a request needs: take an idle connection (``O(1)``), write the request in
one call, read the head, and hand the body on as it arrives. httpx's pool checks every
pooled connection for readability on every request, which cost the gateway over a
millisecond of CPU per request at 32 connections (bench/gateway_cost.py).

A connection goes back to its pool only when its answer was read to the end. A kept-alive
connection that the replica closed while idle fails before its first byte; the request is
then sent once more on a new connection (the replica never saw it).

::

    async with Http11ReplicaClient(connect=1.0) as client:
        async with client.send(UpstreamRequest(url, "/v1/completions", body)) as response:
            async for chunk in response.chunks: ...
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Final, Self
from urllib.parse import urlsplit

from gpufleet.fleet import Outcome
from gpufleet.gateway._errors import LocalOriginError
from gpufleet.gateway._upstream import UpstreamRequest, UpstreamResponse

_PASSED_HEADERS: Final = frozenset({b"content-type", b"content-encoding"})
_LIMIT: Final = 1 << 20
_READ: Final = 1 << 16
_LOST: Final = (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError)

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _head(conn: Conn, raw: bytes) -> bytes:
    """Write ``raw`` and read the answer's head; the connection is closed if that fails
    or is cancelled (a timeout)."""
    reader, writer = conn
    try:
        writer.write(raw)
        return await reader.readuntil(b"\r\n\r\n")
    except BaseException:
        writer.close()
        raise


class _Answer:
    """One answer being read: its framing, and whether the connection may be reused."""

    __slots__ = ("chunked", "done", "keep", "length", "reader")

    def __init__(self, reader: asyncio.StreamReader, head: bytes) -> None:
        self.reader = reader
        self.length: int | None = None
        self.chunked = False
        self.keep = True
        self.done = False
        status = int(head[9:12])
        if status < 200 or status in (204, 304):
            self.length = 0
            return
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                self.length = int(value)
            elif name == b"transfer-encoding":
                self.chunked = b"chunked" in value.lower()
            elif name == b"connection":
                self.keep = b"close" not in value.lower()

    async def chunks(self) -> AsyncIterator[bytes]:
        reader = self.reader
        try:
            if self.chunked:
                while True:
                    line = await reader.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0], 16)
                    if size == 0:
                        while await reader.readuntil(b"\r\n") != b"\r\n":
                            pass  # trailers
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif self.length is not None:
                left = self.length
                while left > 0:
                    data = await reader.read(min(left, _READ))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(data)
                    yield data
            else:
                self.keep = False
                while data := await reader.read(_READ):
                    yield data
        except _LOST as error:
            self.keep = False
            raise LocalOriginError(f"connection lost: {error!r}") from None
        self.done = True


class Http11ReplicaClient:
    """Per ``host:port``, a LIFO of idle kept-alive connections (at most ``max_idle``)."""

    def __init__(self, *, connect: float, max_idle: int = 256) -> None:
        self._connect = connect
        self._max_idle = max_idle
        self._idle: dict[tuple[str, int], list[Conn]] = {}
        self._targets: dict[str, tuple[str, int, bytes]] = {}

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for conns in self._idle.values():
            for _, writer in conns:
                writer.close()
        self._idle.clear()

    def _target(self, url: str) -> tuple[str, int, bytes]:
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or parts.hostname is None:
                raise LocalOriginError(f"not an http:// URL: {url}")
            port = parts.port or 80
            target = (parts.hostname, port, parts.netloc.encode("latin-1"))
            self._targets[url] = target
        return target

    async def _open(self, host: str, port: int) -> Conn:
        try:
            async with asyncio.timeout(self._connect):
                return await asyncio.open_connection(host, port, limit=_LIMIT)
        except TimeoutError:
            raise LocalOriginError(f"connect timeout: {host}:{port}", Outcome.TIMEOUT) from None
        except OSError as error:
            raise LocalOriginError(f"cannot reach replica: {error!r}") from None

    async def _exchange(self, url: str, raw: bytes) -> tuple[Conn, bytes]:
        """Send ``raw`` (``Host`` added) and read the answer's head: (connection, head)."""
        host, port, netloc = self._target(url)
        raw = raw.replace(b"\r\n", b"\r\nhost: " + netloc + b"\r\n", 1)
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if conn[0].at_eof() or conn[1].is_closing():
                conn[1].close()
                continue
            try:
                return conn, await _head(conn, raw)
            except _LOST:
                pass  # closed while idle: the replica never saw it; send again
        conn = await self._open(host, port)
        try:
            return conn, await _head(conn, raw)
        except _LOST as error:
            raise LocalOriginError(f"connection lost: {error!r}") from None

    def _release(self, host_port: tuple[str, int], conn: Conn, answer: _Answer) -> None:
        idle = self._idle.setdefault(host_port, [])
        if answer.done and answer.keep and len(idle) < self._max_idle:
            idle.append(conn)
        else:
            conn[1].close()

    @asynccontextmanager
    async def send(self, request: UpstreamRequest) -> AsyncIterator[UpstreamResponse]:
        body = request.body
        head = [b"POST %s HTTP/1.1" % request.path.encode("latin-1")]
        head.extend(
            b"%s: %s" % (k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers
        )
        head.append(b"content-length: %d\r\n\r\n" % len(body))
        conn, raw_head = await self._exchange(request.url, b"\r\n".join(head) + body)
        answer = _Answer(conn[0], raw_head)
        try:
            status = int(raw_head[9:12])
            headers = []
            for line in raw_head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.lower() in _PASSED_HEADERS:
                    headers.append((name.lower(), value.strip()))
            yield UpstreamResponse(status, headers, answer.chunks())
        finally:
            host, port, _ = self._target(request.url)
            self._release((host, port), conn, answer)

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        parts = urlsplit(url)
        base = f"{parts.scheme}://{parts.netloc}"
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn, raw_head = await self._exchange(
            base, b"GET %s HTTP/1.1\r\n\r\n" % path.encode("latin-1")
        )
        answer = _Answer(conn[0], raw_head)
        try:
            body = b"".join([c async for c in answer.chunks()])
        finally:
            host, port, _ = self._target(base)
            self._release((host, port), conn, answer)
        return int(raw_head[9:12]), body
