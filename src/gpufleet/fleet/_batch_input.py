"""A batch input file (JSONL), checked line by line with OpenAI's error shape.

::

    {"custom_id": "r-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": …}}

One request a line: ``custom_id`` a non-empty string unique in the file, ``method`` ``POST``,
``url`` one of :data:`BATCH_ENDPOINTS` and the same on every line (the batch's ``endpoint`` when
given), ``body`` an object whose ``model`` is a string and that does not ask to stream.
Blank lines are skipped; line numbers count every line of the file from 1, as an editor
does. Errors are values, at most ``max_errors`` of them, in file order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from gpufleet.fleet._batch import BATCH_ENDPOINTS

MAX_BATCH_LINES: Final = 50_000
"""Requests in one batch (OpenAI's limit)."""
MAX_CUSTOM_ID_CHARS: Final = 512
MAX_ERRORS: Final = 100
"""Errors reported for one file: enough to fix a generator, bounded for a 200 MB file."""


@dataclass(frozen=True, slots=True)
class LineError:
    """One entry of a batch object's ``errors.data``."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_openai(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True, slots=True)
class BatchRequest:
    line: int
    """Its line number in the file, from 1."""
    custom_id: str
    body: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class BatchInput:
    """A parsed input file: its requests in file order, or why it is not a batch."""

    endpoint: str | None
    requests: tuple[BatchRequest, ...]
    errors: tuple[LineError, ...]

    @property
    def ok(self) -> bool:
        return not self.errors


_FIELDS: Final = (
    ("custom_id", str, "a string"),
    ("method", str, "a string"),
    ("url", str, "a string"),
    ("body", dict, "a JSON object"),
)


def parse_batch_input(
    data: bytes,
    endpoint: str | None = None,
    *,
    max_lines: int = MAX_BATCH_LINES,
    max_errors: int = MAX_ERRORS,
) -> BatchInput:
    """Check ``data`` line by line; ``endpoint`` (the batch's) is what every ``url`` must be,
    else the first line's ``url`` is."""
    requests: list[BatchRequest] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if len(errors) >= max_errors:
            break
        if not raw.strip():
            continue
        if len(requests) + len(errors) >= max_lines:
            errors.append(
                LineError("too_many_lines", f"A batch has at most {max_lines} requests.", number)
            )
            break
        request = _request(number, raw, endpoint, seen)
        if isinstance(request, LineError):
            errors.append(request)
            continue
        if endpoint is None:
            endpoint = request[1]
        seen.add(request[0].custom_id)
        requests.append(request[0])
    if not requests and not errors:
        errors.append(LineError("empty_file", "The batch input file has no requests."))
    return BatchInput(endpoint, tuple(requests), tuple(errors))


def _request(
    number: int, raw: bytes, endpoint: str | None, seen: set[str]
) -> tuple[BatchRequest, str] | LineError:
    try:
        obj = json.loads(raw.decode())
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return LineError("invalid_json_line", "This line is not parseable as valid JSON.", number)
    if not isinstance(obj, dict):
        return LineError("invalid_request", "Each line must be a JSON object.", number)
    for name, kind, what in _FIELDS:
        if name not in obj:
            return LineError(
                "missing_required_parameter", f"Missing required parameter: '{name}'.", number, name
            )
        if not isinstance(obj[name], kind):
            return LineError("invalid_request", f"'{name}' must be {what}.", number, name)
    return _check(number, obj, endpoint, seen)


def _check(
    number: int, obj: dict[str, Any], endpoint: str | None, seen: set[str]
) -> tuple[BatchRequest, str] | LineError:
    custom_id, url, body = obj["custom_id"], obj["url"], obj["body"]
    problem = _problem(obj, endpoint, seen)
    if problem is not None:
        code, message, param = problem
        return LineError(code, message, number, param)
    return BatchRequest(number, custom_id, body), url


def _problem(
    obj: dict[str, Any], endpoint: str | None, seen: set[str]
) -> tuple[str, str, str] | None:
    """The first rule ``obj`` breaks, as ``(code, message, param)``."""
    custom_id, url, body = obj["custom_id"], obj["url"], obj["body"]
    rules = (
        (
            0 < len(custom_id) <= MAX_CUSTOM_ID_CHARS and _storable(custom_id),
            "invalid_request",
            f"'custom_id' must be 1 to {MAX_CUSTOM_ID_CHARS} characters of text "
            "(no NUL, no lone surrogate).",
            "custom_id",
        ),
        (
            custom_id not in seen,
            "duplicate_custom_id",
            f"The custom_id {custom_id!r} is used by an earlier line: it must be unique in "
            "a batch.",
            "custom_id",
        ),
        (obj["method"] == "POST", "invalid_request", "'method' must be POST.", "method"),
        (
            url in BATCH_ENDPOINTS,
            "invalid_url",
            f"'url' must be one of {', '.join(BATCH_ENDPOINTS)}.",
            "url",
        ),
        (
            endpoint is None or url == endpoint,
            "invalid_url",
            f"Every line's 'url' must be the batch's endpoint {endpoint}.",
            "url",
        ),
        (
            "model" in body,
            "missing_required_parameter",
            "Missing required parameter: 'body.model'.",
            "body.model",
        ),
        (
            isinstance(body.get("model"), str),
            "invalid_request",
            "'body.model' must be a string.",
            "body.model",
        ),
        (
            body.get("stream") is not True,
            "invalid_request",
            "A batch request cannot stream.",
            "body.stream",
        ),
    )
    for holds, code, message, param in rules:
        if not holds:
            return code, message, param
    return None


def _storable(text: str) -> bool:
    """Whether every database keeps ``text`` as it is (PostgreSQL refuses NUL and text that
    is not UTF-8; JSON can spell both)."""
    if "\x00" in text:
        return False
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


PREFIX_CHARS: Final = 4096
"""How much of a line's prompt orders it: past this, lines that share it run side by side."""


def prefix_ranks(requests: Sequence[BatchRequest]) -> list[int]:
    """Each request's place in the order lines are run, so that lines whose prompts share a
    prefix run together and the engines' prefix caches pay: by the prompt's text (its first
    :data:`PREFIX_CHARS` characters; the model first, as each model has its own caches),
    then by line. Sorting by the text itself groups shared prefixes at every length: lines
    with one system prompt sit together, and inside them the ones that share more."""
    keys = sorted(range(len(requests)), key=lambda i: (_prompt_key(requests[i].body), i))
    ranks = [0] * len(requests)
    for rank, i in enumerate(keys):
        ranks[i] = rank
    return ranks


def _prompt_key(body: Mapping[str, Any]) -> str:
    """The model, then the text its prompt starts with (:func:`prompt_text`)."""
    model = body.get("model")
    return ((model if isinstance(model, str) else "") + prompt_text(body, PREFIX_CHARS))[
        :PREFIX_CHARS
    ]


def prompt_text(body: Mapping[str, Any], limit: int | None = None) -> str:
    """A line's prompt as the engine would see it first, at least its first ``limit``
    characters (``None``: all): chat messages' roles and text contents in order (each after
    a NUL), else a completion's prompt or an embedding's input (a list as its JSON)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for message in messages:
            if not isinstance(message, dict):
                continue
            text = _text(message.get("content"))
            parts += ["\0", str(message.get("role", "")), "\0", text]
            size += len(text)
            if limit is not None and size >= limit:
                break
        return "".join(parts)
    prompt = body.get("prompt", body.get("input"))
    return prompt if isinstance(prompt, str) else json.dumps(prompt)[:limit]


def _text(content: object) -> str:
    """A message's text: a string, or its content parts' text in order."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""
