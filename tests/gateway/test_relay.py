"""A stream's rest relayed frame by frame (``GatewayServer``'s ``gpufleet.relay``) and passed
chunk by chunk (under uvicorn) behave alike: a scripted replica on a raw socket that breaks
mid-frame, stalls, or leaves while the gateway's client stays."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest

from tests.gateway.conftest import MODEL, fleet, serve_gateway

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
BODY = {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True}
Script = Callable[[socket.socket], None]


def frame(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(i: int) -> bytes:
    return b'data: {"choices":[{"text":"%d","index":0}]}\n\n' % i


@contextmanager
def scripted_replica(script: Script) -> Iterator[str]:
    """A replica that reads one request per connection and answers with ``script(sock)``."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            sock = self.request
            data = b""
            while b"\r\n\r\n" not in data:
                data += sock.recv(65536)
            script(sock)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def gateway(script: Script, server: str) -> Iterator[str]:
    config = fleet(
        routing="least_request",
        health={"active": {"enabled": False}},
        gateway={"timeouts": {"idle_stream": 0.3}},
    )
    with scripted_replica(script) as url, serve_gateway(config, [url], server=server) as gw:
        yield gw.url


def broken(sock: socket.socket) -> None:
    sock.sendall(SSE_HEAD + frame(event(0)))
    time.sleep(0.05)
    sock.sendall(frame(event(1)) + frame(event(2))[:9])
    time.sleep(0.05)
    sock.close()


def stalled(sock: socket.socket) -> None:
    sock.sendall(SSE_HEAD + frame(event(0)))
    time.sleep(0.05)
    sock.sendall(frame(event(1)))
    time.sleep(3)


def whole(sock: socket.socket) -> None:
    sock.sendall(SSE_HEAD + frame(event(0)))
    for i in range(1, 20):
        time.sleep(0.002)
        sock.sendall(frame(event(i))[:7])
        sock.sendall(frame(event(i))[7:])
    sock.sendall(frame(b"data: [DONE]\n\n") + b"0\r\n\r\n")


SERVERS = ["own", "uvicorn"]


def test_a_stream_split_anywhere_passes_whole() -> None:
    with gateway(whole, "own") as url:
        response = httpx.post(url + "/v1/completions", json=BODY, timeout=5)
        assert response.text == b"".join(event(i) for i in range(20)).decode() + "data: [DONE]\n\n"
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:
            texts = [c.choices[0].text for c in client.completions.create(**BODY)]
        assert texts == [str(i) for i in range(20)]


@pytest.mark.parametrize("server", SERVERS)
def test_a_stream_broken_mid_frame_ends_with_an_error_event(server: str) -> None:
    with gateway(broken, server) as url:
        response = httpx.post(url + "/v1/completions", json=BODY, timeout=5)
        assert response.status_code == 200
        events = [e for e in response.text.split("\n\n") if e]
        assert events[:2] == [event(0).decode().strip(), event(1).decode().strip()]
        # relayed: only whole frames pass; chunk by chunk: the cut frame's bytes pass too
        assert events[2:-2] == ([] if server == "own" else ["data:"])
        assert '"error"' in events[-2]
        assert "stream broke" in events[-2]
        assert events[-1] == "data: [DONE]"


@pytest.mark.parametrize("server", SERVERS)
def test_a_stalled_stream_ends_after_the_idle_timeout(server: str) -> None:
    with gateway(stalled, server) as url:
        started = time.monotonic()
        response = httpx.post(url + "/v1/completions", json=BODY, timeout=5)
        assert time.monotonic() - started < 1.5
        events = [e for e in response.text.split("\n\n") if e]
        assert events[:2] == [event(0).decode().strip(), event(1).decode().strip()]
        assert "idle timeout" in events[2]
        assert events[3] == "data: [DONE]"
