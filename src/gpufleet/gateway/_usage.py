"""Reading a response's token usage on its way to the client, without slowing it.

A non-streamed body's ``usage`` is parsed whole. A stream's usage arrives in a final event
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
from typing import Any, Final

_MAX_CARRY: Final = 1 << 16


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


def read_usage(value: object, usage: Usage) -> None:
    if not isinstance(value, dict):
        return
    prompt, completion = value.get("prompt_tokens"), value.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        usage.prompt_tokens, usage.completion_tokens, usage.known = prompt, completion, True
        details = value.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        usage.cached_tokens = cached if isinstance(cached, int) else 0


class Meter:
    """One response's usage, read as it passes."""

    __slots__ = ("_carry", "_done", "_injected", "_on_complete", "usage")

    def __init__(
        self, prompt_estimate: int, injected: bool, on_complete: Callable[[], None]
    ) -> None:
        self.usage = Usage(prompt_tokens=prompt_estimate)
        self._injected = injected
        self._on_complete = on_complete
        self._carry = b""
        self._done = False

    def whole(self, body: bytes) -> None:
        """A non-streamed body, about to be sent."""
        if b'"usage"' in body:
            with contextlib.suppress(ValueError, AttributeError):
                read_usage(json.loads(body).get("usage"), self.usage)
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

    def _events(self, data: bytes) -> bytes:
        cut = data.rfind(b"\n\n") + 2
        if cut == 1:  # no complete event yet: hold it (bounded)
            if len(data) > _MAX_CARRY:
                self._carry = b""
                return data
            self._carry = data
            return b""
        complete, self._carry = data[:cut], data[cut:]
        if b'"usage"' not in complete:
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
