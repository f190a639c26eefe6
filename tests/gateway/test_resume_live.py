"""L4: streams cut by a replica's SIGKILL resume on the other replica, spliced into the same
client stream (docs/gateway.md, "Resuming a stream"): two sim engine processes, the gateway on
its own server (the relay fast path), 16 official ``openai`` clients streaming 256 tokens."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from gpufleet.engine import WORDS
from gpufleet.engine.model import ReplicaModel
from gpufleet.engine.server import SimEngineConfig
from tests.gateway.conftest import MODEL, fleet, serve_gateway
from tests.gateway.tenants import serve_tenant_gateway, tenant_fleet
from tests.up_process import sim_engine_child

MAX_TOKENS = 256
CLIENTS = 16
SEED = 7
ENGINE = ("--time-scale", "1", "--max-model-len", "4096", "--seed", str(SEED))


@dataclass
class Stream:
    chat: bool
    words: list[str] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    usage: Any = None
    finish: str | None = None
    error: BaseException | None = None


def run(client: openai.OpenAI, stream: Stream, i: int) -> None:
    common: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }
    try:
        if stream.chat:
            messages = [{"role": "user", "content": f"Tell me story number {i}."}]
            chunks = client.chat.completions.create(messages=messages, **common)
        else:
            chunks = client.completions.create(prompt=f"Story number {i}:", **common)
        for chunk in chunks:
            stream.ids.add(chunk.id)
            if chunk.usage is not None:
                stream.usage = chunk.usage
            for choice in chunk.choices:
                text = choice.delta.content if stream.chat else choice.text  # type: ignore[union-attr]
                stream.words += (text or "").split()
                stream.finish = choice.finish_reason or stream.finish
    except BaseException as error:
        stream.error = error


def a_window_of_the_answer(words: list[str], filler: list[int]) -> bool:
    """Whether ``words`` are consecutive tokens of the engines' generated sequence: what an
    uninterrupted run gives (a duplicate or a gap at the splice breaks the window)."""
    n = len(WORDS)
    first = [WORDS.index(w) for w in words[:8]]
    size = len(filler)
    for start in range(size):
        if all(filler[(start + j) % size] % n == first[j] for j in range(8)):
            return all(
                WORDS[filler[(start + j) % size] % n] == word for j, word in enumerate(words)
            )
    return False


def test_streams_cut_by_a_sigkill_resume_on_the_other_replica_token_for_token() -> None:
    config = fleet(
        routing="least_request",
        health={"active": {"interval": 0.2}},
        gateway={"seed": SEED},
    )
    filler = ReplicaModel(SimEngineConfig(seed=SEED).replica_config()).filler.ids
    with (
        sim_engine_child(*ENGINE) as (a, doomed),
        sim_engine_child(*ENGINE) as (b, _),
        serve_gateway(config, [a, b], server="own") as gw,
        openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0, timeout=60) as client,
    ):
        streams = [Stream(chat=i % 2 == 1) for i in range(CLIENTS)]
        threads = [threading.Thread(target=run, args=(client, s, i)) for i, s in enumerate(streams)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while min(len(s.words) for s in streams) < 20:  # every stream well under way
            assert time.monotonic() < deadline, [len(s.words) for s in streams]
            time.sleep(0.005)
        assert max(len(s.words) for s in streams) < MAX_TOKENS  # none finished: mid-stream
        os.kill(doomed.pid, signal.SIGKILL)
        for t in threads:
            t.join(timeout=60)
        resumed = gw.sample("gpufleet:gateway_stream_resumes_total", model=MODEL, outcome="resumed")
        broken = gw.sample("gpufleet:gateway_stream_resumes_total", model=MODEL, outcome="broken")
        resent = gw.sample("gpufleet:gateway_resumed_prompt_tokens_total", model=MODEL)
    print(f"resumed {resumed:.0f}, broken {broken:.0f}, prompt tokens resent {resent:.0f}")
    assert [s.error for s in streams] == [None] * CLIENTS  # 0 client-visible errors
    assert broken == 0
    assert resumed >= 1  # the killed replica's streams (about half)
    assert resent > 0
    for s in streams:
        assert len(s.ids) == 1  # one stream id from the first event to the last
        assert s.finish == "length"
        assert s.usage is not None
        assert s.usage.completion_tokens == MAX_TOKENS
        assert s.usage.total_tokens == s.usage.prompt_tokens + MAX_TOKENS
        assert len(s.words) == MAX_TOKENS
        assert a_window_of_the_answer(s.words, filler), "a duplicate or a gap at the splice"
    # every prompt counted once: each kind's prompts are as long as one another's
    assert len({s.usage.prompt_tokens for s in streams if s.chat}) <= 2
    assert len({s.usage.prompt_tokens for s in streams if not s.chat}) <= 2


def test_a_metered_stream_resumes_and_its_ledger_row_counts_the_answer_once(
    tmp_path: Path,
) -> None:
    """Auth on: streams are read chunk by chunk (their usage metered), not relayed."""
    config = tenant_fleet(gateway={"seed": SEED})
    with (
        sim_engine_child(*ENGINE) as (a, doomed),
        sim_engine_child(*ENGINE) as (b, _),
        serve_tenant_gateway(tmp_path, config, [a, b]) as gw,
    ):
        _, key = gw.store.create_key("metered")
        time.sleep(0.5)  # the tenancy snapshot refreshes every 0.2 s
        streams = [Stream(chat=i % 2 == 1) for i in range(4)]
        with openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0, timeout=60) as client:
            threads = [
                threading.Thread(target=run, args=(client, s, i)) for i, s in enumerate(streams)
            ]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while min(len(s.words) for s in streams) < 20:
                assert time.monotonic() < deadline, [len(s.words) for s in streams]
                time.sleep(0.005)
            os.kill(doomed.pid, signal.SIGKILL)
            for t in threads:
                t.join(timeout=60)
        resumed = gw.sample("gpufleet:gateway_stream_resumes_total", model=MODEL, outcome="resumed")
        gw.flush()
        (row,) = gw.store.usage(tenant="metered")
    assert [s.error for s in streams] == [None] * len(streams)
    assert resumed >= 1
    assert all(s.usage.completion_tokens == MAX_TOKENS for s in streams)
    assert row.requests == len(streams)
    assert row.errors == 0
    assert row.completion_tokens == MAX_TOKENS * len(streams)  # every token once
    assert row.prompt_tokens == sum(s.usage.prompt_tokens for s in streams)  # every prompt once
