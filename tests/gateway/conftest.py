"""Gateway fixtures: real sim replicas under uvicorn and the real gateway under its own server
(``GatewayServer``, as ``gpufleet up`` serves it; ``server="uvicorn"`` for uvicorn), each on
127.0.0.1:0.

Each server runs its own event loop in a thread (like httpx's ``serve_in_thread``); tests talk
to the gateway with the official ``openai`` client over loopback.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import httpx
import uvicorn
import uvloop
from prometheus_client import CollectorRegistry

from gpufleet.config import FleetConfig, parse_fleet
from gpufleet.engine.server import FaultConfig, SimEngineConfig, create_app
from gpufleet.fleet import ReplicaId
from gpufleet.gateway import (
    Gateway,
    GatewayServer,
    ServerTLS,
    StaticReplicas,
    Upstream,
    create_gateway,
)

FAST = 200.0
"""Sim time scale: 200 modelled seconds per real second."""
MODEL = "llama-3.1-8b"


@contextmanager
def serve_app(
    app: Any, server_kind: str = "uvicorn", *, tls: ServerTLS | None = None
) -> Iterator[str]:
    """Serve ``app`` on a free loopback port in a thread; yields its base URL.

    ``server_kind``: ``"uvicorn"`` or ``"own"`` (the gateway's ``GatewayServer`` on uvloop).
    ``tls``: serve HTTPS with its certificate (uvicorn: its files, never reloaded).
    """
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server: uvicorn.Server | GatewayServer
    if server_kind == "own":
        server = GatewayServer(app, graceful_timeout=2, tls=tls)

        def run() -> None:
            assert isinstance(server, GatewayServer)
            uvloop.run(server.serve([sock]))
    else:
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level="warning",
                ws="none",
                lifespan="on",
                timeout_graceful_shutdown=2,
                ssl_certfile=None if tls is None else tls.cert_file,
                ssl_keyfile=None if tls is None else tls.key_file,
            )
        )
        run = partial(server.run, sockets=[sock])
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.01)
    try:
        yield f"{'http' if tls is None else 'https'}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextmanager
def sim_replica(
    faults: FaultConfig | None = None, seed: int = 0, name: str | None = None
) -> Iterator[str]:
    """A sim engine (``name``: the model name it serves, default its own)."""
    named = {} if name is None else {"served_model_name": name}
    config = SimEngineConfig(
        time_scale=FAST, max_model_len=4096, seed=seed, faults=faults or FaultConfig(), **named
    )
    with serve_app(create_app(config)) as url:
        yield url


def closed_port_url() -> str:
    """A loopback URL nothing listens on (connection refused)."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def fleet(**model: Any) -> FleetConfig:
    gateway = model.pop("gateway", {})
    return parse_fleet({"models": [{"name": MODEL, **model}], "gateway": gateway})


class Running:
    """A gateway being served: its URL, app and metrics registry."""

    def __init__(self, url: str, app: Gateway, registry: CollectorRegistry) -> None:
        self.url = url
        self.app = app
        self.registry = registry

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def sample(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@contextmanager
def serve_gateway(
    config: FleetConfig, urls: Sequence[str], *, wait_ready: bool = True, server: str = "own"
) -> Iterator[Running]:
    replicas = [Upstream(ReplicaId(f"{MODEL}-{i}"), MODEL, url) for i, url in enumerate(urls)]
    registry = CollectorRegistry()
    app = create_gateway(config, StaticReplicas(replicas), registry)
    with serve_app(app, server) as url:
        if wait_ready:
            deadline = time.monotonic() + 10
            while httpx.get(url + "/ready").status_code != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError("gateway not ready")
                time.sleep(0.02)
        yield Running(url, app, registry)


def eventually(read: Any, expected: float, within: float = 2.0) -> None:
    """Wait until ``read()`` returns ``expected``: a response's last byte reaches the client
    a moment before the gateway's metrics count it."""
    deadline = time.monotonic() + within
    while (value := read()) != expected:
        assert time.monotonic() < deadline, f"{value} != {expected}"
        time.sleep(0.01)
