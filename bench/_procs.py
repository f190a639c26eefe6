"""Process and port helpers the loopback benches share (gateway_cost.py, long_prompts.py):
run as ``python bench/X.py``, a bench imports this file as a sibling module."""

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
