"""L4: the sim engine continues an answer it recognises, and returns token ids (vLLM's
``return_token_ids``), what a stream resumed on another replica needs (docs/gateway.md)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from gpufleet.engine import WORDS
from gpufleet.engine.server import SimEngineConfig
from tests.engine.conftest import FAST, Served, serve

MODEL = "llama-3.1-8b"
USER = [{"role": "user", "content": "Tell me about the old stone bridge."}]


def events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url, json={"model": MODEL, "stream": True, **body}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_a_stream_returns_its_token_ids_and_the_prompts_in_its_first_event(sim: Served) -> None:
    chunks = events(
        sim.v1 + "/completions",
        {"prompt": "Hello there", "max_tokens": 6, "ignore_eos": True, "return_token_ids": True},
    )
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["prompt_token_ids"][:1] == [128256 - 16]  # BOS first
    assert all("prompt_token_ids" not in c for c in choices[1:])
    ids = [i for c in choices for i in c["token_ids"]]
    assert len(ids) == 6
    assert "".join(c["text"] for c in choices) == "".join(" " + WORDS[i % len(WORDS)] for i in ids)


def test_a_chat_stream_returns_token_ids_in_choices_and_the_prompts_on_top(sim: Served) -> None:
    chunks = events(
        sim.v1 + "/chat/completions",
        {"messages": USER, "max_tokens": 5, "ignore_eos": True, "return_token_ids": True},
    )
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["prompt_token_ids"]
    content = [c["choices"][0] for c in chunks[1:]]
    assert [len(c["token_ids"]) for c in content] == [1] * 5


def test_a_stream_without_return_token_ids_has_none(sim: Served) -> None:
    chunks = events(sim.v1 + "/completions", {"prompt": "Hi", "max_tokens": 3})
    assert all("token_ids" not in c["choices"][0] for c in chunks)


def _completion(sim: Served, prompt: object, max_tokens: int) -> tuple[list[int], list[int], str]:
    chunks = events(
        sim.v1 + "/completions",
        {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True},
    )
    choices = [c["choices"][0] for c in chunks]
    ids = [i for c in choices for i in c["token_ids"]]
    return choices[0]["prompt_token_ids"], ids, "".join(c["text"] for c in choices)


@pytest.mark.parametrize("cut", [8, 20, 39])
def test_a_prompt_ending_in_generated_ids_goes_on_token_for_token(cut: int) -> None:
    """Two replicas on one seed: the second continues the first's answer (a resume)."""
    config = SimEngineConfig(time_scale=FAST)
    with serve(config) as a, serve(config) as b:
        prompt, whole, text = _completion(a, "Once upon a time", 40)
        _, rest, rest_text = _completion(b, prompt + whole[:cut], 40 - cut)
        assert whole[:cut] + rest == whole
        assert text.endswith(rest_text)


def test_too_short_a_run_is_not_continued(sim: Served) -> None:
    prompt, whole, _ = _completion(sim, "Once upon a time", 10)
    _, rest, _ = _completion(sim, prompt + whole[:3], 7)
    assert rest != whole[3:]  # 3 tokens are not enough to recognise an answer


def test_a_chat_continued_from_its_partial_answer_goes_on_word_for_word() -> None:
    config = SimEngineConfig(time_scale=FAST)
    with serve(config) as a, serve(config) as b:
        url = "/chat/completions"
        body = {"messages": USER, "max_tokens": 30, "ignore_eos": True}
        first = events(a.v1 + url, {**body, "stream_options": {"include_usage": True}})
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in first if c["choices"])
        words = text.split()
        partial = " " + " ".join(words[:12])
        resumed = events(
            b.v1 + url,
            {
                **body,
                "messages": [*USER, {"role": "assistant", "content": partial}],
                "max_tokens": 18,
                "continue_final_message": True,
                "add_generation_prompt": False,
                "stream_options": {"include_usage": True},
            },
        )
        rest = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in resumed if c["choices"]
        )
        assert partial + rest == text
        usage = resumed[-1]["usage"]
        assert usage["prompt_tokens"] == first[-1]["usage"]["prompt_tokens"] + 12
        assert usage["completion_tokens"] == 18


def test_continue_final_message_with_add_generation_prompt_is_refused(sim: Served) -> None:
    body = {
        "model": MODEL,
        "messages": [*USER, {"role": "assistant", "content": " The"}],
        "continue_final_message": True,
        "add_generation_prompt": True,
    }
    response = httpx.post(sim.v1 + "/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "continue_final_message"
