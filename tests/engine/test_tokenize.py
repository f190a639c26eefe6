"""L4: ``POST /tokenize`` and ``POST /detokenize`` as vLLM serves them."""

from __future__ import annotations

import httpx
import pytest

from gpufleet.engine import Tokenizer
from tests.engine.conftest import Served
from tests.engine.test_server import MODEL, USER, client

TOK = Tokenizer(128256)


def test_tokenize_a_prompt(sim: Served) -> None:
    body = httpx.post(sim.url + "/tokenize", json={"model": MODEL, "prompt": "Hello, world!"})
    assert body.status_code == 200
    expected = list(TOK.encode("Hello, world!"))
    assert body.json() == {
        "count": len(expected),
        "max_model_len": 4096,
        "tokens": expected,
        "token_strs": None,
    }
    bare = httpx.post(
        sim.url + "/tokenize",
        json={"prompt": "Hello", "add_special_tokens": False, "return_token_strs": True},
    ).json()
    assert bare["tokens"] == list(TOK.encode("Hello", add_bos=False))
    assert bare["token_strs"] == [TOK.token_str(i) for i in bare["tokens"]]


def test_tokenize_a_chat_counts_what_a_chat_completion_counts(sim: Served) -> None:
    body = httpx.post(sim.url + "/tokenize", json={"messages": USER}).json()
    reply = client(sim).chat.completions.create(model=MODEL, messages=USER, max_tokens=1)
    assert reply.usage is not None
    assert body["count"] == reply.usage.prompt_tokens
    assert body["tokens"] == list(TOK.encode_chat([("user", USER[0]["content"])]))
    open_turn = httpx.post(
        sim.url + "/tokenize", json={"messages": USER, "add_generation_prompt": False}
    ).json()
    assert open_turn["tokens"] == body["tokens"][:-1]
    continued = httpx.post(
        sim.url + "/tokenize",
        json={"messages": USER, "continue_final_message": True, "add_generation_prompt": False},
    ).json()
    assert continued["tokens"] == body["tokens"][:-2]


def test_detokenize_reads_ids_back(sim: Served) -> None:
    ids = list(TOK.encode_chat([("user", "Hi")]))
    body = httpx.post(sim.url + "/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert body == {"prompt": TOK.detokenize(ids)}
    assert body["prompt"].startswith("<|begin_of_text|><|user|>")
    assert httpx.post(sim.url + "/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        (
            "/tokenize",
            {"messages": USER, "continue_final_message": True, "add_generation_prompt": True},
            400,
            "continue_final_message",
        ),
        ("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [128256]}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
    ],
)
def test_bad_requests_get_openai_shaped_errors(
    sim: Served, path: str, body: dict[str, object], status: int, param: str
) -> None:
    response = httpx.post(sim.url + path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert str(error["param"]).startswith(param)
    assert httpx.get(sim.url + path).status_code == 405
