"""Sim engine fixtures: the real app under a real uvicorn on 127.0.0.1, port chosen by the OS.

Like httpx's ``serve_in_thread``: the server runs its own event loop in a thread, the test
talks to it over loopback with real clients (the official ``openai`` client included).
"""

from __future__ import annotations

import gc
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
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
        self._client: openai.OpenAI | None = None

    def client(self) -> openai.OpenAI:
        """One official client for this engine (thread-safe), closed when the engine stops:
        clients left to the garbage collector leave sockets for it to warn about."""
        if self._client is None:
            self._client = openai.OpenAI(
                base_url=self.v1, api_key="unused", max_retries=0, timeout=30
            )
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

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
    """The app under uvicorn in a thread; what the test process built so far is frozen out of
    the garbage collector while it runs, as ``gpufleet engine sim`` freezes its start-up heap
    (a full collection of the pytest heap between a request's arrival and its first step
    otherwise adds milliseconds to the modelled latencies that timing tests compare)."""
    gc.freeze()
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
    served = Served(f"http://127.0.0.1:{port}", app)
    try:
        yield served
    finally:
        served.close()
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        gc.unfreeze()


@pytest.fixture(scope="module")
def sim() -> Iterator[Served]:
    """One shared sim engine at ``FAST`` time scale, with a short context window."""
    with serve(SimEngineConfig(time_scale=FAST, max_model_len=4096, seed=1)) as served:
        yield served
