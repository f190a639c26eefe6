"""A lean HTTP/1.1 upstream client: per-replica pools of kept-alive asyncio connections.

The gateway's default :class:`~gpufleet.gateway.ReplicaClient`. It speaks only what the
replicas speak (``POST`` / ``GET``, answers framed by ``content-length``, ``chunked`` or the
connection's close) and does per request only what a request needs: take an idle connection
(``O(1)``), write the request in one call, parse the head once, and hand the body on as it
arrives — one piece per read from the socket, however many chunks that read held.

Each connection is an :class:`asyncio.Protocol` (no ``StreamReader``): ``data_received``
appends to one buffer and wakes the reader only when it waits. httpx's pool checks every
pooled connection for readability on every request, which cost the gateway over a
millisecond of CPU per request at 32 connections (bench/gateway_cost.py).

A connection goes back to its pool only when its answer was read to the end. A kept-alive
connection that the replica closed while idle fails before the first byte of its answer;
the request is then sent once more on a new connection (the replica never answered it).

``https://`` replicas are reached over TLS (the handshake within the ``connect`` timeout),
verified with the context ``tls`` gives for their address (:class:`ReplicaTLS`: a model's
``ca_file``, else the system's trust store) and the URL's host name. A handshake that fails
(an unknown CA, a wrong name) is a connect failure, as a refused connection is.

::

    async with Http11ReplicaClient(connect=1.0) as client:
        async with client.send(UpstreamRequest(url, "/v1/completions", body)) as response:
            async for chunk in response.chunks: ...
"""

from __future__ import annotations

import asyncio
import ssl
from types import TracebackType
from typing import Final, Self, cast
from urllib.parse import urlsplit

from gpufleet.fleet import Outcome
from gpufleet.gateway._errors import LocalOriginError
from gpufleet.gateway._tls import ReplicaTLS
from gpufleet.gateway._upstream import FrameSink, UpstreamRequest, UpstreamResponse

_PASSED_HEADERS: Final = frozenset({b"content-type", b"content-encoding"})
_HIGH_WATER: Final = 1 << 20
"""Buffered, unread answer bytes above which the socket stops being read."""
_MAX_HEAD: Final = 64 * 1024

# how an answer's body is framed
_LENGTH: Final = 0
_CHUNKED: Final = 1
_UNTIL_CLOSE: Final = 2


class _LostError(Exception):
    """The connection closed, or its answer could not be parsed."""


class _Conn(asyncio.Protocol):
    """One kept-alive connection and the answer being read on it."""

    __slots__ = (
        "answered",
        "buf",
        "closed",
        "crlf",
        "done",
        "error",
        "framing",
        "idle_timer",
        "keep",
        "left",
        "paused",
        "reads",
        "relaying",
        "sink",
        "transport",
        "waiter",
    )

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.paused = False
        self.error: BaseException | None = None
        # the answer now being read
        self.answered = False
        self.framing = _LENGTH
        self.left = 0
        self.crlf = False
        self.keep = True
        self.done = False
        # a body being relayed (``relay``): frames go to ``sink`` from ``data_received``
        self.sink: FrameSink | None = None
        self.relaying: asyncio.Future[None] | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.reads = 0

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is not None:
            # the common read of a relayed stream: exactly one whole data frame
            eol = data.find(b"\r\n")
            if 0 < eol < 9 and not self.buf and data.endswith(b"\r\n"):
                try:
                    size = int(data[:eol], 16)
                except ValueError:
                    size = 0
                if size and eol + size + 4 == len(data):
                    self.reads += 1
                    if not sink.write_frames(data):
                        self._lagging(sink)
                    return
            self._relay(data)
            return
        self.buf += data
        if len(self.buf) > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def eof_received(self) -> bool:
        self._wake_lost()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.error = exc
        self._wake_lost()

    def _wake_lost(self) -> None:
        self.closed = True
        if self.relaying is not None:
            self._relay_end(_LostError(f"connection closed by the replica ({self.error!r})"))
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- the client's side --------------------------------------------------------------

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def _more(self) -> None:
        """Wait for more bytes; ``_LostError`` if the connection closed first."""
        if self.closed:
            raise _LostError(f"connection closed by the replica ({self.error!r})")
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        waiter = asyncio.get_running_loop().create_future()
        self.waiter = waiter
        try:
            await waiter
        finally:
            self.waiter = None

    def start(self, head: bytes, body: bytes) -> None:
        """Send one request, ``head`` and ``body`` in one write (the body copied once behind
        its head: ``writelines`` would not copy it, but on uvloop it takes the buffered
        path, ~70 µs more system time for a 220 kB body); the previous answer was read to
        its end."""
        assert self.transport is not None
        self.answered = False
        self.done = False
        self.keep = True
        self.transport.write(head + body if body else head)

    async def head(self) -> tuple[int, list[tuple[bytes, bytes]]]:
        """The answer's status and passed headers; framing set up for :meth:`read`."""
        buf = self.buf
        while (end := buf.find(b"\r\n\r\n")) < 0:
            if len(buf) > _MAX_HEAD:
                raise _LostError("answer head too large")
            await self._more()
        self.answered = True
        head = bytes(buf[:end])
        del buf[: end + 4]
        status, headers, framing, left, keep = _parse_head(head)
        self.keep = keep
        if status < 200 or status in (204, 304):
            framing, left = _LENGTH, 0
        if framing == _UNTIL_CLOSE:
            self.keep = False
        self.framing, self.left, self.crlf = framing, left, False
        if framing == _LENGTH and left == 0:
            self.done = True
        return status, headers

    async def read(self) -> bytes:
        """The body's next bytes, as many as have arrived; ``b""`` at its end."""
        while not self.done:
            if self.buf:
                if self.framing == _CHUNKED:
                    data = self._take_chunked()
                elif self.framing == _LENGTH:
                    data = self._take(self.left)
                    self.left -= len(data)
                    self.done = self.left == 0
                else:
                    data = self._take(len(self.buf))
                if data:
                    return data
                if self.done:
                    break
            if self.closed and self.framing == _UNTIL_CLOSE:
                self.done = True
                break
            await self._more()
        return b""

    def _take(self, most: int) -> bytes:
        buf = self.buf
        if most >= len(buf):
            data = bytes(buf)
            buf.clear()
        else:
            data = bytes(buf[:most])
            del buf[:most]
        return data

    def _take_chunked(self) -> bytes:
        """Every whole or partial chunk payload in the buffer, joined; ``done`` at the end."""
        buf = self.buf
        pos = 0
        size = len(buf)
        out: list[bytes] = []
        while True:
            if self.left:
                n = min(self.left, size - pos)
                if n == 0:
                    break
                out.append(bytes(buf[pos : pos + n]))
                pos += n
                self.left -= n
                if self.left:
                    break
                self.crlf = True
            if self.crlf:
                if size - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise _LostError("bad chunk framing")
                pos += 2
                self.crlf = False
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            length = _chunk_size(bytes(buf[pos:eol]))
            if length == 0:
                end = buf.find(b"\r\n\r\n", eol)  # the last chunk, any trailers, a blank line
                if end < 0:
                    break
                pos = end + 4
                self.done = True
                break
            pos = eol + 2
            self.left = length
        if pos:
            del buf[:pos]
        if len(out) == 1:
            return out[0]
        return b"".join(out)

    # -- relaying a chunked body: no task woken per chunk ----------------------------------

    async def relay(self, sink: FrameSink, idle: float) -> None:
        """:class:`~gpufleet.gateway._upstream.Relay`: the rest of this ``chunked`` body to
        ``sink``, whole frames as they arrive, from ``data_received`` itself."""
        try:
            # a frame that ``read`` began: finish it the plain way, framed anew
            while not self.done and (self.left or self.crlf):
                data = await self.read()
                if data:
                    sink.write_frames(b"%x\r\n%s\r\n" % (len(data), data))
            if self.done:
                return
            loop = asyncio.get_running_loop()
            relaying = self.relaying = loop.create_future()
            self.sink = sink
            self.idle_timer = loop.call_later(idle / 2, self._tick, idle / 2, self.reads, 0)
            if self.buf:
                data = bytes(self.buf)
                self.buf.clear()
                self._relay(data)
            elif self.closed:
                self._relay_end(_LostError(f"connection closed by the replica ({self.error!r})"))
            if self.paused and self.transport is not None and self.sink is not None:
                self.paused = False
                self.transport.resume_reading()
            await relaying
        except _LostError as error:
            self.keep = False
            raise LocalOriginError(f"connection lost: {error}") from None
        finally:
            sink.on_drained(None)
            self._relay_end(None)

    def _relay(self, data: bytes) -> None:
        sink = self.sink
        assert sink is not None
        self.reads += 1
        buf = self.buf
        if buf:  # a frame split across reads
            buf += data
            data = bytes(buf)
            buf.clear()
        try:
            end, body_end = _whole_frames(data)
        except _LostError as error:
            self._relay_end(error)
            return
        if end and not sink.write_frames(data if end == len(data) else data[:end]):
            self._lagging(sink)
        if body_end >= 0:
            self.done = True
            if body_end < len(data):  # bytes after the body: the connection is not reusable
                self.keep = False
            self._relay_end(None)
        elif end < len(data):
            buf += data[end:]

    def _lagging(self, sink: FrameSink) -> None:
        """The client reads slower than the replica writes: stop reading until it drains."""
        if self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
            sink.on_drained(self._drained)

    def _drained(self) -> None:
        if self.paused and self.transport is not None and self.sink is not None:
            self.paused = False
            self.transport.resume_reading()

    def _tick(self, every: float, reads: int, silent: int) -> None:
        """Every ``every`` s while relaying: two silent ticks in a row are the idle timeout."""
        silent = silent + 1 if self.reads == reads else 0
        if silent >= 2:
            self.idle_timer = None
            self._relay_end(TimeoutError())
            return
        loop = asyncio.get_running_loop()
        self.idle_timer = loop.call_later(every, self._tick, every, self.reads, silent)

    def _relay_end(self, error: BaseException | None) -> None:
        """Stop relaying: the body ended (``None``) or failed."""
        self.sink = None
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        relaying = self.relaying
        if relaying is not None:
            self.relaying = None
            if not relaying.done():
                if error is None:
                    relaying.set_result(None)
                else:
                    relaying.set_exception(error)


def _whole_frames(data: bytes) -> tuple[int, int]:
    """Where the whole data frames at the start of ``data`` end, and where the body ends
    (after its last chunk and trailers; ``-1`` if not in ``data``)::

        5\r\nhello\r\n 6\r\n world\r\n 0\r\n\r\n
        └─ frame ──────┴─ frame ───────┘        ← end
                                       └ last ┘ ← body end
    """
    pos, size_of = 0, len(data)
    while True:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            if size_of - pos > 1024:
                raise _LostError("bad chunk framing")
            return pos, -1
        size = _chunk_size(data[pos:eol])
        if size == 0:
            last = data.find(b"\r\n\r\n", eol)
            return pos, (-1 if last < 0 else last + 4)
        following = eol + size + 4
        if following > size_of:
            return pos, -1
        if data[following - 2 : following] != b"\r\n":
            raise _LostError("bad chunk framing")
        pos = following


def _chunk_size(line: bytes) -> int:
    try:
        return int(line.split(b";", 1)[0], 16)
    except ValueError:
        raise _LostError(f"bad chunk size: {line[:40]!r}") from None


def _parse_head(head: bytes) -> tuple[int, list[tuple[bytes, bytes]], int, int, bool]:
    """(status, passed headers, framing, content length, keep-alive) of an answer's head."""
    lines = head.split(b"\r\n")
    try:
        status = int(lines[0][9:12])
    except ValueError:
        raise _LostError(f"not an HTTP answer: {lines[0][:40]!r}") from None
    headers: list[tuple[bytes, bytes]] = []
    framing, left, keep = _UNTIL_CLOSE, 0, True
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            if framing != _CHUNKED:
                if not value.strip().isdigit():
                    raise _LostError(f"bad content-length: {value[:40]!r}")
                framing, left = _LENGTH, int(value)
        elif name == b"transfer-encoding":
            if b"chunked" in value.lower():
                framing = _CHUNKED
        elif name == b"connection":
            keep = b"close" not in value.lower()
        elif name in _PASSED_HEADERS:
            headers.append((name, value.strip()))
    return status, headers, framing, left, keep


class _Body:
    """``UpstreamResponse.chunks`` over a :class:`_Conn`: the body as it arrives."""

    __slots__ = ("conn",)

    def __init__(self, conn: _Conn) -> None:
        self.conn = conn

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> bytes:
        conn = self.conn
        if conn.done:
            raise StopAsyncIteration
        try:
            data = await conn.read()
        except (_LostError, ValueError) as error:
            conn.keep = False
            raise LocalOriginError(f"connection lost: {error}") from None
        if not data:
            raise StopAsyncIteration
        return data


class _Sending:
    """``Http11ReplicaClient.send``'s context: a class, not a generator (cheaper per request)."""

    __slots__ = ("client", "conn", "host_port", "request")

    def __init__(self, client: Http11ReplicaClient, request: UpstreamRequest) -> None:
        self.client = client
        self.request = request

    async def __aenter__(self) -> UpstreamResponse:
        request = self.request
        body = request.body
        head = b"".join(
            [b"\r\n%s: %s" % (k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers]
        )
        self.host_port, conn, status, headers = await self.client._exchange(
            request.url,
            b"POST %s HTTP/1.1" % request.path.encode("latin-1"),
            b"%s\r\ncontent-length: %d\r\n\r\n" % (head, len(body)),
            body,
        )
        self.conn = conn
        relay = conn.relay if conn.framing == _CHUNKED else None
        return UpstreamResponse(status, headers, _Body(conn), relay)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.client._release(self.host_port, self.conn)


_Target = tuple[tuple[str, int], bytes, ssl.SSLContext | None]
"""A base URL's ``(host, port)``, its ``Host`` header line, and its TLS context (https)."""


class Http11ReplicaClient:
    """Per ``host:port``, a LIFO of idle kept-alive connections (at most ``max_idle``);
    ``https://`` replicas verified with ``tls`` (default: the system's trust store)."""

    def __init__(
        self, *, connect: float, max_idle: int = 256, tls: ReplicaTLS | None = None
    ) -> None:
        self._connect = connect
        self._max_idle = max_idle
        self._tls = tls if tls is not None else ReplicaTLS()
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._targets: dict[str, _Target] = {}

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def forget(self, url: str) -> None:
        """The replica at ``url`` is gone: close its idle connections, drop its entries
        (else replica churn grows ``_idle`` and ``_targets`` without bound)."""
        target = self._targets.pop(url, None)
        if target is None:
            return
        host_port = target[0]
        for other in [u for u, (hp, _, _) in self._targets.items() if hp == host_port]:
            del self._targets[other]  # the same address spelled another way
        for conn in self._idle.pop(host_port, ()):
            conn.close()

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or parts.hostname is None:
                raise LocalOriginError(f"not an http:// or https:// URL: {url}")
            secure = parts.scheme == "https"
            port = parts.port or (443 if secure else 80)
            host = parts.hostname
            context = self._tls.context(host, port) if secure else None
            target = ((host, port), b"\r\nhost: " + parts.netloc.encode("latin-1"), context)
            self._targets[url] = target
        return target

    async def _open(self, host: str, port: int, context: ssl.SSLContext | None) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect):
                if context is None:
                    _, conn = await loop.create_connection(_Conn, host, port)
                else:  # the handshake counts in the connect timeout
                    _, conn = await loop.create_connection(
                        _Conn, host, port, ssl=context, server_hostname=host
                    )
        except TimeoutError:
            raise LocalOriginError(f"connect timeout: {host}:{port}", Outcome.TIMEOUT) from None
        except OSError as error:
            raise LocalOriginError(f"cannot reach replica: {error!r}") from None
        return conn

    async def _exchange(
        self, url: str, line: bytes, rest: bytes, body: bytes = b""
    ) -> tuple[tuple[str, int], _Conn, int, list[tuple[bytes, bytes]]]:
        """Send ``line`` + ``Host`` + ``rest`` (the head's end), then ``body``; read the
        answer's head. The connection is closed if that fails or is cancelled (a timeout)."""
        host_port, host, context = self._target(url)
        raw = line + host + rest
        idle = self._idle.get(host_port)
        while idle:
            conn = idle.pop()
            if conn.closed or conn.buf:
                conn.close()
                continue
            try:
                conn.start(raw, body)
                status, headers = await conn.head()
                return host_port, conn, status, headers
            except _LostError:
                conn.close()
                if conn.answered or conn.buf:
                    raise LocalOriginError("bad answer from the replica") from None
                # closed while idle: the replica never answered; send again
            except BaseException:
                conn.close()
                raise
        conn = await self._open(*host_port, context)
        try:
            conn.start(raw, body)
            status, headers = await conn.head()
        except _LostError as error:
            conn.close()
            raise LocalOriginError(f"connection lost: {error}") from None
        except BaseException:
            conn.close()
            raise
        return host_port, conn, status, headers

    def _release(self, host_port: tuple[str, int], conn: _Conn) -> None:
        if conn.done and conn.keep and not conn.closed:
            idle = self._idle.get(host_port)
            if idle is None:
                if all(t[0] != host_port for t in self._targets.values()):
                    conn.close()  # its replica was forgotten while this ran
                    return
                idle = self._idle[host_port] = []
            if len(idle) < self._max_idle:
                idle.append(conn)
                return
        conn.close()

    def send(self, request: UpstreamRequest) -> _Sending:
        return _Sending(self, request)

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        parts = urlsplit(url)
        base = f"{parts.scheme}://{parts.netloc}"
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host_port, conn, status, _ = await self._exchange(
            base, b"GET %s HTTP/1.1" % path.encode("latin-1"), b"\r\n\r\n"
        )
        try:
            body = b"".join([c async for c in _Body(conn)])
        finally:
            self._release(host_port, conn)
        return status, body
