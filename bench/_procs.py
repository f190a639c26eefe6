"""Process, port and HTTP-framing helpers the loopback benches share (gateway_cost.py,
long_prompts.py): run as ``python bench/X.py``, a bench imports this file as a sibling
module."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_port(port: int, within: float = 30.0) -> None:
    """Until something accepts connections on ``port`` (``RuntimeError`` after ``within``)."""
    deadline = time.monotonic() + within
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on {port}") from None
            time.sleep(0.05)


@contextmanager
def process(argv: list[str], **kwargs: Any) -> Iterator[subprocess.Popen[str]]:
    """``argv`` running for the block; SIGTERM at its end (SIGKILL after 10 s)."""
    proc = subprocess.Popen(argv, text=True, **kwargs)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def chunk(data: bytes) -> bytes:
    """``data`` as one HTTP/1.1 chunk (``transfer-encoding: chunked``)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def post(port: int, body: bytes, path: bytes = b"/v1/chat/completions") -> bytes:
    """The raw bytes of a kept-alive JSON ``POST`` to ``127.0.0.1:port``."""
    return (
        b"POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
    ) % (path, port, len(body), body)


def static_gateway(model: str, backends: list[int], policy: str) -> Any:
    """The gateway app over one pool of ``model`` on ``backends`` (loopback ports), routed
    by ``policy``. gpufleet is imported here: a bench that runs another tree's gateway
    (``PYTHONPATH``) gets that tree's."""
    from prometheus_client import CollectorRegistry  # noqa: PLC0415

    from gpufleet.config import parse_fleet  # noqa: PLC0415
    from gpufleet.fleet import ReplicaId  # noqa: PLC0415
    from gpufleet.gateway import StaticReplicas, Upstream, create_gateway  # noqa: PLC0415

    config = parse_fleet(
        {"models": [{"name": model, "replicas": len(backends), "routing": policy}]}
    )
    replicas = [
        Upstream(ReplicaId(f"{model}-{i}"), model, f"http://127.0.0.1:{p}")
        for i, p in enumerate(backends)
    ]
    return create_gateway(config, StaticReplicas(replicas), CollectorRegistry())
