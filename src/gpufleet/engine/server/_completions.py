"""``POST /v1/chat/completions`` and ``POST /v1/completions``, one or ``n`` sequences each.

``n`` sequences are ``n`` model requests with the same prompt, queued together, as vLLM v1
fans a request out into child requests: each is scheduled, counted in the metrics and
finished on its own. The first one's full prompt blocks enter the prefix cache when they
are allocated, so the others are prefilled from the cache in the same step (all but the
last partial block)::

    prompt P = 70 tokens, block 16, n = 3        step 1 schedules   s0: 70   s1: 6   s2: 6

Usage counts the prompt once and sums the completions (vLLM's rule); ``cached_tokens`` is
the first sequence's.

A prompt that ends with the start of an answer this engine's seed generates (a completion's
token ids, or a chat's last assistant message continued with ``continue_final_message``) goes
on with that answer, as a greedy decoder would: a stream resumed on another replica by the
gateway continues token for token (``FillerTokens.position_after``). ``return_token_ids`` puts
the generated ids in a stream's events and the prompt's in its first, as vLLM does.

Responses are written by one of three writers: the body (all choices at once), the one-choice
stream (the hot path: precomputed fragments, one write per wake-up) and the ``n``-choice
stream (each choice's events as they come, tagged with its ``index``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

from gpufleet.engine._tokenizer import WORDS
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
from gpufleet.engine.server._engine import SimEngine
from gpufleet.engine.server._errors import (
    ApiError,
    EngineUnavailableError,
    InvalidRequestError,
    UnsupportedError,
)
from gpufleet.engine.server._loop import EngineDeadError, RequestStream
from gpufleet.engine.server._protocol import (
    DONE,
    WORD_JSON,
    ChatRequest,
    Choice,
    CompletionRequest,
    ResponseShape,
    StopMatcher,
    Usage,
)
from gpufleet.engine.server._tokenize import chat_prompt_ids

Completion = ChatRequest | CompletionRequest
_WORD_INDEX: dict[str, int] = {word: i for i, word in enumerate(WORDS)}
"""A generated word's index in ``WORDS`` (a resumed chat's text read back)."""


class Completions(JsonRoute):
    """``POST /v1/chat/completions`` (``chat=True``) and ``POST /v1/completions``."""

    def __init__(self, engine: SimEngine, *, chat: bool) -> None:
        super().__init__(engine)
        self.chat = chat

    def accept(self, scope: Scope, payload: Any) -> Respond:
        request: Completion = (
            parse_body(ChatRequest, payload)
            if self.chat
            else parse_body(CompletionRequest, payload)
        )
        adapter = check_model(self.engine, request.model)
        filler = self.engine.model.filler
        if isinstance(request, ChatRequest):
            prompt = tuple(chat_prompt_ids(self.engine.tokenizer, request))
            continues_at = None
            last = request.messages[-1]
            if request.continue_final_message and last.role == "assistant":
                words = [_WORD_INDEX.get(w, -1) for w in last.text().split()]
                continues_at = filler.position_after(words, modulus=len(WORDS))
        else:
            prompt = self._prompt_ids(request.prompt)
            token_ids = not isinstance(request.prompt, str) and not (
                request.prompt and isinstance(request.prompt[0], str)
            )
            continues_at = filler.position_after(prompt) if token_ids else None
        return functools.partial(
            self._respond, scope, request, prompt, continues_at, adapter=adapter
        )

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
        request: Completion,
        prompt: tuple[int, ...],
        continues_at: int | None,
        send: Send,
        *,
        adapter: str | None,
    ) -> None:
        engine = self.engine
        model = adapter or engine.name
        max_tokens = request.requested_max_tokens()
        if max_tokens is None:
            max_tokens = max(1, engine.max_model_len - len(prompt))
        news = [
            NewRequest(
                request_id=engine.new_request_id(),
                prompt_token_ids=prompt,
                max_tokens=max_tokens,
                ignore_eos=request.ignore_eos,
                priority=request.priority,
                continues_at=continues_at,
            )
            for _ in range(request.n)
        ]
        response_id = engine.response_id("chatcmpl" if self.chat else "cmpl", scope)
        shape = ResponseShape(
            chat=self.chat,
            response_id=response_id,
            created=int(time.time()),
            model=model,
            token_ids=request.return_token_ids,
        )
        try:
            streams = await engine.submit_as(adapter, news)
        except ApiError as error:
            await send_error(send, error)
            return
        gens = [
            Generation(engine, stream, shape.for_choice(i), request, prompt)
            for i, stream in enumerate(streams)
        ]
        span = None
        if engine.tracing is not None:
            span = engine.tracing.start(
                scope["headers"],
                {
                    "gen_ai.request.id": response_id,
                    "gen_ai.response.model": model,
                    "gen_ai.request.max_tokens": max_tokens,
                    "gen_ai.request.n": request.n,
                    "gen_ai.usage.prompt_tokens": len(prompt),
                },
            )
        done = False
        try:
            if not request.stream:
                try:
                    await write_body(send, gens, len(prompt))
                except EngineDeadError as error:  # nothing was sent yet: a 500 body
                    await send_error(send, EngineUnavailableError(str(error)))
            elif len(gens) == 1:
                await StreamWriter(gens[0]).write(send)
            else:
                await write_streams(send, gens, len(prompt), request.include_usage)
            done = True
        except OSError:  # the connection broke while writing
            pass
        finally:
            if not done:
                for stream in streams:
                    engine.loop.abort(stream.request_id)
            engine.release_lora(streams)
            if span is not None:
                _end_span(engine, span, gens, ok=done)


class Generation:
    """Tokens of one sequence turned into text and a finish, stop strings applied."""

    def __init__(
        self,
        engine: SimEngine,
        stream: RequestStream,
        shape: ResponseShape,
        request: Completion,
        prompt: tuple[int, ...],
    ) -> None:
        self.engine = engine
        self.stream = stream
        self.shape = shape
        self.prompt = prompt
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

    def choice(self, text: str) -> Choice:
        assert self.finish_reason is not None
        return Choice(self.shape.index, text, self.finish_reason, self.stop_reason)

    def _stopped(self, matched: str) -> None:
        self.finish_reason = FinishReason.STOP.value
        self.stop_reason = matched
        self.engine.metrics.shell.stop_string_finishes += 1
        self.engine.loop.abort(self.stream.request_id)

    async def pieces(self) -> AsyncIterator[tuple[str, bool, tuple[int, ...]]]:
        """Yield ``(text, last, ids)`` per output (``last`` on the finishing one) until
        finished."""
        tokenizer = self.engine.tokenizer
        while self.finish_reason is None:
            outputs = await self.stream.next()
            if not outputs:  # closed without finishing: aborted or the engine stopped
                self.finish_reason = FinishReason.ABORT.value
                yield "", True, ()
                return
            for output in outputs:
                self.prompt_tokens = output.num_prompt_tokens
                self.cached_tokens = output.num_cached_tokens
                ids = output.new_token_ids
                self.completion_tokens += len(ids)
                text = tokenizer.decode(ids)
                if self.matcher is not None:
                    text = self.matcher.feed(text)
                    if self.matcher.matched is not None:
                        self._stopped(self.matcher.matched)
                        yield text, True, ids
                        return
                if output.finish_reason is not None:
                    self.finish_reason = str(output.finish_reason.value)
                    if self.matcher is not None:
                        text += self.matcher.flush()
                    yield text, True, ids
                    return
                yield text, False, ids

    async def text(self) -> str:
        return "".join([text async for text, _, _ in self.pieces()])

    def first(self, event: bytes) -> bytes:
        """A stream's first event, with the prompt's ids if they were asked for."""
        if not self.shape.token_ids:
            return event
        return self.shape.with_prompt_ids(event, self.prompt)


def _end_span(engine: SimEngine, span: Any, gens: list[Generation], *, ok: bool) -> None:
    """A request's span ends with its tokens and its latencies (modelled seconds)."""
    assert engine.tracing is not None
    now = engine.clock.now()
    arrival = min(g.stream.arrival for g in gens)
    firsts = [g.stream.first_token_at for g in gens if g.stream.first_token_at is not None]
    attributes: dict[str, Any] = {
        "gen_ai.usage.completion_tokens": sum(g.completion_tokens for g in gens),
        "gen_ai.usage.cached_tokens": gens[0].cached_tokens,
        "gen_ai.latency.e2e": max(0.0, now - arrival),
    }
    if firsts:
        attributes["gen_ai.latency.time_to_first_token"] = max(0.0, min(firsts) - arrival)
    if gens[0].finish_reason is not None:
        attributes["gen_ai.response.finish_reasons"] = [g.finish_reason or "" for g in gens]
    engine.tracing.end(span, attributes, ok=ok)


def _usage(gens: list[Generation], prompt_tokens: int) -> Usage:
    """vLLM's usage of ``n`` sequences: the prompt once, the completions summed."""
    completion = sum(g.completion_tokens for g in gens)
    return Usage(prompt_tokens, completion, gens[0].cached_tokens)


async def write_body(send: Send, gens: list[Generation], prompt_tokens: int) -> None:
    texts = await asyncio.gather(*(g.text() for g in gens))
    choices = [g.choice(text) for g, text in zip(gens, texts, strict=True)]
    body = gens[0].shape.full_body(choices, _usage(gens, prompt_tokens))
    await send_bytes(send, 200, body, JSON_HEADERS)


async def write_streams(
    send: Send, gens: list[Generation], prompt_tokens: int, include_usage: bool
) -> None:
    """``n`` choices in one SSE stream: each output's event as it comes, in one write per
    wake-up; chat sends every choice's role event first, as vLLM does."""
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    ready: asyncio.Queue[tuple[Generation, str, bool, tuple[int, ...]]] = asyncio.Queue()

    async def pump(gen: Generation) -> None:
        async for text, last, ids in gen.pieces():
            ready.put_nowait((gen, text, last, ids))

    async with asyncio.TaskGroup() as group:
        for gen in gens:
            group.create_task(pump(gen))
        pending = len(gens)
        events = [g.first(g.shape.role_event) for g in gens if g.shape.chat]
        started = {g.shape.index for g in gens if g.shape.chat}
        while pending:
            items = [await ready.get()]
            while not ready.empty():
                items.append(ready.get_nowait())
            for gen, text, last, ids in items:
                shape = gen.shape
                event = b""
                if last:
                    assert gen.finish_reason is not None
                    tail = shape.final_tail(gen.finish_reason, gen.stop_reason)
                    event = shape.text_event(text, tail, ids)
                    pending -= 1
                elif text:
                    event = shape.text_event(text, None, ids)
                if event and shape.index not in started:
                    started.add(shape.index)
                    event = gen.first(event)
                if event:
                    events.append(event)
            if events:
                await send_chunk(send, b"".join(events))
            events = []
    usage = gens[0].shape.usage_event(_usage(gens, prompt_tokens)) if include_usage else b""
    await send_chunk(send, usage + DONE, more=False)


class StreamWriter:
    """One choice's SSE events; everything ready at a wake-up goes out in one write."""

    def __init__(self, gen: Generation) -> None:
        self.gen = gen

    async def write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        gen = self.gen
        shape = gen.shape
        first = True
        if gen.matcher is None:
            await self._fast(send)
        else:
            async for text, last, ids in gen.pieces():
                events: list[bytes] = []
                if first and shape.chat:
                    events.append(shape.role_event)
                if last:
                    assert gen.finish_reason is not None
                    tail = shape.final_tail(gen.finish_reason, gen.stop_reason)
                    events.append(shape.text_event(text, tail, ids))
                elif text:
                    events.append(shape.text_event(text, None, ids))
                if first and events:
                    events[0] = gen.first(events[0])
                    first = False
                if events:
                    await send_chunk(send, b"".join(events))
        end = shape.usage_event(gen.usage()) + DONE if gen.include_usage else DONE
        await send_chunk(send, end, more=False)

    async def _fast(self, send: Send) -> None:
        """The hot path without stop strings: precomputed fragments, one write per wake-up."""
        gen = self.gen
        shape, stream = gen.shape, gen.stream
        head, tail = shape.head, shape.tail
        words = WORD_JSON
        nwords = len(words)
        pending_role = shape.chat
        first = True
        with_ids = shape.with_ids if shape.token_ids else None
        while True:
            outputs = await stream.next()
            events: list[bytes] = []
            if pending_role and outputs:
                events.append(shape.role_event)
                pending_role = False
            if not outputs:
                gen.finish_reason = FinishReason.ABORT.value
                events.append(shape.text_event("", shape.final_tail("abort", None)))
            for output in outputs:
                gen.prompt_tokens = output.num_prompt_tokens
                gen.cached_tokens = output.num_cached_tokens
                ids = output.new_token_ids
                gen.completion_tokens += len(ids)
                if output.finish_reason is None:
                    if with_ids is None:
                        events.extend([head + words[i % nwords] + tail for i in ids])
                    else:
                        events.extend(
                            [head + words[i % nwords] + with_ids(tail, (i,)) for i in ids]
                        )
                    continue
                gen.finish_reason = str(output.finish_reason.value)
                final = shape.final_tail(gen.finish_reason, None)
                if ids:
                    events.extend(
                        [shape.text_event(" " + WORDS[i % nwords], tail, (i,)) for i in ids[:-1]]
                    )
                    events.append(shape.text_event(" " + WORDS[ids[-1] % nwords], final, ids[-1:]))
                else:
                    events.append(shape.text_event("", final, ()))
            if first and events:
                events[0] = gen.first(events[0])
                first = False
            await send_chunk(send, b"".join(events))
            if gen.finish_reason is not None:
                return
