"""Sim engine fixtures: the real app under a real uvicorn on 127.0.0.1, port chosen by the OS.

Like httpx's ``serve_in_thread``: the server runs its own event loop in a thread, the test
talks to it over loopback with real clients (the official ``openai`` client included).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.engine.server import SimEngineConfig, create_app

FAST = 200.0
"""Time scale for tests that do not measure time: 200 modelled seconds per real second."""


class Served:
    """A running sim engine: its base URL and the app (for its engine's read-only state)."""

    def __init__(self, url: str, app: Any) -> None:
        self.url = url
        self.app = app

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def metrics(self) -> dict[str, Any]:
        """``/metrics`` parsed by prometheus_client: family name → family."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return {family.name: family for family in text_string_to_metric_families(text)}

    def sample(self, family: str, sample: str | None = None, **labels: str) -> float:
        for s in self.metrics()[family].samples:
            if s.name == (sample or family) and all(
                s.labels.get(k) == v for k, v in labels.items()
            ):
                return float(s.value)
        raise KeyError(f"{sample or family} {labels}")


@contextmanager
def serve(config: SimEngineConfig) -> Iterator[Served]:
    app = create_app(config)
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app, log_level="warning", ws="none", lifespan="on", timeout_graceful_shutdown=2
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("sim engine did not start")
        time.sleep(0.01)
    try:
        yield Served(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def sim() -> Iterator[Served]:
    """One shared sim engine at ``FAST`` time scale, with a short context window."""
    with serve(SimEngineConfig(time_scale=FAST, max_model_len=4096, seed=1)) as served:
        yield served
