"""A local OTLP/HTTP trace receiver: what a collector does with ``POST /v1/traces``,
enough to read back the spans a process exported (real HTTP over loopback, the protobuf
messages of the OpenTelemetry protocol, decoded with its own generated classes)."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Span:
    """One exported span, flattened."""

    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    end_ns: int
    status: int
    """``0`` unset, ``1`` ok, ``2`` error (the protocol's ``Status.StatusCode``)."""
    attributes: dict[str, Any] = field(default_factory=dict)


SERVER, INTERNAL, CLIENT = 2, 1, 3  # the protocol's Span.SpanKind numbers
ERROR = 2


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return None if kind is None else getattr(any_value, kind)


class Receiver:
    """The spans received so far (thread-safe), by trace."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spans: list[Span] = []
        self.posts = 0

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(resource.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    spans.append(
                        Span(
                            service=service,
                            name=s.name,
                            kind=s.kind,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            status=s.status.code,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        with self._lock:
            self.spans.extend(spans)
            self.posts += 1

    def traces(self) -> dict[str, list[Span]]:
        with self._lock:
            spans = list(self.spans)
        out: dict[str, list[Span]] = {}
        for span in spans:
            out.setdefault(span.trace_id, []).append(span)
        return out


@contextmanager
def otlp_receiver() -> Iterator[tuple[Receiver, str]]:
    """A receiver on a free loopback port, and its traces URL."""
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            receiver.take(body)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver, f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    finally:
        server.shutdown()
        server.server_close()
