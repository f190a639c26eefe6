"""A throwaway Redis for tests: ``redis-server`` on a free loopback port, its files in a
temporary directory, stopped and removed afterwards. Tests using it are skipped, saying why,
only when the binary is missing (``.ci/run`` installs it: ``apt-get install redis-server``)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def unavailable() -> str | None:
    """Why no server can be started here, or ``None``."""
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (apt-get install redis-server)"
    return None


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def redis_server(port: int | None = None) -> Iterator[str]:
    """Start a server (on ``port``, or a free one); yields its ``redis://`` URL."""
    binary = shutil.which("redis-server")
    assert binary is not None
    root = Path(tempfile.mkdtemp(prefix="gpufleet-redis-"))
    if port is None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(root)]
    args += ["--save", "", "--appendonly", "no", "--logfile", str(root / "log")]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not _pong(port):
            if process.poll() is not None or time.monotonic() > deadline:
                log = (root / "log").read_text() if (root / "log").exists() else ""
                raise RuntimeError(f"redis-server did not start: {log[-500:]}")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(root, ignore_errors=True)
