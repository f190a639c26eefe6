"""Issue 19: the whole OpenAI surface through the gateway, with the official ``openai`` client
over loopback HTTP, a real gateway and two real sim engine replicas: the Responses API
(streamed and not), embeddings (one input and a list, float and base64), chat with ``n = 2``
(streamed and not), ``/tokenize`` and ``/detokenize``, rerank and score passed through to a
replica that has none (its own 404); each request in the usage ledger with its tokens.

Auth on (``metered``: every answer read for its usage, streams chunk by chunk) and auth off
under the gateway's own server (``open_gateway``: a stream relayed frame by frame)."""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy

from gpufleet.store import _schema as schema
from tests.gateway.conftest import MODEL, Running, eventually, fleet, serve_gateway, sim_replica
from tests.gateway.tenants import TenantGateway, serve_tenant_gateway, tenant_fleet


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[str, str]]:
    with sim_replica(seed=1) as a, sim_replica(seed=2) as b:
        yield a, b


@pytest.fixture(scope="module")
def metered(
    replicas: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TenantGateway, str]]:
    tmp: Path = tmp_path_factory.mktemp("surface")
    with serve_tenant_gateway(tmp, tenant_fleet(), list(replicas)) as gw:
        _, key = gw.store.create_key("surface")
        gw.tenancy.reload()
        yield gw, key


@pytest.fixture(scope="module")
def open_gateway(replicas: tuple[str, str]) -> Iterator[Running]:
    config = fleet(routing="least_request", health={"active": {"interval": 0.2}})
    with serve_gateway(config, list(replicas), server="own") as gw:
        yield gw


def ledger(gw: TenantGateway, request_id: str) -> dict[str, Any]:
    """The usage ledger's row of one request (journaled before its last byte was sent)."""
    u = schema.usage.c
    gw.flush()
    with gw.store.engine.connect() as conn:
        rows = conn.execute(sqlalchemy.select(schema.usage).where(u.request_id == request_id))
        (row,) = [dict(r._mapping) for r in rows]
    return row


def rid(name: str) -> dict[str, dict[str, str]]:
    return {"extra_headers": {"x-request-id": f"{name}-{time.monotonic_ns()}"}}


def request_id(options: dict[str, dict[str, str]]) -> str:
    return options["extra_headers"]["x-request-id"]


# -- the Responses API ---------------------------------------------------------------------


def test_a_response_is_served_and_ledgered_with_its_input_and_output_tokens(
    metered: tuple[TenantGateway, str],
) -> None:
    gw, key = metered
    options = rid("resp")
    with openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0) as client:
        response = client.responses.create(
            model=MODEL, instructions="Be brief.", input="Tell me a story", max_output_tokens=7,
            **options,
        )  # fmt: skip
    assert response.status == "incomplete"  # it hit max_output_tokens
    assert len(response.output_text.split()) == 7
    assert response.usage is not None
    assert response.usage.output_tokens == 7
    row = ledger(gw, request_id(options))
    assert row["status"] == 200
    assert row["prompt_tokens"] == response.usage.input_tokens > 0
    assert row["completion_tokens"] == 7
    assert row["replica"] is not None


def test_a_streamed_response_is_ledgered_from_its_final_event(
    metered: tuple[TenantGateway, str],
) -> None:
    gw, key = metered
    options = rid("resp-stream")
    with openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0) as client:
        events = list(
            client.responses.create(
                model=MODEL,
                input=[{"role": "user", "content": "Count to five"}],
                max_output_tokens=5,
                stream=True,
                **options,
            )
        )
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types.count("response.output_text.delta") == 5
    final = events[-1]
    assert final.type == "response.completed"
    assert final.response.usage is not None
    row = ledger(gw, request_id(options))
    assert row["prompt_tokens"] == final.response.usage.input_tokens > 0
    assert row["completion_tokens"] == final.response.usage.output_tokens == 5
    assert row["ttft_s"] is not None


def test_a_streamed_response_relayed_with_auth_off(open_gateway: Running) -> None:
    before = open_gateway.sample("gpufleet:gateway_requests_total", model=MODEL, status="200")
    with (
        openai.OpenAI(base_url=open_gateway.v1, api_key="none", max_retries=0) as client,
        client.responses.stream(model=MODEL, input="Hi", max_output_tokens=6) as stream,
    ):
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert len(text.split()) == 6
    assert final.output_text == text
    eventually(
        lambda: open_gateway.sample("gpufleet:gateway_requests_total", model=MODEL, status="200"),
        before + 1,
    )


# -- embeddings ----------------------------------------------------------------------------


def test_embeddings_of_one_input_and_a_list_float_and_base64(
    metered: tuple[TenantGateway, str],
) -> None:
    gw, key = metered
    one, many, packed = rid("embed-one"), rid("embed-many"), rid("embed-b64")
    with openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0) as client:
        single = client.embeddings.create(
            model=MODEL, input="the quick brown fox", encoding_format="float", **one
        )
        listed = client.embeddings.create(
            model=MODEL, input=["the quick brown fox", "jumps"], encoding_format="float", **many
        )
        raw = client.embeddings.with_raw_response.create(
            model=MODEL, input=["the quick brown fox", "jumps"], encoding_format="base64",
            dimensions=64, **packed,
        )  # fmt: skip
    assert len(single.data) == 1
    assert [d.index for d in listed.data] == [0, 1]
    assert sum(x * x for x in single.data[0].embedding) == pytest.approx(1.0)
    encoded = raw.http_response.json()["data"][0]["embedding"]
    assert isinstance(encoded, str)  # base64 on the wire, through the gateway untouched
    vector = struct.unpack("<64f", base64.b64decode(encoded))
    assert sum(x * x for x in vector) == pytest.approx(1.0, rel=1e-5)
    for options, usage in (
        (one, single.usage),
        (many, listed.usage),
        (packed, raw.parse().usage),
    ):
        row = ledger(gw, request_id(options))
        assert row["prompt_tokens"] == usage.prompt_tokens > 0
        assert row["completion_tokens"] == 0
    assert listed.usage.prompt_tokens > single.usage.prompt_tokens


def test_embeddings_with_auth_off(open_gateway: Running) -> None:
    with openai.OpenAI(base_url=open_gateway.v1, api_key="none", max_retries=0) as client:
        reply = client.embeddings.create(model=MODEL, input=["a", "b", "c"])  # base64 default
    assert [len(d.embedding) for d in reply.data] == [len(reply.data[0].embedding)] * 3


# -- chat with n = 2 -----------------------------------------------------------------------


def test_chat_with_two_choices_whole_and_streamed_is_metered_once(
    metered: tuple[TenantGateway, str],
) -> None:
    gw, key = metered
    whole, streamed = rid("n2"), rid("n2-stream")
    messages = [{"role": "user", "content": "Two answers, please"}]
    with openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, n=2, max_tokens=4,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True}, **whole,
        )  # fmt: skip
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=messages, n=2, max_tokens=5, stream=True,  # type: ignore[arg-type]
                extra_body={"ignore_eos": True}, **streamed,
            )
        )  # fmt: skip
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.message.content for c in reply.choices)
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 8  # both choices' tokens
    row = ledger(gw, request_id(whole))
    assert (row["prompt_tokens"], row["completion_tokens"]) == (
        reply.usage.prompt_tokens,
        reply.usage.completion_tokens,
    )
    texts: dict[int, str] = {0: "", 1: ""}
    for chunk in chunks:
        assert chunk.choices  # the usage event the gateway asked for is not the client's
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [len(t.split()) for t in texts.values()] == [5, 5]
    row = ledger(gw, request_id(streamed))
    assert row["prompt_tokens"] == reply.usage.prompt_tokens  # the prompt counted once
    assert row["completion_tokens"] == 10  # both choices' tokens


def test_chat_with_two_choices_streamed_with_auth_off(open_gateway: Running) -> None:
    with openai.OpenAI(base_url=open_gateway.v1, api_key="none", max_retries=0) as client:
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=3,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )  # fmt: skip
    indexes = {choice.index for chunk in chunks for choice in chunk.choices}
    assert indexes == {0, 1}
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1
    assert usage[0].completion_tokens == 6


# -- tokenize and detokenize ---------------------------------------------------------------


def test_tokenize_and_detokenize_are_routed_and_ledgered_without_tokens(
    metered: tuple[TenantGateway, str],
) -> None:
    gw, key = metered
    headers = {"authorization": f"Bearer {key}"}
    with httpx.Client(base_url=gw.url, headers=headers) as http:
        assert http.post("/tokenize", json={"prompt": "x"}).status_code == 400  # no model
        told = http.post(
            "/tokenize",
            json={"model": MODEL, "prompt": "Hello there"},
            headers={"x-request-id": "tok-1"},
        )
        chat = http.post(
            "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        )
        back = http.post(
            "/detokenize",
            json={"model": MODEL, "tokens": told.json()["tokens"]},
            headers={"x-request-id": "detok-1"},
        )
        unauthorised = httpx.post(gw.url + "/tokenize", json={"model": MODEL, "prompt": "x"})
    assert told.status_code == 200
    assert told.json()["count"] == len(told.json()["tokens"]) == 3  # BOS and two words
    assert chat.status_code == 200
    assert chat.json()["count"] > 3
    assert back.status_code == 200
    assert back.json()["prompt"].startswith("<|begin_of_text|>")
    assert unauthorised.status_code == 401
    for name in ("tok-1", "detok-1"):
        row = ledger(gw, name)
        assert row["status"] == 200
        assert (row["prompt_tokens"], row["completion_tokens"]) == (0, 0)  # no model ran


# -- rerank and score; errors --------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score"])
def test_rerank_and_score_pass_the_replicas_own_404_through(
    open_gateway: Running, path: str
) -> None:
    def client_errors() -> float:
        return sum(
            open_gateway.sample(
                "gpufleet:gateway_upstream_attempts_total",
                replica=f"{MODEL}-{i}",
                outcome="client_error",
            )
            for i in (0, 1)
        )

    before = client_errors()
    body = {"model": MODEL, "query": "q", "documents": ["a", "b"], "text_1": "a", "text_2": "b"}
    answer = httpx.post(open_gateway.url + path, json=body)
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert error["code"] == 404
    assert "no route" not in error["message"]  # the replica's answer, not the gateway's
    eventually(client_errors, before + 1)  # one attempt: a 4xx is an answer, not retried
    assert httpx.get(open_gateway.url + "/ready").json()["routable"][MODEL] == 2


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/responses", b"{not json", "not valid JSON"),
        ("/v1/responses", b'{"input": "x"}', "model"),
        ("/v1/responses", b'{"model": "llama-3.1-8b"}', "`input` is required"),
        ("/v1/embeddings", b"[1]", "JSON object"),
        ("/v1/embeddings", b'{"model": 3, "input": "x"}', "model"),
        ("/v1/embeddings", b'{"model": "llama-3.1-8b"}', "`input` is required"),
        ("/tokenize", b'{"model": "llama-3.1-8b"}', "`prompt` or `messages` is required"),
        ("/detokenize", b'{"model": "llama-3.1-8b"}', "`tokens` is required"),
        ("/v1/rerank", b"{}", "model"),
    ],
)
def test_bad_input_is_the_same_400_as_chat(
    open_gateway: Running, path: str, body: bytes, message: str
) -> None:
    answer = httpx.post(open_gateway.url + path, content=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", 400)
    assert message in error["message"]


def test_an_unknown_model_is_404_and_a_replicas_4xx_is_passed_through(
    open_gateway: Running,
) -> None:
    with openai.OpenAI(base_url=open_gateway.v1, api_key="none", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError, match="gpt-4"):
            client.embeddings.create(model="gpt-4", input="x")
        with pytest.raises(openai.NotFoundError, match="gpt-4"):
            client.responses.create(model="gpt-4", input="x")
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            client.embeddings.create(model=MODEL, input="x", dimensions=10**6)


def test_methods_and_unknown_paths(open_gateway: Running) -> None:
    for path in ("/v1/responses", "/v1/embeddings", "/tokenize", "/v1/rerank"):
        answer = httpx.get(open_gateway.url + path)
        assert answer.status_code == 405
        assert answer.json()["error"]["type"] == "invalid_request_error"
    for path in ("/v1/audio/speech", "/v1/embedding", "/v1/responses/resp_1", "/pooling"):
        answer = httpx.post(open_gateway.url + path, json={"model": MODEL})
        assert answer.status_code == 404
        assert answer.json()["error"] == {
            "message": f"no route POST {path}",
            "type": "not_found_error",
            "param": None,
            "code": 404,
        }
