"""The gateway's own HTTP/1.1 server for the client side: httptools on an ``asyncio.Protocol``.

It drives any ASGI 3 app (the gateway is a plain ASGI app, and uvicorn still serves it in
tests), but does per request and per streamed chunk only what the gateway needs:

* a whole answer (``content-length``, or one body message) leaves in **one**
  ``transport.write`` — head and body together;
* a streamed answer is ``chunked``: each body message becomes one frame, written at once
  (``b"%x\\r\\n%s\\r\\n"``, one copy), no per-message bookkeeping beyond that;
* keep-alive and pipelining: requests are answered in order, one ASGI task at a time per
  connection; a request parsed while another runs waits in a queue and reading pauses;
* backpressure both ways: a large unread request body pauses reading; a full write buffer
  (``pause_writing``) makes ``send`` wait for ``resume_writing``;
* a client that disconnects gets its app an ``http.disconnect`` from ``receive()``
  (the gateway then cancels the upstream request); later ``send`` calls are dropped;
* limits: request head ``MAX_HEAD`` bytes (431), body ``MAX_BODY`` bytes (413; ``MAX_UPLOAD``
  on ``/v1/files``, a batch input file's upload); a malformed request gets 400 and the
  connection closes;
* ``Expect: 100-continue`` is answered when the app first reads the body;
* graceful shutdown: stop accepting, close idle connections, let in-flight requests finish
  within ``graceful_timeout`` (then cancel them), then the lifespan's shutdown;
* TLS (``tls``, a :class:`~gpufleet.gateway._tls.ServerTLS`): the listening sockets speak
  HTTPS, the certificate files are polled every ``reload_interval`` and a changed pair is
  used for new handshakes. A client that does not complete a handshake within
  ``TLS_HANDSHAKE_TIMEOUT`` (or sends plain HTTP) is closed; the app never sees it.

::

    server = GatewayServer(app, graceful_timeout=5)
    await server.serve(sockets=[sock])      # until SIGINT/SIGTERM or server.should_exit

Like uvicorn's ``Server.serve``, ``serve`` (in the main thread) takes SIGINT and SIGTERM while
it runs and raises the signal again once it has shut down, so an owner's handler (the local
runtime's, in ``gpufleet up``) acts on it next.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator, MutableMapping
from email.utils import formatdate
from http import HTTPStatus
from types import FrameType
from typing import Any, Final, cast
from urllib.parse import unquote

import httptools

from gpufleet.gateway._tls import ServerTLS

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Coroutine[Any, Any, None]]

MAX_HEAD: Final = 64 * 1024
"""Bytes of request line and headers above which a request gets 431."""
MAX_BODY: Final = 32 * 1024 * 1024
"""Bytes of request body above which a request gets 413 (the gateway's own limit)."""
MAX_UPLOAD: Final = 201 * 1024 * 1024
"""The body limit of ``/v1/files``: a batch input file (at most 200 MiB, the store's
``MAX_FILE_BYTES``) and its multipart framing. The route checks the file's own limit."""
KEEP_ALIVE: Final = 75.0
"""Seconds an idle kept-alive connection stays open (nginx's default)."""
TLS_HANDSHAKE_TIMEOUT: Final = 10.0
"""Seconds a new connection has to complete its TLS handshake (with ``tls``)."""
_BODY_HIGH_WATER: Final = 256 * 1024
"""Unread request-body bytes above which the socket stops being read."""
_ASGI: Final = {"version": "3.0", "spec_version": "2.3"}
RELAY: Final = "gpufleet.relay"
"""The ASGI extension (and message type) by which the gateway hands a stream's rest over::

    if RELAY in scope.get("extensions", {}):   # after http.response.start and a first body
        await send({"type": RELAY, "relay": response.relay, "idle": 30.0})
    await send({"type": "http.response.body", "body": b""})
"""
_EXTENSIONS: Final[dict[str, dict[str, Any]]] = {RELAY: {}}
_FRAMING: Final = frozenset({b"content-length", b"transfer-encoding"})
_NO_BODY_STATUS: Final = frozenset({204, 304})
_STATUS_LINES: Final = {
    int(s): b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus
}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


class _Date:
    """The ``date`` header, formatted at most once a second (shared by every connection)."""

    line = b""
    _second = -1

    @classmethod
    def refresh(cls) -> None:
        now = int(time.time())
        if now != cls._second:
            cls._second = now
            cls.line = b"date: %s\r\n" % formatdate(now, usegmt=True).encode()


class _Cycle:
    """One request and its response, as the ASGI app sees them (``receive`` and ``send``)."""

    __slots__ = (
        "body",
        "chunked",
        "conn",
        "continue_",
        "disconnected",
        "head_only",
        "keep_alive",
        "more_body",
        "received",
        "response_complete",
        "scope",
        "start",
        "started",
        "unread",
        "waiter",
    )

    def __init__(self, conn: _Connection, scope: Scope, keep_alive: bool, continue_: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.continue_ = continue_  # an ``Expect: 100-continue`` not answered yet
        self.body: list[bytes] = []  # received, not yet handed to the app
        self.unread = 0  # their size
        self.more_body = True
        self.received = False  # the last http.request was handed over
        self.disconnected = False
        self.waiter: asyncio.Future[None] | None = None
        self.start: Message | None = None  # the response start, held until the first body
        self.started = False  # its head was written
        self.chunked = False
        self.head_only = scope["method"] == "HEAD"
        self.response_complete = False

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- ASGI receive -------------------------------------------------------------------

    async def receive(self) -> Message:
        if self.continue_:
            self.continue_ = False
            if not self.disconnected and self.more_body and self.start is None:
                self.conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while True:
            if self.disconnected or self.response_complete:
                return {"type": "http.disconnect"}
            if self.body or not (self.more_body or self.received):
                parts = self.body
                body = parts[0] if len(parts) == 1 else b"".join(parts)
                parts.clear()
                self.unread = 0
                self.received = not self.more_body
                self.conn.resume_body()
                return {"type": "http.request", "body": body, "more_body": self.more_body}
            # nothing new, or the whole body was handed over: wait (for the client to leave)
            waiter = self.waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self.waiter = None

    # -- ASGI send ----------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        if message["type"] != "http.response.body":
            if message["type"] == RELAY:
                await self._relay(message)
            else:
                self._start(message)
            return
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if not self.started:
            if self.start is None:
                raise RuntimeError("http.response.body before http.response.start")
            out = self._head(body, more)
        elif self.response_complete:
            raise RuntimeError("http.response.body after the response completed")
        else:
            out = self._frame(body, more)
        conn = self.conn
        if not more:
            self.response_complete = True
        if self.disconnected:
            return
        if out:
            conn.write(out)
        if not more:
            conn.response_done(self)
        elif conn.write_paused:
            await conn.drain()

    async def _relay(self, message: Message) -> None:
        """The ``gpufleet.relay`` extension: the app hands over a relay (an upstream body's
        rest, already chunk-framed) after a ``more_body`` message of a chunked answer."""
        if not self.chunked or self.response_complete:
            raise RuntimeError(f"{RELAY} needs a chunked answer under way")
        await message["relay"](self, message["idle"])

    def write_frames(self, frames: bytes) -> bool:
        """``FrameSink``: frames straight to the socket; whether it keeps up."""
        if self.disconnected:
            return True
        conn = self.conn
        transport = conn.transport
        assert transport is not None
        transport.write(frames)  # open until connection_lost, which sets ``disconnected``
        return not conn.write_paused

    def on_drained(self, callback: Callable[[], None] | None) -> None:
        self.conn.on_drained = callback

    def _start(self, message: Message) -> None:
        kind = message["type"]
        if kind != "http.response.start":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if self.start is not None:
            raise RuntimeError("http.response.start sent twice")
        self.start = message

    def _frame(self, body: bytes, more: bool) -> bytes:
        """What goes on the wire for a body message after the head."""
        if self.head_only:
            return b""
        if not self.chunked:
            return body
        if body:
            out = b"%x\r\n%s\r\n" % (len(body), body)
            return out if more else out + b"0\r\n\r\n"
        return b"" if more else b"0\r\n\r\n"

    def _head(self, body: bytes, more: bool) -> bytes:
        """The response head, with ``body`` appended when it goes in the same write."""
        start = self.start
        assert start is not None
        self.started = True
        status = start["status"]
        parts = [_status_line(status), _Date.line]
        framed = False
        for name, value in start.get("headers", ()):
            if b"\n" in name or b"\r" in name or b"\n" in value or b"\r" in value:
                raise RuntimeError(f"invalid response header {name!r}")
            low = name.lower()
            if low in _FRAMING:
                framed = True
            elif low == b"connection" and value.lower() == b"close":
                self.keep_alive = False
            parts.append(b"%s: %s\r\n" % (name, value))
        no_body = self.head_only or status in _NO_BODY_STATUS or status < 200
        if not framed and not no_body:
            if more:
                self.chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
            else:
                parts.append(b"content-length: %d\r\n" % len(body))
        if not self.keep_alive or self.conn.closing or self.more_body:
            # (a request body not read to its end: the connection cannot be reused)
            self.keep_alive = False
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        if not no_body:
            parts.append(self._frame(body, more))
        return b"".join(parts)

    # -- running the app ----------------------------------------------------------------

    async def run(self, app: App) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except asyncio.CancelledError:  # shutdown ran out of time
            self.conn.abort_cycle(self, 503)
            raise
        except BaseException as error:
            logger.exception("the ASGI app raised")
            self.conn.abort_cycle(self, 500)
            if not isinstance(error, Exception):
                raise
        else:
            if not self.response_complete:
                self.conn.abort_cycle(self, 500)


class _Connection(asyncio.Protocol):
    """One client connection: parses requests with httptools and runs each as an ASGI cycle."""

    def __init__(self, server: GatewayServer) -> None:
        self.server = server
        self.app = server.app
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.peer: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.cycle: _Cycle | None = None  # the one the app runs now
        self.parsing: _Cycle | None = None  # the one the parser fills (may be queued)
        self.queue: deque[_Cycle] = deque()
        self.task: asyncio.Task[None] | None = None
        self.write_paused = False
        self.drained: asyncio.Future[None] | None = None
        self.on_drained: Callable[[], None] | None = None  # a relay waiting to read again
        self.read_paused = False
        self.closing = False
        self.last_active = 0.0
        # the request head being parsed
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_size = 0
        self.body_size = 0
        self.body_limit = MAX_BODY
        self.continue_ = False
        self.error: tuple[int, str] | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is no subclass
        self.peer = _address(transport.get_extra_info("peername"))
        self.local = _address(transport.get_extra_info("sockname"))
        self.last_active = self.loop.time()
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.connections.discard(self)
        for cycle in (self.cycle, *self.queue):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.wake()
        self.queue.clear()
        self.resume_writing()  # nothing more is written: no one waits for a drain

    def eof_received(self) -> bool | None:
        return None  # the client half-closed: close; a running cycle sees a disconnect

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.on_drained is not None:
            self.on_drained()
        drained = self.drained
        if drained is not None:
            self.drained = None
            if not drained.done():
                drained.set_result(None)

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return  # refused and closing (a shutdown still reads a running request's body)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # an upgrade (h2c, websocket) this server does not do: answer the request as
            # plain HTTP/1.1, then close (the parser stops after an upgrade)
            if self.parsing is not None:
                self.parsing.keep_alive = False
        except httptools.HttpParserError as error:
            status, why = self.error or (400, f"malformed request: {error}")
            self._refuse(status, why)

    # -- httptools callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.head_size = 0
        self.body_size = 0
        self.body_limit = MAX_BODY
        self.continue_ = False
        self.parsing = None

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.head_size += len(url)
        if self.head_size > MAX_HEAD:
            self._too_large(431, f"request head over {MAX_HEAD} bytes")
        path = self.url.partition(b"?")[0]
        self.body_limit = MAX_UPLOAD if path.rstrip(b"/") == b"/v1/files" else MAX_BODY

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_size += len(name) + len(value) + 4
        if self.head_size > MAX_HEAD:
            self._too_large(431, f"request head over {MAX_HEAD} bytes")
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.continue_ = True
        elif (
            name == b"content-length"
            and value.isdigit()
            and (len(value) > 12 or int(value) > self.body_limit)
        ):
            self._too_large(413, f"request body over {self.body_limit} bytes")
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        url = self.url
        if b"?" in url or b"%" in url or not url.startswith(b"/"):
            parsed = httptools.parse_url(url)
            raw_path = parsed.path
            query = parsed.query or b""
            path = raw_path.decode("ascii")
            if "%" in path:
                path = unquote(path)
        else:
            raw_path, query, path = url, b"", url.decode("ascii")
        version = parser.get_http_version()
        scope: Scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": version,
            "server": self.local,
            "client": self.peer,
            "scheme": self.server.scheme,
            "method": parser.get_method().decode("ascii"),
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "headers": self.headers,
            "state": self.server.state.copy(),
            "extensions": _EXTENSIONS,
        }
        keep_alive = parser.should_keep_alive() and not self.closing
        cycle = _Cycle(self, scope, keep_alive, self.continue_)
        self.parsing = cycle
        if self.cycle is None:
            self._run(cycle)
        else:  # pipelined: answered after the one running now
            self.queue.append(cycle)
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        cycle = self.parsing
        if cycle is None or cycle.response_complete:
            return
        cycle.body.append(body)
        cycle.unread += len(body)
        if cycle.unread > _BODY_HIGH_WATER:
            self._pause_reading()
        self.body_size += len(body)
        if self.body_size > self.body_limit:  # a chunked body over the limit
            self._too_large(413, f"request body over {self.body_limit} bytes")
        cycle.wake()

    def on_message_complete(self) -> None:
        cycle = self.parsing
        if cycle is None:
            return
        cycle.more_body = False
        cycle.wake()

    # -- the connection's side of a cycle ---------------------------------------------

    def _run(self, cycle: _Cycle) -> None:
        self.cycle = cycle
        task = self.task = self.loop.create_task(cycle.run(self.app))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    async def drain(self) -> None:
        if not self.write_paused:
            return
        drained = self.drained
        if drained is None:
            drained = self.drained = self.loop.create_future()
        await drained

    def response_done(self, cycle: _Cycle) -> None:
        """The app sent its last body message: keep the connection or close it."""
        self.last_active = self.loop.time()
        cycle.wake()  # a receive() still waiting gets http.disconnect
        if cycle is not self.cycle:
            return
        self.cycle = None
        self.task = None
        if not cycle.keep_alive or self.closing:
            self._close()
            return
        if self.queue:
            self._run(self.queue.popleft())
        self.resume_body()

    def abort_cycle(self, cycle: _Cycle, status: int) -> None:
        """The app ended without completing its response, raised (500) or was cancelled at
        shutdown (503): that status if nothing was sent yet, and close."""
        if cycle.response_complete:
            return
        cycle.response_complete = True
        if not cycle.started and not cycle.disconnected:
            self.write(_error_response(status, "server_error", "the server could not answer"))
        if cycle is self.cycle:
            self.cycle = None
        self._close()

    def resume_body(self) -> None:
        if self.read_paused and not self.queue:
            cycle = self.parsing
            if cycle is None or cycle.unread <= _BODY_HIGH_WATER:
                self.read_paused = False
                if self.transport is not None:
                    self.transport.resume_reading()

    def _pause_reading(self) -> None:
        if not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()

    def _too_large(self, status: int, why: str) -> None:
        self.error = (status, why)
        raise ValueError(why)  # httptools turns it into HttpParserCallbackError

    def _refuse(self, status: int, why: str) -> None:
        """Answer a request the parser rejected (400, 413, 431) and close."""
        running, parsing = self.cycle, self.parsing
        if running is not None and running is not parsing:
            # a bad request behind one still being answered: finish that one, then close
            running.keep_alive = False
            self.queue.clear()
            self._pause_reading()
            return
        if running is not None:  # its own body was bad: the app sees the client gone
            running.disconnected = True
            running.wake()
            if running.started:
                self._close()
                return
        self.write(_error_response(status, "invalid_request_error", why))
        self._close()

    def _close(self) -> None:
        self.closing = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def shutdown(self) -> None:
        """Server shutdown: close now if idle, else after the response being sent."""
        self.closing = True
        if self.cycle is None:
            self._close()
        else:
            self.cycle.keep_alive = False
            self.queue.clear()

    def idle_for(self, now: float) -> float:
        return 0.0 if self.cycle is not None else now - self.last_active


def _error_response(status: int, kind: str, message: str) -> bytes:
    """A whole OpenAI-shaped error answer that closes the connection."""
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    ).encode()
    return (
        b"%scontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
        % (
            _status_line(status),
            len(body),
            body,
        )
    )


def _address(value: Any) -> tuple[str, int] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return (str(value[0]), int(value[1]))
    return None


class GatewayServer:
    """Serve an ASGI app (lifespan included) on listening sockets until told to stop."""

    def __init__(
        self,
        app: App,
        *,
        graceful_timeout: float = 5.0,
        keep_alive: float = KEEP_ALIVE,
        handle_signals: bool = True,
        tls: ServerTLS | None = None,
    ) -> None:
        self.app = app
        self.graceful_timeout = graceful_timeout
        self.keep_alive = keep_alive
        self.handle_signals = handle_signals
        self.tls = tls
        """HTTPS with this certificate, reloaded when its files change; ``None``: HTTP."""
        self.scheme = "http" if tls is None else "https"
        self.state: dict[str, Any] = {}
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.started = False
        self.should_exit = False
        self._servers: list[asyncio.Server] = []
        self._signals: list[signal.Signals] = []
        self._lifespan: asyncio.Task[None] | None = None
        self._to_app: asyncio.Queue[Message] = asyncio.Queue()
        self._from_app: asyncio.Queue[Message] = asyncio.Queue()

    async def serve(self, sockets: list[socket.socket]) -> None:
        """Start, serve until ``should_exit`` (or SIGINT/SIGTERM), then shut down gracefully."""
        with self._capture_signals():
            await self.startup(sockets)
            try:
                ticks = 0
                while not self.should_exit:
                    await asyncio.sleep(0.1)
                    _Date.refresh()
                    ticks += 1
                    if ticks % 10 == 0:
                        self._sweep()
                    if self.tls is not None:
                        self.tls.poll(asyncio.get_running_loop().time())
            finally:
                await self.shutdown()

    async def startup(self, sockets: list[socket.socket]) -> None:
        """The lifespan's startup, then accept connections on ``sockets``."""
        self._to_app = asyncio.Queue()
        self._from_app = asyncio.Queue()
        scope = {"type": "lifespan", "asgi": _ASGI, "state": self.state}
        self._lifespan = asyncio.create_task(
            self.app(scope, self._to_app.get, self._from_app.put), name="gateway-lifespan"
        )
        await self._lifespan_step("lifespan.startup")
        loop = asyncio.get_running_loop()
        tls = self.tls
        for sock in sockets:
            server = await loop.create_server(
                lambda: _Connection(self),
                sock=sock,
                backlog=2048,
                ssl=None if tls is None else tls.context,
                ssl_handshake_timeout=None if tls is None else TLS_HANDSHAKE_TIMEOUT,
                start_serving=True,
            )
            self._servers.append(server)
        _Date.refresh()
        self.started = True

    async def shutdown(self) -> None:
        """Stop accepting; in-flight requests finish (within ``graceful_timeout``); the
        lifespan's shutdown."""
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.shutdown()
        deadline = asyncio.get_running_loop().time() + self.graceful_timeout
        while self.tasks and asyncio.get_running_loop().time() < deadline:
            await asyncio.wait(list(self.tasks), timeout=0.1)
        if self.tasks:
            logger.warning("cancelling %d request(s) still running at shutdown", len(self.tasks))
            for task in list(self.tasks):
                task.cancel()
            await asyncio.wait(list(self.tasks), timeout=1.0)
        for conn in list(self.connections):
            conn.shutdown()
            if conn.transport is not None:
                conn.transport.abort()
        for server in self._servers:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await server.wait_closed()
        self._servers.clear()
        if self._lifespan is not None and not self._lifespan.done():
            await self._lifespan_step("lifespan.shutdown")
            with contextlib.suppress(BaseException):
                await self._lifespan
        self._lifespan = None

    async def _lifespan_step(self, kind: str) -> None:
        """Send ``kind`` to the app's lifespan and wait for its answer."""
        lifespan = self._lifespan
        assert lifespan is not None
        await self._to_app.put({"type": kind})
        answer = asyncio.ensure_future(self._from_app.get())
        await asyncio.wait([answer, lifespan], return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():
            answer.cancel()
            error = lifespan.exception()
            raise RuntimeError(f"the app's lifespan ended at {kind}") from error
        message = answer.result()
        if message["type"].endswith(".failed"):
            raise RuntimeError(f"{kind} failed: {message.get('message', '')}")

    def _sweep(self) -> None:
        """Close connections idle past the keep-alive time."""
        now = asyncio.get_running_loop().time()
        for conn in list(self.connections):
            if conn.idle_for(now) > self.keep_alive:
                conn.shutdown()

    @contextlib.contextmanager
    def _capture_signals(self) -> Iterator[None]:
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            yield
            return
        # signal.signal (not loop.add_signal_handler) so the previous handlers come back
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        for sig in reversed(self._signals):
            signal.raise_signal(sig)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self._signals.append(signal.Signals(sig))
        self.should_exit = True


_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM)
