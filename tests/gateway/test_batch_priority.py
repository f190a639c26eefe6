"""Batch lines carry vLLM's request ``priority`` to engines that schedule by it: two sim
engines (in-process, behind a tap that keeps the bodies they are sent), one started with
``--scheduling-policy priority`` and one with vLLM's default ``fcfs``, behind the real
gateway with auth on. A batch's lines reach the priority pool with ``priority`` 1 (after
the interactive default, 0); the fcfs pool gets them as they were written (vLLM refuses a
priority there, and so does the sim engine); interactive requests pass untouched."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai

from gpufleet.config import parse_fleet
from gpufleet.engine.server import SimEngineConfig, create_app
from gpufleet.store import TenantSettings
from tests.gateway.batches import CHAT, input_lines, serve_batch_gateway, wait_ended
from tests.gateway.conftest import serve_app
from tests.gateway.test_batch_runner import check_every_line_once, key_for, start

FAST, PLAIN = "priority-pool", "fcfs-pool"


@contextmanager
def tapped_engine(
    policy: str, seen: list[dict[str, Any]], cuts: list[int | None] | None = None
) -> Iterator[str]:
    """A sim engine serving ``llama-3.1-8b`` under both pool names' requests, with the
    scheduling ``policy``; every chat body it is sent is appended to ``seen`` first.
    ``cuts``: ``[n]``, shared by engines: the first stream any of them answers breaks after
    ``n`` body chunks (the connection cut, as a replica that dies mid-answer)."""
    cuts = cuts if cuts is not None else [None]
    engine = create_app(
        SimEngineConfig(time_scale=50.0, max_model_len=4096, scheduling_policy=policy)  # type: ignore[arg-type]
    )

    async def tap(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != CHAT:
            await engine(scope, receive, send)
            return
        messages, body, more = [], b"", True
        while more:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            more = message.get("more_body", False)
        data = json.loads(body)
        seen.append(data)
        data["model"] = "llama-3.1-8b"  # the engine serves the catalog name
        rewritten = json.dumps(data).encode()

        async def again() -> Any:
            if messages:
                messages.clear()
                return {"type": "http.request", "body": rewritten, "more_body": False}
            return await receive()

        left = cuts[0] if data.get("stream") else None
        if left is None:
            await engine(scope, again, send)
            return
        cuts[0] = None  # only the first stream

        async def cutting(message: Any) -> None:
            nonlocal left
            if message["type"] == "http.response.body":
                assert left is not None
                if left == 0:
                    raise ConnectionResetError("the tap cut this stream")
                left -= 1
            await send(message)

        await engine(scope, again, cutting)

    with serve_app(tap) as url:
        yield url


def test_batch_lines_reach_a_priority_engine_with_a_lower_priority(tmp_path: Path) -> None:
    fleet = parse_fleet(
        {
            "models": [
                {"name": FAST, "model": "llama-3.1-8b",
                 "args": ["--scheduling-policy", "priority"]},
                {"name": PLAIN, "model": "llama-3.1-8b"},
            ],
            "gateway": {"batch": {"poll_interval": 0.1, "max_backoff": 0.2}},
            "tenants": {"auth": True, "refresh_interval": 0.2},
        }
    )  # fmt: skip
    fast: list[dict[str, Any]] = []
    plain: list[dict[str, Any]] = []
    with ExitStack() as stack:
        urls = [
            stack.enter_context(tapped_engine("priority", fast)),
            stack.enter_context(tapped_engine("fcfs", plain)),
        ]
        gw = stack.enter_context(serve_batch_gateway(tmp_path, fleet, urls, pools=[FAST, PLAIN]))
        key = key_for(gw, "team", TenantSettings())
        with openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0) as client:
            for pool, n in ((FAST, 12), (PLAIN, 8)):
                batch_id = start(client, input_lines(n, model=pool, prefix="r"))
                assert wait_ended(client, batch_id).status == "completed"
                out = check_every_line_once(client, batch_id, n)
                assert {o["response"]["status_code"] for o in out} == {200}
            for pool in (FAST, PLAIN):  # interactive: the client's body as it is
                client.chat.completions.create(
                    model=pool, messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
        # a batch-class tenant's own requests: an earlier priority is raised to 1, a later
        # one kept
        batch_key = key_for(gw, "nightly", TenantSettings(priority="batch"))
        for content, priority in (("early", -5), ("late", 3)):
            answer = httpx.post(
                gw.v1 + "/chat/completions",
                headers={"authorization": f"Bearer {batch_key}"},
                json={"model": FAST, "messages": [{"role": "user", "content": content}],
                      "max_tokens": 2, "priority": priority},
            )  # fmt: skip
            assert answer.status_code == 200, answer.text
    lines = [b for b in fast if b["messages"][0]["content"].startswith("line")]
    assert len(lines) == 12
    assert {b.get("priority") for b in lines} == {1}
    assert [b.get("priority") for b in plain if b["messages"][0]["content"].startswith("line")] == [
        None
    ] * 8
    assert [b.get("priority") for b in fast if b["messages"][0]["content"] == "hi"] == [None]
    assert [b.get("priority") for b in plain if b["messages"][0]["content"] == "hi"] == [None]
    assert [b["priority"] for b in fast if b["messages"][0]["content"] == "early"] == [1]
    assert [b["priority"] for b in fast if b["messages"][0]["content"] == "late"] == [3]


def test_an_fcfs_sim_engine_refuses_a_priority_as_vllm_does() -> None:
    body = {"model": "llama-3.1-8b", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2, "priority": 1}  # fmt: skip
    with tapped_engine("fcfs", []) as url:
        answer = httpx.post(url + CHAT, json=body)
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert "Priority scheduling is not enabled" in error["message"]
        assert error["param"] == "priority"
    with tapped_engine("priority", []) as url:
        assert httpx.post(url + CHAT, json=body).status_code == 200


def test_a_batch_class_stream_resumes_with_its_engine_priority(tmp_path: Path) -> None:
    """A batch-class tenant's stream breaks after its first bytes (the engine's connection
    cut by the tap) and resumes on the pool's other replica: the resumed attempt's body
    (the prompt and what the client already has) carries ``priority`` 1 as the first did,
    and the client's stream ends whole."""
    fleet = parse_fleet(
        {
            "models": [{"name": FAST, "model": "llama-3.1-8b", "replicas": 2,
                        "args": ["--scheduling-policy", "priority"]}],
            "tenants": {"auth": True, "refresh_interval": 0.2},
        }
    )  # fmt: skip
    seen: list[dict[str, Any]] = []
    cut: list[int | None] = [3]  # the first stream either engine answers
    with ExitStack() as stack:
        urls = [
            stack.enter_context(tapped_engine("priority", seen, cut)),
            stack.enter_context(tapped_engine("priority", seen, cut)),
        ]
        gw = stack.enter_context(serve_batch_gateway(tmp_path, fleet, urls, pools=[FAST, FAST]))
        batch_key = key_for(gw, "nightly", TenantSettings(priority="batch"))
        with openai.OpenAI(base_url=gw.v1, api_key=batch_key, max_retries=0) as client:
            stream = client.chat.completions.create(
                model=FAST,
                messages=[{"role": "user", "content": "cut-me"}],
                max_tokens=40,
                stream=True,
            )
            chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(text.split()) >= 30  # the whole answer, spliced across the two replicas
    bodies = [b for b in seen if b["messages"][0]["content"] == "cut-me"]
    assert len(bodies) == 2  # the first attempt and its resume
    assert bodies[1] != bodies[0]  # the resume: the prompt and the answer so far
    assert [b.get("priority") for b in bodies] == [1, 1]
