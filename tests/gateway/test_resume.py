"""L0: the gateway's resume pieces without sockets: which requests are resumable, what a
broken stream's client has, the next attempt's body, and the splice of its events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpufleet.gateway._resume import (
    Splice,
    StreamResume,
    Transcript,
    ask_for_token_ids,
    dechunk,
    resumable,
)
from gpufleet.gateway._usage import Meter

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True}
COMPLETION = {"model": "m", "prompt": "Once", "stream": True, "max_tokens": 10}


def sse(*chunks: dict[str, Any] | str) -> bytes:
    return b"".join(
        b"data: " + (c.encode() if isinstance(c, str) else json.dumps(c).encode()) + b"\n\n"
        for c in chunks
    )


def text(i: int, word: str, ids: list[int] | None = None, **extra: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": word, "finish_reason": None, **extra}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
            "choices": [choice]}  # fmt: skip


def delta(content: str | None, role: str | None = None, **extra: Any) -> dict[str, Any]:
    d: dict[str, Any] = {} if role is None else {"role": role}
    if content is not None:
        d["content"] = content
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
            "choices": [{"index": 0, "delta": d, "finish_reason": None}], **extra}  # fmt: skip


@pytest.mark.parametrize(
    ("chat", "payload", "ok"),
    [
        (True, CHAT, True),
        (False, COMPLETION, True),
        (False, {**COMPLETION, "prompt": [1, 2, 3]}, True),
        (False, {**COMPLETION, "prompt": ["one"]}, True),
        (False, {**COMPLETION, "prompt": ["one", "two"]}, False),  # a batch
        (True, {**CHAT, "stream": False}, False),
        (True, {**CHAT, "n": 2}, False),
        (False, {**COMPLETION, "echo": True}, False),
        (False, {**COMPLETION, "best_of": 3}, False),
        (True, {**CHAT, "tools": [{"type": "function"}]}, False),
        (True, {**CHAT, "response_format": {"type": "json_object"}}, False),
        (True, {**CHAT, "response_format": {"type": "text"}}, True),
        (True, {**CHAT, "guided_json": {}}, False),
        (True, {**CHAT, "logprobs": True, "top_logprobs": 2}, True),
        (False, {**COMPLETION, "prompt_logprobs": 1}, False),
        (True, {**CHAT, "max_tokens": "ten"}, False),
    ],
)
def test_which_streams_are_resumable(chat: bool, payload: dict[str, Any], ok: bool) -> None:
    assert resumable(chat, payload) is ok


def test_the_first_attempt_asks_for_token_ids_and_a_clients_own_value_wins() -> None:
    assert json.loads(ask_for_token_ids(b'{"model":"m"}'))["return_token_ids"] is True
    body = ask_for_token_ids(b' {"return_token_ids": false}')
    assert json.loads(body)["return_token_ids"] is False


def test_a_completion_resumes_with_the_ids_sent_after_the_prompts() -> None:
    sent = sse(
        text(0, " a", [7], prompt_token_ids=[1, 2]),
        text(1, " b", [8]),
    )
    transcript = Transcript.read(False, sent + b"data: {")  # cut mid-event: noted
    assert not transcript.spliceable
    transcript = Transcript.read(False, sent)
    assert (transcript.sent, transcript.prompt_ids, transcript.ids) == (2, [1, 2], [7, 8])
    body = json.loads(transcript.next_body(COMPLETION) or b"")
    assert body["prompt"] == [1, 2, 7, 8]
    assert body["max_tokens"] == 8
    assert body["stream_options"] == {"include_usage": True}


def test_a_completion_without_ids_resumes_with_its_text() -> None:
    transcript = Transcript.read(False, sse(text(0, " a"), text(1, " b")))
    body = json.loads(transcript.next_body(COMPLETION) or b"")
    assert body["prompt"] == "Once a b"
    ids_prompt = {**COMPLETION, "prompt": [1, 2]}
    assert Transcript.read(False, sse(text(0, " a"))).next_body(ids_prompt) is None


def test_stop_strings_resume_by_text() -> None:
    """A stop string may hold text back that the ids include: text is what the client has."""
    transcript = Transcript.read(False, sse(text(0, " a", [7], prompt_token_ids=[1])))
    body = json.loads(transcript.next_body({**COMPLETION, "stop": ["x"]}) or b"")
    assert body["prompt"] == "Once a"


def test_a_chat_resumes_with_its_partial_answer_continued() -> None:
    transcript = Transcript.read(
        True, sse(delta("", role="assistant"), delta(" The"), delta(" old"))
    )
    body = json.loads(transcript.next_body({**CHAT, "max_completion_tokens": 5}) or b"")
    assert body["messages"][-1] == {"role": "assistant", "content": " The old"}
    assert (body["continue_final_message"], body["add_generation_prompt"]) == (True, False)
    assert body["max_completion_tokens"] == 3
    # a client's own continuation goes on in its message
    own = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "So"}],
           "continue_final_message": True}  # fmt: skip
    body = json.loads(Transcript.read(True, sse(delta(" the"))).next_body(own) or b"")
    assert body["messages"][-1]["content"] == "So the"
    assert len(body["messages"]) == 2


def test_a_tool_call_in_the_stream_is_not_spliceable() -> None:
    call = delta(None)
    call["choices"][0]["delta"]["tool_calls"] = [{"index": 0}]
    assert not Transcript.read(True, sse(call)).spliceable


def test_the_splice_keeps_the_streams_id_drops_the_new_role_and_makes_usage_whole() -> None:
    transcript = Transcript.read(True, sse(delta("", role="assistant"), delta(" The")))
    assert transcript.next_body(CHAT) is not None
    splice = Splice(transcript, include_usage=True, prompt_estimate=3)
    other = {"id": "chatcmpl-2", "created": 9}
    usage = {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15,
             "prompt_tokens_details": {"cached_tokens": 10}}  # fmt: skip
    resumed = sse(
        {**delta("", role="assistant"), **other, "prompt_token_ids": [1]},
        {**delta(" old"), **other},
        {**delta(" stone"), **other},
        {**delta(None), **other, "choices": [], "usage": usage},
        "[DONE]",
    )
    out = b"".join(splice.feed(resumed[i : i + 7]) for i in range(0, len(resumed), 7))
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {"chatcmpl-1"}
    assert {c["created"] for c in chunks} == {5}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[:-1]] == [" old", " stone"]
    assert all("prompt_token_ids" not in c for c in chunks)
    # the prompt once (11 resent − 1 token sent before), every token sent
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 10,
        "total_tokens": 15,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 10},
    }
    assert transcript.done
    assert "".join(transcript.text) == " The old stone"
    assert splice.resent_prompt_tokens() == 10 + 1


def test_a_usage_event_the_client_did_not_ask_for_is_dropped_but_metered() -> None:
    state = StreamResume(False, COMPLETION, 2)
    state.sent.append(sse(text(0, " a", [7], prompt_token_ids=[1, 2])))
    assert state.next_body()
    assert state.splice is not None
    usage = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    out = state.splice.feed(sse(text(0, " b", [8]), {"choices": [], "usage": usage}, "[DONE]"))
    assert b'"usage"' not in out
    assert out.endswith(b"data: [DONE]\n\n")
    ended: list[bool] = []
    meter = Meter(2, injected=True, on_complete=lambda: ended.append(True))
    state.meter(meter)
    assert ended == [True]
    assert (meter.usage.prompt_tokens, meter.usage.completion_tokens) == (2, 10)
    assert meter.usage.resumed_prompt_tokens == 3  # the prompt (2) and the token sent (1)


def test_relayed_frames_read_back_as_their_data() -> None:
    frames = b"5\r\nhello\r\n6\r\n world\r\n"
    assert dechunk(frames) == b"hello world"
    state = StreamResume(False, COMPLETION, 2)
    state.sent.append(sse(text(0, " a")))
    body = sse(text(1, " b"))
    state.frames.append(b"%x\r\n%s\r\n" % (len(body), body))
    assert state.next_body()
    assert state.transcript is not None
    assert "".join(state.transcript.text) == " a b"


def test_a_stream_that_had_its_whole_answer_is_ended_not_resumed() -> None:
    state = StreamResume(False, {**COMPLETION, "stream_options": {"include_usage": True}}, 2)
    last = text(1, " b", [8], finish_reason="length")
    state.sent.append(sse(text(0, " a", [7], prompt_token_ids=[1]), last))
    assert state.complete()
    end = state.ending()
    assert end.endswith(b"data: [DONE]\n\n")
    usage = json.loads(end.split(b"\n\n")[0][6:])["usage"]
    assert usage == {"prompt_tokens": 1, "total_tokens": 3, "completion_tokens": 2}
