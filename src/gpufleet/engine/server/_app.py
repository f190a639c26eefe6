"""The sim engine's ASGI app: vLLM's OpenAI-compatible routes over one modelled replica.

    app = create_app(SimEngineConfig(model="llama-3.1-8b", gpu="h100-sxm", time_scale=10))
    uvicorn.run(app, port=8001)

Routes (all pure ASGI endpoints; STYLE 11)::

    POST /v1/chat/completions   POST /v1/completions     streaming (SSE) or not
    GET  /v1/models             GET  /health             GET /metrics
    GET|POST /admin/faults      only with enable_admin (404 otherwise)

The engine loop runs as a task of the app's lifespan (STYLE 10). Each completion request
reads its body, passes the fault gate, is validated and tokenized, and is submitted to the
loop; then one task writes the response while a second watches for the client going away:
a disconnect cancels the writer, whose ``finally`` aborts the model request at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import pydantic
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gpufleet.engine._tokenizer import Tokenizer
from gpufleet.engine.model import FinishReason, NewRequest, ReplicaModel
from gpufleet.engine.server._clock import Clock, ScaledClock
from gpufleet.engine.server._config import SimEngineConfig
from gpufleet.engine.server._errors import (
    ApiError,
    BadRequestError,
    EngineUnavailableError,
    InjectedFaultError,
    InvalidJSONError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    PromptTooLongError,
    UnsupportedError,
    describe,
    error_body,
    http_error,
)
from gpufleet.engine.server._faults import Faults
from gpufleet.engine.server._loop import EngineDeadError, EngineLoop, RequestStream
from gpufleet.engine.server._metrics import EngineMetrics
from gpufleet.engine.server._protocol import (
    DONE,
    WORD_JSON,
    ChatRequest,
    CompletionRequest,
    ResponseShape,
    StopMatcher,
    Usage,
)

logger = logging.getLogger("gpufleet.engine.sim")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

MAX_BODY_BYTES = 32 * 1024 * 1024
_JSON = [(b"content-type", b"application/json")]
_SSE = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class _ClientGoneError(Exception):
    """The client disconnected before the request body was read."""


class SimEngine:
    """Everything one sim replica holds: model, loop, tokenizer, metrics and faults."""

    def __init__(self, config: SimEngineConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        replica = config.replica_config()
        spec = replica.model
        self.model = ReplicaModel(replica)
        self.model.set_slowdown(config.faults.slowdown)
        self.tokenizer = Tokenizer(spec.vocab_size)
        self.name = config.name
        self.max_model_len = self.model.max_model_len
        stats = self.model.stats()
        self.metrics = EngineMetrics(
            self.name,
            self.model.stats,
            {
                "block_size": str(stats.block_size),
                "num_gpu_blocks": str(stats.num_gpu_blocks),
                "num_cpu_blocks": "0",
                "cache_dtype": "auto",
                "enable_prefix_caching": str(config.enable_prefix_caching),
                "gpu_memory_utilization": str(config.gpu_memory_utilization),
            },
        )
        self.loop = EngineLoop(self.model, clock, self.metrics)
        self.faults = Faults(config.faults, random.Random(config.seed))
        self._next_request = 0
        self.created = int(time.time())

    def new_request_id(self) -> str:
        """The model's id for a request: unique in this process, deterministic per seed."""
        self._next_request += 1
        return str(self._next_request)

    def response_id(self, prefix: str, scope: Scope) -> str:
        """``prefix-<X-Request-Id>`` when the client sent one (as vLLM does), else random, as
        vLLM's are: not drawn from ``--seed``, which every replica of a fleet shares, so two
        replicas never answer with the same id."""
        for key, value in scope["headers"]:
            if key == b"x-request-id" and value:
                return f"{prefix}-{value.decode('latin-1')}"
        return f"{prefix}-{secrets.token_hex(16)}"

    def set_faults(self, patch: dict[str, Any]) -> dict[str, Any]:
        config = self.faults.update(patch)
        self.model.set_slowdown(config.slowdown)
        return config.model_dump()


# --- ASGI plumbing ---------------------------------------------------------------------------


async def _read_json(receive: Receive) -> Any:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGoneError
        body = message.get("body", b"")
        size += len(body)
        if size > MAX_BODY_BYTES:
            raise PayloadTooLargeError(f"request body is larger than {MAX_BODY_BYTES} bytes")
        chunks.append(body)
        if not message.get("more_body", False):
            break
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as error:
        raise InvalidJSONError(f"request body is not valid JSON: {error}") from None


async def _send_bytes(send: Send, status: int, body: bytes, headers: list[Any]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: Send, error: BaseException) -> None:
    status, body = describe(error)
    await _send_bytes(send, status, body, _JSON)


async def _until_disconnect(receive: Receive, work: Coroutine[Any, Any, object]) -> None:
    """Run ``work`` (which writes the response); cancel it if the client goes away."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        worker.cancel()

    async with asyncio.TaskGroup() as group:
        worker = group.create_task(work)
        watcher = group.create_task(watch())
        worker.add_done_callback(lambda _: watcher.cancel())


def _validation_error(error: pydantic.ValidationError) -> InvalidRequestError:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "body"
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return InvalidRequestError(f"{where}: {first['msg']}{more}", param=where)


# --- completions -----------------------------------------------------------------------------


class _Completions:
    """``POST /v1/chat/completions`` (``chat=True``) and ``POST /v1/completions``."""

    def __init__(self, engine: SimEngine, *, chat: bool) -> None:
        self.engine = engine
        self.chat = chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            payload = await _read_json(receive)
            faults = self.engine.faults
            if faults.config.hang:
                await _until_disconnect(receive, asyncio.Event().wait())
                return
            if faults.draw_error():
                raise InjectedFaultError("injected fault: this request was chosen to fail")
            request, prompt = self._parse(payload)
        except _ClientGoneError:
            return
        except ApiError as error:
            await _send_error(send, error)
            return
        await _until_disconnect(receive, self._respond(scope, send, request, prompt))

    def _parse(self, payload: Any) -> tuple[ChatRequest | CompletionRequest, tuple[int, ...]]:
        if not isinstance(payload, dict):
            raise InvalidRequestError("request body must be a JSON object")
        kind = ChatRequest if self.chat else CompletionRequest
        try:
            request = kind.model_validate(payload)
        except pydantic.ValidationError as error:
            raise _validation_error(error) from None
        engine = self.engine
        if request.model is not None and request.model != engine.name:
            raise NotFoundError(f"The model `{request.model}` does not exist.", param="model")
        if request.n != 1:
            raise UnsupportedError(f"n must be 1 in the sim engine, got {request.n}", param="n")
        if isinstance(request, ChatRequest):
            messages = [(m.role, m.text()) for m in request.messages]
            return request, engine.tokenizer.encode_chat(messages)
        return request, self._prompt_ids(request.prompt)

    def _prompt_ids(self, prompt: str | list[int] | list[str] | list[list[int]]) -> tuple[int, ...]:
        tokenizer = self.engine.tokenizer
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise UnsupportedError(
                    "batched prompts are not supported; send one prompt", param="prompt"
                )
            only = prompt[0]
            return tokenizer.encode(only) if isinstance(only, str) else self._check_ids(only)
        return self._check_ids([p for p in prompt if isinstance(p, int)])

    def _check_ids(self, ids: list[int]) -> tuple[int, ...]:
        if not ids:
            raise InvalidRequestError("prompt cannot be empty", param="prompt")
        vocab = self.engine.tokenizer.vocab_size
        for token in ids:
            if not 0 <= token < vocab:
                raise InvalidRequestError(f"Token id {token} is out of vocabulary", param="prompt")
        return tuple(ids)

    async def _respond(
        self,
        scope: Scope,
        send: Send,
        request: ChatRequest | CompletionRequest,
        prompt: tuple[int, ...],
    ) -> None:
        engine = self.engine
        max_tokens = request.requested_max_tokens()
        if max_tokens is None:
            max_tokens = max(1, engine.max_model_len - len(prompt))
        new = NewRequest(
            request_id=engine.new_request_id(),
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            ignore_eos=request.ignore_eos,
            priority=request.priority,
        )
        try:
            stream = engine.loop.submit(new)
        except ValueError as error:
            await _send_error(send, PromptTooLongError(str(error)))
            return
        except EngineDeadError as error:
            await _send_error(send, EngineUnavailableError(str(error)))
            return
        shape = ResponseShape(
            chat=self.chat,
            response_id=engine.response_id("chatcmpl" if self.chat else "cmpl", scope),
            created=int(time.time()),
            model=engine.name,
        )
        writer = _StreamWriter if request.stream else _BodyWriter
        done = False
        try:
            await writer(engine, stream, shape, request).write(send)
            done = True
        except OSError:  # the connection broke while writing
            pass
        finally:
            if not done:
                engine.loop.abort(new.request_id)


class _Generation:
    """Tokens of one request turned into text and a finish, stop strings applied."""

    def __init__(
        self,
        engine: SimEngine,
        stream: RequestStream,
        shape: ResponseShape,
        request: ChatRequest | CompletionRequest,
    ) -> None:
        self.engine = engine
        self.stream = stream
        self.shape = shape
        stops = request.stop_strings()
        self.matcher = StopMatcher(stops) if stops else None
        self.include_usage = request.include_usage
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None

    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def _stopped(self, matched: str) -> None:
        self.finish_reason = FinishReason.STOP.value
        self.stop_reason = matched
        self.engine.metrics.shell.stop_string_finishes += 1
        self.engine.loop.abort(self.stream.request_id)

    async def pieces(self) -> AsyncIterator[tuple[str, bool]]:
        """Yield ``(text, last)`` per output (``last`` on the finishing one) until finished."""
        tokenizer = self.engine.tokenizer
        while self.finish_reason is None:
            outputs = await self.stream.next()
            if not outputs:  # closed without finishing: aborted or the engine stopped
                self.finish_reason = FinishReason.ABORT.value
                yield "", True
                return
            for output in outputs:
                self.prompt_tokens = output.num_prompt_tokens
                self.cached_tokens = output.num_cached_tokens
                self.completion_tokens += len(output.new_token_ids)
                text = tokenizer.decode(output.new_token_ids)
                if self.matcher is not None:
                    text = self.matcher.feed(text)
                    if self.matcher.matched is not None:
                        self._stopped(self.matcher.matched)
                        yield text, True
                        return
                if output.finish_reason is not None:
                    self.finish_reason = str(output.finish_reason.value)
                    if self.matcher is not None:
                        text += self.matcher.flush()
                    yield text, True
                    return
                yield text, False


class _BodyWriter(_Generation):
    async def write(self, send: Send) -> None:
        parts = [text async for text, _ in self.pieces()]
        assert self.finish_reason is not None
        body = self.shape.full_body(
            "".join(parts), self.finish_reason, self.stop_reason, self.usage()
        )
        await _send_bytes(send, 200, body, _JSON)


class _StreamWriter(_Generation):
    """One SSE event per output; everything ready at a wake-up goes out in one write."""

    async def write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        shape = self.shape
        first = True
        if self.matcher is None:
            await self._fast(send)
        else:
            async for text, last in self.pieces():
                events: list[bytes] = []
                if first and shape.chat:
                    events.append(shape.role_event)
                first = False
                if last:
                    assert self.finish_reason is not None
                    tail = shape.final_tail(self.finish_reason, self.stop_reason)
                    events.append(shape.text_event(text, tail))
                elif text:
                    events.append(shape.text_event(text))
                if events:
                    await send(
                        {"type": "http.response.body", "body": b"".join(events), "more_body": True}
                    )
        end = shape.usage_event(self.usage()) + DONE if self.include_usage else DONE
        await send({"type": "http.response.body", "body": end, "more_body": False})

    async def _fast(self, send: Send) -> None:
        """The hot path without stop strings: precomputed fragments, one write per wake-up."""
        shape, stream = self.shape, self.stream
        head, tail = shape.head, shape.tail
        words = WORD_JSON
        nwords = len(words)
        pending_role = shape.chat
        while True:
            outputs = await stream.next()
            events: list[bytes] = []
            if pending_role and outputs:
                events.append(shape.role_event)
                pending_role = False
            if not outputs:
                self.finish_reason = FinishReason.ABORT.value
                events.append(shape.text_event("", shape.final_tail("abort", None)))
            for output in outputs:
                self.prompt_tokens = output.num_prompt_tokens
                self.cached_tokens = output.num_cached_tokens
                ids = output.new_token_ids
                self.completion_tokens += len(ids)
                if output.finish_reason is None:
                    events.extend([head + words[i % nwords] + tail for i in ids])
                    continue
                self.finish_reason = str(output.finish_reason.value)
                final = shape.final_tail(self.finish_reason, None)
                if ids:
                    events.extend([head + words[i % nwords] + tail for i in ids[:-1]])
                    events.append(head + words[ids[-1] % nwords] + final)
                else:
                    events.append(shape.text_event("", final))
            await send({"type": "http.response.body", "body": b"".join(events), "more_body": True})
            if self.finish_reason is not None:
                return


# --- the other routes ------------------------------------------------------------------------


class _Models:
    def __init__(self, engine: SimEngine) -> None:
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
        self.body = json.dumps({"object": "list", "data": [card]}).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_bytes(send, 200, self.body, _JSON)


class _Health:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine
        if engine.faults.config.hang:
            await _until_disconnect(receive, asyncio.Event().wait())
            return
        if engine.faults.config.unhealthy or engine.loop.dead is not None:
            reason = "engine loop stopped" if engine.loop.dead else "injected fault: unhealthy"
            body = error_body(503, reason, "ServiceUnavailableError")
            await _send_bytes(send, 503, body, _JSON)
            return
        await _send_bytes(send, 200, b"", [(b"content-length", b"0")])


class _Metrics:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = generate_latest(self.engine.metrics.registry)
        await _send_bytes(send, 200, body, [(b"content-type", CONTENT_TYPE_LATEST.encode())])


class _AdminFaults:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = self.engine
        try:
            if scope["method"] == "POST":
                patch = await _read_json(receive)
                if not isinstance(patch, dict):
                    raise InvalidRequestError("request body must be a JSON object")
                try:
                    current = engine.set_faults(patch)
                except pydantic.ValidationError as error:
                    raise _validation_error(error) from None
                logger.warning("faults set: %s", current)
            else:
                current = engine.faults.config.model_dump()
        except _ClientGoneError:
            return
        except ApiError as error:
            await _send_error(send, error)
            return
        await _send_bytes(send, 200, json.dumps(current).encode(), _JSON)


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
        Route("/v1/chat/completions", _Completions(engine, chat=True), methods=["POST"]),
        Route("/v1/completions", _Completions(engine, chat=False), methods=["POST"]),
        Route("/v1/models", _Models(engine), methods=["GET"]),
        Route("/health", _Health(engine), methods=["GET"]),
        Route("/metrics", _Metrics(engine), methods=["GET"]),
    ]
    if engine.config.enable_admin:
        routes.append(Route("/admin/faults", _AdminFaults(engine), methods=["GET", "POST"]))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        started = asyncio.Event()
        async with asyncio.TaskGroup() as group:
            loop_task = group.create_task(engine.loop.run(started))
            crash_task = group.create_task(engine.faults.watch_for_crash())
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
            try:
                yield
            finally:
                loop_task.cancel()
                crash_task.cancel()

    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={HTTPException: _on_http_error, ApiError: _on_http_error},
    )
    app.state.engine = engine
    return app
