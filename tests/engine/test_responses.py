"""L4: ``POST /v1/responses`` (the Responses API) over loopback with the ``openai`` client."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gpufleet.engine import Tokenizer
from tests.engine.conftest import Served
from tests.engine.test_server import MODEL, client

TOK = Tokenizer(128256)

EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    # response.output_text.delta × output tokens
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def test_a_string_input_with_instructions_gives_one_message(sim: Served) -> None:
    reply = client(sim).responses.create(
        model=MODEL, instructions="Be brief.", input="Tell me about the bridge."
    )
    assert reply.id.startswith("resp_")
    assert reply.object == "response"
    assert reply.model == MODEL
    assert reply.instructions == "Be brief."
    assert reply.status in {"completed", "incomplete"}
    assert len(reply.output) == 1
    message = reply.output[0]
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.id.startswith("msg_")
    assert reply.output_text
    prompt = TOK.encode_chat([("system", "Be brief."), ("user", "Tell me about the bridge.")])
    usage = reply.usage
    assert usage is not None
    assert usage.input_tokens == len(prompt)
    assert usage.output_tokens == TOK.count(reply.output_text)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_max_output_tokens_makes_the_response_incomplete(sim: Served) -> None:
    reply = client(sim).responses.create(
        model=MODEL, input="Go on.", max_output_tokens=7, extra_body={"ignore_eos": True}
    )
    assert reply.status == "incomplete"
    assert reply.incomplete_details is not None
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.max_output_tokens == 7
    assert reply.usage is not None
    assert reply.usage.output_tokens == 7


def test_a_message_list_is_the_chat_template_of_its_turns(sim: Served) -> None:
    reply = client(sim).responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Why?"}],
            },
        ],
        max_output_tokens=3,
    )
    expected = TOK.encode_chat([("user", "Hi"), ("assistant", "Hello."), ("user", "Why?")])
    assert reply.usage is not None
    assert reply.usage.input_tokens == len(expected)


def test_streaming_sends_vllms_event_sequence(sim: Served) -> None:
    stream = client(sim).responses.create(
        model=MODEL,
        input="Stream it.",
        max_output_tokens=6,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    events = list(stream)
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 6
    assert [t for t in types if t != "response.output_text.delta"] == EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, done = events[0], events[-1]
    assert created.type == "response.created"
    assert created.response.status == "in_progress"
    assert created.response.usage is None
    assert done.type == "response.completed"
    final = done.response
    assert final.status == "incomplete"  # it ran into max_output_tokens
    assert final.output_text == "".join(d.delta for d in deltas)  # type: ignore[union-attr]
    assert final.usage is not None
    assert final.usage.output_tokens == 6
    assert final.id == created.response.id
    text_done = next(e for e in events if e.type == "response.output_text.done")
    assert text_done.text == final.output_text  # type: ignore[union-attr]


def test_the_raw_stream_is_named_sse_events_without_done(sim: Served) -> None:
    body = {"model": MODEL, "input": "raw", "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", sim.v1 + "/responses", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        blocks = response.read().decode().strip().split("\n\n")
    for block in blocks:
        kind, data = block.split("\n")
        assert kind.startswith("event: ")
        assert json.loads(data.removeprefix("data: "))["type"] == kind.removeprefix("event: ")
    assert blocks[-1].startswith("event: response.completed")


def test_responses_count_in_the_metrics_like_chats(sim: Served) -> None:
    before = sim.sample("vllm:generation_tokens", "vllm:generation_tokens_total")
    reply = client(sim).responses.create(model=MODEL, input="count me", max_output_tokens=4)
    after = sim.sample("vllm:generation_tokens", "vllm:generation_tokens_total")
    assert reply.usage is not None
    assert after - before == reply.usage.output_tokens


def _error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    return error


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({}, 400, "input"),
        ({"input": 5}, 400, "input"),
        ({"input": [{"role": "user"}]}, 400, "input"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "word " * 5000}, 400, "input"),
        ({"input": "x", "background": True}, 400, "background"),
        ({"input": "x", "previous_response_id": "resp_1"}, 404, "response_id"),
        ({"input": "x", "model": "gpt-9"}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_shaped_errors(
    sim: Served, body: dict[str, object], status: int, param: str
) -> None:
    error = _error(httpx.post(sim.v1 + "/responses", json=body), status)
    assert str(error["param"]).startswith(param)


def test_the_client_raises_its_own_errors(sim: Served) -> None:
    with pytest.raises(openai.BadRequestError):
        client(sim).responses.create(model=MODEL, input="word " * 5000)
    with pytest.raises(openai.NotFoundError):
        client(sim).responses.create(model="gpt-9", input="x")
