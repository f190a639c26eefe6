"""The ASGI plumbing every route shares: body reading, answers, the fault gate, disconnects.

A JSON route is a ``JsonRoute``: it reads the body, passes the fault gate, and ``accept``
validates the payload (raising ``ApiError``) and returns the coroutine that writes the
answer; that coroutine runs while a second task watches for the client going away, and a
disconnect cancels it (its ``finally`` aborts whatever it queued in the model)::

    body ─► fault gate ─► accept(scope, payload) ─► respond(send)   ◄─ cancelled on disconnect
                 │                 │
                 └── ApiError ─────┴──► one OpenAI-shaped error answer
"""

from __future__ import annotations

import asyncio
import json
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from typing import Any, ClassVar, TypeVar

import pydantic

from gpufleet.engine.server._engine import SimEngine
from gpufleet.engine.server._errors import (
    ApiError,
    InjectedFaultError,
    InjectedOverloadError,
    InvalidJSONError,
    InvalidRequestError,
    ModelSleepingError,
    NotFoundError,
    PayloadTooLargeError,
    describe,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Respond = Callable[[Send], Coroutine[Any, Any, None]]

MAX_BODY_BYTES = 32 * 1024 * 1024
JSON_HEADERS = [(b"content-type", b"application/json")]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)


class ClientGoneError(Exception):
    """The client disconnected before the request body was read."""


async def read_json(receive: Receive) -> Any:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGoneError
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


async def send_bytes(send: Send, status: int, body: bytes, headers: list[Any]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_chunk(send: Send, body: bytes, *, more: bool = True) -> None:
    """One piece of a streamed body (``more=False`` ends it)."""
    await send({"type": "http.response.body", "body": body, "more_body": more})


async def send_error(send: Send, error: BaseException) -> None:
    status, body = describe(error)
    await send_bytes(send, status, body, JSON_HEADERS)


async def until_disconnect(receive: Receive, work: Coroutine[Any, Any, object]) -> None:
    """Run ``work`` (which writes the response); cancel it if the client goes away."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        worker.cancel()

    async with asyncio.TaskGroup() as group:
        worker = group.create_task(work)
        watcher = group.create_task(watch())
        worker.add_done_callback(lambda _: watcher.cancel())


def validation_error(error: pydantic.ValidationError) -> InvalidRequestError:
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "body"
    more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
    return InvalidRequestError(f"{where}: {first['msg']}{more}", param=where)


def parse_body(kind: type[ModelT], payload: Any) -> ModelT:
    """``payload`` validated as ``kind``; ``InvalidRequestError`` naming the first bad field."""
    if not isinstance(payload, dict):
        raise InvalidRequestError("request body must be a JSON object")
    try:
        return kind.model_validate(payload)
    except pydantic.ValidationError as error:
        raise validation_error(error) from None


def check_model(engine: SimEngine, model: str | None) -> str | None:
    """A request may name the served model, a registered LoRA adapter (its name is
    returned) or none; another name is vLLM's 404."""
    if model is None or model == engine.name:
        return None
    if engine.lora is not None and model in engine.lora.registered:
        return model
    raise NotFoundError(f"The model `{model}` does not exist.", param="model")


class JsonRoute(ABC):
    """A ``POST`` route with a JSON body, behind the fault gate (see the module docstring)."""

    draws_errors: ClassVar[bool] = True
    """Whether ``error_rate`` applies (routes that run the model); ``hang`` always does."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            payload = await read_json(receive)
            faults = self.engine.faults
            if faults.config.hang:
                await until_disconnect(receive, asyncio.Event().wait())
                return
            if self.draws_errors and self.engine.sleep.sleeping:
                raise ModelSleepingError("the model is sleeping (POST /wake_up wakes it)")
            if self.draws_errors and faults.draw_error():
                kind = (
                    InjectedOverloadError
                    if faults.config.error_status == 503
                    else InjectedFaultError
                )
                raise kind("injected fault: this request was chosen to fail")
            respond = self.accept(scope, payload)
        except ClientGoneError:
            return
        except ApiError as error:
            await send_error(send, error)
            return
        await until_disconnect(receive, respond(send))

    @abstractmethod
    def accept(self, scope: Scope, payload: Any) -> Respond:
        """Validate ``payload`` (``ApiError`` if it is bad); the coroutine that answers it."""
