"""What goes away must leave nothing behind: a client that leaves while queued for admission,
a client that trickles its body, replicas that churn, tenant snapshots applied off the loop.
Real HTTP over loopback, real sim replicas, real sockets."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import uvicorn
from prometheus_client import CollectorRegistry, generate_latest

from gpufleet.engine.server import SimEngineConfig, create_app
from gpufleet.fleet import ReplicaId
from gpufleet.gateway import Upstream, create_gateway
from gpufleet.gateway._http11 import Http11ReplicaClient
from gpufleet.gateway._replicas import Listener
from gpufleet.store import TenantSettings
from tests.gateway.conftest import FAST, MODEL, Running, eventually, fleet, serve_app
from tests.gateway.tenants import serve_tenant_gateway, tenant_fleet

_CHAT = b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8%s}'


class LoopReplicas:
    """A replica source whose ``update`` runs on the gateway's loop (as a runtime's does)."""

    def __init__(self, replicas: Sequence[Upstream]) -> None:
        self._replicas = tuple(replicas)
        self._listener: Listener | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self._loop = asyncio.get_running_loop()
        self._listener = listener
        listener(self._replicas)
        return lambda: None

    def update(self, replicas: Sequence[Upstream]) -> None:
        assert self._loop is not None
        assert self._listener is not None
        listener = self._listener
        done = threading.Event()

        def apply() -> None:
            listener(tuple(replicas))
            done.set()

        self._loop.call_soon_threadsafe(apply)
        assert done.wait(5)


@contextmanager
def sim_on_ports(n: int, time_scale: float = FAST) -> Iterator[list[str]]:
    """One sim replica listening on ``n`` loopback ports (as many addresses)."""
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    config = SimEngineConfig(time_scale=time_scale, max_model_len=4096)
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), log_level="warning", ws="none", lifespan="on")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": socks}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive(), "replica did not start"
        assert time.monotonic() < deadline, "replica did not start"
        time.sleep(0.01)
    try:
        yield [f"http://127.0.0.1:{s.getsockname()[1]}" for s in socks]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        for sock in socks:
            sock.close()


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + 10
    while httpx.get(url + "/ready").status_code != 200:
        assert time.monotonic() < deadline, "gateway not ready"
        time.sleep(0.02)


def _raw_post(port: int, body: bytes, key: str | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    auth = b"" if key is None else b"authorization: Bearer %s\r\n" % key.encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"%scontent-length: %d\r\n\r\n%s" % (auth, len(body), body)
    )
    return sock


def test_a_client_that_leaves_while_queued_gives_its_place_back(tmp_path: Path) -> None:
    """A saturated pool (one sequence), auth on: a queued streaming client disconnects → its
    ticket leaves the fair queue at once, its quota lease is given back, and nothing is sent
    to a replica for it when the slot frees."""
    slow = SimEngineConfig(time_scale=1.0, max_model_len=4096)  # a stream that stays open
    config = tenant_fleet(args=["--max-num-seqs", "1"], admission={"max_wait": 30.0})
    with serve_app(create_app(slow)) as a, serve_tenant_gateway(tmp_path, config, [a]) as gw:
        _, key = gw.store.create_key("leaver", TenantSettings(concurrency=2))
        gw.tenancy.reload()
        pool = gw.pool
        attempts = "gpufleet:gateway_upstream_attempts_total"
        with openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0) as c:
            stream = c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                max_tokens=2000,
                stream=True,
            )
            next(iter(stream))
            assert gw.saturated()
            port = int(gw.url.rsplit(":", 1)[1])
            queued = _raw_post(port, _CHAT % (MODEL.encode(), b', "stream": true'), key)
            eventually(lambda: pool.queued, 1)
            quota = gw.tenancy.quotas.local("leaver")
            assert quota.running == 2
            queued.close()
            eventually(lambda: pool.queued, 0, within=1.0)  # at once, not at the deadline
            eventually(lambda: quota.running, 1, within=1.0)  # its lease is given back
            stream.close()  # the slot frees: no one is waiting for it
        time.sleep(0.3)
        replica = f"{MODEL}-0"
        assert gw.sample(attempts, replica=replica, outcome="cancelled") == 1
        assert gw.sample(attempts, replica=replica, outcome="success") == 0
        eventually(
            lambda: gw.sample("gpufleet:gateway_requests_total", model=MODEL, status="499"), 2
        )
        assert pool.in_flight == 0


def test_a_trickled_request_body_gets_408_and_the_connection_closes() -> None:
    """A client that sends its body a byte at a time holds neither handler nor connection
    past ``timeouts.request_body``."""
    config = fleet(routing="least_request", gateway={"timeouts": {"request_body": 0.3}})
    registry = CollectorRegistry()
    with sim_on_ports(1) as urls:
        replicas = LoopReplicas([Upstream(ReplicaId(f"{MODEL}-0"), MODEL, urls[0])])
        app = create_gateway(config, replicas, registry)
        with serve_app(app, "own") as url:
            _wait_ready(url)
            port = int(url.rsplit(":", 1)[1])
            body = _CHAT % (MODEL.encode(), b"")
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
            )
            answer = b""
            started = time.monotonic()
            for byte in body:  # one byte every 50 ms: the whole body would take seconds
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    break
                time.sleep(0.05)
                sock.settimeout(0.001)
                try:
                    answer += sock.recv(65536)
                except (TimeoutError, BlockingIOError):
                    pass
                except OSError:
                    break
                if b"\r\n\r\n" in answer:
                    break
            sock.settimeout(5)
            while chunk := sock.recv(65536):
                answer += chunk  # until the gateway closes the connection
            sock.close()
            assert time.monotonic() - started < 3
            assert answer.startswith(b"HTTP/1.1 408 ")
            assert b'"type":"invalid_request_error"' in answer.replace(b" ", b"")
            assert b"connection: close" in answer.lower()


def test_replicas_that_churn_leave_no_series_or_connections_behind() -> None:
    """Pods with unique names come and go (operator mode): /metrics keeps no series of a gone
    replica, the metric children and upstream connections stay bounded; one with a request in
    flight keeps its in-flight gauge until that request ends."""
    config = fleet(routing="least_request", health={"active": {"interval": 0.05}})
    registry = CollectorRegistry()
    with sim_on_ports(4) as urls, sim_on_ports(1, time_scale=1.0) as slow:
        replicas = LoopReplicas([Upstream(ReplicaId("pod-0"), MODEL, urls[0])])
        app = create_gateway(config, replicas, registry)
        with serve_app(app, "own") as url:
            _wait_ready(url)
            running = Running(url, app, registry)
            with openai.OpenAI(base_url=running.v1, api_key="x", max_retries=0) as c:
                for k in range(8):
                    if k:
                        replicas.update([Upstream(ReplicaId(f"pod-{k}"), MODEL, urls[k % 4])])
                        _wait_ready(url)
                    for _ in range(2):
                        c.chat.completions.create(
                            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                        )
                # one that leaves with a stream in flight
                replicas.update([Upstream(ReplicaId("pod-slow"), MODEL, slow[0])])
                _wait_ready(url)
                stream = c.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "x"}],
                    max_tokens=2000,
                    stream=True,
                )
                next(iter(stream))
                replicas.update([Upstream(ReplicaId("pod-last"), MODEL, urls[0])])
                in_flight = "gpufleet:gateway_in_flight_requests"
                assert running.sample(in_flight, replica="pod-slow") == 1  # kept while it runs
                stream.close()
                eventually(
                    lambda: registry.get_sample_value(in_flight, {"replica": "pod-slow"}), None
                )
                time.sleep(0.2)
            text = generate_latest(registry).decode()
            assert "pod-last" in text or "pod-" not in text
            gone = [f'"pod-{k}"' for k in range(8)] + ['"pod-slow"']
            assert [name for name in gone if name in text] == []
            children = app.metrics._children
            replica_keys = [k for k in children if k[1][0].startswith("pod-")]
            assert all(k[1][0] == "pod-last" for k in replica_keys)
            client = app._client
            assert isinstance(client, Http11ReplicaClient)
            assert set(client._targets) <= {urls[0]}
            assert len(client._idle) <= 1


def test_tenant_snapshots_apply_on_the_event_loop(tmp_path: Path) -> None:
    """The periodic reload and an admin action read the store in a thread but apply the
    snapshot on the loop: a worker thread never touches the quotas requests use."""
    with sim_on_ports(1) as urls, serve_tenant_gateway(tmp_path, tenant_fleet(), urls) as gw:
        on_loop: list[bool] = []
        quotas = gw.tenancy.quotas
        set_limits = quotas.set_limits

        def recording(tenant: str, limits: object) -> None:
            try:
                asyncio.get_running_loop()
                on_loop.append(True)
            except RuntimeError:
                on_loop.append(False)
            set_limits(tenant, limits)  # type: ignore[arg-type]

        quotas.set_limits = recording  # type: ignore[method-assign]
        admin = {"authorization": "Bearer admin-secret-for-tests"}
        answer = httpx.put(gw.url + "/admin/tenants/t1", json={"rpm": 10}, headers=admin)
        assert answer.status_code < 300, answer.text
        time.sleep(0.5)  # refresh_interval is 0.2 s: periodic reloads ran too
        assert on_loop
        assert all(on_loop)
