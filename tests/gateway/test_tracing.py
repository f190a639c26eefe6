"""The gateway's spans, read from the OpenTelemetry SDK's in-memory exporter: what a
request's trace holds, what goes upstream, sampling, and what a request that never reaches
a replica leaves (the live OTLP path under a replica kill: ``test_tracing_live.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import CollectorRegistry

from gpufleet.config import FleetFileError, parse_fleet
from gpufleet.engine.server import SimEngineConfig, create_app
from gpufleet.fleet import ReplicaId
from gpufleet.gateway import StaticReplicas, Upstream, create_gateway
from gpufleet.gateway._tracing import Tracing
from tests.gateway.conftest import MODEL, serve_app, sim_replica

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


Spans = Callable[[], list[ReadableSpan]]


@contextmanager
def traced_gateway(urls: list[str], sample: float = 1.0) -> Iterator[tuple[str, Spans]]:
    """A gateway over ``urls`` whose spans go to an in-memory exporter; yields its URL and
    what reads the spans that ended so far."""
    config = parse_fleet(
        {
            "models": [{"name": MODEL, "routing": "round_robin"}],
            "gateway": {"tracing": {"endpoint": "http://127.0.0.1:9/v1/traces", "sample": sample}},
        }
    )
    assert config.gateway.tracing is not None
    replicas = [Upstream(ReplicaId(f"{MODEL}-{i}"), MODEL, u) for i, u in enumerate(urls)]
    app = create_gateway(config, StaticReplicas(replicas), CollectorRegistry())
    exporter = InMemorySpanExporter()
    tracing = app.tracing = Tracing(config.gateway.tracing, exporter=exporter)

    def spans() -> list[ReadableSpan]:
        tracing.provider.force_flush()
        return list(exporter.get_finished_spans())

    with serve_app(app, "own") as url:
        yield url, spans


@contextmanager
def header_echo() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """An upstream that answers every chat with a fixed completion and keeps the headers
    it was sent (what an engine that continues the trace reads)."""
    seen: list[dict[str, str]] = []
    answer = json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hi"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }
    ).encode()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        seen.append({k.decode(): v.decode() for k, v in scope["headers"]})
        while (await receive()).get("more_body"):
            pass
        body = answer if scope["path"] == "/v1/chat/completions" else b"{}"
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    with serve_app(app) as url:
        yield url, seen


def test_a_request_is_one_trace_that_continues_the_clients_and_goes_upstream() -> None:
    with (
        header_echo() as (upstream, seen),
        traced_gateway([upstream]) as (url, spans),
        openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client,
    ):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            extra_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
        )
        ended = spans()
    assert {s.context.trace_id for s in ended} == {int(CLIENT_TRACE, 16)}
    (server,) = [s for s in ended if s.kind == SpanKind.SERVER]
    (route,) = [s for s in ended if s.name == "gpufleet.route"]
    (attempt,) = [s for s in ended if s.name == "gpufleet.attempt"]
    assert server.parent is not None
    assert server.parent.span_id == int(CLIENT_SPAN, 16)
    assert server.attributes is not None
    assert route.attributes is not None
    assert attempt.attributes is not None
    assert server.attributes["gen_ai.request.model"] == MODEL
    assert server.attributes["gen_ai.operation.name"] == "chat"
    assert server.attributes["http.response.status_code"] == 200
    for child in (route, attempt):
        assert child.parent is not None
        assert child.parent.span_id == server.context.span_id
    assert route.attributes["gpufleet.replica"] == f"{MODEL}-0"
    assert route.attributes["gpufleet.routing.policy"] == "round_robin"
    assert attempt.kind == SpanKind.CLIENT
    assert attempt.attributes["gpufleet.outcome"] == "success"
    # the engine gets the attempt's span as its parent: its own spans join the trace
    sent = [h for h in seen if "traceparent" in h]
    assert [h["traceparent"] for h in sent] == [
        f"00-{CLIENT_TRACE}-{attempt.context.span_id:016x}-01"
    ]


def test_a_refused_connection_is_a_failed_attempt_then_a_retry() -> None:
    with (
        sim_replica() as good,
        traced_gateway(["http://127.0.0.1:9", good]) as (url, spans),
        openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client,
    ):
        for _ in range(4):  # round robin: some go to the closed port first
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
    traces: dict[int, list[ReadableSpan]] = {}
    for span in spans():
        traces.setdefault(span.context.trace_id, []).append(span)
    assert len(traces) == 4
    retried = [t for t in traces.values() if sum(s.name == "gpufleet.attempt" for s in t) == 2]
    assert retried, "no request met the closed port first"
    for trace in retried:
        first, second = sorted(
            (s for s in trace if s.name == "gpufleet.attempt"), key=lambda s: s.start_time or 0
        )
        assert first.status.status_code == StatusCode.ERROR
        assert first.attributes is not None
        assert second.attributes is not None
        assert first.attributes["gpufleet.outcome"] == "connect_failure"
        assert second.attributes["gpufleet.retry"] is True
        assert second.attributes["gpufleet.outcome"] == "success"
        assert sum(s.name == "gpufleet.route" for s in trace) == 2  # the retry's decision


def test_requests_that_reach_no_replica_are_traced_with_their_status() -> None:
    with sim_replica() as good, traced_gateway([good]) as (url, spans):
        unknown = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            timeout=10,
        )
        broken = httpx.post(url + "/v1/completions", content=b"{not json", timeout=10)
    assert (unknown.status_code, broken.status_code) == (404, 400)
    ended = spans()
    assert sorted((s.name, s.attributes["http.response.status_code"]) for s in ended) == [  # type: ignore[index]
        ("POST /v1/chat/completions", 404),
        ("POST /v1/completions", 400),
    ]


def test_a_client_that_leaves_mid_stream_ends_its_spans() -> None:
    slow = create_app(SimEngineConfig(time_scale=1.0, max_model_len=4096))  # ~20 s to answer
    with serve_app(slow) as replica, traced_gateway([replica]) as (url, spans):
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 2000, "stream": True},
            timeout=10,
        ) as response:
            next(response.iter_lines())  # the first chunk, then away
        for _ in range(200):
            if any(s.kind == SpanKind.SERVER for s in spans()):
                break
            httpx.get(url + "/health")
    ended = spans()
    (server,) = [s for s in ended if s.kind == SpanKind.SERVER]
    (attempt,) = [s for s in ended if s.name == "gpufleet.attempt"]
    assert server.attributes is not None
    assert attempt.attributes is not None
    assert server.attributes["http.response.status_code"] == 499  # the client left
    assert attempt.attributes["gpufleet.outcome"] == "cancelled"


@pytest.mark.parametrize(
    ("flags", "kept"), [(None, False), ("01", True), ("00", False)], ids=["new", "sampled", "not"]
)
def test_sampling_keeps_a_share_of_new_traces_and_follows_the_clients_choice(
    flags: str | None, kept: bool
) -> None:
    headers = {} if flags is None else {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-{flags}"}
    with sim_replica() as good, traced_gateway([good], sample=0.0) as (url, spans):
        answer = httpx.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 2},
            headers=headers,
            timeout=10,
        )
        assert answer.status_code == 200
    assert bool(spans()) == kept


def test_off_the_gateway_never_imports_its_tracing() -> None:
    """(OpenTelemetry's API itself may be imported by others: redis does where installed.)"""
    code = (
        "import sys; from prometheus_client import CollectorRegistry;"
        "from gpufleet.config import parse_fleet;"
        "from gpufleet.gateway import StaticReplicas, create_gateway;"
        f"app = create_gateway(parse_fleet({{'models': [{{'name': '{MODEL}'}}]}}),"
        " StaticReplicas([]), CollectorRegistry());"
        "assert app.tracing is None;"
        "print([m for m in sys.modules if m.endswith('_tracing') or 'otlp' in m])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_tracing_without_the_extra_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gpufleet.gateway._tracing", None)  # as if not importable
    config = parse_fleet(
        {
            "models": [{"name": MODEL}],
            "gateway": {"tracing": {"endpoint": "http://127.0.0.1:4318/v1/traces"}},
        }
    )
    with pytest.raises(ValueError, match=r"pip install 'gpufleet\[tracing\]'"):
        create_gateway(config, StaticReplicas([]), CollectorRegistry())


@pytest.mark.parametrize(
    "tracing",
    [
        {"endpoint": "127.0.0.1:4318"},
        {"endpoint": "http://x/v1/traces", "sample": 1.5},
        {"endpoint": "http://x/v1/traces", "export_interval": 0},
        {"sample": 0.5},
    ],
)
def test_a_bad_tracing_section_is_a_fleet_file_error(tracing: dict[str, Any]) -> None:
    with pytest.raises(FleetFileError, match=r"gateway\.tracing"):
        parse_fleet({"models": [{"name": MODEL}], "gateway": {"tracing": tracing}})
