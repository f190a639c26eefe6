"""``GatewayServer`` conformance over real loopback sockets: a small ASGI app behind it, raw
HTTP/1.1 on the wire (keep-alive, pipelining, chunked bodies, HEAD, 100-continue, limits,
malformed requests, disconnects, graceful shutdown) and httpx for streamed answers."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvloop

from gpufleet.gateway import GatewayServer
from gpufleet.gateway._server import MAX_BODY, MAX_HEAD

Scope = dict[str, Any]
BLOCK = b"x" * 65536


class EchoApp:
    """``/echo`` answers the request body; ``/stream?n`` streams n chunks (``/big?n``: n of
    64 KiB); ``/slow?s`` answers
    after s seconds; ``/hold`` streams one chunk then waits for the client to leave;
    ``/boom`` raises; ``/nothing`` returns without answering."""

    def __init__(self) -> None:
        self.lifespan: list[str] = []
        self.disconnected = threading.Event()
        self.seen: list[Scope] = []
        self.sent = 0

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        self.seen.append(scope)
        path, query = scope["path"], scope["query_string"].decode()
        if path == "/echo":
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            await _answer(send, body)
        elif path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for i in range(int(query)):
                await send({"type": "http.response.body", "body": b"%d;" % i, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        elif path == "/big":
            await self._big(send, int(query))
        elif path == "/slow":
            await asyncio.sleep(float(query))
            await _answer(send, b"slow")
        elif path == "/hold":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()
        elif path == "/boom":
            raise RuntimeError("boom")
        elif path != "/nothing":
            await _answer(send, path.encode() + b"?" + query.encode())

    async def _big(self, send: Any, blocks: int) -> None:
        self.sent = 0
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(blocks):
            await send({"type": "http.response.body", "body": BLOCK, "more_body": True})
            self.sent += 1
        await send({"type": "http.response.body", "body": b""})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            self.lifespan.append(message["type"])
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return


async def _answer(send: Any, body: bytes) -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def serving(app: Any, graceful_timeout: float = 2.0) -> Iterator[tuple[int, GatewayServer]]:
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = GatewayServer(app, graceful_timeout=graceful_timeout)
    thread = threading.Thread(target=uvloop.run, args=(server.serve([sock]),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        yield port, server
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def echo() -> Iterator[tuple[int, EchoApp]]:
    app = EchoApp()
    with serving(app) as (port, _):
        yield port, app
    assert app.lifespan == ["lifespan.startup", "lifespan.shutdown"]


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_response(sock: socket.socket, buf: bytearray) -> tuple[bytes, bytes]:
    """One response (content-length or chunked framing) from ``sock``: (head, body)."""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        assert data, f"closed before a head: {bytes(buf)!r}"
        buf += data
    end = buf.index(b"\r\n\r\n")
    head = bytes(buf[:end]).lower()
    del buf[: end + 4]
    if b"transfer-encoding: chunked" in head:
        body = b""
        while True:
            while b"\r\n" not in buf:
                buf += sock.recv(65536)
            line_end = buf.index(b"\r\n")
            size = int(buf[:line_end], 16)
            while len(buf) < line_end + 2 + size + 2:
                buf += sock.recv(65536)
            body += bytes(buf[line_end + 2 : line_end + 2 + size])
            del buf[: line_end + 2 + size + 2]
            if size == 0:
                return head, body
    length = 0
    for line in head.split(b"\r\n"):
        if line.startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    if head.startswith(b"head ") or b" 304 " in head.split(b"\r\n")[0]:
        length = 0
    while len(buf) < length:
        buf += sock.recv(65536)
    body = bytes(buf[:length])
    del buf[:length]
    return head, body


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_keep_alive_serves_several_requests_on_one_connection(echo: Any) -> None:
    port, _ = echo
    with _connect(port) as sock:
        buf = bytearray()
        for i in range(3):
            body = b"x" * (i + 1)
            sock.sendall(b"POST /echo HTTP/1.1\r\ncontent-length: %d\r\n\r\n%s" % (i + 1, body))
            head, got = _read_response(sock, buf)
            assert head.startswith(b"http/1.1 200 ok")
            assert b"date: " in head
            assert b"connection: close" not in head
            assert got == body


def test_a_chunked_request_body_is_read_whole(echo: Any) -> None:
    port, _ = echo
    with _connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n")
        sock.sendall(b"5\r\nhello\r\n")
        time.sleep(0.05)
        sock.sendall(b"6\r\n world\r\n0\r\n\r\n")
        head, body = _read_response(sock, bytearray())
        assert head.startswith(b"http/1.1 200")
        assert body == b"hello world"


def test_path_and_query_reach_the_app(echo: Any) -> None:
    port, app = echo
    with _connect(port) as sock:
        sock.sendall(b"GET /a%20b?x=1&y=2 HTTP/1.1\r\nhost: t\r\nX-Thing: V\r\n\r\n")
        _, body = _read_response(sock, bytearray())
    assert body == b"/a b?x=1&y=2"
    scope = app.seen[-1]
    assert scope["raw_path"] == b"/a%20b"
    assert (b"x-thing", b"V") in scope["headers"]
    assert scope["method"] == "GET"
    assert scope["http_version"] == "1.1"


def test_head_gets_the_headers_without_the_body(echo: Any) -> None:
    port, _ = echo
    with _connect(port) as sock:
        buf = bytearray()
        sock.sendall(b"HEAD /hello HTTP/1.1\r\n\r\nGET /after HTTP/1.1\r\n\r\n")
        while b"\r\n\r\n" not in buf:
            buf += sock.recv(65536)
        end = buf.index(b"\r\n\r\n")
        assert b"content-length: 7" in bytes(buf[:end]).lower()  # "/hello?"
        del buf[: end + 4]
        _, body = _read_response(sock, buf)  # the next answer follows the head at once
        assert body == b"/after?"


def test_expect_100_continue_is_answered_before_the_body(echo: Any) -> None:
    port, _ = echo
    with _connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 4\r\n\r\n")
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"ping")
        _, body = _read_response(sock, bytearray())
        assert body == b"ping"


def test_pipelined_requests_are_answered_in_order(echo: Any) -> None:
    port, _ = echo
    with _connect(port) as sock:
        sock.sendall(
            b"GET /slow?0.1 HTTP/1.1\r\nhost: t\r\n\r\n"
            b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\n\r\nabc"
            b"GET /last HTTP/1.1\r\nhost: t\r\n\r\n"
        )
        buf = bytearray()
        bodies = [_read_response(sock, buf)[1] for _ in range(3)]
    assert bodies == [b"slow", b"abc", b"/last?"]


def test_a_streamed_answer_is_chunked_and_arrives_whole(echo: Any) -> None:
    port, _ = echo
    with httpx.stream("GET", f"http://127.0.0.1:{port}/stream?50") as response:
        assert response.headers["transfer-encoding"] == "chunked"
        text = b"".join(response.iter_bytes())
    assert text == b"".join(b"%d;" % i for i in range(50))


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"NOT A REQUEST\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nhost: t\r\nbad header line\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * (MAX_HEAD + 10) + b"\r\n\r\n", 431),
        (b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % (MAX_BODY + 1), 413),
        (b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", 400),
    ],
    ids=["request-line", "header", "head-too-large", "body-too-large", "bad-chunk"],
)
def test_a_bad_request_gets_an_error_and_the_connection_closes(
    echo: Any, raw: bytes, status: int
) -> None:
    port, _ = echo
    with _connect(port) as sock:
        sock.sendall(raw)
        head, body = _read_response(sock, bytearray())
        assert head.startswith(b"http/1.1 %d" % status)
        assert b"connection: close" in head
        assert b'"error"' in body
        assert _closed(sock)


def test_an_app_error_is_a_500_and_a_missing_answer_too(echo: Any) -> None:
    port, _ = echo
    for path in (b"/boom", b"/nothing"):
        with _connect(port) as sock:
            sock.sendall(b"GET %s HTTP/1.1\r\nhost: t\r\n\r\n" % path)
            head, _ = _read_response(sock, bytearray())
            assert head.startswith(b"http/1.1 500")
            assert _closed(sock)


def test_a_client_leaving_mid_stream_is_an_http_disconnect(echo: Any) -> None:
    port, app = echo
    app.disconnected.clear()
    sock = _connect(port)
    sock.sendall(b"GET /hold HTTP/1.1\r\nhost: t\r\n\r\n")
    assert b"first" in sock.recv(65536)
    sock.close()
    assert app.disconnected.wait(5)


def test_http_1_0_closes_after_the_answer(echo: Any) -> None:
    port, _ = echo
    with _connect(port) as sock:
        sock.sendall(b"GET /old HTTP/1.0\r\n\r\n")
        head, body = _read_response(sock, bytearray())
        assert b"connection: close" in head
        assert body == b"/old?"
        assert _closed(sock)


def test_shutdown_lets_in_flight_requests_finish_and_stops_accepting() -> None:
    app = EchoApp()
    with serving(app, graceful_timeout=5) as (port, server):
        busy = _connect(port)
        idle = _connect(port)
        busy.sendall(b"GET /slow?0.5 HTTP/1.1\r\nhost: t\r\n\r\n")
        time.sleep(0.1)
        server.should_exit = True
        head, body = _read_response(busy, bytearray())
        assert body == b"slow"
        assert b"connection: close" in head
        assert _closed(busy)
        assert _closed(idle)
        busy.close()
        idle.close()
        deadline = time.monotonic() + 5
        while app.lifespan[-1:] != ["lifespan.shutdown"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(ConnectionRefusedError):
            _connect(port).close()


def test_shutdown_cancels_what_outlives_the_grace_period() -> None:
    app = EchoApp()
    with serving(app, graceful_timeout=0.2) as (port, server):
        sock = _connect(port)
        sock.sendall(b"GET /slow?30 HTTP/1.1\r\nhost: t\r\n\r\n")
        time.sleep(0.1)
        started = time.monotonic()
        server.should_exit = True
        head, body = _read_response(sock, bytearray())
        assert head.startswith(b"http/1.1 503")
        assert b'"error"' in body
        assert _closed(sock)
        assert time.monotonic() - started < 3
        sock.close()


def test_a_client_that_does_not_read_holds_the_app_back(echo: Any) -> None:
    port, app = echo
    with _connect(port) as sock:
        sock.sendall(b"GET /big?320 HTTP/1.1\r\n\r\n")  # 20 MiB
        time.sleep(0.3)
        assert 0 < app.sent < 320  # send() waits while the socket's buffers are full
        received = 0
        tail = b""
        while not tail.endswith(b"\r\n0\r\n\r\n"):
            data = sock.recv(1 << 20)
            assert data
            received += len(data)
            tail = (tail + data)[-16:]
        assert received > 320 * len(BLOCK)
        assert app.sent == 320
