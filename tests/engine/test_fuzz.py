"""Nothing a client sends crashes the sim engine or hangs a request (Hypothesis, in-process ASGI).

Bodies are random JSON, random bytes, and valid requests with fields replaced by random JSON.
Every answer must be 200 or a vLLM-shaped error with a 4xx status, within a deadline, and
the engine must end up idle (no request left running or waiting).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette

from gpufleet.engine.server import SimEngine, SimEngineConfig, create_app

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "ignore_eos", "n",
    "stop", "stream", "stream_options", "user", "temperature", "top_p", "priority", "seed",
    "input", "encoding_format", "dimensions", "instructions", "max_output_tokens", "tokens",
    "add_special_tokens", "add_generation_prompt", "return_token_strs", "background",
    "lora_name", "lora_path", "load_inplace",
]  # fmt: skip
VALID = {
    "/v1/chat/completions": {
        "model": "llama-3.1-8b",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4,
        "n": 2,
    },
    "/v1/completions": {"model": "llama-3.1-8b", "prompt": "hello there", "max_tokens": 4},
    "/v1/embeddings": {"model": "llama-3.1-8b", "input": ["hello there", "again"]},
    "/v1/responses": {"model": "llama-3.1-8b", "input": "hello there", "max_output_tokens": 4},
    "/tokenize": {"model": "llama-3.1-8b", "prompt": "hello there"},
    "/detokenize": {"model": "llama-3.1-8b", "tokens": [1, 2, 3]},
    "/v1/load_lora_adapter": {"lora_name": "chat", "lora_path": "/adapters/chat"},
    "/v1/unload_lora_adapter": {"lora_name": "chat"},
}


@st.composite
def mutated(draw: st.DrawFn) -> dict[str, Any]:
    path = draw(st.sampled_from(sorted(VALID)))
    body = dict(VALID[path])
    if "model" in body and draw(st.booleans()):
        body["model"] = "sql"  # the LoRA adapter the engine starts with
    for field in draw(st.lists(st.sampled_from(FIELDS), max_size=4)):
        body[field] = draw(JSON)
    if draw(st.booleans()):
        body["stream"] = True
    return {"path": path, "body": json.dumps(body).encode()}


@st.composite
def raw(draw: st.DrawFn) -> dict[str, Any]:
    path = draw(st.sampled_from([*sorted(VALID), "/v1/models", "/health", "/admin/faults"]))
    content = draw(st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode()))
    return {"path": path, "body": content}


@pytest_asyncio.fixture
async def app() -> AsyncIterator[Starlette]:
    config = SimEngineConfig(
        time_scale=10_000,
        max_model_len=256,
        num_gpu_blocks_override=64,
        enable_lora=True,
        allow_runtime_lora_updating=True,
        lora_modules=({"name": "sql", "path": "/adapters/sql"},),
    )
    application = create_app(config)
    async with application.router.lifespan_context(application):
        yield application


async def _check(app: Starlette, case: dict[str, Any]) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
        async with asyncio.timeout(10):
            response = await client.post(case["path"], content=case["body"])
    if response.status_code == 200:
        return
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == response.status_code


@pytest.mark.asyncio
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=mutated() | raw())
async def test_random_bodies_get_an_answer_and_never_crash(
    app: Starlette, case: dict[str, Any]
) -> None:
    await _check(app, case)
    engine: SimEngine = app.state.engine
    stats = engine.model.stats()
    assert stats.num_running == 0
    assert stats.num_waiting == 0
    assert engine.metrics.shell.lora_held == 0  # no request left waiting for an adapter
    assert engine.loop.dead is None


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
)
async def test_a_dead_engine_loop_answers_500_in_vllms_shape(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the model stops the loop: the request in flight and every later one get a 500
    body, never a hang or a bare traceback."""
    application = create_app(SimEngineConfig(time_scale=10_000, max_model_len=256))
    engine: SimEngine = application.state.engine

    def bug(now: float) -> None:
        raise ZeroDivisionError("a bug in the model")

    monkeypatch.setattr(engine.model, "plan_step", bug)
    async with application.router.lifespan_context(application):
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:
            for _ in range(2):  # in flight when the loop dies, then after it
                async with asyncio.timeout(10):
                    response = await client.post(path, content=json.dumps(VALID[path]))
                assert response.status_code == 500, response.text
                error = response.json()["error"]
                assert (error["type"], error["code"]) == ("InternalServerError", 500)
    assert isinstance(engine.loop.dead, ZeroDivisionError)
