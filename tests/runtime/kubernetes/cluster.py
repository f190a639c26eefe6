"""The pods and the gateway process of operator-mode end-to-end tests (no real cluster).

``sim_pod`` serves a real sim engine on a loopback port in the test's event loop: it plays a
pool's pod, which ``FakeKubeApi.set_pod`` then reports in an EndpointSlice. ``gateway_up``
runs ``gpufleet up --runtime kubernetes`` as a subprocess and yields its base URL and output.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from gpufleet.engine.server import SimEngineConfig, create_app


@contextlib.asynccontextmanager
async def sim_pod(
    config: SimEngineConfig | None = None, ip: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[int]:
    """A sim engine on ``ip`` (any of 127.0.0.0/8) and ``port`` (0: a free one), in this event
    loop; yields the port. The pods of one EndpointSlice share a port: give each its own IP."""
    sock = socket.create_server((ip, port))
    app = create_app(config or SimEngineConfig(time_scale=200.0, max_model_len=2048))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        sock.close()


@dataclass
class Gateway:
    base: str
    out: list[str] = field(default_factory=list)
    """Every line the process wrote so far (stdout and stderr)."""
    code: int | None = None


@contextlib.asynccontextmanager
async def gateway_up(fleet: Path, *, start_timeout: float = 30.0) -> AsyncIterator[Gateway]:
    """``gpufleet up --runtime kubernetes`` until the block ends (then SIGTERM; exit code in
    ``code``); its output is read on all along, so that a full pipe never blocks it."""
    up = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "gpufleet", "up", "--fleet", str(fleet), "--port", "0"),
        *("--runtime", "kubernetes"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "GPUFLEET_HOME": str(fleet.parent / "gpufleet-home")},  # batches
    )
    assert up.stdout is not None
    stdout = up.stdout
    lines: list[str] = []
    listening = asyncio.Event()

    async def read() -> None:
        while line := (await stdout.readline()).decode():
            lines.append(line)
            if "listening on" in line:
                listening.set()

    reader = asyncio.create_task(read())
    try:
        async with asyncio.timeout(start_timeout):
            await asyncio.wait(
                [asyncio.create_task(listening.wait()), reader],
                return_when=asyncio.FIRST_COMPLETED,
            )
        assert listening.is_set(), "".join(lines)
        base = next(line for line in lines if "listening on" in line).split("listening on ")[1]
        gateway = Gateway(base.split()[0], lines)
        yield gateway
    finally:
        if up.returncode is None:
            up.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            await reader
            code = await up.wait()
    gateway.code = code
