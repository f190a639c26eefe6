"""Batch input files: valid files parse to their requests in order; one broken line is
reported at its own line number with OpenAI's error code; no input raises."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import assume, given
from hypothesis import strategies as st

from gpufleet.fleet import (
    BATCH_ENDPOINTS,
    BatchRequest,
    LineError,
    parse_batch_input,
    prefix_ranks,
)

ids = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=20)
bodies = st.fixed_dictionaries(
    {"model": st.text(max_size=10)},
    optional={
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=20)})
        ),
        "max_tokens": st.integers(1, 100),
        "stream": st.just(False),
    },
)


@st.composite
def batch_files(draw: st.DrawFn) -> tuple[str, list[dict[str, Any]], list[str]]:
    """An endpoint, the requests of a valid file, and the file's lines (with blank ones)."""
    endpoint = draw(st.sampled_from(BATCH_ENDPOINTS))
    custom_ids = draw(st.lists(ids, min_size=1, max_size=12, unique=True))
    requests = [
        {"custom_id": c, "method": "POST", "url": endpoint, "body": draw(bodies)}
        for c in custom_ids
    ]
    lines: list[str] = []
    for request in requests:
        lines.extend([""] * draw(st.integers(0, 2)))
        ascii_only = draw(st.booleans())
        lines.append(
            json.dumps(request, ensure_ascii=ascii_only) + draw(st.sampled_from(["", "\r"]))
        )
    return endpoint, requests, lines


def encode(lines: list[str]) -> bytes:
    return "\n".join(lines).encode() + b"\n"


@given(batch_files(), st.booleans())
def test_a_valid_file_parses_to_its_requests_in_order(
    case: tuple[str, list[dict[str, Any]], list[str]], pass_endpoint: bool
) -> None:
    endpoint, requests, lines = case
    parsed = parse_batch_input(encode(lines), endpoint if pass_endpoint else None)
    assert parsed.ok, parsed.errors
    assert parsed.endpoint == endpoint
    assert [r.custom_id for r in parsed.requests] == [r["custom_id"] for r in requests]
    assert [dict(r.body) for r in parsed.requests] == [r["body"] for r in requests]
    for request in parsed.requests:
        assert json.loads(lines[request.line - 1])["custom_id"] == request.custom_id


def break_line(kind: str, line: dict[str, Any], first: dict[str, Any]) -> str:
    broken = dict(line)
    if kind == "invalid_json_line":
        return json.dumps(line)[:-1]
    if kind == "duplicate_custom_id":
        broken["custom_id"] = first["custom_id"]
    elif kind == "method":
        broken["method"] = "GET"
    elif kind == "url":
        broken["url"] = "/v1/embeddings"
    elif kind == "mismatched_url":
        (other,) = set(BATCH_ENDPOINTS) - {line["url"]}
        broken["url"] = other
    elif kind == "missing":
        del broken["body"]
    elif kind == "model":
        broken["body"] = {**line["body"], "model": 7}
    elif kind == "body":
        broken["body"] = ["not", "an", "object"]
    elif kind == "stream":
        broken["body"] = {**line["body"], "stream": True}
    elif kind == "nul":
        broken["custom_id"] = "a\x00b"
    return json.dumps(broken)


EXPECTED = {
    "invalid_json_line": ("invalid_json_line", None),
    "duplicate_custom_id": ("duplicate_custom_id", "custom_id"),
    "method": ("invalid_request", "method"),
    "url": ("invalid_url", "url"),
    "mismatched_url": ("invalid_url", "url"),
    "missing": ("missing_required_parameter", "body"),
    "model": ("invalid_request", "body.model"),
    "body": ("invalid_request", "body"),
    "stream": ("invalid_request", "body.stream"),
    "nul": ("invalid_request", "custom_id"),
}


@given(batch_files(), st.sampled_from(sorted(EXPECTED)), st.data())
def test_one_broken_line_is_reported_at_its_line_number(
    case: tuple[str, list[dict[str, Any]], list[str]], kind: str, data: st.DataObject
) -> None:
    endpoint, requests, lines = case
    at = data.draw(st.integers(0, len(requests) - 1))
    assume(kind != "duplicate_custom_id" or at > 0)  # the first line duplicates nothing
    numbers = [i for i, text in enumerate(lines) if text.strip()]
    lines[numbers[at]] = break_line(kind, requests[at], requests[0])
    parsed = parse_batch_input(encode(lines), endpoint)
    assert not parsed.ok
    (error,) = parsed.errors
    assert (error.code, error.param) == EXPECTED[kind]
    assert error.line == numbers[at] + 1
    assert len(parsed.requests) == len(requests) - 1
    assert error.to_openai() == {
        "code": error.code,
        "message": error.message,
        "param": error.param,
        "line": error.line,
    }


@given(st.binary(max_size=300))
def test_no_input_raises(data: bytes) -> None:
    parsed = parse_batch_input(data)
    total = data.count(b"\n") + 1
    assert all(e.line is None or 1 <= e.line <= total for e in parsed.errors)
    assert parsed.ok == (not parsed.errors)


def test_deep_nesting_is_a_bad_line_not_a_crash() -> None:
    (error,) = parse_batch_input(b"[" * 100_000 + b"\n").errors
    assert (error.code, error.line) == ("invalid_json_line", 1)


def test_file_level_errors() -> None:
    assert parse_batch_input(b"\n \n").errors == (
        LineError("empty_file", "The batch input file has no requests."),
    )
    line = json.dumps(
        {"custom_id": "x", "method": "POST", "url": BATCH_ENDPOINTS[0], "body": {"model": "m"}}
    )
    lines = [line.replace('"x"', f'"x{i}"') for i in range(5)]
    parsed = parse_batch_input(encode(lines), max_lines=3)
    assert [(e.code, e.line) for e in parsed.errors] == [("too_many_lines", 4)]
    broken = encode(["{"] * 10)
    assert len(parse_batch_input(broken, max_errors=4).errors) == 4


_systems = st.sampled_from(["", "You are terse. ", "You are kind. " * 30, "Réponds en français. "])


@given(st.lists(st.tuples(_systems, st.text(max_size=20), st.booleans()), max_size=40))
def test_prefix_ranks_order_every_line_once_and_keep_a_prefix_together(
    lines: list[tuple[str, str, bool]],
) -> None:
    """A permutation of the lines; lines with the same system prompt form one run in it
    (whatever their questions), and the run order is the text's."""

    def body(system: str, question: str, chat: bool) -> dict[str, Any]:
        if not chat:
            return {"model": "m", "prompt": system + question}
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ]
        return {"model": "m", "messages": messages}

    requests = [BatchRequest(i + 1, f"r-{i}", body(*line)) for i, line in enumerate(lines)]
    ranks = prefix_ranks(requests)
    assert sorted(ranks) == list(range(len(requests)))
    order = sorted(range(len(requests)), key=ranks.__getitem__)
    chat_systems = [lines[i][0] for i in order if lines[i][2] and lines[i][0]]
    runs = [system for system, _ in itertools.groupby(chat_systems)]
    assert len(runs) == len(set(runs))  # each system prompt's chat lines in one run
