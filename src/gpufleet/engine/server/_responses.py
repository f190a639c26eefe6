"""``POST /v1/responses``: the OpenAI Responses API, as vLLM serves it for a text model.

    client.responses.create(model="llama-3.1-8b", instructions="Be brief.", input="Hi",
                            max_output_tokens=64, stream=True)

``instructions`` become a system message and ``input`` (a string, or a list of messages,
``function_call`` and ``function_call_output`` items) the rest of the chat; the prompt is the
chat template's, and one generation runs through the replica model. The answer is one
``message`` output item with one ``output_text`` part; ``status`` is ``incomplete`` (with
``incomplete_details.reason = "max_output_tokens"``) when the generation hit its limit.
``max_output_tokens`` defaults to, and is clamped to, what is left of the context (vLLM's
``get_max_tokens``). No response is stored, as in vLLM without
``VLLM_ENABLE_RESPONSES_API_STORE``: ``previous_response_id`` is a 404 and ``background`` a 400.

Streaming sends vLLM's events, ``event: <type>`` then ``data: <json>``, numbered from 0::

    response.created  response.in_progress  response.output_item.added
    response.content_part.added  response.output_text.delta × tokens
    response.output_text.done  response.content_part.done  response.output_item.done
    response.completed  (the final response, whose status may be "incomplete"; no [DONE])
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from gpufleet.engine.model import FinishReason, NewRequest
from gpufleet.engine.server._asgi import (
    JSON_HEADERS,
    SSE_HEADERS,
    JsonRoute,
    Respond,
    Scope,
    Send,
    check_model,
    parse_body,
    send_bytes,
    send_chunk,
    send_error,
)
from gpufleet.engine.server._errors import (
    ApiError,
    EngineUnavailableError,
    InvalidRequestError,
    NotFoundError,
)
from gpufleet.engine.server._loop import EngineDeadError, RequestStream

_INT32 = 2**31 - 1


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class TextContent(_Item):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Item):
    type: Literal["message"] = "message"
    role: Annotated[str, StringConstraints(min_length=1)]
    content: str | list[TextContent]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCall(_Item):
    type: Literal["function_call"]
    name: str
    arguments: str


class FunctionCallOutput(_Item):
    type: Literal["function_call_output"]
    output: str


class ResponsesRequest(_Item):
    """The fields of vLLM's ``ResponsesRequest`` the sim engine reads or echoes."""

    model: str | None = None
    input: str | list[InputMessage | FunctionCall | FunctionCallOutput]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=_INT32)
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = True
    background: bool | None = False
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool | None = True
    max_tool_calls: int | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    truncation: Literal["auto", "disabled"] | None = "disabled"
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    ignore_eos: bool = False
    priority: int = Field(default=0, ge=-_INT32, le=_INT32)

    def messages(self) -> list[tuple[str, str]]:
        chat = [("system", self.instructions)] if self.instructions is not None else []
        if isinstance(self.input, str):
            return [*chat, ("user", self.input)]
        for item in self.input:
            if isinstance(item, InputMessage):
                chat.append((item.role, item.text()))
            elif isinstance(item, FunctionCall):
                chat.append(("assistant", f"{item.name}({item.arguments})"))
            else:
                chat.append(("tool", item.output))
        return chat


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


class _Answer:
    """One response being built: its ids, its echo of the request, its events' numbering."""

    def __init__(
        self, request: ResponsesRequest, response_id: str, item_id: str, model: str, limit: int
    ) -> None:
        self.request = request
        self.id = response_id
        self.item_id = item_id
        self.model = model
        self.limit = limit
        self.created = int(time.time())
        self.sequence = 0
        self.text: list[str] = []
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self.finish_reason: str | None = None

    def event(self, type_: str, **fields: Any) -> bytes:
        event = {"type": type_, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return _sse(event)

    def item(self, status: str) -> dict[str, Any]:
        content = [self.part()] if status == "completed" and self.text else []
        return {
            "id": self.item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def part(self, text: str | None = None) -> dict[str, Any]:
        body = "".join(self.text) if text is None else text
        return {"type": "output_text", "text": body, "annotations": [], "logprobs": []}

    def status(self) -> str:
        if self.finish_reason is None:
            return "in_progress"
        if self.finish_reason == FinishReason.LENGTH:
            return "incomplete"
        return "cancelled" if self.finish_reason == FinishReason.ABORT else "completed"

    def response(self) -> dict[str, Any]:
        """vLLM's ``ResponsesResponse.from_request`` for where the answer stands now."""
        request = self.request
        status = self.status()
        done = self.finish_reason is not None
        usage = None
        if done:
            usage = {
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.output_tokens,
            }
        return {
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": request.instructions,
            "metadata": request.metadata,
            "model": self.model,
            "object": "response",
            "output": [self.item("completed")] if done and self.text else [],
            "parallel_tool_calls": request.parallel_tool_calls,
            "temperature": 1.0 if request.temperature is None else request.temperature,
            "tool_choice": request.tool_choice,
            "tools": request.tools,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "background": bool(request.background),
            "max_output_tokens": self.limit,
            "max_tool_calls": request.max_tool_calls,
            "previous_response_id": None,
            "prompt": None,
            "reasoning": request.reasoning,
            "service_tier": request.service_tier,
            "status": status,
            "text": request.text,
            "top_logprobs": request.top_logprobs,
            "truncation": request.truncation,
            "usage": usage,
            "user": request.user,
        }

    async def pieces(
        self, stream: RequestStream, decode: Callable[[Sequence[int]], str]
    ) -> AsyncIterator[str]:
        """Each output's text as it comes; ``finish_reason`` set at the end."""
        while self.finish_reason is None:
            outputs = await stream.next()
            if not outputs:
                self.finish_reason = FinishReason.ABORT.value
                return
            for output in outputs:
                self.prompt_tokens = output.num_prompt_tokens
                self.cached_tokens = output.num_cached_tokens
                self.output_tokens += len(output.new_token_ids)
                text = decode(output.new_token_ids)
                self.text.append(text)
                if output.finish_reason is not None:
                    self.finish_reason = str(output.finish_reason.value)
                yield text


class Responses(JsonRoute):
    """``POST /v1/responses``."""

    def accept(self, scope: Scope, payload: Any) -> Respond:
        request = parse_body(ResponsesRequest, payload)
        engine = self.engine
        adapter = check_model(engine, request.model)
        if request.background:
            raise InvalidRequestError(
                "This vLLM engine does not support `store=True` and therefore does not "
                "support the background mode.",
                param="background",
            )
        if request.previous_response_id is not None:
            raise NotFoundError(
                f"Response with id '{request.previous_response_id}' not found.",
                param="response_id",
            )
        prompt = engine.tokenizer.encode_chat(request.messages())
        if len(prompt) >= engine.max_model_len:
            raise InvalidRequestError(
                f"The engine prompt length {len(prompt)} exceeds the max_model_len "
                f"{engine.max_model_len}. Please reduce prompt.",
                param="input",
            )
        return functools.partial(self._respond, request, prompt, adapter)

    async def _respond(
        self,
        request: ResponsesRequest,
        prompt: tuple[int, ...],
        adapter: str | None,
        send: Send,
    ) -> None:
        engine = self.engine
        room = engine.max_model_len - len(prompt)
        limit = min(room, request.max_output_tokens or room)
        new = NewRequest(
            engine.new_request_id(),
            prompt,
            max_tokens=limit,
            ignore_eos=request.ignore_eos,
            priority=request.priority,
        )
        try:
            (stream,) = await engine.submit_as(adapter, [new])
        except ApiError as error:
            await send_error(send, error)
            return
        model = adapter or engine.name
        answer = _Answer(
            request, f"resp_{engine.random_hex()}", f"msg_{engine.random_hex()}", model, limit
        )
        done = False
        try:
            if request.stream:
                await self._stream(send, stream, answer)
            else:
                await self._body(send, stream, answer)
            done = True
        except OSError:  # the connection broke while writing
            pass
        finally:
            if not done:
                engine.loop.abort(stream.request_id)
            engine.release_lora([stream])

    async def _body(self, send: Send, stream: RequestStream, answer: _Answer) -> None:
        try:
            async for _ in answer.pieces(stream, self.engine.tokenizer.decode):
                pass
        except EngineDeadError as error:
            await send_error(send, EngineUnavailableError(str(error)))
            return
        body = json.dumps(answer.response(), separators=(",", ":")).encode()
        await send_bytes(send, 200, body, JSON_HEADERS)

    async def _stream(self, send: Send, stream: RequestStream, answer: _Answer) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        head = answer.response()
        events = [
            answer.event("response.created", response=head),
            answer.event("response.in_progress", response=head),
        ]
        where = {"item_id": answer.item_id, "output_index": 0, "content_index": 0}
        started = False
        try:
            async for text in answer.pieces(stream, self.engine.tokenizer.decode):
                if not text:
                    continue
                if not started:
                    started = True
                    events.append(
                        answer.event(
                            "response.output_item.added",
                            output_index=0,
                            item=answer.item("in_progress"),
                        )
                    )
                    events.append(
                        answer.event("response.content_part.added", **where, part=answer.part(""))
                    )
                events.append(
                    answer.event("response.output_text.delta", **where, delta=text, logprobs=[])
                )
                await send_chunk(send, b"".join(events))
                events = []
        except EngineDeadError as error:  # vLLM's error event ends the stream
            events.append(answer.event("error", code="500", message=str(error), param=None))
            await send_chunk(send, b"".join(events), more=False)
            return
        if started:
            full = "".join(answer.text)
            events += [
                answer.event("response.output_text.done", **where, text=full, logprobs=[]),
                answer.event("response.content_part.done", **where, part=answer.part()),
                answer.event(
                    "response.output_item.done", output_index=0, item=answer.item("completed")
                ),
            ]
        events.append(answer.event("response.completed", response=answer.response()))
        await send_chunk(send, b"".join(events), more=False)
