"""Wire format pieces: stop-string release rule and the precomputed SSE fragments."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from gpufleet.engine.server._protocol import WORD_JSON, Choice, ResponseShape, StopMatcher, Usage


def _run(pieces: list[str], stops: tuple[str, ...]) -> tuple[str, str | None]:
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        out.append(matcher.feed(piece))
        if matcher.matched is not None:
            return "".join(out), matcher.matched
    out.append(matcher.flush())
    return "".join(out), None


def test_text_is_cut_before_the_stop_string() -> None:
    assert _run([" the", " old", " stone", " bridge"], ("stone",)) == (" the old ", "stone")


def test_text_that_may_begin_a_stop_string_is_held_back() -> None:
    matcher = StopMatcher(("bridge",))
    assert matcher.feed(" the br") == " t"
    assert matcher.feed("oad") == "he "  # a fixed hold of len(stop) - 1 chars, as vLLM
    assert matcher.flush() == "broad"


@given(
    st.lists(st.text(alphabet="abc ", max_size=4), max_size=12),
    st.lists(st.text(alphabet="abc ", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_streamed_release_equals_cutting_the_whole_text(
    pieces: list[str], stops: list[str]
) -> None:
    """What is streamed equals the text cut where generation stops: at the first piece
    (token) after which a stop string appears, before the earliest stop string in the text
    so far. A longer stop string that would have begun earlier, had generation gone on, does
    not count (vLLM checks after each token: ``["cb", "a"]`` with stops ``b`` and ``cba``
    stops at ``b``, with ``"c"``)."""
    text, matched = _run(pieces, tuple(stops))
    so_far = ""
    for piece in pieces:
        so_far += piece
        hits = [so_far.find(s) for s in stops if s in so_far]
        if hits:
            first = min(hits)
            assert text == so_far[:first]
            assert matched is not None
            assert so_far.find(matched) == first
            return
    assert (text, matched) == (so_far, None)


def _event(raw: bytes) -> dict[str, object]:
    assert raw.startswith(b"data: ")
    assert raw.endswith(b"\n\n")
    return json.loads(raw[6:])


def test_fragments_join_into_valid_chunks() -> None:
    for chat in (True, False):
        shape = ResponseShape(chat=chat, response_id='x"1', created=5, model="m\\n")
        token = _event(shape.head + WORD_JSON[3] + shape.tail)
        final = _event(shape.text_event("é\n", shape.final_tail("stop", "\n")))
        usage = _event(shape.usage_event(Usage(10, 3, 8)))
        assert token["id"] == final["id"] == usage["id"] == 'x"1'
        assert token["model"] == "m\\n"
        choice = final["choices"][0]  # type: ignore[index]
        assert choice["finish_reason"] == "stop"
        assert choice["stop_reason"] == "\n"
        text = choice["delta"]["content"] if chat else choice["text"]
        assert text == "é\n"
        assert usage["choices"] == []
        assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}  # type: ignore[index]
        assert usage["usage"]["total_tokens"] == 13  # type: ignore[index]
    chat_shape = ResponseShape(chat=True, response_id="c", created=1, model="m")
    role = _event(chat_shape.role_event)
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # type: ignore[index]


def test_full_bodies_have_vllm_shapes() -> None:
    chat = json.loads(
        ResponseShape(chat=True, response_id="chatcmpl-1", created=1, model="m").full_body(
            [Choice(0, "hi", "length")], Usage(4, 1, 0)
        )
    )
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi", "tool_calls": []}
    text = json.loads(
        ResponseShape(chat=False, response_id="cmpl-1", created=1, model="m").full_body(
            [Choice(0, "hi", "stop", "x")], Usage(4, 1, 0)
        )
    )
    assert text["object"] == "text_completion"
    assert text["choices"][0]["text"] == "hi"
    assert text["choices"][0]["stop_reason"] == "x"


def test_n_choices_carry_their_index_in_fragments_and_bodies() -> None:
    shape = ResponseShape(chat=True, response_id="c", created=1, model="m")
    second = shape.for_choice(1)
    assert _event(second.head + WORD_JSON[0] + second.tail)["choices"][0]["index"] == 1  # type: ignore[index]
    assert _event(second.role_event)["choices"][0]["index"] == 1  # type: ignore[index]
    body = json.loads(
        shape.full_body([Choice(1, "b", "stop"), Choice(0, "a", "length")], Usage(4, 2, 0))
    )
    assert [(c["index"], c["message"]["content"]) for c in body["choices"]] == [(0, "a"), (1, "b")]
