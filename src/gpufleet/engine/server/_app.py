"""The sim engine's ASGI app: vLLM's OpenAI-compatible routes over one modelled replica.

    app = create_app(SimEngineConfig(model="llama-3.1-8b", gpu="h100-sxm", time_scale=10))
    uvicorn.run(app, port=8001)

Routes (all pure ASGI endpoints; STYLE 11), each in a module of its own::

    POST /v1/chat/completions   POST /v1/completions   streaming or not, n ≥ 1   _completions
    POST /v1/embeddings                                 pooling requests          _embeddings
    POST /v1/responses                                  streaming or not          _responses
    POST /tokenize              POST /detokenize        no model work             _tokenize
    GET  /v1/models             GET  /health            GET /metrics              here
    GET|POST /admin/faults      only with enable_admin (404 otherwise)            here
    POST /sleep  POST /wake_up  GET /is_sleeping   only with dev_mode       _sleep_routes
    POST /v1/load_lora_adapter  POST /v1/unload_lora_adapter
                                only with allow_runtime_lora_updating     _lora_routes

The engine loop runs as a task of the app's lifespan (STYLE 10). A JSON route reads its body,
passes the fault gate, is validated and tokenized, and submits its model requests to the
loop; then one task writes the response while a second watches for the client going away:
a disconnect cancels the writer, whose ``finally`` aborts the model requests at once
(``_asgi.JsonRoute``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pydantic
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gpufleet.engine.server._asgi import (
    JSON_HEADERS,
    ClientGoneError,
    Receive,
    Scope,
    Send,
    read_json,
    send_bytes,
    send_error,
    until_disconnect,
    validation_error,
)
from gpufleet.engine.server._clock import ScaledClock
from gpufleet.engine.server._completions import Completions
from gpufleet.engine.server._config import SimEngineConfig
from gpufleet.engine.server._embeddings import Embeddings
from gpufleet.engine.server._engine import SimEngine
from gpufleet.engine.server._errors import (
    ApiError,
    BadRequestError,
    InvalidRequestError,
    describe,
    error_body,
    http_error,
)
from gpufleet.engine.server._lora_routes import LoadLoraAdapter, UnloadLoraAdapter
from gpufleet.engine.server._responses import Responses
from gpufleet.engine.server._sleep_routes import IsSleepingRoute, SleepRoute, WakeRoute
from gpufleet.engine.server._tokenize import Detokenize, Tokenize

logger = logging.getLogger("gpufleet.engine.sim")


class _Models:
    """The base model's card, then each LoRA adapter's, in the order they were registered
    (vLLM's cards: ``root`` the adapter's path, ``parent`` the served model name)."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        config = engine.config
        card = {
            "id": engine.name,
            "object": "model",
            "created": engine.created,
            "owned_by": "vllm",
            "root": config.model,
            "parent": None,
            "max_model_len": engine.max_model_len,
            "permission": [],
            "gpufleet": {
                "sim_engine": True,
                "gpu": config.gpu,
                "tp": config.tp,
                "time_scale": config.time_scale,
                "latency_clock": "modelled",
            },
        }
        self.card = card
        self.body = json.dumps({"object": "list", "data": [card]}).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lora = self.engine.lora
        if lora is None:
            await send_bytes(send, 200, self.body, JSON_HEADERS)
            return
        created = int(time.time())
        cards = [self.card]
        for adapter in lora.registered.values():
            cards.append(
                {
                    "id": adapter.name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": adapter.path,
                    "parent": self.engine.name,
                    "max_model_len": None,
                    "permission": [],
                }
            )
        body = json.dumps({"object": "list", "data": cards}).encode()
        await send_bytes(send, 200, body, JSON_HEADERS)


class _Health:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine
        if engine.faults.config.hang:
            await until_disconnect(receive, asyncio.Event().wait())
            return
        if engine.faults.config.unhealthy or engine.loop.dead is not None:
            reason = "engine loop stopped" if engine.loop.dead else "injected fault: unhealthy"
            body = error_body(503, reason, "ServiceUnavailableError")
            await send_bytes(send, 503, body, JSON_HEADERS)
            return
        await send_bytes(send, 200, b"", [(b"content-length", b"0")])


class _Metrics:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = generate_latest(self.engine.metrics.registry)
        await send_bytes(send, 200, body, [(b"content-type", CONTENT_TYPE_LATEST.encode())])


class _AdminFaults:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine
        try:
            if scope["method"] == "POST":
                patch = await read_json(receive)
                if not isinstance(patch, dict):
                    raise InvalidRequestError("request body must be a JSON object")
                try:
                    current = engine.set_faults(patch)
                except pydantic.ValidationError as error:
                    raise validation_error(error) from None
                logger.warning("faults set: %s", current)
            else:
                current = engine.faults.config.model_dump()
        except ClientGoneError:
            return
        except ApiError as error:
            await send_error(send, error)
            return
        await send_bytes(send, 200, json.dumps(current).encode(), JSON_HEADERS)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    """The edge's one mapping (STYLE 13) for what Starlette's router raises."""
    if isinstance(exc, HTTPException):
        error: ApiError = http_error(exc.status_code, exc.detail)
        headers = exc.headers
    else:
        error = exc if isinstance(exc, ApiError) else BadRequestError(str(exc))
        headers = None
    status, body = describe(error)
    return Response(body, status, headers=headers, media_type="application/json")


def create_app(config: SimEngineConfig) -> Starlette:
    """A sim engine serving ``config``, its loop clocked by ``ScaledClock(config.time_scale)``.

    Raises ``ValueError`` (catalog errors included) when the config names an unknown model or
    GPU, or when the replica cannot be built (e.g. the weights do not fit).
    """
    return _build(SimEngine(config, ScaledClock(config.time_scale)))


def _build(engine: SimEngine) -> Starlette:
    routes = [
        Route("/v1/chat/completions", Completions(engine, chat=True), methods=["POST"]),
        Route("/v1/completions", Completions(engine, chat=False), methods=["POST"]),
        Route("/v1/embeddings", Embeddings(engine), methods=["POST"]),
        Route("/v1/responses", Responses(engine), methods=["POST"]),
        Route("/tokenize", Tokenize(engine), methods=["POST"]),
        Route("/detokenize", Detokenize(engine), methods=["POST"]),
        Route("/v1/models", _Models(engine), methods=["GET"]),
        Route("/health", _Health(engine), methods=["GET"]),
        Route("/metrics", _Metrics(engine), methods=["GET"]),
    ]
    if engine.config.dev_mode:  # vLLM's VLLM_SERVER_DEV_MODE=1 endpoints
        enabled = engine.config.enable_sleep_mode
        routes += [
            Route("/sleep", SleepRoute(engine.sleep, enabled), methods=["POST"]),
            Route("/wake_up", WakeRoute(engine.sleep, enabled), methods=["POST"]),
            Route("/is_sleeping", IsSleepingRoute(engine.sleep), methods=["GET"]),
        ]
    if engine.config.allow_runtime_lora_updating:  # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING
        routes += [
            Route("/v1/load_lora_adapter", LoadLoraAdapter(engine), methods=["POST"]),
            Route("/v1/unload_lora_adapter", UnloadLoraAdapter(engine), methods=["POST"]),
        ]
    if engine.config.enable_admin:
        routes.append(Route("/admin/faults", _AdminFaults(engine), methods=["GET", "POST"]))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        started = asyncio.Event()
        async with asyncio.TaskGroup() as group:
            loop_task = group.create_task(engine.loop.run(started))
            crash_task = group.create_task(engine.faults.watch_for_crash())
            kv = engine.kv_events
            replay_task = None if kv is None else group.create_task(kv.serve_replay())
            await started.wait()
            logger.info(
                "sim engine ready: %s on %s (tp=%d), %d KV blocks, max_model_len %d; "
                "time scale %g: latencies are reported in modelled seconds",
                engine.name,
                engine.config.gpu,
                engine.config.tp,
                engine.model.stats().num_gpu_blocks,
                engine.max_model_len,
                engine.config.time_scale,
            )
            if kv is not None:
                logger.info(
                    "KV events on %s (replay: %s)", kv.endpoint, kv.replay_endpoint or "none"
                )
            try:
                yield
            finally:
                loop_task.cancel()
                crash_task.cancel()
                if replay_task is not None:
                    replay_task.cancel()
        if kv is not None:
            kv.close()
        if engine.tracing is not None:  # the spans still waiting go out
            await asyncio.to_thread(engine.tracing.shutdown)

    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _on_http_error, ApiError: _on_http_error},
    )
    app.state.engine = engine
    return app
