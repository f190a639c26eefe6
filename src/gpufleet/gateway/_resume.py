"""Resuming a stream whose replica failed after the first byte (docs/gateway.md).

The pool controller decides *whether* (``Route(resume=True)``: the request is resumable,
it has resumes left, it is young enough, another replica is reachable); this module is the
gateway's *how*::

    resumable(chat, payload)          at arrival: can this stream be continued elsewhere?
    ask_for_token_ids(body)           its first attempt asks the engine for the ids it makes
    Transcript.read(sse)              at the break: what the client has (text, ids, finish)
    transcript.next_body(payload)     the prompt plus what was sent, max_tokens reduced
    Splice(transcript, …).feed(chunk) the new attempt's events, as the same stream's

Completions resume with token ids when the engine returned them for every token sent
(vLLM's ``return_token_ids``; the sim engine's too), else with the text appended to a text
prompt; chat resumes with the partial assistant message continued (vLLM's
``continue_final_message``). The client sees one stream: the same ``id``, ``created`` and
``model`` on every event, the new attempt's role event dropped, one ``[DONE]``, and a final
``usage`` (when it asked for one) that counts the prompt once and every token sent::

    sent:     role  " The"  " old"  " stone"  ✗ (replica died)
    resumed:  (role dropped)        " bridge"  " was"  …  usage  [DONE]
    usage:    prompt_tokens = the resumed prompt's − tokens sent before;
              completion_tokens = tokens sent before + the resumed attempt's
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from gpufleet.gateway._upstream import FrameSink, Relay
from gpufleet.gateway._usage import Meter, Usage

_NEVER_WITH: Final = ("echo", "use_beam_search", "suffix", "structured_outputs")
"""Fields that make a stream not resumable when set (truthy): the continuation would echo
the resent prompt, search beams, or restart a grammar from its beginning."""
_ONE: Final = ("n", "best_of")


def resumable(chat: bool, payload: dict[str, Any]) -> bool:
    """Whether the request's stream can be resumed on another replica if it breaks: a
    stream of one choice, asking for nothing a continuation would change (tools, a response
    format or guided decoding, echo, prompt logprobs, beams) and with a prompt the gateway
    can extend (text or token ids, one prompt; a chat whose message to continue is text)."""
    return (
        payload.get("stream") is True
        and all(payload.get(key) in (None, 1) for key in _ONE)
        and not any(payload.get(key) for key in _NEVER_WITH)
        and payload.get("prompt_logprobs") is None
        and not any(k.startswith("guided_") and v is not None for k, v in payload.items())
        and _int_or_none(payload.get("max_tokens"))
        and (_chat_resumable(payload) if chat else _prompt_kind(payload.get("prompt")) is not None)
    )


def _chat_resumable(payload: dict[str, Any]) -> bool:
    form = payload.get("response_format")
    if payload.get("tools") or payload.get("functions") or form not in (None, {"type": "text"}):
        return False
    if not _int_or_none(payload.get("max_completion_tokens")):
        return False
    if payload.get("continue_final_message") is True:  # the client's own continuation
        last = payload["messages"][-1]
        return isinstance(last, dict) and isinstance(last.get("content"), str)
    return True


def _int_or_none(value: object) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _prompt_kind(prompt: object) -> str | None:
    """``"text"``, ``"ids"``, or ``None`` for a prompt the gateway cannot extend."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return "text"
    if isinstance(prompt, list) and prompt and all(type(i) is int for i in prompt):
        return "ids"
    return None


def ask_for_token_ids(body: bytes) -> bytes:
    """The first attempt's body, asking the engine for the ids it generates (vLLM's
    ``return_token_ids``): one field put first, so a client's own value (last) still wins."""
    start = body.find(b"{") + 1
    return b"".join((body[:start], b'"return_token_ids":true,', memoryview(body)[start:]))


@dataclass(slots=True)
class Transcript:
    """What the client has of one stream's single choice, read from the events it got."""

    chat: bool
    meta: dict[str, Any] = field(default_factory=dict)
    """The stream's ``id``, ``object``, ``created``, ``model`` (every spliced event gets them)."""
    text: list[str] = field(default_factory=list)
    ids: list[int] | None = field(default_factory=list)
    """The generated ids, while every event with text carried its ``token_ids``."""
    prompt_ids: list[int] | None = None
    events: int = 0
    """Events with text."""
    finish_reason: str | None = None
    done: bool = False
    """``[DONE]`` was sent."""
    spliceable: bool = True
    """Nothing the gateway cannot continue was sent (a tool call, reasoning, an event cut
    in the middle, a second choice)."""
    resumed_at: list[int] = field(default_factory=list)
    """Tokens sent before each resume so far."""
    first: bool = True
    """Reading the first attempt (only its prompt ids are the client's prompt)."""

    @classmethod
    def read(cls, chat: bool, sse: bytes) -> Transcript:
        """The transcript of ``sse``, the bytes the client got (events, maybe cut short)."""
        transcript = cls(chat)
        *events, rest = sse.split(b"\n\n")
        if rest.strip():
            transcript.spliceable = False  # an event cut in the middle
        for event in events:
            transcript.take(event)
        return transcript

    @property
    def sent(self) -> int:
        """Tokens the client has: the ids counted, else one per event with text."""
        return len(self.ids) if self.ids is not None else self.events

    def take(self, event: bytes) -> dict[str, Any] | None:
        """Note one event the client gets; its JSON (``None``: not a data event)."""
        event = event.strip()
        if not event.startswith(b"data:"):
            return None
        data = event[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return None
        try:
            chunk = json.loads(data)
        except ValueError:
            self.spliceable = False
            return None
        if not isinstance(chunk, dict):
            self.spliceable = False
            return None
        if not self.meta:
            self.meta = {k: chunk[k] for k in ("id", "object", "created", "model") if k in chunk}
        top = chunk.get("prompt_token_ids")
        if isinstance(top, list) and self.first and self.prompt_ids is None:
            self.prompt_ids = top
        for choice in chunk.get("choices") or ():
            self._choice(choice)
        return chunk

    def _choice(self, choice: Any) -> None:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            self.spliceable = False
            return
        prompt_ids = choice.get("prompt_token_ids")
        if isinstance(prompt_ids, list) and self.first and self.prompt_ids is None:
            self.prompt_ids = prompt_ids
        if self.chat:
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if any(v for k, v in delta.items() if k not in ("role", "content")):
                self.spliceable = False  # a tool call, reasoning: not a text continuation
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            self.text.append(text)
            self.events += 1
        ids = choice.get("token_ids")
        if self.ids is not None:
            if isinstance(ids, list):
                self.ids.extend(ids)
            elif text:
                self.ids = None
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]

    def next_body(self, payload: dict[str, Any]) -> bytes | None:
        """The body that continues this stream on another replica (``None``: it cannot be:
        nothing left to generate, or a prompt that cannot take what was sent)."""
        sent = self.sent
        body = dict(payload)
        for key in ("max_tokens", "max_completion_tokens"):
            limit = body.get(key)
            if isinstance(limit, int):
                if limit - sent < 1:
                    return None
                body[key] = limit - sent
        if isinstance(body.get("min_tokens"), int):
            body["min_tokens"] = max(0, body["min_tokens"] - sent)
        text = "".join(self.text)
        if self.chat:
            _continue_chat(body, text)
        else:
            prompt = self._prompt(body, text)
            if prompt is None:
                return None
            body["prompt"] = prompt
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        body["return_token_ids"] = True
        self.resumed_at.append(sent)
        self.first = False
        return json.dumps(body, separators=(",", ":")).encode()

    def _prompt(self, body: dict[str, Any], text: str) -> str | list[int] | None:
        """A completion's prompt with what was sent: by token ids when every token came
        with its id (and no stop string could have held text back), else as text."""
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        ids = self.ids
        if ids is not None and not body.get("stop"):
            if self.prompt_ids is not None:
                return [*self.prompt_ids, *ids]
            if isinstance(prompt, list):
                return [*prompt, *ids]
        if isinstance(prompt, str):
            return prompt + text
        return None  # token ids sent, text came back without its ids


def _continue_chat(body: dict[str, Any], text: str) -> None:
    """The chat with the partial answer as its last, open assistant message."""
    messages = list(body["messages"])
    if body.get("continue_final_message") is True:
        last = dict(messages[-1])
        last["content"] = str(last["content"]) + text
        messages[-1] = last
    else:
        messages.append({"role": "assistant", "content": text})
    body["messages"] = messages
    body["continue_final_message"] = True
    body["add_generation_prompt"] = False


class Splice:
    """A resumed attempt's events rewritten into the client's stream: the first stream's
    ``id``/``created``/``model``, the new role event and prompt ids dropped, the usage
    made the whole answer's (sent only if the client asked for it), what passes noted in
    the transcript (for a further resume)."""

    __slots__ = ("_carry", "_first", "include_usage", "prompt_estimate", "transcript", "usage")

    def __init__(
        self, transcript: Transcript, *, include_usage: bool, prompt_estimate: int
    ) -> None:
        self.transcript = transcript
        self.include_usage = include_usage
        self.prompt_estimate = prompt_estimate
        """The gateway's own estimate of the prompt, when no engine reported it."""
        self.usage: Usage | None = None
        """The whole answer's usage, once the resumed attempt reported its own."""
        self._carry = b""
        self._first = True

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send the client for ``chunk`` of the resumed answer (whole events;
        a cut one waits for its rest)."""
        data = self._carry + chunk
        cut = data.rfind(b"\n\n") + 2
        if cut == 1:
            self._carry = data
            return b""
        self._carry = data[cut:]
        out: list[bytes] = []
        for event in data[:cut].split(b"\n\n")[:-1]:
            rewritten = self._event(event)
            if rewritten:
                out.append(rewritten)
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        transcript = self.transcript
        if event.strip() == b"data: [DONE]":
            transcript.done = True
            return b"data: [DONE]\n\n"
        text_before = transcript.sent
        chunk = transcript.take(event)
        if chunk is None:
            return b""
        chunk.update(transcript.meta)
        chunk.pop("prompt_token_ids", None)
        choices = chunk.get("choices")
        if choices == [] and isinstance(chunk.get("usage"), dict):
            self.usage = self._whole(chunk["usage"])
            if not self.include_usage:
                return b""
            chunk["usage"] = {
                "prompt_tokens": self.usage.prompt_tokens,
                "total_tokens": self.usage.total,
                "completion_tokens": self.usage.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.usage.cached_tokens},
            }
        elif isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict):
                    choice.pop("prompt_token_ids", None)
            if self._first and transcript.chat and transcript.sent == text_before:
                self._first = False
                if _role_only(choices):
                    return b""  # the new attempt's role event: the client has one
            self._first = False
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    def _whole(self, usage: dict[str, Any]) -> Usage:
        """The whole answer's usage from the resumed attempt's: the prompt once (the
        resent prompt less the tokens it carried), every token sent."""
        transcript = self.transcript
        before = transcript.resumed_at[-1] if transcript.resumed_at else 0
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if transcript.prompt_ids is not None:
            first_prompt = len(transcript.prompt_ids)
        elif isinstance(prompt, int):
            first_prompt = max(prompt - before, 0)
        else:
            first_prompt = self.prompt_estimate
        return Usage(
            prompt_tokens=first_prompt,
            cached_tokens=min(cached if isinstance(cached, int) else 0, first_prompt),
            completion_tokens=before + (completion if isinstance(completion, int) else 0),
            known=isinstance(prompt, int) and isinstance(completion, int),
        )

    def resent_prompt_tokens(self) -> int:
        """Prompt tokens the resumes sent again (each: the first prompt + tokens sent)."""
        usage = self.usage
        first_prompt = usage.prompt_tokens if usage is not None else self.prompt_estimate
        return sum(first_prompt + sent for sent in self.transcript.resumed_at)


def _role_only(choices: list[Any]) -> bool:
    """A chat stream's opening event: the role, no text, no finish."""
    if len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta")
    return (
        isinstance(delta, dict)
        and not delta.get("content")
        and choices[0].get("finish_reason") is None
    )


class StreamResume:
    """One resumable stream across its attempts: what its client got, how it goes on.

    The first attempt notes the bytes it sends (``sent``; a relayed rest's frames through
    :meth:`tap`, read only if it breaks); at a break, :meth:`next_body` reads them into the
    :class:`Transcript` and makes the next attempt's body and :class:`Splice`."""

    __slots__ = (
        "_payload",
        "body",
        "chat",
        "failure",
        "frames",
        "include_usage",
        "prompt_estimate",
        "sent",
        "splice",
        "tail",
        "transcript",
    )

    def __init__(self, chat: bool, payload: dict[str, Any], prompt_estimate: int) -> None:
        self.chat = chat
        self._payload = payload
        self.prompt_estimate = prompt_estimate
        options = payload.get("stream_options")
        self.include_usage = isinstance(options, dict) and options.get("include_usage") is True
        self.sent: list[bytes] = []
        """What the first attempt sent the client, chunk by chunk (before any relay)."""
        self.frames: list[bytes] = []
        """The relayed rest of the first attempt, as ``chunked`` frames."""
        self.transcript: Transcript | None = None
        self.splice: Splice | None = None
        self.body = b""
        """The next attempt's body (a resume's)."""
        self.tail = b""
        self.failure = ""

    def tap(self, relay: Relay) -> Relay:
        """``relay``, noting the frames it passes (one list append per frame)."""
        frames = self.frames

        async def tapped(sink: FrameSink, idle: float) -> None:
            await relay(_Tap(sink, frames), idle)

        return tapped

    def broke(self, tail: bytes, message: str) -> None:
        """The attempt broke after the client's first byte (``tail``: the last it got)."""
        self.tail, self.failure = tail, message

    def _read(self) -> Transcript:
        transcript = self.transcript
        if transcript is None:
            sse = b"".join(self.sent) + dechunk(b"".join(self.frames))
            transcript = self.transcript = Transcript.read(self.chat, sse)
            self.sent, self.frames = [], []
            if sse:
                self.tail = sse[-2:]
        return transcript

    def complete(self) -> bool:
        """Whether the client already has the whole answer (its finish, or ``[DONE]``)."""
        transcript = self._read()
        return transcript.done or transcript.finish_reason is not None

    def next_body(self) -> bool:
        """Make the next attempt's body and splice; ``False``: the stream cannot go on."""
        transcript = self._read()
        if not transcript.spliceable:
            return False
        body = transcript.next_body(self._payload)
        if body is None:
            return False
        self.body = body
        self.splice = Splice(
            transcript, include_usage=self.include_usage, prompt_estimate=self.prompt_estimate
        )
        return True

    @property
    def resumes(self) -> int:
        return 0 if self.transcript is None else len(self.transcript.resumed_at)

    def resent(self) -> int:
        """Prompt tokens the resumes sent again."""
        splice = self.splice
        return 0 if splice is None else splice.resent_prompt_tokens()

    def usage(self) -> Usage | None:
        """The whole answer's usage (the last resume's, made whole), if it is known."""
        splice = self.splice
        if splice is None:
            return None
        usage = splice.usage
        if usage is not None:
            usage.resumed_prompt_tokens = splice.resent_prompt_tokens()
        return usage

    def meter(self, meter: Meter) -> None:
        """The ledger's usage is the whole answer's, resumes' prompts apart; the record is
        journaled now (before the client sees the end)."""
        usage = self.usage()
        if usage is not None:
            meter.usage = usage
        elif self.resumes:
            meter.usage.resumed_prompt_tokens = self.resent()
        meter.complete()

    def ending(self) -> bytes:
        """The end a stream that lost its replica after its last token still needs."""
        transcript = self._read()
        if transcript.done:
            return b""
        end = b""
        if self.include_usage:
            sent = transcript.sent
            prompt = (
                len(transcript.prompt_ids) if transcript.prompt_ids is not None else None
            ) or self.prompt_estimate
            usage = {
                "prompt_tokens": prompt,
                "total_tokens": prompt + sent,
                "completion_tokens": sent,
            }
            chunk = {**transcript.meta, "choices": [], "usage": usage}
            end = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        transcript.done = True
        return end + b"data: [DONE]\n\n"


class _Tap:
    """A :class:`FrameSink` that notes the frames it passes on."""

    __slots__ = ("_frames", "_sink")

    def __init__(self, sink: FrameSink, frames: list[bytes]) -> None:
        self._sink = sink
        self._frames = frames

    def write_frames(self, frames: bytes) -> bool:
        self._frames.append(frames)
        return self._sink.write_frames(frames)

    def on_drained(self, callback: Callable[[], None] | None) -> None:
        self._sink.on_drained(callback)


def dechunk(frames: bytes) -> bytes:
    """The data of whole ``chunked`` frames (``5\\r\\nhello\\r\\n`` → ``hello``)."""
    out: list[bytes] = []
    pos, end = 0, len(frames)
    while pos < end:
        eol = frames.find(b"\r\n", pos)
        if eol < 0:
            break
        size = int(frames[pos:eol].split(b";", 1)[0], 16)
        if size == 0:
            break
        out.append(frames[eol + 2 : eol + 2 + size])
        pos = eol + 2 + size + 2
    return b"".join(out)
