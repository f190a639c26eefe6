"""Reading each route's usage on the way (``gateway/_usage.py``): the readers of the bodies'
``usage`` objects, and the Responses API's stream meter, fed its events cut anywhere."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from gpufleet.gateway._routes import ROUTES
from gpufleet.gateway._usage import (
    INPUT_ONLY,
    NO_MODEL,
    RESPONSES,
    Meter,
    Metering,
    ResponsesMeter,
    Usage,
    read_input_usage,
    read_responses_usage,
)


def new_meter(metering: Metering, estimate: int, injected: bool, done: Callable[[], None]) -> Meter:
    """The meter ``Tenancy.admit`` gives a request of a route with this ``metering``."""
    return metering.meter(estimate, injected, done, metering.read)


def test_input_only_usage_reads_prompt_tokens_else_rerank_total_tokens() -> None:
    usage = Usage(prompt_tokens=99)
    read_input_usage({"prompt_tokens": 12, "total_tokens": 12, "completion_tokens": 0}, usage)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.known) == (12, 0, True)
    usage = Usage(prompt_tokens=99)
    read_input_usage({"prompt_tokens": 5, "total_tokens": 5}, usage)  # OpenAI's: no completion
    assert (usage.prompt_tokens, usage.completion_tokens, usage.known) == (5, 0, True)
    usage = Usage(prompt_tokens=99)
    read_input_usage({"total_tokens": 30}, usage)  # vLLM's rerank
    assert (usage.prompt_tokens, usage.known) == (30, True)
    for bad in (None, [], {"prompt_tokens": "7"}, {"prompt_tokens": True}, {"total_tokens": -1}):
        usage = Usage(prompt_tokens=99)
        read_input_usage(bad, usage)
        assert (usage.prompt_tokens, usage.known) == (99, False)


def test_responses_usage_maps_input_and_output_tokens() -> None:
    usage = Usage(prompt_tokens=99)
    read_responses_usage(
        {
            "input_tokens": 10,
            "input_tokens_details": {"cached_tokens": 4},
            "output_tokens": 7,
            "total_tokens": 17,
        },
        usage,
    )
    assert (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens) == (10, 4, 7)
    assert usage.known
    usage = Usage(prompt_tokens=99)
    read_responses_usage({"prompt_tokens": 10, "completion_tokens": 7}, usage)  # chat's names
    assert not usage.known


def test_a_route_that_runs_no_model_is_known_and_free() -> None:
    ended: list[bool] = []
    meter = new_meter(NO_MODEL, 50, False, lambda: ended.append(True))
    meter.whole(b'{"count": 3, "tokens": [1, 2, 3]}')
    assert ended == [True]
    assert (meter.usage.total, meter.usage.known) == (0, True)


def test_embeddings_are_metered_from_the_whole_body() -> None:
    meter = new_meter(INPUT_ONLY, 50, False, lambda: None)
    meter.whole(json.dumps({"data": [], "usage": {"prompt_tokens": 8, "total_tokens": 8}}).encode())
    assert (meter.usage.prompt_tokens, meter.usage.completion_tokens) == (8, 0)


def _event(type_: str, **fields: object) -> bytes:
    data = json.dumps({"type": type_, "sequence_number": 0, **fields}, separators=(",", ":"))
    return f"event: {type_}\ndata: {data}\n\n".encode()


USAGE = {"input_tokens": 6, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 3}
STREAM = b"".join(
    [
        _event("response.created", response={"status": "in_progress", "usage": None}),
        _event("response.output_text.delta", delta=" a"),
        _event("response.output_text.delta", delta=" b c"),
        _event("response.completed", response={"status": "completed", "usage": USAGE}),
    ]
)


@pytest.mark.parametrize("size", [1, 7, 64, 10_000])
def test_a_responses_stream_cut_anywhere_passes_whole_and_is_metered_at_its_final_event(
    size: int,
) -> None:
    sent: list[bytes] = []
    ended_after: list[int] = []
    meter = new_meter(RESPONSES, 50, False, lambda: ended_after.append(len(b"".join(sent))))
    assert isinstance(meter, ResponsesMeter)
    for start in range(0, len(STREAM), size):
        sent.append(meter.chunk(STREAM[start : start + size]))
    sent.append(meter.rest())
    assert b"".join(sent) == STREAM  # nothing dropped, nothing reordered
    assert (meter.usage.prompt_tokens, meter.usage.completion_tokens) == (6, 3)
    final = STREAM.rindex(b"event: response.completed")
    assert len(ended_after) == 1
    assert ended_after[0] <= final  # ledgered before the client could see the final event


def test_a_responses_stream_without_its_final_event_is_not_completed() -> None:
    meter = new_meter(RESPONSES, 50, False, lambda: None)
    cut = STREAM.rindex(b"event: response.completed")
    assert meter.chunk(STREAM[:cut]) == STREAM[:cut]
    assert not meter.done
    assert not meter.usage.known  # finish() ledgers the estimate


def test_every_model_route_is_a_post_route_of_vllm() -> None:
    assert set(ROUTES) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/tokenize",
        "/detokenize",
        "/v1/rerank",
        "/rerank",
        "/v2/rerank",
        "/v1/score",
        "/score",
    }
    assert [p for p, r in ROUTES.items() if r.resumes] == [
        "/v1/chat/completions",
        "/v1/completions",
    ]
