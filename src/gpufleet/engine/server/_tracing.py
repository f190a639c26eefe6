"""OpenTelemetry spans of the sim engine's requests, as vLLM's ``--otlp-traces-endpoint``
makes them: one ``llm_request`` span per completion, the child of the caller's
``traceparent`` (the gateway's attempt span), exported over OTLP/HTTP (docs/tracing.md).

Latencies on the span are *modelled* seconds (as on ``/metrics``); the span's own start and
end are the wall clock's. Needs the ``tracing`` extra; imported only when the flag is given.
"""

from __future__ import annotations

from typing import Any, Final

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR: Final = TraceContextTextMapPropagator()
_CARRIED: Final = (b"traceparent", b"tracestate")


class EngineTracing:
    """The engine's tracer: its own provider, batches to ``endpoint``."""

    def __init__(self, endpoint: str, service_name: str) -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=10))
        )
        self.tracer = self.provider.get_tracer("gpufleet.engine.sim")

    def start(self, headers: list[tuple[bytes, bytes]], attributes: dict[str, Any]) -> Span:
        """A request's span, the child of the caller's ``traceparent`` if it sent one."""
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in _CARRIED}
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        return self.tracer.start_span(
            "llm_request", context=parent, kind=SpanKind.SERVER, attributes=attributes
        )

    @staticmethod
    def end(span: Span, attributes: dict[str, Any], *, ok: bool) -> None:
        span.set_attributes(attributes)
        if not ok:
            span.set_status(Status(StatusCode.ERROR, "aborted"))
        span.end()

    def shutdown(self) -> None:
        self.provider.shutdown()
