"""The gateway and the local runtime against two real vLLM replicas (``make test-vllm``).

vLLM's CPU build serves a tiny random Llama made at test time (tests/real_vllm/tiny_model.py)
under ``gpufleet up``; everything goes through the gateway with the official ``openai``
client. Skipped where vLLM is not installed (the ordinary ``make test`` environment).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test-vllm` only")

from gpufleet.fleet import read_engine_metrics
from tests.real_vllm.fleet import (
    MODEL,
    STARTUP_BUDGET_S,
    RunningFleet,
    alive,
    sample,
    vllm_fleet,
)

SHARED = (
    "You are the operator's assistant for a fleet of inference replicas. "
    "The quick brown fox jumps over the lazy dog. A fleet of replicas serves the model "
    "behind one gateway. Prefix caching keeps the key and value blocks of a shared prompt. "
) * 4
"""A system prompt several KV blocks long (vLLM's CPU block is 128 tokens)."""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    with vllm_fleet(tmp_path_factory.mktemp("vllm")) as running:
        yield running
    assert running.process.returncode == 0, running.output()
    assert "stopped" in running.output()
    assert not any(alive(pid) for pid in running.pids.values())


@pytest.fixture
def client(fleet: RunningFleet) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=fleet.base + "/v1", api_key="none", max_retries=0) as c:
        yield c


def test_chat_and_completion(client: openai.OpenAI) -> None:
    models = [m.id for m in client.models.list().data]
    assert models == [MODEL]
    completion = client.completions.create(
        model=MODEL, prompt="The router sends", max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert completion.model == MODEL
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 6
    assert completion.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello, how can I help you today?"}],
        max_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None
    assert chat.usage.completion_tokens == 5


def test_streaming(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tokens stream back one chunk at a time."}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    deltas = [c for c in chunks if c.choices and c.choices[0].delta.content is not None]
    assert len(deltas) >= 2  # streamed, not one body
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_responses_and_tokenize_pass_through(fleet: RunningFleet, client: openai.OpenAI) -> None:
    """vLLM's Responses API (whole and streamed) and its ``/tokenize`` and ``/detokenize``
    answer through the gateway as they do on a replica."""
    response = client.responses.create(model=MODEL, input="The router sends", max_output_tokens=6)
    assert response.status in ("completed", "incomplete"), response  # incomplete: at the cap
    if response.status == "incomplete":
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens", response
    assert response.usage is not None
    assert 0 < response.usage.output_tokens <= 6
    events = list(
        client.responses.create(
            model=MODEL, input="Tokens stream back.", max_output_tokens=6, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created", kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert any(k == "response.output_text.delta" for k in kinds), kinds
    text = "The router sends"
    tokenized = httpx.post(
        fleet.base + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=30
    )
    assert tokenized.status_code == 200, tokenized.text
    tokens = tokenized.json()["tokens"]
    direct = httpx.post(
        next(iter(fleet.replicas.values())) + "/tokenize",
        json={"model": MODEL, "prompt": text},
        timeout=30,
    ).json()
    assert tokens == direct["tokens"]
    assert tokenized.json()["count"] == len(tokens)
    back = httpx.post(
        fleet.base + "/detokenize", json={"model": MODEL, "tokens": tokens}, timeout=30
    )
    assert back.status_code == 200, back.text
    assert text in back.json()["prompt"]


def test_the_gateway_reads_the_real_metrics(fleet: RunningFleet, client: openai.OpenAI) -> None:
    for name, url in fleet.replicas.items():
        page = httpx.get(url + "/metrics", timeout=10).text
        read = read_engine_metrics(page)
        assert read is not None, name
        assert {"vllm:kv_cache_usage_perc", "vllm:num_requests_running"} <= read.names
        assert read.prefix_queries is not None
    client.completions.create(model=MODEL, prompt=SHARED, max_tokens=2)
    # the scraper (every 200 ms) published each replica's KV usage and queue as gauges
    deadline = time.monotonic() + 10
    while True:
        found = {
            name: fleet.gateway_metric("gpufleet:gateway_replica_kv_cache_usage", replica=name)
            for name in fleet.replicas
        }
        if all(value is not None for value in found.values()):
            break
        assert time.monotonic() < deadline, found
        time.sleep(0.2)
    assert all(0.0 <= value <= 1.0 for value in found.values() if value is not None)


def _hits(fleet: RunningFleet) -> dict[str, float]:
    hits = {}
    for name, url in fleet.replicas.items():
        read = read_engine_metrics(httpx.get(url + "/metrics", timeout=10).text)
        assert read is not None
        assert read.prefix_hits is not None
        hits[name] = read.prefix_hits
    return hits


def _attempts(fleet: RunningFleet) -> dict[str, float]:
    return {
        name: fleet.gateway_metric("gpufleet:gateway_upstream_attempts_total", replica=name) or 0
        for name in fleet.replicas
    }


def test_a_repeated_prefix_goes_to_one_replica_and_hits_its_cache(
    fleet: RunningFleet, client: openai.OpenAI
) -> None:
    hits, attempts = _hits(fleet), _attempts(fleet)
    for question in range(6):
        client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": SHARED},
                {"role": "user", "content": f"Question {question}: where is my request?"},
            ],
            max_tokens=2,
        )
    served = {n: _attempts(fleet)[n] - attempts[n] for n in fleet.replicas}
    cached = {n: _hits(fleet)[n] - hits[n] for n in fleet.replicas}
    chosen = max(served, key=lambda n: served[n])
    assert served[chosen] == 6, served  # every request on one replica
    # ... which found the shared blocks in its cache (vLLM's own counter) from the 2nd on
    assert cached[chosen] >= 5 * 128, cached
    assert all(cached[n] == 0 for n in fleet.replicas if n != chosen), cached


def test_a_killed_replica_is_ejected_and_restarted(
    fleet: RunningFleet, client: openai.OpenAI
) -> None:
    victim = sorted(fleet.pids)[-1]
    os.kill(fleet.pids[victim], signal.SIGKILL)
    # every request still succeeds: a refused connection is retried on the other replica
    for i in range(10):
        reply = client.completions.create(model=MODEL, prompt=f"{i} {SHARED[i:]}", max_tokens=2)
        assert reply.choices
    seen: set[str] = set()
    deadline = time.monotonic() + STARTUP_BUDGET_S
    while True:
        page = httpx.get(fleet.base + "/metrics", timeout=10).text
        for line in page.splitlines():
            state = line.startswith("gpufleet:gateway_replica_state{")
            if state and f'"{victim}"' in line and line.endswith(" 1.0"):
                seen.add(line.split('state="')[1].split('"')[0])
        restarted = _value(page, "gpufleet:runtime_replica_restarts_total", pool=MODEL)
        ready = _value(page, "gpufleet:runtime_ready_replicas", pool=MODEL)
        if restarted == 1 and ready == 2 and "ready" in seen and len(seen) > 1:
            break
        assert time.monotonic() < deadline, (seen, restarted, ready, fleet.output())
        time.sleep(0.1)
    assert seen - {"ready"}, seen  # taken out of routing before it came back
    assert not alive(fleet.pids[victim])
    log = Path(fleet.run_dir / f"{victim}.log").read_text(errors="replace")
    assert "launch 2:" in log  # the runtime started it again, same log file
    # and it serves again: a request with a prefix of its own lands somewhere and succeeds
    reply = client.completions.create(model=MODEL, prompt="after the restart", max_tokens=2)
    assert reply.choices


def _value(page: str, name: str, **labels: str) -> float | None:
    return sample(page, name, **labels)


RESUME_TOKENS = 768
"""Most of the context (``max_model_len`` 1,024): seconds of generation on the tiny model
here, so the cut lands while the replica still generates."""
RESUME_TRIALS = 3
"""The cut comes with the client's first token ids: vLLM's API server can hand over tens of
tokens in one chunk when it lags, and a client that waited for more could find the whole
answer already sent (in the sockets' buffers), with nothing left to cut."""
TRIES = 3
"""Attempts a trial has to land its cut. About one attempt in ten comes back whole with no
resume counted although the replica the header names was SIGKILLed at the first ids, a
fraction of a second into a ~3 s stream (streams are incremental here: first ids after
0.02-0.3 s). Why is not known yet (issue 14's closing note); such an attempt cut nothing,
so it is run again rather than counted either way, and what it saw is printed."""


def test_a_stream_cut_by_a_kill_resumes_with_no_duplicate_and_no_gap(
    fleet: RunningFleet, client: openai.OpenAI
) -> None:
    """The issue's bar on real engines: a completions stream (temperature 0, token ids
    asked for) whose replica is SIGKILLed mid-way goes on on the other replica, resent as
    the prompt's ids plus the ids sent; the client sees one stream of exactly
    ``max_tokens`` ids whose part before the cut is what it was sent. The victim is the
    replica the gateway names in the stream's ``x-gpufleet-replica`` header. How often the
    whole answer equals an uninterrupted run's is printed (a random model's near-tie logits
    can flip one token when the batch or the cache differs)."""
    equal = 0
    for trial in range(RESUME_TRIALS):
        for attempt in range(TRIES):
            outcome = _cut_trial(fleet, client, f"Trial {trial}.{attempt}: ")
            if outcome is None:
                continue
            equal += outcome
            break
        else:
            raise AssertionError(f"trial {trial}: no cut landed in {TRIES} tries")
    print(f"resumed streams equal to an uninterrupted run: {equal} of {RESUME_TRIALS}")
    _wait_ready(fleet, 2)  # leave the fleet whole


def _cut_trial(fleet: RunningFleet, client: openai.OpenAI, label: str) -> bool | None:
    """One reference stream and one cut by a kill of its replica: whether the resumed
    answer equals the reference (``None``: nothing was cut, see ``TRIES``). Asserts no
    duplicate and no gap."""
    resumes = "gpufleet:gateway_stream_resumes_total"
    _wait_ready(fleet, 2)
    prompt = f"{label}{SHARED[:200]}"
    began = time.monotonic()
    reference, _, _ = _stream_ids(client, prompt)
    took = time.monotonic() - began
    assert len(reference) == RESUME_TOKENS, (len(reference), took)
    pids = {name: _pid_of(fleet, name) for name in fleet.replicas}
    before = fleet.gateway_metric(resumes, model=MODEL, outcome="resumed") or 0.0
    ids, usage, (victim, cut) = _stream_ids(client, prompt, kill=pids)
    assert cut, "no token ids came"
    assert len(ids) == RESUME_TOKENS, (label, len(ids))  # no duplicate, no gap
    assert ids[:cut] == reference[:cut], label  # what was sent, as sent
    assert usage is not None
    assert usage.completion_tokens == RESUME_TOKENS, usage
    after = fleet.gateway_metric(resumes, model=MODEL, outcome="resumed") or 0.0
    what = f"{label}uninterrupted in {took:.2f} s; kill of {victim} (pid {pids[victim]}) "
    if after == before:
        gone = not alive(pids[victim])
        print(what + f"after {cut} ids cut nothing (process gone after the kill: {gone}; "
              f"replicas' pids {pids})")  # fmt: skip
        return None
    assert after == before + 1, (label, before, after)  # cut once, and went on
    print(what + f"after {cut} ids; equal to uninterrupted: {ids == reference}")
    return ids == reference


def _stream_ids(
    client: openai.OpenAI, prompt: str, *, kill: dict[str, int] | None = None
) -> tuple[list[int], Any, tuple[str, int]]:
    """A completions stream's generated token ids, its usage, and the replica that served
    its first byte with the ids the client had when it was killed (0: not killed).
    ``kill``: each replica's process; the serving one's whole process group is SIGKILLed
    when the first ids come, as in a crash of the replica (the runtime starts each replica
    as one group: vLLM's API server and its engine core)."""
    ids: list[int] = []
    usage, cut = None, 0
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=RESUME_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    served = raw.headers["x-gpufleet-replica"]
    for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            ids.extend((choice.model_extra or {}).get("token_ids") or ())
        if kill is not None and not cut and ids:
            os.killpg(kill[served], signal.SIGKILL)
            cut = len(ids)
    return ids, usage, (served, cut)


def _pid_of(fleet: RunningFleet, replica: str) -> int:
    """The process serving ``replica`` now: the child of ``gpufleet up`` started with the
    port of the replica's last launch (a restart takes a new port and pid; the runtime
    writes each launch's command line into the replica's log, just before it starts the
    process: a restart under way is waited for)."""
    deadline = time.monotonic() + STARTUP_BUDGET_S
    while (pid := _launched(fleet, replica)) is None:
        assert time.monotonic() < deadline, f"no process of {replica} on its last port"
        time.sleep(0.1)
    return pid


def _launched(fleet: RunningFleet, replica: str) -> int | None:
    """The child of ``gpufleet up`` with the port of ``replica``'s last launch, if it runs
    (and has exec'd: a child still forking shows its parent's command line)."""
    log = (fleet.run_dir / f"{replica}.log").read_text(errors="replace")
    launches = re.findall(r"--- gpufleet: launch \d+: .*--port (\d+)", log)
    assert launches, log[-2000:]
    port = launches[-1]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == fleet.process.pid and port.encode() in argv:
            return int(entry.name)
    return None


def _wait_ready(fleet: RunningFleet, count: int) -> None:
    deadline = time.monotonic() + STARTUP_BUDGET_S
    while httpx.get(fleet.base + "/ready", timeout=10).json()["routable"][MODEL] != count:
        assert time.monotonic() < deadline, fleet.output()
        time.sleep(0.2)
