"""Issue 19's traces, as a user meets them: ``gpufleet up`` with ``gateway.tracing`` sends
its spans over OTLP/HTTP to a collector (here a local receiver on loopback, decoding the
protocol's protobuf); the official client continues its own trace through the gateway to the
sim engine that answers; a replica is SIGKILLed under 16 clients and the traces show the
failed attempt and its retry."""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import openai

from tests.otlp_receiver import CLIENT, ERROR, INTERNAL, SERVER, Span, otlp_receiver
from tests.up_process import replica_pids, start_up, stop, wait_routable

FLEET = """
gateway:
  tracing: {{endpoint: "{endpoint}", export_interval: 0.2, service_name: gw-test}}
models:
  - name: llama-3.1-8b
    replicas: 2
    routing: least_request
    args: ["--time-scale", "0.25", "--max-model-len", "2048"]
    health: {{active: {{interval: 0.2}}, outlier: {{base_ejection_time: 0.5}}}}
"""
"""Two sim replicas at a quarter of the modelled speed (a chat takes ~0.5 s), balanced by
least request: each has some eight requests in flight when one is killed."""
CLIENTS = 16


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def test_a_client_trace_continues_through_the_gateway_across_a_replica_kill(
    tmp_path: Path,
) -> None:
    with otlp_receiver() as (receiver, endpoint):
        (tmp_path / "fleet.yaml").write_text(FLEET.format(endpoint=endpoint))
        # the engines export every 0.2 s too (the SDK's variable): a killed one loses less
        env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "200"}
        process, base = start_up(
            tmp_path / "fleet.yaml", tmp_path / "up.out", run_dir=tmp_path / "run", env=env
        )
        done = threading.Event()
        lock = threading.Lock()
        sent: dict[str, tuple[str, bool]] = {}  # trace id -> (client span id, streamed)
        failed: Counter[str] = Counter()

        def send(worker: int) -> None:
            with openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as client:
                i = 0
                while not done.is_set():
                    i += 1
                    trace_id, span_id, header = _traceparent()
                    stream = i % 2 == 0
                    try:
                        answer = client.chat.completions.create(
                            model="llama-3.1-8b",
                            messages=[{"role": "user", "content": f"client {worker}, chat {i}"}],
                            max_tokens=16,
                            stream=stream,
                            extra_headers={"traceparent": header},
                        )
                        if stream:
                            for _ in answer:  # type: ignore[union-attr]
                                pass
                    except openai.APIError as error:
                        with lock:
                            failed[str(error)[:160]] += 1
                    else:
                        with lock:
                            sent[trace_id] = (span_id, stream)

        threads = [threading.Thread(target=send, args=(w,)) for w in range(CLIENTS)]
        try:
            wait_routable(base, "llama-3.1-8b", 2)
            for t in threads:
                t.start()
            time.sleep(1.5)
            os.kill(replica_pids(process.pid)[0], signal.SIGKILL)
            wait_routable(base, "llama-3.1-8b", 2)  # restarted
            time.sleep(1.0)
            done.set()
            for t in threads:
                t.join(timeout=30)
            process.send_signal(signal.SIGTERM)  # a drain: the last spans are exported
            process.wait(timeout=30)
        finally:
            done.set()
            stop(process)
        traces = receiver.traces()

    assert not failed, f"{sum(failed.values())} requests failed: {dict(failed)}"
    assert len(sent) > 50
    missing = [t for t in sent if t not in traces]
    assert not missing, f"{len(missing)} of {len(sent)} client traces have no gateway span"
    retried = engine_spans = 0
    for trace_id, (client_span, streamed) in sent.items():
        spans = [s for s in traces[trace_id] if s.service == "gw-test"]
        engine = [s for s in traces[trace_id] if s.service != "gw-test"]
        (server,) = [s for s in spans if s.kind == SERVER]
        assert server.service == "gw-test"
        assert server.name == "POST /v1/chat/completions"
        assert server.parent_id == client_span  # the client's trace, continued
        assert server.attributes["http.response.status_code"] == 200
        assert server.attributes["gen_ai.request.model"] == "llama-3.1-8b"
        assert server.status != ERROR
        children = [s for s in spans if s.parent_id == server.span_id]
        assert len(children) == len(spans) - 1, "every gateway span is the request's child"
        routes = sorted((s for s in children if s.kind == INTERNAL), key=lambda s: s.start_ns)
        attempts = sorted((s for s in children if s.kind == CLIENT), key=lambda s: s.start_ns)
        assert routes
        assert attempts
        assert [s.name for s in routes] == ["gpufleet.route"] * len(routes)
        assert routes[0].attributes["gpufleet.routing.policy"]
        # each attempt goes where the decision before it said, and inside the request
        _follows(routes, attempts)
        for span in children:
            assert server.start_ns <= span.start_ns <= span.end_ns <= server.end_ns
        last = attempts[-1]
        assert last.attributes["gpufleet.outcome"] == "success"
        assert last.attributes["http.response.status_code"] == 200
        assert last.status != ERROR
        for earlier in attempts[:-1]:  # a failed attempt is marked so, the next says why
            assert earlier.status == ERROR
        # the engine that answered continued the trace under the attempt that reached it
        # (spans an engine had not exported yet die with it when it is killed)
        assert {s.parent_id for s in engine} <= {a.span_id for a in attempts}
        for answered in [s for s in engine if s.parent_id == last.span_id]:
            assert answered.name == "llm_request"
            assert answered.service == "sim-engine llama-3.1-8b"
            assert 1 <= answered.attributes["gen_ai.usage.completion_tokens"] <= 16
            assert answered.attributes["gen_ai.latency.time_to_first_token"] > 0
            engine_spans += 1
        if len(attempts) > 1:
            retried += 1
            nxt = attempts[1].attributes
            assert nxt["gpufleet.retry"] or (streamed and nxt["gpufleet.resume"])
    print(
        f"{len(sent)} traced requests, {retried} with a retried or resumed attempt,"
        f" {engine_spans} engine spans"
    )
    assert retried >= 1, "the kill caught no request in flight"
    assert engine_spans >= 0.8 * len(sent), "the engines' spans did not join the traces"


def _follows(routes: list[Span], attempts: list[Span]) -> None:
    """Every attempt is on the replica of the last decision before it (a resumed stream's
    decision is the controller's too, but made inside the attempt that broke: it has no
    route span of its own)."""
    for attempt in attempts:
        before = [r for r in routes if r.end_ns <= attempt.start_ns]
        assert before, "an attempt before any decision"
        if attempt.attributes["gpufleet.resume"]:
            continue
        assert attempt.attributes["gpufleet.replica"] == before[-1].attributes["gpufleet.replica"]
