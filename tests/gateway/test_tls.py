"""TLS on both sides of the gateway, over loopback with a test CA made by ``openssl``.

The client side: the gateway under its own server with a ``ServerTLS`` answers the official
openai client over HTTPS (whole and streamed answers, 16 clients at once), closes a
connection that speaks plain HTTP to it and goes on serving, and serves a new certificate
to new connections once its files change (a pair that does not load is logged and the old
one kept). The replica side: ``Http11ReplicaClient`` reaches a sim replica served over HTTPS
with the fleet file's CA bundle (requests, streams, probes, scrapes) and fails to connect,
as to a dead replica, when the certificate is not one it trusts.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from gpufleet.config import parse_fleet
from gpufleet.engine.server import SimEngineConfig, create_app
from gpufleet.fleet import Outcome, ReplicaId
from gpufleet.gateway import (
    Http11ReplicaClient,
    LocalOriginError,
    ReplicaTLS,
    ServerTLS,
    StaticReplicas,
    Upstream,
    UpstreamRequest,
    create_gateway,
)
from tests.gateway.conftest import FAST, MODEL, fleet, serve_app, sim_replica
from tests.tls_certs import Issued, TestCA


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("ca"))


def trusting(ca: TestCA) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca.cert))


@contextmanager
def https_gateway(tls: ServerTLS, ca: TestCA) -> Iterator[str]:
    """The gateway over one sim replica, under ``GatewayServer`` with ``tls``: its URL once
    ready."""
    with sim_replica() as replica:
        app = create_gateway(
            fleet(health={"active": {"interval": 0.2}}),
            StaticReplicas([Upstream(ReplicaId(f"{MODEL}-0"), MODEL, replica)]),
            CollectorRegistry(),
        )
        with serve_app(app, "own", tls=tls) as url, httpx.Client(verify=trusting(ca)) as http:
            deadline = time.monotonic() + 10
            while http.get(url + "/ready").status_code != 200:
                assert time.monotonic() < deadline, "gateway not ready"
                time.sleep(0.02)
            yield url


def serial_served(url: str, ca: TestCA) -> int:
    """The serial number of the certificate a new connection to ``url`` gets."""
    port = int(url.rsplit(":", 1)[1])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        trusting(ca).wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        cert = tls.getpeercert()
    assert cert is not None
    return int(str(cert["serialNumber"]), 16)


def chat(client: openai.OpenAI, text: str, *, stream: bool = False) -> str:
    if not stream:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=4
        )
        return reply.choices[0].message.content or ""
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=6,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def openai_client(url: str, ca: TestCA) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url + "/v1",
        api_key="none",
        max_retries=0,
        http_client=httpx.Client(verify=trusting(ca)),
    )


def test_the_openai_client_over_https(ca: TestCA, tmp_path: Path) -> None:
    issued = ca.issue("gateway", folder=tmp_path)
    with https_gateway(ServerTLS(str(issued.cert), str(issued.key)), ca) as url:
        assert url.startswith("https://")
        with openai_client(url, ca) as client:
            assert chat(client, "Say hello")
            assert len(chat(client, "Count", stream=True).split()) == 6  # relayed over TLS
        assert serial_served(url, ca) == issued.serial
        # a client that does not trust the CA does not get through
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(url + "/health")


def test_plain_http_to_the_tls_port_is_closed_and_serving_goes_on(
    ca: TestCA, tmp_path: Path
) -> None:
    issued = ca.issue("gateway", folder=tmp_path)
    with https_gateway(ServerTLS(str(issued.cert), str(issued.key)), ca) as url:
        port = int(url.rsplit(":", 1)[1])
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as plain:
                plain.sendall(b"GET /health HTTP/1.1\r\nhost: gateway\r\n\r\n")
                try:
                    answer = plain.recv(4096)
                except ConnectionResetError:
                    answer = b""
                assert not answer.startswith(b"HTTP/")  # closed, nothing served in clear
        # a client that connects and never says hello does not hold anything up either
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5),
            openai_client(url, ca) as client,
        ):
            assert chat(client, "still there?")
            assert chat(client, "and streaming?", stream=True)


def _replace(issued: Issued, cert: Path, key: Path) -> None:
    """Put ``issued``'s pair where the server reads its files, each file atomically (key
    first: between the two renames the pair does not match, as in a real rollout)."""
    for source, target in ((issued.key, key), (issued.cert, cert)):
        staged = target.with_suffix(".new")
        staged.write_bytes(source.read_bytes())
        os.replace(staged, target)


def _eventually_served(url: str, ca: TestCA, serial: int, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while (seen := serial_served(url, ca)) != serial:
        assert time.monotonic() < deadline, f"still serving {seen:x}, not {serial:x}"
        time.sleep(0.05)


def test_a_changed_certificate_is_served_to_new_connections(
    ca: TestCA, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = ca.issue("first", folder=tmp_path / "first")
    second = ca.issue("second", folder=tmp_path / "second")
    third = ca.issue("third", folder=tmp_path / "third")
    live = tmp_path / "live"
    live.mkdir()
    cert, key = live / "tls.pem", live / "tls.key"
    _replace(first, cert, key)
    tls = ServerTLS(str(cert), str(key), reload_interval=0.1)
    with https_gateway(tls, ca) as url, openai_client(url, ca) as client:
        assert serial_served(url, ca) == first.serial
        assert chat(client, "before")  # a kept-alive connection, made with the first

        _replace(second, cert, key)
        _eventually_served(url, ca, second.serial)
        assert chat(client, "the old connection still works")

        # a key that is not the certificate's: logged, and the second pair stays in use
        caplog.set_level(logging.ERROR, logger="gpufleet.tls")
        key.write_bytes(third.key.read_bytes())
        deadline = time.monotonic() + 5
        while not any("not reloaded" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no error logged for the mismatched pair"
            time.sleep(0.05)
        assert serial_served(url, ca) == second.serial
        with openai_client(url, ca) as fresh:
            assert chat(fresh, "a new connection during the bad pair")

        cert.write_bytes(third.cert.read_bytes())  # the pair is whole again
        _eventually_served(url, ca, third.serial)
        assert tls.reloads == 2


def test_16_concurrent_clients_over_tls(ca: TestCA, tmp_path: Path) -> None:
    issued = ca.issue("gateway", folder=tmp_path)
    with https_gateway(ServerTLS(str(issued.cert), str(issued.key)), ca) as url:

        def one_client(i: int) -> int:
            with openai_client(url, ca) as client:  # its own connection, its own handshake
                done = 0
                for j in range(4):
                    assert chat(client, f"client {i} request {j}", stream=j % 2 == 1)
                    done += 1
                return done

        with ThreadPoolExecutor(16) as pool:
            assert sum(pool.map(one_client, range(16))) == 64


# -- the replica side -------------------------------------------------------------------


@contextmanager
def https_replica(issued: Issued) -> Iterator[str]:
    """A sim replica served by uvicorn over HTTPS with ``issued``."""
    app = create_app(SimEngineConfig(time_scale=FAST, max_model_len=4096))
    with serve_app(app, tls=ServerTLS(str(issued.cert), str(issued.key))) as url:
        yield url


def replica_tls(url: str, ca: TestCA) -> ReplicaTLS:
    """What ``gpufleet up`` builds from a fleet file naming ``url`` and the CA bundle."""
    config = parse_fleet(
        {
            "models": [
                {"name": MODEL, "engine": "external", "endpoints": [url], "ca_file": str(ca.cert)}
            ]
        }
    )
    return ReplicaTLS.of(config)


def _chat_request(url: str, *, stream: bool) -> UpstreamRequest:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        "stream": stream,
        "ignore_eos": True,
    }
    return UpstreamRequest(
        url,
        "/v1/chat/completions",
        json.dumps(body).encode(),
        [("content-type", "application/json")],
    )


@pytest.mark.asyncio
async def test_the_upstream_client_speaks_tls_to_an_https_replica(
    ca: TestCA, tmp_path: Path
) -> None:
    with https_replica(ca.issue("replica", folder=tmp_path)) as url:
        assert url.startswith("https://")
        async with Http11ReplicaClient(connect=2.0, tls=replica_tls(url, ca)) as client:
            for _ in range(2):  # the second on the kept-alive connection
                async with client.send(_chat_request(url, stream=False)) as response:
                    body = b"".join([c async for c in response.chunks])
                assert response.status == 200
                assert json.loads(body)["usage"]["completion_tokens"] == 5
            async with client.send(_chat_request(url, stream=True)) as response:
                assert response.relay is not None  # chunked: relayable as over plain HTTP
                streamed = b"".join([c async for c in response.chunks])
            assert streamed.count(b"data: ") == 7  # 5 tokens, the usage-less end, [DONE]
            assert (await client.get(url + "/health", timeout=2.0))[0] == 200
            status, page = await client.get(url + "/metrics", timeout=2.0)
            assert status == 200
            assert b"vllm:num_requests_running" in page


@pytest.mark.asyncio
async def test_an_untrusted_replica_certificate_is_a_connect_failure(
    ca: TestCA, tmp_path: Path
) -> None:
    other_ca = TestCA(tmp_path / "other", name="other")
    with https_replica(other_ca.issue("replica", folder=tmp_path)) as url:
        # the system's trust store (no ca_file), and a CA bundle that did not sign it
        for tls in (ReplicaTLS(), replica_tls(url, ca)):
            async with Http11ReplicaClient(connect=2.0, tls=tls) as client:
                with pytest.raises(LocalOriginError, match="CERTIFICATE_VERIFY_FAILED") as caught:
                    async with client.send(_chat_request(url, stream=False)):
                        pass
                assert caught.value.outcome is Outcome.CONNECT_FAILURE
    # a certificate the CA signed, for another name
    with https_replica(ca.issue("elsewhere", ("replica.example",), folder=tmp_path)) as url:
        async with Http11ReplicaClient(connect=2.0, tls=replica_tls(url, ca)) as client:
            with pytest.raises(LocalOriginError, match="CERTIFICATE_VERIFY_FAILED"):
                await client.get(url + "/health", timeout=2.0)
