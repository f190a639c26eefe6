"""L4: the sim engine under uvicorn on loopback, driven by the official ``openai`` client."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from gpufleet.engine import WORDS, Tokenizer
from gpufleet.engine.server import SimEngine, SimEngineConfig, VirtualClock
from tests.engine.conftest import Served, serve

MODEL = "llama-3.1-8b"
USER = [{"role": "user", "content": "Tell me about the old stone bridge."}]


def client(sim: Served) -> openai.OpenAI:
    return sim.client()


def test_models_lists_the_served_model_and_its_context(sim: Served) -> None:
    models = client(sim).models.list().data
    assert [m.id for m in models] == [MODEL]
    card = models[0].model_dump()
    assert card["max_model_len"] == 4096
    assert card["gpufleet"]["latency_clock"] == "modelled"
    assert card["gpufleet"]["time_scale"] == 200.0


def test_health_is_ok(sim: Served) -> None:
    response = httpx.get(sim.url + "/health")
    assert response.status_code == 200
    assert response.content == b""


def test_chat_completion_with_ignore_eos_gives_exactly_max_tokens(sim: Served) -> None:
    reply = client(sim).chat.completions.create(
        model=MODEL, messages=USER, max_tokens=17, extra_body={"ignore_eos": True}
    )
    assert reply.id.startswith("chatcmpl-")
    assert reply.object == "chat.completion"
    assert reply.model == MODEL
    choice = reply.choices[0]
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert choice.logprobs is None
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 17
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 17
    text = choice.message.content or ""
    assert Tokenizer(128256).count(text) == 17  # filler re-tokenizes to the same count


def test_chat_prompt_tokens_follow_the_chat_template(sim: Served) -> None:
    reply = client(sim).chat.completions.create(model=MODEL, messages=USER, max_tokens=1)
    expected = Tokenizer(128256).encode_chat([("user", USER[0]["content"])])
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(expected)


def test_max_completion_tokens_is_honoured(sim: Served) -> None:
    reply = client(sim).chat.completions.create(
        model=MODEL, messages=USER, max_completion_tokens=5, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 5


def test_completion_without_ignore_eos_stops_within_max_tokens(sim: Served) -> None:
    reply = client(sim).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=40)
    assert reply.id.startswith("cmpl-")
    assert reply.object == "text_completion"
    assert reply.choices[0].finish_reason in {"stop", "length"}
    assert reply.usage is not None
    assert 1 <= reply.usage.completion_tokens <= 40


def test_completion_accepts_token_id_prompts(sim: Served) -> None:
    reply = client(sim).completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=2)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == 5


def test_streaming_chat_sends_role_then_one_chunk_per_token_then_usage(sim: Served) -> None:
    stream = client(sim).chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    token_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(token_chunks) == 12
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens_details.cached_tokens is not None


def test_streaming_completion_without_include_usage_has_no_usage_chunk(sim: Served) -> None:
    stream = client(sim).completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, None, "length"]
    assert all(c.usage is None for c in chunks)


def test_stream_ends_with_done(sim: Served) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", sim.v1 + "/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        assert event.startswith("data: ")
        json.loads(event.removeprefix("data: "))


def test_repeated_prefix_reports_cached_tokens(sim: Served) -> None:
    long_context = " ".join(f"fact {i} is that the river runs past the mill." for i in range(60))
    messages = [{"role": "system", "content": long_context}, {"role": "user", "content": "Q?"}]
    openai_client = client(sim)
    first = openai_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    stream = openai_client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = next(c.usage for c in reversed(list(stream)) if c.usage is not None)
    assert first.usage is not None
    assert first.usage.prompt_tokens == usage.prompt_tokens > 600
    assert usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    # Whole 16-token blocks of the shared prompt, at least all but the last partial block.
    assert usage.prompt_tokens - 32 <= cached < usage.prompt_tokens
    assert cached % 16 == 0


STOPS = [" " + word for word in WORDS[::2]]  # half the filler words: one turns up at once


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_text_before_it(sim: Served, stream: bool) -> None:
    kwargs = {"model": MODEL, "prompt": "stop probe", "max_tokens": 30, "stop": STOPS}
    extra = {"ignore_eos": True}
    if stream:
        chunks = list(client(sim).completions.create(**kwargs, stream=True, extra_body=extra))
        text = "".join(c.choices[0].text for c in chunks)
        final = chunks[-1].choices[0]
    else:
        final = client(sim).completions.create(**kwargs, extra_body=extra).choices[0]
        text = final.text
    assert final.finish_reason == "stop"
    assert final.model_dump()["stop_reason"] in STOPS
    assert not any(stop in text for stop in STOPS)
    assert Tokenizer(128256).count(text) < 30


def test_a_stop_string_that_never_appears_changes_nothing(sim: Served) -> None:
    reply = client(sim).completions.create(
        model=MODEL, prompt="x", max_tokens=9, stop=["@@", "\n\n"], extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length"
    assert Tokenizer(128256).count(reply.choices[0].text) == 9


def test_user_temperature_top_p_and_priority_are_accepted(sim: Served) -> None:
    reply = client(sim).chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=2,
        user="tenant-a",
        temperature=0.7,
        top_p=0.9,
        seed=3,
        extra_body={"priority": 0},
    )
    assert reply.choices[0].finish_reason in {"stop", "length"}


def test_x_request_id_names_the_response(sim: Served) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    response = httpx.post(sim.v1 + "/completions", json=body, headers={"X-Request-Id": "abc"})
    assert response.json()["id"] == "cmpl-abc"


def test_replicas_on_one_seed_never_answer_with_the_same_id() -> None:
    config = SimEngineConfig(seed=7)  # a fleet's replicas share its seed
    first, second = SimEngine(config, VirtualClock()), SimEngine(config, VirtualClock())
    ids = {engine.response_id("cmpl", {"headers": []}) for engine in (first, second)}
    assert len(ids) == 2
    assert all(i.startswith("cmpl-") and len(i) == len("cmpl-") + 32 for i in ids)


def test_concurrent_clients_are_batched(sim: Served) -> None:
    results: list[int] = []

    def one(i: int) -> None:
        reply = client(sim).completions.create(
            model=MODEL, prompt=f"request {i}", max_tokens=8, extra_body={"ignore_eos": True}
        )
        assert reply.usage is not None
        results.append(reply.usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [8] * 8


@pytest.mark.asyncio
async def test_async_client_streams_and_not() -> None:
    with serve(SimEngineConfig(time_scale=200, max_model_len=2048)) as sim:
        async with openai.AsyncOpenAI(base_url=sim.v1, api_key="x", max_retries=0) as aclient:
            reply = await aclient.completions.create(
                model=MODEL, prompt="Hi", max_tokens=6, extra_body={"ignore_eos": True}
            )
            assert reply.usage is not None
            assert reply.usage.completion_tokens == 6
            stream = await aclient.chat.completions.create(
                model=MODEL,
                messages=USER,
                max_tokens=6,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            contents = [c.choices[0].delta.content async for c in stream if c.choices]
            assert len([c for c in contents if c]) == 6


# --- /metrics ----------------------------------------------------------------------------------

EXPECTED_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
}


def test_metrics_parse_with_vllm_names_types_and_labels(sim: Served) -> None:
    client(sim).completions.create(
        model=MODEL, prompt="metrics", max_tokens=3, extra_body={"ignore_eos": True}
    )
    families = sim.metrics()
    for name, kind in EXPECTED_METRICS.items():
        assert families[name].type == kind, name
    counter_samples = {s.name for s in families["vllm:prompt_tokens"].samples}
    assert "vllm:prompt_tokens_total" in counter_samples
    running = families["vllm:num_requests_running"].samples[0]
    assert running.labels == {"model_name": MODEL, "engine": "0"}
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort"}
    info = families["vllm:cache_config_info"].samples[0]
    assert info.value == 1.0
    assert info.labels["block_size"] == "16"
    assert int(info.labels["num_gpu_blocks"]) > 0
    assert sim.sample("vllm:generation_tokens", "vllm:generation_tokens_total") >= 3
    assert (
        sim.sample("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count")
        >= 1
    )


def test_stop_string_finishes_count_as_stop(sim: Served) -> None:
    before = sim.sample(
        "vllm:request_success", "vllm:request_success_total", finished_reason="stop"
    )
    aborted_before = sim.sample(
        "vllm:request_success", "vllm:request_success_total", finished_reason="abort"
    )
    client(sim).completions.create(
        model=MODEL, prompt="count stop", max_tokens=30, stop=STOPS, extra_body={"ignore_eos": True}
    )
    after = sim.sample("vllm:request_success", "vllm:request_success_total", finished_reason="stop")
    aborted = sim.sample(
        "vllm:request_success", "vllm:request_success_total", finished_reason="abort"
    )
    assert after == before + 1
    assert aborted == aborted_before


# --- errors ------------------------------------------------------------------------------------


def _error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert isinstance(error["message"], str)
    assert error["message"]
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"model": MODEL}, "messages"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 3}, "messages"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": USER, "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 129}, "n"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [1, -5]}, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", [1, 2], None),
    ],
)
def test_bad_requests_get_400(sim: Served, path: str, body: object, param: str | None) -> None:
    error = _error(httpx.post(sim.url + path, json=body), 400)
    assert error["type"] == "BadRequestError"
    if param is not None:
        assert str(error["param"]).startswith(param)


def test_invalid_json_gets_400(sim: Served) -> None:
    response = httpx.post(sim.v1 + "/completions", content=b'{"prompt": "x",')
    assert _error(response, 400)["type"] == "BadRequestError"


def test_prompt_longer_than_the_context_gets_the_models_400(sim: Served) -> None:
    prompt = "word " * 5000
    with pytest.raises(openai.BadRequestError) as caught:
        client(sim).completions.create(model=MODEL, prompt=prompt, max_tokens=10)
    assert caught.value.status_code == 400
    assert "4096" in caught.value.message


def test_unknown_model_gets_404(sim: Served) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client(sim).chat.completions.create(model="gpt-9", messages=USER, max_tokens=1)
    assert "gpt-9" in caught.value.message


def test_unknown_route_gets_404_and_wrong_method_405(sim: Served) -> None:
    assert _error(httpx.get(sim.url + "/v2/nothing"), 404)["type"] == "NotFoundError"
    assert _error(httpx.get(sim.v1 + "/completions"), 405)["type"] == "MethodNotAllowedError"
    assert _error(httpx.post(sim.url + "/health"), 405)["code"] == 405


def test_admin_endpoint_is_off_by_default(sim: Served) -> None:
    _error(httpx.post(sim.url + "/admin/faults", json={"unhealthy": True}), 404)
    assert httpx.get(sim.url + "/health").status_code == 200


# --- disconnects and time ----------------------------------------------------------------------


def _running(sim: Served) -> float:
    return sim.sample("vllm:num_requests_running")


def _wait_for(predicate: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(stream: bool) -> None:
    with serve(SimEngineConfig(time_scale=1, max_model_len=4096)) as sim:
        body = {"model": MODEL, "prompt": "long", "max_tokens": 3000, "ignore_eos": True}
        if stream:
            with httpx.stream("POST", sim.v1 + "/completions", json={**body, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)
                assert _running(sim) == 1
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(sim.v1 + "/completions", json=body, timeout=0.3)
        assert _wait_for(lambda: _running(sim) == 0)
        assert (
            sim.sample(
                "vllm:request_success", "vllm:request_success_total", finished_reason="abort"
            )
            == 1
        )


def test_time_scale_runs_modelled_time_faster() -> None:
    scale = 20.0
    with serve(SimEngineConfig(time_scale=scale, max_model_len=4096)) as sim:
        started = time.monotonic()
        client(sim).completions.create(
            model=MODEL, prompt="time", max_tokens=100, extra_body={"ignore_eos": True}
        )
        real = time.monotonic() - started
        modelled = sim.sample(
            "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum"
        )
    assert modelled > 0.5  # 100 decode steps of an 8B model on an H100
    assert real >= 0.9 * modelled / scale
    assert real < modelled / scale + 0.5
