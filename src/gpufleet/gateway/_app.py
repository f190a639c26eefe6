"""The gateway: a pure ASGI app in front of the fleet's replicas.

::

    app = create_gateway(load_fleet(), replica_source, CollectorRegistry())
    uvicorn.run(app)      # lifespan on: the prober and the scraper run in its TaskGroup

Routes: the model routes of ``_routes.ROUTES`` (``POST /v1/chat/completions``,
``/v1/completions``, ``/v1/responses``, ``/v1/embeddings``, ``/tokenize``, ``/detokenize``,
rerank and score; proxied, SSE passed through chunk by chunk), ``GET /v1/models``,
``GET /health``, ``GET /ready``, ``GET /metrics``, and with a store the Batch API's
``/v1/files`` and ``/v1/batches`` (``_batches_api``). Every response carries
``x-request-id`` (the client's, or a new one), and a replica's answer ``x-gpufleet-replica``
(the replica that sent its first byte). Errors are mapped once, in
:meth:`Gateway._answer_error` (the tree is in ``_errors``).

The batch runner (``_batch_runner``) sends each batch line through this app in-process
(``_inprocess.call_app``): the same path as an HTTP request, its principal already in the
scope (``BATCH_LINE``), so it is not authenticated again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from contextlib import AsyncExitStack
from typing import IO, TYPE_CHECKING, Any, Final

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gpufleet.config import FleetConfig, TracingConfig
from gpufleet.control import BATCH, PoolSettings, Reject, Route
from gpufleet.fleet import Outcome, RouteRequest, text_prefix_hashes
from gpufleet.gateway._admin import AdminApi
from gpufleet.gateway._admin_adapters import restore_adapters
from gpufleet.gateway._admin_fleet import FleetActions
from gpufleet.gateway._autoscale import ScaleActuator, ScaleExecutor
from gpufleet.gateway._batch_runner import BatchService
from gpufleet.gateway._batches_api import batch_path
from gpufleet.gateway._console import serve_console
from gpufleet.gateway._control import LiveControl
from gpufleet.gateway._errors import (
    BadRequestError,
    GatewayError,
    LocalOriginError,
    MethodNotAllowedError,
    ModelNotFoundError,
    PayloadTooLargeError,
    ReplicaOriginError,
    RequestTimeoutError,
    RouteNotFoundError,
    UpstreamError,
    error_body,
    error_event,
)
from gpufleet.gateway._http11 import Http11ReplicaClient
from gpufleet.gateway._metrics import GatewayMetrics
from gpufleet.gateway._replicas import ReplicaSource, Upstream
from gpufleet.gateway._resume import StreamResume, ask_for_token_ids, resumable
from gpufleet.gateway._rollouts import RolloutShell
from gpufleet.gateway._routes import ROUTES, ProxyRoute
from gpufleet.gateway._server import MAX_BODY
from gpufleet.gateway._spans import Spans
from gpufleet.gateway._tenancy import BATCH_LINE, OPEN_PATHS, Admitted, Tenancy, metered
from gpufleet.gateway._tls import ReplicaTLS
from gpufleet.gateway._upstream import ReplicaClient, UpstreamRequest, UpstreamResponse
from gpufleet.gateway._watch import FleetWatch
from gpufleet.store import Store

if TYPE_CHECKING:  # imported where tracing is on (the `tracing` extra)
    from gpufleet.gateway._tracing import Tracing

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Header = tuple[bytes, bytes]
SERVED_BY = b"x-gpufleet-replica"
"""The response header naming the replica that sent its first byte (as LiteLLM names the
deployment that answered): which engine's log to read, and which one a test cuts."""

_JSON: Final = (b"content-type", b"application/json")

KvHasher = Callable[[str, dict[str, Any]], tuple[int, ...]]
"""``(pool, request body) -> engine block hashes`` (the engine's tokens, block size and hash
chain; ``()`` when it cannot tell): injected by whoever knows the engines (``gpufleet up``),
since the gateway imports no engine code."""
_RELAY: Final = "gpufleet.relay"
"""The ASGI extension of ``GatewayServer`` (``_server.RELAY``) that passes a stream's frames
from the replica's socket to the client's; under another server, chunks go one by one."""


class ClientDisconnectedError(Exception):
    """The client went away; its upstream attempt is cancelled."""


class Gateway:
    """The ASGI callable. Build it with :func:`create_gateway`."""

    def __init__(
        self,
        config: FleetConfig,
        source: ReplicaSource,
        registry: CollectorRegistry,
        *,
        client: ReplicaClient | None = None,
        clock: Callable[[], float] = time.monotonic,
        actuator: ScaleActuator | None = None,
        tenancy: Tenancy | None = None,
        record: IO[str] | None = None,
        actions: FleetActions | None = None,
        store: Store | None = None,
        kv_hasher: KvHasher | None = None,
        prefill_s: Mapping[str, float] | None = None,
    ) -> None:
        self.config = config
        self._kv_hasher = kv_hasher
        """A prompt's engine block hashes, for pools routed on KV events (docs/kv-events.md)."""
        self.tenancy = tenancy
        """Auth, quotas, admission and the ledger (docs/tenants.md); ``None``: auth off."""
        self._source = source
        self._registry = registry
        self._client_given = client
        self._client: ReplicaClient | None = client
        self._clock = clock
        self.metrics = GatewayMetrics(registry)
        gateway_tracing = config.gateway.tracing
        admitting = tenancy is not None  # the gateway queues only with auth on
        self.control = LiveControl(
            config,
            self.metrics,
            clock=clock,
            admission=admitting,
            scaling=None if actuator is None else ScaleExecutor(config, actuator, registry),
            on_gone=self._forget,
            prefill_s=prefill_s,
        )
        """Every pool's controller (``gpufleet.control``): admission, routing, retries,
        health, holds and autoscaling decisions; this app carries them out."""
        self.watch = FleetWatch(config, self.control, self.metrics, clock)
        self.admin = AdminApi(
            config, tenancy, self.control, self.watch, actions=actions, clock=clock
        )
        """``/admin`` by role, the console's JSON, the ``/metrics`` guard (docs/console.md)."""
        if record is not None:
            self.control.record(record)
        store = store or (None if tenancy is None else tenancy.store)
        self.rollouts = RolloutShell(self.control, registry, store, audit=_auditor(tenancy, store))
        self._store = store
        """Rollouts' decisions carried out: log, metrics, audit, the store's state."""
        self.batches = None
        """``/v1/files``, ``/v1/batches`` and their runner (docs/batch.md): on with a store."""
        if store is not None and config.gateway.batch.enabled:
            self.batches = BatchService(
                config.gateway.batch,
                store,
                self,
                registry,
                tenancy=tenancy,
                body_timeout=config.gateway.timeouts.request_body,
            )
        self.tracing = None if gateway_tracing is None else _tracing(gateway_tracing)
        """OpenTelemetry spans of proxied requests (docs/tracing.md); ``None``: off."""
        self._created = int(time.time())
        self._id_prefix = os.urandom(8).hex()
        self._count = 0
        gateway = config.gateway
        self._timeouts = gateway.timeouts
        self._resumes = gateway.retry.max_resumes > 0
        self._scraped = frozenset(
            m.name for m in config.models if PoolSettings.of(config, m, admission=admitting).scraped
        )
        """The pools whose engines are scraped: one rule with the simulator's
        (``PoolSettings.scraped``: the router, the admission gauge or the autoscaler reads them)."""
        self._models_body = b""
        self._models_count = -1
        """``/v1/models``: the served names (a pool that is only another name's variant is
        not one; LoRA adapters registered at run time too), made again when they change."""

    def _models(self) -> bytes:
        served = self.control.control.served
        if len(served) != self._models_count:  # names are only ever added
            data = [
                {"id": name, "object": "model", "created": self._created, "owned_by": "gpufleet"}
                for name in served
            ]
            self._models_body = json.dumps({"object": "list", "data": data}).encode()
            self._models_count = len(served)
        return self._models_body

    # -- ASGI -----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = None
        for key, value in scope["headers"]:
            if key == b"x-request-id":
                request_id = value.decode("latin-1")
                break
        if request_id is None:
            self._count += 1
            request_id = f"{self._id_prefix}{self._count:016x}"
        rid = (b"x-request-id", request_id.encode("latin-1"))
        path, method = scope["path"], scope["method"]
        try:
            tenancy = self.tenancy
            if path.startswith(_OPERATORS):  # own credentials and roles, auth on or off
                await self._operators(scope, receive, send, rid)
                return
            if tenancy is not None and path not in OPEN_PATHS and BATCH_LINE not in scope:
                self.admin.authorize(scope, path)  # a tenant's key (/metrics: or more)
            route = ROUTES.get(path)
            if route is not None:
                if method != "POST":
                    raise MethodNotAllowedError(f"{method} is not allowed on {path}")
                proxy = self._proxy if self.tracing is None else self._traced
                await proxy(route, path, scope, receive, send, request_id, rid)
            elif self.batches is not None and batch_path(path):
                await self.batches.api.handle(scope, receive, send, rid)
            else:
                await self._get(method, path, send, rid)
        except GatewayError as error:
            # raised only before a response started (after it, a stream ends in an event)
            await self._answer_error(send, error, rid)
        except ClientDisconnectedError:
            pass  # gone while sending its body: nothing to answer

    async def _operators(self, scope: Scope, receive: Receive, send: Send, rid: Header) -> None:
        """``/admin`` (by role) and ``/console`` (static; its data comes from ``/admin``)."""
        if scope["path"].startswith("/admin"):
            await self.admin.handle(scope, receive, send, rid)
        else:
            await serve_console(scope["method"], scope["path"], send, rid)

    async def _get(self, method: str, path: str, send: Send, rid: Header) -> None:
        if method not in ("GET", "HEAD"):
            if path in _GETS:
                raise MethodNotAllowedError(f"{method} is not allowed on {path}")
            raise RouteNotFoundError(f"no route {method} {path}")
        if path == "/v1/models":
            await _respond(send, rid, 200, self._models())
        elif path == "/health":
            await _respond(send, rid, 200, b'{"status":"ok"}')
        elif path == "/ready":
            await self._ready(send, rid)
        elif path == "/metrics":
            body = generate_latest(self._registry)
            await _respond(send, rid, 200, body, CONTENT_TYPE_LATEST.encode())
        else:
            raise RouteNotFoundError(f"no route {method} {path}")

    async def _answer_error(self, send: Send, error: GatewayError, rid: Header) -> None:
        """The one place where an error becomes a response."""
        body = error_body(error.status, error.type, error.message)
        await send(
            {
                "type": "http.response.start",
                "status": error.status,
                "headers": [_JSON, (b"content-length", b"%d" % len(body)), *error.headers(), rid],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _ready(self, send: Send, rid: Header) -> None:
        routable = self.control.ready()
        ok = all(n > 0 for n in routable.values())
        body = json.dumps({"ready": ok, "routable": routable}).encode()
        await _respond(send, rid, 200 if ok else 503, body)

    # -- lifespan: the background loops live in one TaskGroup --------------------------------

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup"
        try:
            async with AsyncExitStack() as stack:
                if self._client is None:
                    self._client = await stack.enter_async_context(
                        Http11ReplicaClient(
                            connect=self._timeouts.connect,
                            max_idle=self.config.gateway.max_connections,
                            tls=ReplicaTLS.of(self.config),  # the fleet's CA bundles
                        )
                    )
                if self.tenancy is not None:
                    self.tenancy.open()
                    stack.callback(self.tenancy.close)
                    stack.push_async_callback(self.tenancy.aclose)
                stack.callback(self.control.stop)
                if self.tracing is not None:  # the spans still waiting go out (a thread)
                    stack.push_async_callback(asyncio.to_thread, self.tracing.shutdown)
                async with asyncio.TaskGroup() as tg:
                    # probes run in the group; the replica list arrives once it can hold them
                    self.control.start(tg, self._client)
                    self.rollouts.begin()  # restored from the store, or the fleet file's
                    if self._store is not None and self.control.adapters is not None:
                        restore_adapters(self.control, self._store)  # registered at run time
                    stack.callback(self._source.subscribe(self.control.set_replicas))
                    loops = []
                    if self.tenancy is not None:
                        loops.append(tg.create_task(self.tenancy.refresh_loop()))
                        loops.append(tg.create_task(self.tenancy.quotas.run(), name="quotas"))
                    if self._scraped:
                        scrape = self.control.scrape_loop(self._scraped)
                        loops.append(tg.create_task(scrape, name="gateway-scrape"))
                    loops.append(tg.create_task(self.watch.run(self._client), name="watch"))
                    if self.batches is not None:  # in-process requests: after the client
                        loops.append(tg.create_task(self.batches.runner.run(), name="batches"))
                    await send({"type": "lifespan.startup.complete"})
                    await receive()  # lifespan.shutdown
                    self.control.stop()  # no more probes into the closing group
                    for task in loops:
                        task.cancel()
        except BaseException as error:
            await send({"type": "lifespan.shutdown.failed", "message": repr(error)})
            raise
        finally:
            self._client = self._client_given
        await send({"type": "lifespan.shutdown.complete"})

    def _forget(self, replica: Upstream) -> None:
        """A replica left the replica set: close its idle upstream connections (its series
        went in ``LiveControl.set_replicas``), unless another replica has its address."""
        client = self._client
        if replica.url is None or not isinstance(client, Http11ReplicaClient):
            return
        if all(u.url != replica.url for u in self.control.upstreams.values()):
            client.forget(replica.url)

    # -- the proxy ------------------------------------------------------------------------

    async def _traced(  # noqa: PLR0917 - _proxy's, traced
        self,
        route: ProxyRoute,
        path: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        request_id: str,
        rid: Header,
    ) -> None:
        """:meth:`_proxy` in a trace of its own (a request refused before it reaches a pool,
        a bad body or an unknown model, included)."""
        assert self.tracing is not None
        trace = self.tracing.request(scope["headers"], scope["method"], path, request_id)
        status = 500
        try:
            await self._proxy(route, path, scope, receive, send, request_id, rid, trace)
        except GatewayError as error:
            status = error.status
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            trace.end(status)  # (ended already by _proxy where the request reached a pool)

    async def _proxy(  # noqa: PLR0917 - the request as _http has it
        self,
        route: ProxyRoute,
        path: str,
        scope: Scope,
        receive: Receive,
        send: Send,
        request_id: str,
        rid: Header,
        trace: Spans | None = None,
    ) -> None:
        arrived = self._clock()
        body = await _read_body(receive, self._timeouts.request_body)
        payload = _parse(body, route)
        model = payload["model"]
        if trace is not None:
            trace.model(model)
        hashes = self.control.hashes(model)
        if hashes is None:
            raise ModelNotFoundError(f"The model `{model}` does not exist.")
        blocks: tuple[int, ...] = ()
        if self._kv_hasher is not None and (pool := self.control.kv_pool(model)) is not None:
            blocks = self._kv_hasher(pool, payload)
        request = _route_request(model, scope, payload, request_id, hashes, blocks=blocks)
        budget = _ttft_budget(scope)
        admitted = None
        status = 500
        # watched from before admission: a client that leaves while queued gives its
        # place and quota lease back at once (the controller and the lease undo on cancel)
        watch = _DisconnectWatch(receive, send)
        send = watch.send
        try:
            if self.tenancy is not None:
                admitted, body = await self.tenancy.admit(
                    scope,
                    model,
                    payload,
                    body,
                    request_id=request_id,
                    arrived=arrived,
                    prompt_estimate=request.prompt_tokens,
                    metering=route.metering,
                )
                request = dataclasses.replace(request, tenant=admitted.principal.tenant)
            stream = None
            if self._resumes and route.resumes and resumable(route.chat, payload):
                body = ask_for_token_ids(body)  # what a resume by token ids needs
                stream = StreamResume(route.chat, payload, request.prompt_tokens)
            status = await self._route(
                route,
                path,
                scope,
                request,
                payload=payload,
                body=body,
                send=send,
                rid=rid,
                arrived=arrived,
                admitted=admitted,
                resume=stream,
                trace=trace,
                budget=budget,
            )
        except asyncio.CancelledError:
            if not watch.stop():
                raise
            status = 499  # the client left; its upstream attempt (or its queue place) is gone
        except GatewayError as error:
            status = error.status
            raise
        finally:
            watch.stop()
            if admitted is not None and self.tenancy is not None:
                self.tenancy.finish(admitted, status)
            self.metrics.child(self.metrics.requests, model, str(status)).inc()
            self.metrics.child(self.metrics.e2e, model).observe(self._clock() - arrived)
            if trace is not None:
                trace.end(status, admitted)

    async def _route(  # noqa: PLR0912, PLR0915 - the walk in one place, with its trace hooks
        self,
        route: ProxyRoute,
        path: str,
        scope: Scope,
        request: RouteRequest,
        *,
        payload: dict[str, Any],
        body: bytes,
        send: Send,
        rid: Header,
        arrived: float,
        admitted: Admitted | None = None,
        resume: StreamResume | None = None,
        trace: Spans | None = None,
        budget: float | None = None,
    ) -> int:
        """The request's walk as its pool controller decides it: admission, then an attempt
        on each replica it routes to, until one answers or it is refused; a stream that can
        ``resume`` and breaks goes on where the controller resumes it. Every way out ends the
        request in the controller once (a Reject, Finished, or ClientGone)."""
        control, metrics = self.control, self.metrics
        model, request_id = request.model, request.request_id
        priority, weight, deadline = _admission(admitted, scope)
        ended = False
        state = resume
        bodies = {model: body}  # the body each pool's engines get (_body_of)
        lowered: dict[str, bytes] = {}  # bodies with the Route's engine priority (_lowered)
        adapters = control.adapters
        # a LoRA adapter's request: its pool's engines serve it under the adapter's name
        keep = adapters is not None and adapters.is_adapter(model)
        if keep:  # the adapter's pool gets the client's body as it is
            bodies.update(dict.fromkeys(control.control.served[model].weights(), body))
        try:
            if trace is not None:
                trace.deciding()
            stream = route.streams and payload.get("stream") is True
            decision = await control.arrive(
                request,
                priority,
                weight,
                deadline,
                resumable=state is not None,
                recallable=not stream,
                budget=budget,
            )
            if trace is not None:
                trace.decided(decision)
            if isinstance(decision, Route):
                self._routed(decision.model or model, decision, arrived, admitted)
            relays = stream and _RELAY in (scope.get("extensions") or ())
            headers = [("content-type", "application/json"), ("x-request-id", request_id)]
            last: UpstreamError | None = None
            while isinstance(decision, Route):
                replica = decision.replica
                pool = decision.model or model
                upstream = control.upstreams.get(replica)
                url = None if upstream is None else upstream.url
                if url is None:  # its process went away between the decision and now
                    last = LocalOriginError(f"replica {replica} is gone")
                    if decision.resume:  # the client has part of the answer: resume again
                        assert state is not None
                        decision = await control.failed(
                            pool, request_id, last.outcome, streamed=True
                        )
                        if not isinstance(decision, Route):  # it ends in an error event
                            ended = True
                            metrics.child(metrics.resumes, pool, "broken").inc()
                            await self._break_stream(send, state.tail, state.failure)
                            return 200
                    else:
                        decision = await self._retry(pool, request_id, last, trace)
                    continue
                if admitted is not None:
                    admitted.replica = replica
                (in_flight := metrics.child(metrics.in_flight, replica)).inc()
                outcome = Outcome.CANCELLED
                sent = headers if trace is None else trace.attempt(decision, pool, url, headers)
                try:
                    if keep:
                        await control.adapter_ready(decision, model)
                    if decision.resume:
                        assert state is not None
                        body_now = state.body if keep else _for_pool(state.body, pool, model)
                        if decision.priority:  # a batch-class stream resumes as it began
                            body_now = _lowered({}, pool, body_now, decision.priority)
                        status, outcome, broke = await self._resume(
                            UpstreamRequest(url, path, body_now, sent),
                            state,
                            send,
                            request_id,
                            admitted=admitted,
                        )
                    else:
                        body_now = _body_of(bodies, pool)
                        if decision.priority:  # the controller's: a batch line, a priority pool
                            body_now = _lowered(lowered, pool, body_now, decision.priority)
                        status, outcome, broke = await self._attempt(
                            UpstreamRequest(url, path, body_now, sent),
                            stream,
                            send,
                            request_id,
                            rid=rid,
                            served=(SERVED_BY, replica.encode()),
                            model=pool,
                            arrived=arrived,
                            admitted=admitted,
                            relays=relays,
                            state=state,
                            broken=route.broken,
                        )
                    if trace is not None:
                        trace.attempt_ended(outcome, status, broke=broke)
                except UpstreamError as failure:
                    outcome, last = failure.outcome, failure
                    decision = await self._retry(pool, request_id, failure, trace)
                    continue
                finally:
                    if trace is not None:  # cancelled (the others ended it already)
                        trace.attempt_ended(outcome)
                    in_flight.dec()
                    metrics.child(metrics.attempts, replica, outcome.value).inc()
                    if replica not in control.upstreams:  # it left while this ran
                        metrics.forget_replica(replica)
                ended = True
                after = await self._after(
                    pool, request_id, (status, outcome, broke), state, send, admitted
                )
                if not isinstance(after, Route):
                    return after
                decision, ended = after, False
            ended = True
            raise control.refusal(model, decision, last)
        except BaseException:
            if not ended:  # the client left (or a bug): the controller lets it go
                control.gone(model, request_id)
            raise

    async def _retry(
        self, pool: str, request_id: str, failure: UpstreamError, trace: Spans | None
    ) -> Route | Reject:
        """An attempt failed before the first byte: the controller's next decision (a
        retry, a fallback's first attempt, or the Reject that ends the request)."""
        if trace is not None:
            trace.attempt_ended(failure.outcome, None, failure)
            trace.deciding()
        decision = await self.control.failed(pool, request_id, failure.outcome)
        if trace is not None:
            trace.decided(decision)
        return decision

    async def _after(  # noqa: PLR0917 - an attempt's end, as _route has it
        self,
        model: str,
        request_id: str,
        attempt: tuple[int, Outcome, bool],
        state: StreamResume | None,
        send: Send,
        admitted: Admitted | None,
    ) -> Route | int:
        """An attempt that reached the client ended (on pool ``model``): the request's
        status, or the Route of a resume (a resumable stream that broke, and the controller
        resumes it)."""
        control, metrics = self.control, self.metrics
        status, outcome, broke = attempt
        if not broke:
            control.finished(model, request_id, outcome, _work(admitted))
            if state is not None and state.resumes:
                metrics.child(metrics.resumed_prompt_tokens, model).inc(state.resent())
            return status
        if state is None:  # the client has an error event; the controller counts it
            await control.failed(model, request_id, outcome, streamed=True)
            return status
        if state.complete():  # it broke after the answer's end: the client has it
            await self._end_answered(send, state, admitted)
            control.finished(model, request_id, outcome, _work(admitted))
            return 200
        decision = await control.failed(model, request_id, outcome, streamed=True)
        if isinstance(decision, Route) and state.next_body():
            metrics.child(metrics.resumes, model, "resumed").inc()
            return decision
        if isinstance(decision, Route):  # routed on, but not splicable: let it go
            control.finished(model, request_id, Outcome.CANCELLED)
        metrics.child(metrics.resumes, model, "broken").inc()
        if state.resumes:
            metrics.child(metrics.resumed_prompt_tokens, model).inc(state.resent())
        await self._break_stream(send, state.tail, state.failure)
        return status

    def _routed(self, model: str, route: Route, arrived: float, admitted: Admitted | None) -> None:
        """Count a request's routing decision (its first attempt's)."""
        metrics, now = self.metrics, self._clock()
        if admitted is not None:
            admitted.queued = now - arrived
        panic = "true" if route.panic else "false"
        metrics.child(metrics.routing, model, route.policy, panic).inc()
        metrics.child(metrics.prefix_match, model).observe(route.matched)
        metrics.child(metrics.overhead, model).observe(now - arrived)

    async def _attempt(
        self,
        request: UpstreamRequest,
        stream: bool,
        send: Send,
        request_id: str,
        *,
        rid: Header,
        served: Header,
        model: str,
        arrived: float,
        admitted: Admitted | None = None,
        relays: bool = False,
        state: StreamResume | None = None,
        broken: Callable[[str], bytes] = error_event,
    ) -> tuple[int, Outcome, bool]:
        """One attempt: its status, outcome, and whether its stream broke after the first
        byte. A failure before the client saw a byte raises ``UpstreamError`` (the caller
        may retry); one after it ends the stream with an error event, or, for a resumable
        stream (``state``), is left to the caller with what the client got noted there.

        ``served``: the ``x-gpufleet-replica`` header of this attempt's replica.
        ``relays``: the server takes the ``gpufleet.relay`` extension; a stream's rest then
        goes from the replica's socket to the client's without a task step per chunk.
        ``broken``: the events that end a stream broken after its first byte (the route's).
        An :class:`~gpufleet.control.Abandon` ends it as a timeout (``LiveControl.abandon``)."""
        assert self._client is not None
        timeouts, control = self._timeouts, self.control
        sent = False
        tail = [b"\n\n"]  # the last bytes the client got (set by _pump as it sends)
        try:
            async with asyncio.timeout(timeouts.first_byte) as deadline:
                control.attempting(request_id, deadline)
                async with self._client.send(request) as response:
                    status = response.status
                    chunks = response.chunks
                    if status >= 500:
                        raise await _origin_error(status, chunks)
                    outcome = Outcome.SUCCESS if status < 400 else Outcome.CLIENT_ERROR
                    if not stream or status >= 400:

                        def read() -> None:  # the answer is in: an Abandon or Recall is late
                            control.attempted(request_id)
                            deadline.reschedule(None)

                        await self._answer_whole(
                            response,
                            send,
                            (rid, served),
                            model,
                            arrived,
                            admitted=admitted,
                            read=read,
                            request_id=request_id,
                        )
                        return status, outcome, False
                    if admitted is not None:  # usage read on the way, ledgered before the end
                        chunks = metered(admitted, chunks, self._clock)
                    first = await anext(chunks, b"")
                    ttft = self._first_byte(model, request_id, arrived)
                    headers = response.headers
                    headers += rid, served
                    await send(
                        {"type": "http.response.start", "status": status, "headers": headers}
                    )
                    sent = True
                    await send({"type": "http.response.body", "body": first, "more_body": True})
                    tail[0] = first
                    record = None if state is None else state.sent
                    if record is not None:
                        record.append(first)
                    idle = timeouts.idle_stream
                    # a metered stream (auth on) reads every chunk for its usage: no relay
                    if relays and admitted is None and response.relay is not None:
                        deadline.reschedule(None)  # the relay keeps its own idle timeout
                        tail[0] = b"\n"  # unknown: a blank line first (harmless after an event)
                        relay = response.relay if state is None else state.tap(response.relay)
                        await send({"type": _RELAY, "relay": relay, "idle": idle})
                    else:
                        await _pump(chunks, send, deadline, idle, record, tail)
                    await send({"type": "http.response.body", "body": b""})
                    if model in self.control.sampled:  # a rollout's analysis reads it
                        self._sample(model, arrived, ttft, admitted)
                    return status, outcome, False
        except (TimeoutError, LocalOriginError) as failure:
            abandoned = control.attempted(request_id)
            if abandoned and not sent and control.take_recalled(request_id):
                raise LocalOriginError(_RECALLED, Outcome.CANCELLED) from None
            return await self._failed(failure, abandoned, sent, send, state, tail[0], broken)
        finally:
            control.attempted(request_id)

    async def _failed(  # noqa: PLR0917 - an attempt's failure, as _attempt has it
        self,
        failure: TimeoutError | LocalOriginError,
        abandoned: bool,
        sent: bool,
        send: Send,
        state: StreamResume | None,
        tail: bytes,
        broken: Callable[[str], bytes],
    ) -> tuple[int, Outcome, bool]:
        """An attempt failed (timed out, ``abandoned``, or lost its connection): before the
        client's first byte it is raised, for a retry; after it the stream breaks."""
        if isinstance(failure, TimeoutError):
            if not sent:
                why = _ABANDONED if abandoned else "timed out waiting for the replica"
                raise LocalOriginError(why, Outcome.TIMEOUT) from None
            outcome = Outcome.TIMEOUT
            message = _ABANDONED if abandoned else "the replica stopped streaming (idle timeout)"
        else:
            if not sent:
                raise failure
            outcome, message = failure.outcome, f"the replica's stream broke: {failure}"
        await self._broke(send, state, tail, message, broken)
        return 502, outcome, True

    def _sample(self, pool: str, arrived: float, ttft: float, admitted: Admitted | None) -> None:
        """A streamed answer on a pool a rollout watches: its TTFT, and its mean inter-token
        latency when its output tokens were metered (auth on)."""
        itl = None
        if admitted is not None:
            usage = admitted.meter.usage
            if usage.known and usage.completion_tokens > 1:
                itl = (self._clock() - arrived - ttft) / (usage.completion_tokens - 1)
        self.control.sample(pool, ttft, itl)

    async def _resume(
        self,
        request: UpstreamRequest,
        state: StreamResume,
        send: Send,
        request_id: str,
        *,
        admitted: Admitted | None = None,
    ) -> tuple[int, Outcome, bool]:
        """A resume: the stream goes on from this replica's answer to ``state.body``,
        spliced into the client's (``_resume.Splice``). Any failure is after the client's
        first byte: it breaks the stream (the caller asks the controller what next)."""
        assert self._client is not None
        timeouts, control = self._timeouts, self.control
        splice = state.splice
        assert splice is not None
        tail = state.tail
        try:
            async with asyncio.timeout(timeouts.first_byte) as deadline:
                control.attempting(request_id, deadline)
                async with self._client.send(request) as response:
                    status = response.status
                    if status >= 400:
                        error = await _origin_error(status, response.chunks)
                        outcome = Outcome.REPLICA_ERROR if status >= 500 else Outcome.CLIENT_ERROR
                        state.broke(tail, f"the stream could not be resumed: {error}")
                        return 502, outcome, True
                    idle = timeouts.idle_stream
                    now_is = asyncio.get_running_loop().time
                    due = now_is() + 1.5 * idle
                    deadline.reschedule(due)
                    async for chunk in response.chunks:
                        out = splice.feed(chunk)
                        if not out:
                            continue
                        if admitted is not None and splice.transcript.done:
                            state.meter(admitted.meter)  # ledgered before the client sees [DONE]
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                        tail = out
                        now = now_is()
                        if due - now < idle:
                            due = now + 1.5 * idle
                            deadline.reschedule(due)
                    if admitted is not None:
                        state.meter(admitted.meter)
                    await send({"type": "http.response.body", "body": b""})
                    return status, Outcome.SUCCESS, False
        except TimeoutError:
            why = "the replica stopped streaming (idle timeout)"
            state.broke(tail, _ABANDONED if control.attempted(request_id) else why)
            return 502, Outcome.TIMEOUT, True
        except LocalOriginError as failure:
            state.broke(tail, f"the replica's stream broke: {failure}")
            return 502, failure.outcome, True
        finally:
            control.attempted(request_id)

    async def _end_answered(
        self, send: Send, state: StreamResume, admitted: Admitted | None
    ) -> None:
        """A stream whose replica failed after its answer's last token: the client gets the
        end it was missing (``[DONE]``, after a usage event if it asked for one)."""
        end = state.ending()
        if admitted is not None:
            state.meter(admitted.meter)
        lead = b"" if state.tail.endswith(b"\n\n") or not state.tail else b"\n\n"
        await send({"type": "http.response.body", "body": lead + end})

    async def _answer_whole(
        self,
        response: UpstreamResponse,
        send: Send,
        ours: tuple[Header, Header],
        model: str,
        arrived: float,
        *,
        admitted: Admitted | None = None,
        read: Callable[[], None] | None = None,
        request_id: str = "",
    ) -> None:
        """A whole answer; ``ours``: the request id's and the serving replica's headers.
        ``read`` is called once the answer is in, before it is sent on: the attempt is over
        then, and an Abandon or a Recall that comes while it is sent must not cut the
        client's response in half (the controller hears ``Finished``: a recalled line is
        simply done)."""
        whole = b"".join([c async for c in response.chunks])
        if read is not None:
            read()
        ttft = self._first_byte(model, request_id, arrived)
        if model in self.control.sampled:  # a rollout's analysis reads it
            self.control.sample(model, ttft)
        if admitted is not None:  # ledgered before the client can see the end
            admitted.first_at = self._clock()
            admitted.status = response.status
            admitted.meter.whole(whole)
        headers = response.headers
        headers.append((b"content-length", b"%d" % len(whole)))
        headers += ours
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": whole})

    def _first_byte(self, model: str, request_id: str, arrived: float) -> float:
        """The answer's first byte is here: its TTFT, observed, and told to the controller
        with the request's end when it reads it (the batch gate's TTFT guard)."""
        ttft = self._clock() - arrived
        self.metrics.child(self.metrics.ttft, model).observe(ttft)
        self.control.first_byte(request_id, ttft)
        return ttft

    async def _broke(
        self,
        send: Send,
        state: StreamResume | None,
        tail: bytes,
        message: str,
        broken: Callable[[str], bytes],
    ) -> None:
        """A stream broke: its error event now, or (resumable) later, if not resumed."""
        if state is not None:
            state.broke(tail, message)
        else:
            await self._break_stream(send, tail, message, broken)

    @staticmethod
    async def _break_stream(
        send: Send, tail: bytes, message: str, broken: Callable[[str], bytes] = error_event
    ) -> None:
        lead = b"" if tail.endswith(b"\n\n") or not tail else b"\n\n"
        await send({"type": "http.response.body", "body": lead + broken(message)})


_GETS: Final = frozenset({"/v1/models", "/health", "/ready", "/metrics"})
_OPERATORS: Final = ("/admin", "/console")

SERVER_OPTIONS: Final[dict[str, Any]] = {
    "http": "httptools",
    "ws": "none",
    "lifespan": "on",
    "access_log": False,
    "proxy_headers": False,
    "server_header": False,
}
"""How ``gpufleet up`` (and bench/gateway_cost.py) run the gateway under uvicorn: the C
HTTP parser, no access log, no proxy-headers middleware or ``server`` header on the hot
path. The event loop is uvloop's (``gpufleet up`` runs on it)."""


def create_gateway(
    config: FleetConfig,
    replica_source: ReplicaSource,
    registry: CollectorRegistry,
    *,
    client: ReplicaClient | None = None,
    clock: Callable[[], float] = time.monotonic,
    actuator: ScaleActuator | None = None,
    tenancy: Tenancy | None = None,
    record: IO[str] | None = None,
    actions: FleetActions | None = None,
    store: Store | None = None,
    kv_hasher: KvHasher | None = None,
    prefill_s: Mapping[str, float] | None = None,
) -> Gateway:
    """The gateway for ``config``'s models over the replicas ``replica_source`` reports.

    Metrics go to ``registry``; ``client`` replaces the HTTP upstream client (tests). With an
    ``actuator``, the models with ``autoscale`` are scaled through it (docs/gateway.md);
    ``tenancy`` turns auth, quotas, admission and the ledger on; ``record`` gets every
    control event and its commands (``gpufleet up --record``, ``gpufleet replay``);
    ``actions`` lets operators drain replicas from the admin API and the console; ``store``
    (else the tenancy's) holds the Batch API's files and batches (docs/batch.md);
    ``kv_hasher(pool, body)`` gives a request's engine block hashes for the pools routed on
    the engines' KV events (``prefix_precise``; docs/kv-events.md). ``prefill_s``: per
    pool, the performance model's seconds per prompt token, by which the controller places a
    request with a latency budget (``x-gpufleet-ttft-budget-ms``; docs/fleet-file.md).
    """
    return Gateway(
        config,
        replica_source,
        registry,
        client=client,
        clock=clock,
        actuator=actuator,
        tenancy=tenancy,
        record=record,
        actions=actions,
        store=store,
        kv_hasher=kv_hasher,
        prefill_s=prefill_s,
    )


async def _respond(
    send: Send, rid: Header, status: int, body: bytes, content_type: bytes = _JSON[1]
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", b"%d" % len(body)),
                rid,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive: Receive, timeout: float) -> bytes:
    """The whole request body, within ``timeout`` seconds (408 past it)."""
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnectedError
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > MAX_BODY:
                    raise PayloadTooLargeError(f"request body over {MAX_BODY} bytes")
                parts.append(chunk)
                if not message.get("more_body", False):
                    return parts[0] if len(parts) == 1 else b"".join(parts)
    except TimeoutError:
        raise RequestTimeoutError(f"the request body did not arrive within {timeout:g} s") from None


_ABANDONED: Final = "the replica failed its health checks (its attempt was abandoned)"
_RECALLED: Final = "recalled: an interactive request took its slot (it runs again later)"


class _DisconnectWatch:
    """Cancels the request's task if its client disconnects, without a task per request.

    A request that ends within ``WATCH_AFTER`` seconds (most non-streaming ones, and every
    error) costs one timer; only a longer one gets a task blocked in ``receive()``, which
    returns ``http.disconnect`` at once if the client already left meanwhile.

    ``receive()`` also says ``http.disconnect`` as soon as the response is complete, while
    the request may still be closing its replica's response: the watch ends with the last
    body message (:meth:`send`), so a whole answer is never taken for a client gone.
    """

    WATCH_AFTER: Final = 0.05
    __slots__ = ("_fired", "_owner", "_receive", "_send", "_task", "_timer")

    def __init__(self, receive: Receive, send: Send) -> None:
        self._receive = receive
        self._send = send
        self._owner = asyncio.current_task()
        self._task: asyncio.Task[None] | None = None
        self._fired = False
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            self.WATCH_AFTER, self._start
        )

    def _start(self) -> None:
        self._timer = None
        if self._owner is not None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        message = await self._receive()
        if message["type"] == "http.disconnect" and self._owner is not None:
            self._fired = True
            self._owner.cancel()

    async def send(self, message: Message) -> None:
        """The request's ``send``: its last body message ends the watch first."""
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self._quiet()
        await self._send(message)

    def _quiet(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def stop(self) -> bool:
        """Stop watching; whether the client left (the owner's ``cancel`` is then undone)."""
        self._quiet()
        fired, self._fired = self._fired, False
        if fired and self._owner is not None:
            self._owner.uncancel()
        self._owner = None
        return fired


async def _pump(  # noqa: PLR0917 - one stream's parts
    chunks: AsyncIterator[bytes],
    send: Send,
    deadline: asyncio.Timeout,
    idle: float,
    record: list[bytes] | None,
    tail: list[bytes],
) -> None:
    """A stream's chunks to the client as they come (noted in ``record``; the last one in
    ``tail[0]``, so that a break knows what the client got).

    The idle ``deadline`` moves at most every idle/2: it falls between idle and 1.5 × idle
    after the last chunk, without a timer per chunk."""
    now_is = asyncio.get_running_loop().time
    due = now_is() + 1.5 * idle
    deadline.reschedule(due)
    async for chunk in chunks:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        tail[0] = chunk
        if record is not None:
            record.append(chunk)
        now = now_is()
        if due - now < idle:
            due = now + 1.5 * idle
            deadline.reschedule(due)


async def _origin_error(status: int, chunks: AsyncIterator[bytes]) -> ReplicaOriginError:
    """A replica's 5xx answer as the error that lets the gateway retry elsewhere."""
    text = b"".join([c async for c in chunks])[:500]
    return ReplicaOriginError(
        f"replica answered {status}: {text.decode('utf-8', 'replace')}", status
    )


def _for_pool(body: bytes, pool: str, served: str) -> bytes:
    """``body`` with ``pool`` as its ``model``: a pool's engines serve the pool's name (a
    variant of served name ``served``, or a fallback's pool); the served name's own pool
    takes the body as it is."""
    if pool == served:
        return body
    data = json.loads(body)
    data["model"] = pool
    return json.dumps(data, separators=(",", ":")).encode()


def _body_of(bodies: dict[str, bytes], pool: str) -> bytes:
    """The first attempt's body for ``pool``'s engines, made once per pool (``bodies``
    starts with the served name's own, the client's body)."""
    found = bodies.get(pool)
    if found is None:
        served, body = next(iter(bodies.items()))
        found = bodies[pool] = _for_pool(body, pool, served)
    return found


def _lowered(lowered: dict[str, bytes], pool: str, body: bytes, priority: int) -> bytes:
    """``body`` (``pool``'s) with its ``priority`` at least ``priority``, made once per pool
    (kept in ``lowered``): vLLM runs a lower value first, so a batch line never goes ahead of
    interactive work in an engine that schedules by priority."""
    found = lowered.get(pool)
    if found is None:
        data = json.loads(body)
        own = data.get("priority")
        if not isinstance(own, int) or isinstance(own, bool) or own < priority:
            data["priority"] = priority
        found = lowered[pool] = json.dumps(data, separators=(",", ":")).encode()
    return found


def _route_request(
    model: str,
    scope: Scope,
    payload: dict[str, Any],
    request_id: str,
    hashes: bool,
    *,
    blocks: tuple[int, ...] = (),
) -> RouteRequest:
    """What the router sees of a request: its prefix hashes (only for a router that reads
    them), size, the output it asks for and its session key."""
    text = _prompt_text(payload)
    session = _header(scope, b"x-session-id") or payload.get("user")
    limit = payload.get("max_completion_tokens", payload.get("max_tokens"))
    return RouteRequest(
        request_id,
        model,
        prefix_hashes=text_prefix_hashes(text) if hashes else (),
        prompt_tokens=len(text) // 4,
        session_key=session if isinstance(session, str) else None,
        max_tokens=limit if isinstance(limit, int) and not isinstance(limit, bool) else None,
        block_hashes=blocks,
    )


TTFT_BUDGET = b"x-gpufleet-ttft-budget-ms"
"""A request's latency class: the milliseconds to its first token it allows."""
MAX_TTFT_BUDGET_MS: Final = 3_600_000


def _ttft_budget(scope: Scope) -> float | None:
    """The request's TTFT budget in seconds (``x-gpufleet-ttft-budget-ms``), if it names one;
    a value that is not a positive number of milliseconds (up to an hour) is a 400."""
    text = _header(scope, TTFT_BUDGET)
    if text is None:
        return None
    try:
        ms = float(text)
    except ValueError:
        ms = math.nan
    if not 0 < ms <= MAX_TTFT_BUDGET_MS:  # NaN fails too
        raise BadRequestError(
            f"x-gpufleet-ttft-budget-ms: {text!r} is not a number of milliseconds "
            f"(more than 0, at most {MAX_TTFT_BUDGET_MS:,})"
        )
    return ms / 1000.0


def _auditor(
    tenancy: Tenancy | None, store: Store | None
) -> Callable[[dict[str, Any]], None] | None:
    """Where the controller's own audit rows go: the tenancy's journal, else the store."""
    if tenancy is not None:
        return lambda row: tenancy.journal.append("audit", row)
    if store is not None:
        return lambda row: store.write([("audit", row)])
    return None


def _tracing(config: TracingConfig) -> Tracing:
    try:
        from gpufleet.gateway._tracing import Tracing  # noqa: PLC0415 - only where it is on
    except ImportError as error:
        raise ValueError(
            f"gateway.tracing needs OpenTelemetry ({error.name} is missing): "
            "pip install 'gpufleet[tracing]'"
        ) from None
    return Tracing(config)


def _work(admitted: Admitted | None) -> tuple[int, int] | None:
    """What the request cost, for fair sharing: (uncached prompt, output tokens), if
    metered."""
    if admitted is None:
        return None
    usage = admitted.meter.usage
    return (usage.uncached_prompt, usage.completion_tokens) if usage.known else None


def _parse(body: bytes, route: ProxyRoute) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except ValueError as error:
        raise BadRequestError(f"the body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise BadRequestError("the body must be a JSON object")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("`model` is required (a string)")
    if route.chat:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequestError("`messages` is required (a non-empty list)")
    elif route.needs and not any(key in payload for key in route.needs):
        raise BadRequestError(f"`{'` or `'.join(route.needs)}` is required")
    return payload


def _prompt_text(payload: dict[str, Any]) -> str:
    """The prompt as text, for prefix hashing and a token estimate (no tokenizer here):
    chat's ``messages``, a completion's ``prompt``, else an ``input`` (the Responses API's
    or embeddings')."""
    messages = payload.get("messages")
    if isinstance(messages, list):  # (a completion's body may carry anything there)
        parts: list[str] = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            parts.append(str(message.get("role", "")))
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
        return "\n".join(parts)
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if "input" in payload:
        return _input_text(payload)
    return ""


def _input_text(payload: dict[str, Any]) -> str:
    """``input`` as text: the Responses API's (after its ``instructions``: a string, or items
    whose ``content`` is text or text parts) or embeddings' (a string or a list of them;
    token ids give none, as a completion's do)."""
    given = payload["input"]
    instructions = payload.get("instructions")
    parts = [instructions] if isinstance(instructions, str) else []
    if isinstance(given, str):
        parts.append(given)
    elif isinstance(given, list):
        for item in given:
            if isinstance(item, str):
                parts.append(item)
            elif isinstance(item, dict):
                content = item.get("content")
                if isinstance(content, str):
                    parts.append(content)
                elif isinstance(content, list):
                    parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "\n".join(parts)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _admission(admitted: Admitted | None, scope: Scope) -> tuple[int, float, float | None]:
    """What the pool controller's admission reads of a request: its class, weight and
    deadline (the tenant's; without tenancy a batch line is still in the batch class, so
    its pool's spare-capacity gate holds it)."""
    if admitted is not None:
        return admitted.admission
    return (BATCH if BATCH_LINE in scope else 0), 1.0, None
