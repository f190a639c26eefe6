"""L4: ``n > 1`` on chat and completions, streaming and not, over loopback."""

from __future__ import annotations

from collections import defaultdict

import httpx
import pytest

from gpufleet.engine import Tokenizer
from gpufleet.engine.server import SimEngineConfig
from tests.engine.conftest import Served, serve
from tests.engine.test_server import MODEL, STOPS, USER, _wait_for, client

TOK = Tokenizer(128256)


def test_chat_n2_gives_two_indexed_choices_and_vllms_summed_usage(sim: Served) -> None:
    reply = client(sim).chat.completions.create(
        model=MODEL, messages=USER, n=2, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in reply.choices] == [0, 1]
    texts = [c.message.content or "" for c in reply.choices]
    assert texts[0] != texts[1]  # two sequences, not one sent twice
    assert all(TOK.count(t) == 6 for t in texts)
    assert all(c.finish_reason == "length" for c in reply.choices)
    prompt = len(TOK.encode_chat([("user", USER[0]["content"])]))
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt, 12)
    assert reply.usage.total_tokens == prompt + 12


def test_completion_n3_without_ignore_eos_stops_each_within_max_tokens(sim: Served) -> None:
    reply = client(sim).completions.create(model=MODEL, prompt="Once", n=3, max_tokens=30)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage is not None
    assert reply.usage.completion_tokens == sum(TOK.count(c.text) for c in reply.choices)


@pytest.mark.parametrize("chat", [True, False])
def test_streaming_n2_interleaves_indexed_chunks_then_one_usage_chunk(
    sim: Served, chat: bool
) -> None:
    common = {
        "model": MODEL,
        "n": 2,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }
    if chat:
        chunks = list(client(sim).chat.completions.create(messages=USER, **common))  # type: ignore[call-overload]
    else:
        chunks = list(client(sim).completions.create(prompt="Hello there", **common))  # type: ignore[call-overload]
    texts: dict[int, list[str]] = defaultdict(list)
    finishes: dict[int, list[str]] = defaultdict(list)
    roles = []
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        text = (choice.delta.content if chat else choice.text) or ""
        if chat and choice.delta.role:
            roles.append(choice.index)
        if text:
            texts[choice.index].append(text)
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert {i: len(t) for i, t in texts.items()} == {0: 5, 1: 5}
    assert dict(finishes) == {0: ["length"], 1: ["length"]}
    if chat:
        assert roles == [0, 1]
        assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage is not None
    assert usage.completion_tokens == 10
    assert len({c.id for c in chunks}) == 1


def test_streaming_n2_with_stop_strings_stops_each_choice(sim: Served) -> None:
    stream = client(sim).completions.create(
        model=MODEL,
        prompt="stop probe n",
        n=2,
        max_tokens=30,
        stop=STOPS,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    finals = {}
    for chunk in stream:
        choice = chunk.choices[0]
        if choice.finish_reason:
            finals[choice.index] = (choice.finish_reason, choice.model_dump()["stop_reason"])
    assert set(finals) == {0, 1}
    assert all(reason == "stop" and stop in STOPS for reason, stop in finals.values())


def test_the_extra_sequences_prefill_from_the_prefix_cache() -> None:
    """n = 4 of a fresh 700-token prompt: the siblings are scheduled with the first one, and
    all of its full blocks but the last are hits for each of them."""
    with serve(SimEngineConfig(time_scale=200, max_model_len=4096)) as sim:
        prompt = " ".join(f"fact {i} about the mill" for i in range(140))
        tokens = len(TOK.encode(prompt))
        queries = sim.sample("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
        hits = sim.sample("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
        reply = client(sim).completions.create(
            model=MODEL, prompt=prompt, n=4, max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == tokens
        assert reply.usage.prompt_tokens_details is not None
        assert reply.usage.prompt_tokens_details.cached_tokens == 0  # the first sequence's
        new_queries = sim.sample("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
        new_hits = sim.sample("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
        assert new_queries - queries == 4 * tokens
        assert new_hits - hits == 3 * 16 * ((tokens - 1) // 16)
        success = sim.sample(
            "vllm:request_success", "vllm:request_success_total", finished_reason="length"
        )
        assert success == 4  # each sequence is a request, as vLLM v1 counts its children


def test_a_disconnect_aborts_every_sequence() -> None:
    with serve(SimEngineConfig(time_scale=1, max_model_len=4096)) as sim:
        body = {"model": MODEL, "prompt": "long", "max_tokens": 3000, "ignore_eos": True}
        with httpx.stream(
            "POST", sim.v1 + "/completions", json={**body, "n": 3, "stream": True}
        ) as response:
            lines = response.iter_lines()  # kept: a dropped generator closes the stream
            next(lines)
            assert sim.sample("vllm:num_requests_running") == 3
        assert _wait_for(lambda: sim.sample("vllm:num_requests_running") == 0)
        aborted = sim.sample(
            "vllm:request_success", "vllm:request_success_total", finished_reason="abort"
        )
        assert aborted == 3
