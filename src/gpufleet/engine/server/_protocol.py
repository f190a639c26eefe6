"""The OpenAI/vLLM wire format: request models in, response bytes out.

Requests are validated once, by pydantic, into ``ChatRequest`` / ``CompletionRequest``
(unknown fields are ignored, as vLLM does). Responses are written without pydantic: the hot
path — one SSE event per generated token — joins precomputed byte fragments::

    data: {"id":"cmpl-…","object":"text_completion","created":…,"model":"…","choices":[
          {"index":0,"text":" word","logprobs":null,"finish_reason":null,"stop_reason":null}]}
    └──────────────────────── head ──────────────────┘ └ text ┘ └──────────── tail ─────────┘

The shapes follow vLLM's OpenAI server: ``chatcmpl-`` / ``cmpl-`` ids, ``stop_reason``
beside ``finish_reason``, usage with ``prompt_tokens_details.cached_tokens``, a final usage
chunk with empty ``choices`` when ``stream_options.include_usage`` is set, then
``data: [DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from gpufleet.engine._tokenizer import WORDS

_INT32 = 2**31 - 1


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class StreamOptions(_Request):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


MAX_N = 128
"""The most sequences one request may ask for (``n``): OpenAI's own limit."""


class _Sampling(_Request):
    """Fields both endpoints share; sampling knobs are accepted and ignored."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=_INT32)
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    priority: int = Field(default=0, ge=-_INT32, le=_INT32)
    return_token_ids: bool = False
    """vLLM's: a stream's events carry the ids they generated (``token_ids``, in the choice)
    and its first event the prompt's (``prompt_token_ids``: in the choice of a completion,
    at the top of a chat chunk). Streams only here."""

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(dict.fromkeys(s for s in stops if s))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Annotated[str, StringConstraints(min_length=1)]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1, le=_INT32)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """vLLM's: the last message (the assistant's, partly written) is left open and the
    answer goes on from it (``add_generation_prompt`` must then be false)."""

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ChatTemplated(Protocol):
    """A request whose messages go through the chat template (chat, ``/tokenize``)."""

    @property
    def messages(self) -> list[ChatMessage]: ...
    @property
    def add_generation_prompt(self) -> bool: ...
    @property
    def continue_final_message(self) -> bool: ...
    @property
    def model_fields_set(self) -> set[str]: ...


class CompletionRequest(_Sampling):
    """``prompt`` is text, token ids, or a one-element list of either (no batches)."""

    prompt: str | list[int] | list[str] | list[list[int]]

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


# --- responses -------------------------------------------------------------------------------

WORD_JSON: tuple[bytes, ...] = tuple(json.dumps(" " + word).encode() for word in WORDS)
"""Each filler word's JSON string (``" word"``), indexed like ``WORDS``."""
DONE = b"data: [DONE]\n\n"


def _j(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True, slots=True)
class Choice:
    """One finished sequence of a response: its index among the ``n`` and its text."""

    index: int
    text: str
    finish_reason: str
    stop_reason: str | None = None


class ResponseShape:
    """Byte fragments and bodies for one response of one endpoint (choice ``index``)."""

    def __init__(
        self,
        *,
        chat: bool,
        response_id: str,
        created: int,
        model: str,
        index: int = 0,
        token_ids: bool = False,
    ) -> None:
        self.chat = chat
        self.index = index
        self.token_ids = token_ids
        """Events carry ``token_ids`` (``return_token_ids``)."""
        self._args = (response_id, created, model)
        self._meta = {"id": response_id, "created": created, "model": model}
        obj = "chat.completion.chunk" if chat else "text_completion"
        prefix = (
            f'data: {{"id":{_j(response_id)},"object":"{obj}","created":{created},'
            f'"model":{_j(model)},"choices":[{{"index":{index},'
        )
        if chat:
            self.head = (prefix + '"delta":{"content":').encode()
            self.tail = b'},"logprobs":null,"finish_reason":null}]}\n\n'
            self.role_event = (
                prefix + '"delta":{"role":"assistant","content":""},'
                '"logprobs":null,"finish_reason":null}]}\n\n'
            ).encode()
        else:
            self.head = (prefix + '"text":').encode()
            self.tail = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
            self.role_event = b""

    def for_choice(self, index: int) -> ResponseShape:
        """The same response's fragments for choice ``index`` (``n > 1``)."""
        response_id, created, model = self._args
        return ResponseShape(
            chat=self.chat,
            response_id=response_id,
            created=created,
            model=model,
            index=index,
            token_ids=self.token_ids,
        )

    def with_ids(self, tail: bytes, ids: Sequence[int]) -> bytes:
        """``tail`` (one of this shape's event tails) with the event's ``token_ids`` in
        its choice: after the delta's brace (chat), or after the text (completions)."""
        field = b',"token_ids":[' + ",".join(map(str, ids)).encode() + b"]"
        return tail[:1] + field + tail[1:] if self.chat else field + tail

    def with_prompt_ids(self, event: bytes, ids: Sequence[int]) -> bytes:
        """A stream's first ``event`` with the prompt's ids (vLLM's ``prompt_token_ids``:
        in the choice of a completion, at the top of a chat chunk)."""
        field = b'"prompt_token_ids":[' + ",".join(map(str, ids)).encode() + b"]"
        if self.chat:  # data: {…,"choices":[…]}\n\n
            return event[: -len(b"}\n\n")] + b"," + field + b"}\n\n"
        head = len(self.head)  # data: {…,"choices":[{"index":i,"text": …
        return event[: head - len(b'"text":')] + field + b"," + event[head - len(b'"text":') :]

    def final_tail(self, finish_reason: str, stop_reason: str | None) -> bytes:
        brace = "}" if self.chat else ""
        return (
            f'{brace},"logprobs":null,"finish_reason":{_j(finish_reason)},'
            f'"stop_reason":{_j(stop_reason)}}}]}}\n\n'
        ).encode()

    def text_event(
        self, text: str, tail: bytes | None = None, ids: Sequence[int] | None = None
    ) -> bytes:
        end = self.tail if tail is None else tail
        if ids is not None and self.token_ids:
            end = self.with_ids(end, ids)
        return self.head + _j(text).encode() + end

    def usage_event(self, usage: Usage) -> bytes:
        body = {
            "id": self._meta["id"],
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self._meta["created"],
            "model": self._meta["model"],
            "choices": [],
            "usage": usage.as_dict(),
        }
        return b"data: " + _j(body).encode() + b"\n\n"

    def full_body(self, choices: Sequence[Choice], usage: Usage) -> bytes:
        """The non-streaming body: every choice, in index order, and the usage."""
        out: list[dict[str, Any]] = []
        for choice in sorted(choices, key=lambda c: c.index):
            entry: dict[str, Any] = {"index": choice.index}
            if self.chat:
                entry["message"] = {"role": "assistant", "content": choice.text, "tool_calls": []}
            else:
                entry["text"] = choice.text
            entry |= {
                "logprobs": None,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
            }
            out.append(entry)
        body = {
            "id": self._meta["id"],
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self._meta["created"],
            "model": self._meta["model"],
            "choices": out,
            "usage": usage.as_dict(),
        }
        return _j(body).encode()


class StopMatcher:
    """Releases generated text as it streams, holding back what may begin a stop string.

    vLLM's rule: the stop string and everything after it are cut from the output; text that
    could still turn into a stop string is not sent until it cannot::

        text so far:  " the old stone br"     stop = "bridge"
        released:     " the old stone "       held: "br" (len(stop) − 1 chars at most)
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._hold = max(len(s) for s in stops) - 1
        self._text = ""
        self._released = 0
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add generated text; return what may be sent now (``matched`` set on a stop)."""
        scan_from = max(0, len(self._text) - self._hold)
        self._text += text
        cut: int | None = None
        for stop in self._stops:
            at = self._text.find(stop, scan_from)
            if at >= 0 and (cut is None or at < cut):
                cut, self.matched = at, stop
        if cut is not None:
            return self._release(cut)
        return self._release(len(self._text) - self._hold)

    def flush(self) -> str:
        return self._release(len(self._text))

    def _release(self, upto: int) -> str:
        if upto <= self._released:
            return ""
        out = self._text[self._released : upto]
        self._released = upto
        return out
