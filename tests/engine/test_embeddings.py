"""L4: ``POST /v1/embeddings`` over loopback with the official ``openai`` client."""

from __future__ import annotations

import base64
import math
from array import array

import httpx
import openai
import pytest

from gpufleet.engine import Tokenizer
from gpufleet.engine.server import SimEngineConfig
from gpufleet.perf import BatchShape
from tests.engine.conftest import Served, serve
from tests.engine.test_server import MODEL, client

HIDDEN = 4096  # llama-3.1-8b's hidden size
TOK = Tokenizer(128256)


def _norm(vector: list[float]) -> float:
    return math.sqrt(sum(v * v for v in vector))


def test_a_string_gives_one_unit_vector_of_the_hidden_size(sim: Served) -> None:
    reply = client(sim).embeddings.create(
        model=MODEL, input="The old stone bridge.", encoding_format="float"
    )
    assert reply.object == "list"
    assert reply.model == MODEL
    assert [(d.index, d.object) for d in reply.data] == [(0, "embedding")]
    vector = reply.data[0].embedding
    assert len(vector) == HIDDEN
    assert _norm(vector) == pytest.approx(1.0, abs=1e-9)
    tokens = len(TOK.encode("The old stone bridge."))
    assert (reply.usage.prompt_tokens, reply.usage.total_tokens) == (tokens, tokens)
    raw = httpx.post(sim.v1 + "/embeddings", json={"input": "x"}).json()
    assert raw["id"].startswith("embd-")
    assert raw["usage"] == {
        "prompt_tokens": 2,
        "total_tokens": 2,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def test_the_clients_default_base64_decodes_to_the_float_vector(sim: Served) -> None:
    text = "base64 round trip"
    floats = client(sim).embeddings.create(model=MODEL, input=text, encoding_format="float")
    decoded = client(sim).embeddings.create(model=MODEL, input=text)  # sends base64
    assert decoded.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-7)
    raw = client(sim).embeddings.create(model=MODEL, input=text, encoding_format="base64")
    words = array("f", base64.b64decode(raw.data[0].embedding))  # type: ignore[arg-type]
    assert len(words) == HIDDEN
    assert list(words) == pytest.approx(floats.data[0].embedding, abs=1e-7)


def test_batches_of_texts_and_token_ids_keep_their_order_and_are_deterministic(
    sim: Served,
) -> None:
    texts = ["alpha beta", "gamma", "alpha beta"]
    reply = client(sim).embeddings.create(model=MODEL, input=texts, encoding_format="float")
    vectors = [d.embedding for d in reply.data]
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert vectors[0] == vectors[2] != vectors[1]
    assert reply.usage.prompt_tokens == sum(len(TOK.encode(t)) for t in texts)
    ids = list(TOK.encode("gamma"))
    by_ids = client(sim).embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert by_ids.data[0].embedding == vectors[1]
    batch = client(sim).embeddings.create(
        model=MODEL, input=[ids, [5, 6, 7]], encoding_format="float"
    )
    assert batch.data[0].embedding == vectors[1]
    assert batch.usage.prompt_tokens == len(ids) + 3


def test_dimensions_give_a_renormalized_prefix(sim: Served) -> None:
    full = client(sim).embeddings.create(model=MODEL, input="mat", encoding_format="float")
    short = client(sim).embeddings.create(
        model=MODEL, input="mat", dimensions=256, encoding_format="float"
    )
    vector = short.data[0].embedding
    assert len(vector) == 256
    assert _norm(vector) == pytest.approx(1.0)
    head = full.data[0].embedding[:256]
    assert vector == pytest.approx([v / _norm(head) for v in head])


def _error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1, 128256]}, "input"),
        ({"input": [[1, -1]]}, "input"),
        ({"input": ["a", 1]}, "input"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": HIDDEN + 1}, "dimensions"),
        ({"input": "x", "encoding_format": "bytes"}, "encoding_format"),
        ({"input": "word " * 5000}, "input"),
    ],
)
def test_bad_inputs_get_an_openai_shaped_400(
    sim: Served, body: dict[str, object], param: str
) -> None:
    error = _error(httpx.post(sim.v1 + "/embeddings", json=body), 400)
    assert error["type"] == "BadRequestError"
    assert str(error["param"]).startswith(param)


def test_the_client_sees_400s_and_404s_as_its_own_errors(sim: Served) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client(sim).embeddings.create(model=MODEL, input="word " * 5000)
    assert "4096" in caught.value.message
    with pytest.raises(openai.NotFoundError):
        client(sim).embeddings.create(model="text-embedding-3-small", input="x")


def test_embeddings_count_in_vllm_metrics_as_pooling_requests(sim: Served) -> None:
    def sample(family: str, sample: str, **labels: str) -> float:
        return sim.sample(family, sample, **labels)

    before = {
        "prompt": sample("vllm:prompt_tokens", "vllm:prompt_tokens_total"),
        "generation": sample("vllm:generation_tokens", "vllm:generation_tokens_total"),
        "stop": sample(
            "vllm:request_success", "vllm:request_success_total", finished_reason="stop"
        ),
        "ttft": sample(
            "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count"
        ),
        "e2e": sample("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count"),
        "itl": sample("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count"),
    }
    texts = ["one metric", "two metrics here"]
    reply = client(sim).embeddings.create(model=MODEL, input=texts)
    after = {
        "prompt": sample("vllm:prompt_tokens", "vllm:prompt_tokens_total"),
        "generation": sample("vllm:generation_tokens", "vllm:generation_tokens_total"),
        "stop": sample(
            "vllm:request_success", "vllm:request_success_total", finished_reason="stop"
        ),
        "ttft": sample(
            "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count"
        ),
        "e2e": sample("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count"),
        "itl": sample("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count"),
    }
    delta = {key: after[key] - before[key] for key in before}
    assert delta == {
        "prompt": reply.usage.prompt_tokens,
        "generation": 0,
        "stop": 2,
        "ttft": 2,
        "e2e": 2,
        "itl": 0,
    }
    assert sim.sample("vllm:num_requests_running") == 0


def test_an_embedding_takes_the_modelled_time_of_its_prefill() -> None:
    with serve(SimEngineConfig(time_scale=1, max_model_len=4096)) as sim:
        text = " ".join(f"line {i} of a long document" for i in range(300))
        reply = client(sim).embeddings.create(model=MODEL, input=text)
        tokens = reply.usage.prompt_tokens
        assert tokens > 1500
        engine = sim.app.state.engine
        prefill = engine.model.step_time_model.step_time(BatchShape.prefill(tokens)).seconds
        e2e = sim.sample("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum")
        assert prefill > 0.02
        assert prefill <= e2e < prefill + 0.01  # the HTTP edge adds a millisecond or so
