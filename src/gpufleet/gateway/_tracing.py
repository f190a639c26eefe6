"""OpenTelemetry traces of the requests the gateway proxies (docs/tracing.md).

One trace per request, its spans made from what the gateway already knows::

    POST /v1/chat/completions   SERVER    the client's traceparent continued, if it sent one
    ├── gpufleet.route          INTERNAL  the controller's decision: queue, hold, the pick
    ├── gpufleet.attempt        CLIENT    one replica's answer; its traceparent goes upstream
    ├── gpufleet.route                    after a failed attempt: the retry's decision
    └── gpufleet.attempt                  the retry (or a resumed stream's next part)

Off (no ``gateway.tracing``), this module is not imported and a request has no hooks
(``_spans.Spans``: the interface). The provider is the gateway's own, not the process's
global one: two gateways in one process (tests) keep their spans apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gpufleet.config import TracingConfig
from gpufleet.control import Reject, Route
from gpufleet.fleet import Outcome
from gpufleet.gateway._spans import Spans

if TYPE_CHECKING:
    from gpufleet.gateway._tenancy import Admitted

_PROPAGATOR: Final = TraceContextTextMapPropagator()
_CARRIED: Final = (b"traceparent", b"tracestate")
_OPERATIONS: Final = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
}
"""``gen_ai.operation.name`` by path (the semantic conventions' names); others: the path."""


class Tracing:
    """The gateway's tracer and its OTLP exporter. ``exporter``: another (tests)."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name}),
            sampler=ParentBased(TraceIdRatioBased(config.sample)),
        )
        if exporter is None:
            exporter = OTLPSpanExporter(
                endpoint=config.endpoint, headers=config.headers or None, timeout=10
            )
        self.provider.add_span_processor(
            BatchSpanProcessor(exporter, schedule_delay_millis=config.export_interval * 1000)
        )
        self.tracer = self.provider.get_tracer("gpufleet.gateway")

    def request(
        self, headers: Iterable[tuple[bytes, bytes]], method: str, path: str, request_id: str
    ) -> RequestTrace:
        """The trace of one request, continuing the client's ``traceparent`` if it sent one."""
        carrier = {
            key.decode("latin-1"): value.decode("latin-1")
            for key, value in headers
            if key in _CARRIED
        }
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        span = self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "url.path": path,
                "gen_ai.operation.name": _OPERATIONS.get(path, path),
                "gpufleet.request_id": request_id,
            },
        )
        return RequestTrace(self.tracer, span)

    def shutdown(self) -> None:
        """Export what is left and stop (blocks up to the exporter's timeout)."""
        self.provider.shutdown()


class RequestTrace(Spans):
    """One request's spans, opened and closed as ``Gateway._route`` walks it (the hooks of
    :class:`Spans`); every method is safe to call twice (the second does nothing)."""

    __slots__ = ("_attempt", "_context", "_decision", "_tracer", "attempts", "span")

    def __init__(self, tracer: trace.Tracer, span: Span) -> None:
        self._tracer = tracer
        self.span = span
        self._context = trace.set_span_in_context(span)
        self._decision: Span | None = None
        self._attempt: Span | None = None
        self.attempts = 0

    def model(self, model: str) -> None:
        self.span.set_attribute("gen_ai.request.model", model)

    def deciding(self) -> None:
        """The controller is asked for the request's (next) decision."""
        if self._decision is None:
            self._decision = self._tracer.start_span(
                "gpufleet.route", context=self._context, kind=SpanKind.INTERNAL
            )

    def decided(self, decision: Route | Reject) -> None:
        span, self._decision = self._decision, None
        if span is None:
            return
        if isinstance(decision, Route):
            span.set_attributes(
                {
                    "gpufleet.replica": str(decision.replica),
                    "gpufleet.routing.policy": decision.policy,
                    "gpufleet.prefix_matched": decision.matched,
                    "gpufleet.panic": decision.panic,
                    "gpufleet.held": decision.held,
                    "gpufleet.retry": decision.retry,
                    "gpufleet.resume": decision.resume,
                }
            )
            if decision.model:
                span.set_attribute("gpufleet.pool", decision.model)
        else:
            span.set_attribute("gpufleet.reject.reason", decision.reason)
            span.set_status(Status(StatusCode.ERROR, f"no replica: {decision.reason}"))
        span.end()

    def attempt(
        self, route: Route, pool: str, url: str, headers: list[tuple[str, str]]
    ) -> list[tuple[str, str]]:
        """An attempt on ``route.replica`` starts: its span, and ``headers`` with the
        span's ``traceparent`` (the engine continues the trace)."""
        self.attempt_ended(Outcome.CANCELLED)
        self.attempts += 1
        span = self._attempt = self._tracer.start_span(
            "gpufleet.attempt",
            context=self._context,
            kind=SpanKind.CLIENT,
            attributes={
                "gpufleet.replica": str(route.replica),
                "gpufleet.pool": pool,
                "gpufleet.attempt": self.attempts,
                "gpufleet.retry": route.retry,
                "gpufleet.resume": route.resume,
                "url.full": url,
            },
        )
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return [*headers, *carrier.items()]

    def attempt_ended(
        self,
        outcome: Outcome,
        status: int | None = None,
        error: BaseException | None = None,
        *,
        broke: bool = False,
    ) -> None:
        span, self._attempt = self._attempt, None
        if span is None:
            return
        span.set_attribute("gpufleet.outcome", outcome.value)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, str(error)))
        elif broke:
            span.set_status(Status(StatusCode.ERROR, f"the stream broke: {outcome.value}"))
        elif outcome != Outcome.SUCCESS:
            span.set_status(Status(StatusCode.ERROR, outcome.value))
        span.end()

    def end(self, status: int, admitted: Admitted | None = None) -> None:
        """The request is answered with ``status`` (499: the client left); a decision or
        an attempt still open ends with it (the client left while it waited or ran)."""
        if self._decision is not None:
            self._decision.set_status(Status(StatusCode.ERROR, "the request ended first"))
            self._decision.end()
            self._decision = None
        self.attempt_ended(Outcome.CANCELLED)
        span = self.span
        if not span.is_recording():  # not sampled, or ended already
            return
        span.set_attribute("http.response.status_code", status)
        if admitted is not None:  # auth on: the tenant, and the answer's usage
            span.set_attribute("gpufleet.tenant", admitted.principal.tenant)
            usage = admitted.meter.usage
            if usage.known:
                span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
                span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()
