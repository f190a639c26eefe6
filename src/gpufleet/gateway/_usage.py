"""Reading a response's token usage on its way to the client, without slowing it.

A non-streamed body's ``usage`` is parsed whole, by its route's reader (:class:`Metering`):
chat and completions name ``prompt_tokens``/``completion_tokens``; embeddings, rerank and
score count only the input (``prompt_tokens``, or rerank's ``total_tokens``); the Responses
API names ``input_tokens``/``output_tokens`` (:class:`ResponsesMeter`, which also reads its
stream's final ``response.completed`` event); tokenize and detokenize run no model and
charge nothing (:class:`Unmetered`). A stream's usage arrives in a final event
(``stream_options.include_usage``): the gateway asks the replica for it when the client did
not (:func:`ask_for_usage`) and then drops that event (``"choices":[]``), so the client sees the
stream it asked for. Only chunks that mention ``"usage"`` are looked into; every other chunk
passes untouched. The meter calls ``on_complete`` when it sees ``[DONE]`` (or the whole body),
*before* the caller sends those bytes: the ledger record is journaled before the client can
see its response end.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

_MAX_CARRY: Final = 1 << 16
_MAX_EVENT: Final = 1 << 24
"""Bytes of one unfinished Responses API event held back to read its usage: its final event
repeats the whole output text, so it can be large; past this it passes unread."""
_FINAL_RESPONSE: Final = frozenset({"response.completed", "response.incomplete", "response.failed"})


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    known: bool = False
    """Whether the replica reported it (else the prompt is the gateway's estimate)."""
    resumed_prompt_tokens: int = 0
    """Prompt tokens computed again by resumes of its stream (the prompt plus what had
    been sent, each time; docs/gateway.md, "Resuming a stream"): charged, not in ``total``."""

    @property
    def uncached_prompt(self) -> int:
        return max(self.prompt_tokens - self.cached_tokens, 0)

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def ask_for_usage(payload: dict[str, Any], body: bytes) -> tuple[bytes, bool]:
    """The body to send upstream, and whether the usage event was added by the gateway."""
    if payload.get("stream") is not True:
        return body, False
    options = payload.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return body, False
    payload = dict(payload)
    payload["stream_options"] = {
        **(options if isinstance(options, dict) else {}),
        "include_usage": True,
    }
    return json.dumps(payload).encode(), True


Reader = Callable[[object, Usage], None]
"""Reads a body's ``usage`` object into a :class:`Usage` (sets ``known`` if it could)."""


def read_usage(value: object, usage: Usage) -> None:
    """Chat and completions: ``prompt_tokens``, ``completion_tokens`` (``n`` choices summed
    by the engine), ``prompt_tokens_details.cached_tokens``."""
    if not isinstance(value, dict):
        return
    prompt, completion = value.get("prompt_tokens"), value.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        usage.prompt_tokens, usage.completion_tokens, usage.known = prompt, completion, True
        details = value.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        usage.cached_tokens = cached if isinstance(cached, int) else 0


def read_input_usage(value: object, usage: Usage) -> None:
    """Embeddings, score and rerank: the input's tokens, ``prompt_tokens`` (rerank names only
    ``total_tokens``); ``completion_tokens`` if given, else none."""
    if not isinstance(value, dict):
        return
    prompt = value.get("prompt_tokens")
    if not _count(prompt):
        prompt = value.get("total_tokens")
    if _count(prompt):
        completion = value.get("completion_tokens")
        usage.prompt_tokens, usage.known = prompt, True
        usage.completion_tokens = completion if _count(completion) else 0
        usage.cached_tokens = 0


def read_responses_usage(value: object, usage: Usage) -> None:
    """The Responses API: ``input_tokens``, ``output_tokens``,
    ``input_tokens_details.cached_tokens``."""
    if not isinstance(value, dict):
        return
    prompt, completion = value.get("input_tokens"), value.get("output_tokens")
    if _count(prompt) and _count(completion):
        usage.prompt_tokens, usage.completion_tokens, usage.known = prompt, completion, True
        details = value.get("input_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        usage.cached_tokens = cached if _count(cached) else 0


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Meter:
    """One response's usage, read as it passes."""

    __slots__ = ("_carry", "_done", "_injected", "_on_complete", "_read", "usage")

    def __init__(
        self,
        prompt_estimate: int,
        injected: bool,
        on_complete: Callable[[], None],
        read: Reader = read_usage,
    ) -> None:
        self.usage = Usage(prompt_tokens=prompt_estimate)
        self._injected = injected
        self._on_complete = on_complete
        self._read = read
        self._carry = b""
        self._done = False

    def whole(self, body: bytes) -> None:
        """A non-streamed body, about to be sent."""
        if b'"usage"' in body:
            with contextlib.suppress(ValueError, AttributeError):
                self._read(json.loads(body).get("usage"), self.usage)
        self.complete()

    def chunk(self, chunk: bytes) -> bytes:
        """A stream's chunk, about to be sent: the bytes to send instead."""
        if self._carry or b'"usage"' in chunk:
            chunk = self._events(self._carry + chunk)
        if not self._done and b"[DONE]" in chunk:
            self.complete()
        return chunk

    def rest(self) -> bytes:
        """Bytes held back at the stream's end (an unfinished event)."""
        rest, self._carry = self._carry, b""
        return rest

    def _complete(self, data: bytes, limit: int) -> tuple[bytes, bool]:
        """The complete events of ``data`` (the unfinished one held back in ``_carry``), and
        whether they are events; past ``limit`` bytes with no event end, all of ``data``
        unread (passed on as it is, nothing held)."""
        cut = data.rfind(b"\n\n") + 2
        if cut == 1:  # no complete event yet: hold it (bounded)
            if len(data) > limit:
                self._carry = b""
                return data, False
            self._carry = data
            return b"", False
        complete, self._carry = data[:cut], data[cut:]
        return complete, True

    def _events(self, data: bytes) -> bytes:
        complete, events = self._complete(data, _MAX_CARRY)
        if not events or b'"usage"' not in complete:
            return complete
        kept: list[bytes] = []
        for event in complete.split(b"\n\n")[:-1]:
            if b'"usage"' in event and event.startswith(b"data: {"):
                try:
                    parsed = json.loads(event[6:])
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    read_usage(parsed.get("usage"), self.usage)
                    if self._injected and parsed.get("choices") == []:
                        continue  # the usage event the client did not ask for
            kept.append(event + b"\n\n")
        return b"".join(kept)

    def complete(self) -> None:
        if not self._done:
            self._done = True
            self._on_complete()

    @property
    def done(self) -> bool:
        return self._done


class ResponsesMeter(Meter):
    """The Responses API's stream: events ``event: <type>`` + ``data: <json>``, no
    ``[DONE]``; the final one (``response.completed``, ``.incomplete`` or ``.failed``)
    carries the response with its ``usage``, and completes the meter before it is sent.
    An unfinished event is held back until its end (the client could not read it earlier);
    nothing is dropped."""

    __slots__ = ()

    def chunk(self, chunk: bytes) -> bytes:
        data = self._carry + chunk if self._carry else chunk
        complete, events = self._complete(data, _MAX_EVENT)
        if events and not self._done and b'"usage"' in complete:
            for event in complete.split(b"\n\n"):
                if b'"usage"' in event:
                    self._final(event)
        return complete

    def _final(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            try:
                parsed = json.loads(line[5:])
            except ValueError:
                return
            if isinstance(parsed, dict) and parsed.get("type") in _FINAL_RESPONSE:
                response = parsed.get("response")
                if isinstance(response, dict):
                    self._read(response.get("usage"), self.usage)
                self.complete()
            return


class Unmetered(Meter):
    """A route that runs no model (tokenize, detokenize): known, and zero tokens."""

    __slots__ = ()

    def __init__(
        self,
        prompt_estimate: int,
        injected: bool,
        on_complete: Callable[[], None],
        read: Reader = read_usage,
    ) -> None:
        super().__init__(0, injected, on_complete, read)
        self.usage.known = True

    def whole(self, body: bytes) -> None:
        self.complete()


@dataclass(frozen=True, slots=True)
class Metering:
    """How one route's answers carry their usage (``Tenancy.admit`` builds the meter)."""

    read: Reader = read_usage
    meter: type[Meter] = Meter
    ask: bool = True
    """Whether a stream is asked for its usage event (:func:`ask_for_usage`: chat and
    completions; the Responses API's final event always has it)."""


COMPLETIONS: Final = Metering()
INPUT_ONLY: Final = Metering(read_input_usage, ask=False)
RESPONSES: Final = Metering(read_responses_usage, ResponsesMeter, ask=False)
NO_MODEL: Final = Metering(meter=Unmetered, ask=False)
