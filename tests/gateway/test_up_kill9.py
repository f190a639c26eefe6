"""``kill -9`` under load, as a user would try it: of the gateway (``gpufleet up --auth``,
restarted: the ledger holds every request a client saw complete), and of a replica (the
gateway retries what was in flight on it: no client sees an error)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import openai

from gpufleet.store import Store
from tests.up_process import replica_pids, start_up, stop, wait_ready, wait_routable

FLEET = """
models:
  - name: llama-3.1-8b
    replicas: 1
    args: ["--time-scale", "100", "--max-model-len", "2048"]
    health: {active: {interval: 0.2}}
"""


def _start(tmp: Path, env: dict[str, str], name: str) -> tuple[subprocess.Popen[bytes], str]:
    process, base = start_up(
        tmp / "fleet.yaml", tmp / f"{name}.out", "--auth", run_dir=tmp / name, env=env
    )
    wait_ready(base, timeout=30)
    return process, base


def test_kill_9_under_load_loses_no_completed_request(tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text(FLEET)
    url = f"sqlite:///{tmp_path / 'home' / 'gpufleet.db'}"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "GPUFLEET_HOME": str(tmp_path / "home"),
        "GPUFLEET_DB_URL": url,
    }
    (tmp_path / "home").mkdir()
    store = Store.open(url)
    _, key = store.create_key("load")
    process, base = _start(tmp_path, env, "first")
    completed: list[str] = []
    lock = threading.Lock()

    def send(worker: int) -> None:
        with openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0) as client:
            for i in range(10_000):
                rid = f"w{worker}-{i}"
                try:
                    client.completions.create(
                        model="llama-3.1-8b", prompt="Hello", max_tokens=2,
                        extra_headers={"x-request-id": rid},
                    )  # fmt: skip
                except openai.APIError:
                    return
                with lock:
                    completed.append(rid)

    threads = [threading.Thread(target=send, args=(w,)) for w in range(4)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while len(completed) < 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        for t in threads:
            t.join(timeout=10)
        assert len(completed) >= 200
        before = len(set(completed) & store.usage_ids())
        print(f"completed {len(completed)}, in the database at the kill {before}")
        # restart: the new gateway replays the journal the killed one left
        process, base = _start(tmp_path, env, "second")
        ledgered = store.usage_ids()
        missing = set(completed) - ledgered
        assert not missing, f"{len(missing)} of {len(completed)} completed requests lost"
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
        store.close()


TWO = """
models:
  - name: llama-3.1-8b
    replicas: 2
    args: ["--time-scale", "0.25", "--max-model-len", "2048"]
    health: {active: {interval: 0.2}, outlier: {base_ejection_time: 0.5}}
"""
"""Two sim replicas, at a quarter of the modelled speed (a chat takes ~0.5 s, so each has
some eight requests in flight, and the machine has the CPU to restart one quickly); a
short ejection, so a restarted replica is not kept out after its crash."""
CLIENTS = 16
KILLS = 10


def _kill_and_wait(parent: int, base: str) -> None:
    """SIGKILL the longer-lived engine process; return once the runtime has replaced it and
    the gateway routes to both again. (Waiting only for two routable replicas raced: the
    gateway may not have seen the death yet, and the next kill then took the survivor.)"""
    victim = replica_pids(parent)[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while len(pids := replica_pids(parent)) < 2 or victim in pids:
        assert time.monotonic() < deadline, "the killed replica was not restarted"
        time.sleep(0.02)
    wait_routable(base, "llama-3.1-8b", 2)


def _served_more(count: Callable[[], int], before: int, kill: int) -> None:
    """The fleet goes on serving (within seconds, on a loaded machine)."""
    deadline = time.monotonic() + 10
    while count() <= before:
        assert time.monotonic() < deadline, f"kill {kill}: nothing was served"
        time.sleep(0.02)


def test_kill_9_of_a_replica_under_load_fails_no_request(tmp_path: Path) -> None:
    """Issue 14: 16 clients (the official client, no client retries) send chats to two
    replicas; one replica is SIGKILLed, the runtime restarts it, then the other is killed,
    ten kills in all. The requests in flight on the killed replica are retried on the
    survivor without the retry budget (a gone replica is no overload): none fails."""
    (tmp_path / "fleet.yaml").write_text(TWO)
    process, base = start_up(tmp_path / "fleet.yaml", tmp_path / "up.out", run_dir=tmp_path / "run")
    done = threading.Event()
    lock = threading.Lock()
    served = 0
    failed: Counter[str] = Counter()

    def send(worker: int) -> None:
        nonlocal served
        with openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as client:
            i = 0
            while not done.is_set():
                i += 1
                try:
                    client.chat.completions.create(
                        model="llama-3.1-8b",
                        messages=[{"role": "user", "content": f"client {worker}, chat {i}"}],
                        max_tokens=16,
                    )
                except openai.APIError as error:
                    with lock:
                        failed[str(error)[:160]] += 1
                else:
                    with lock:
                        served += 1

    threads = [threading.Thread(target=send, args=(w,)) for w in range(CLIENTS)]
    try:
        wait_routable(base, "llama-3.1-8b", 2)
        for t in threads:
            t.start()
        time.sleep(0.5)
        for kill in range(KILLS):
            before = served
            _kill_and_wait(process.pid, base)
            _served_more(lambda: served, before, kill)
        done.set()
        for t in threads:
            t.join(timeout=30)
        metrics = httpx.get(base + "/metrics").text
    finally:
        done.set()
        stop(process)
    assert not failed, f"{sum(failed.values())} of {served} requests failed: {dict(failed)}"
    print(f"{served} requests over {KILLS} kills, none failed")
    assert served > 100 * KILLS / 10
    retried = [
        line
        for line in metrics.splitlines()
        if line.startswith('gpufleet:gateway_retries_total{model="llama-3.1-8b",outcome="connect')
    ]
    assert retried, "no kill caught a request in flight"
    assert float(retried[0].split()[-1]) >= KILLS


def test_kill_9_of_a_replica_under_embeddings_and_responses_fails_no_request(
    tmp_path: Path,
) -> None:
    """Issue 19: the routes beside chat take the same path through the gateway. 16 clients
    (the official client, no client retries, auth on) mix embeddings and Responses API calls
    on two replicas; one replica is SIGKILLed, restarted, then the other, three kills in all:
    none fails, and every request a client saw complete is in the ledger with its tokens.
    (Whole answers: a Responses API stream is never resumed, so one cut mid-way fails.)"""
    (tmp_path / "fleet.yaml").write_text(TWO)
    home = tmp_path / "home"
    home.mkdir()
    url = f"sqlite:///{home / 'gpufleet.db'}"
    env = {**os.environ, "GPUFLEET_HOME": str(home), "GPUFLEET_DB_URL": url}
    store = Store.open(url)
    _, key = store.create_key("mixed")
    process, base = start_up(
        tmp_path / "fleet.yaml", tmp_path / "up.out", "--auth", run_dir=tmp_path / "run", env=env
    )
    done = threading.Event()
    lock = threading.Lock()
    served: dict[str, int] = {}  # request id -> the tokens its answer reported
    failed: Counter[str] = Counter()

    def send(worker: int) -> None:
        with openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0) as client:
            i = 0
            while not done.is_set():
                i += 1
                rid = f"w{worker}-{i}"
                headers = {"x-request-id": rid}
                try:
                    if (worker + i) % 2:
                        embedded = client.embeddings.create(
                            model="llama-3.1-8b",
                            input=[f"client {worker}", f"request {i}"],
                            extra_headers=headers,
                        )
                        tokens = embedded.usage.prompt_tokens
                    else:
                        answer = client.responses.create(
                            model="llama-3.1-8b",
                            input=f"client {worker}, response {i}",
                            max_output_tokens=16,
                            extra_headers=headers,
                        )
                        assert answer.usage is not None
                        tokens = answer.usage.total_tokens
                except openai.APIError as error:
                    with lock:
                        failed[str(error)[:160]] += 1
                else:
                    with lock:
                        served[rid] = tokens

    threads = [threading.Thread(target=send, args=(w,)) for w in range(CLIENTS)]
    try:
        wait_ready(base, timeout=30)
        wait_routable(base, "llama-3.1-8b", 2)
        for t in threads:
            t.start()
        time.sleep(0.5)
        for kill in range(3):
            before = len(served)
            _kill_and_wait(process.pid, base)
            _served_more(lambda: len(served), before, kill)
        done.set()
        for t in threads:
            t.join(timeout=30)
        metrics = httpx.get(base + "/metrics", headers={"authorization": f"Bearer {key}"}).text
        process.send_signal(signal.SIGTERM)  # a clean stop: the journal reaches the database
        process.wait(timeout=30)
        rows = store.usage(tenant="mixed")
        ledgered = store.usage_ids()
    finally:
        done.set()
        stop(process)
        store.close()
    assert not failed, f"{sum(failed.values())} of {len(served)} requests failed: {dict(failed)}"
    print(f"{len(served)} embeddings and responses over 3 kills, none failed")
    assert len(served) > 100
    assert not set(served) - ledgered, "a served request is missing from the ledger"
    (row,) = rows
    assert (row.requests, row.errors) == (len(served), 0)
    assert row.prompt_tokens + row.completion_tokens == sum(served.values())  # as answered
    retried = [
        line
        for line in metrics.splitlines()
        if line.startswith('gpufleet:gateway_retries_total{model="llama-3.1-8b",outcome="connect')
    ]
    assert retried, "no kill caught a request in flight"
