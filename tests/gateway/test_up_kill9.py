"""Durability as a user would test it: ``gpufleet up --auth`` under load, ``kill -9``, restart;
the ledger holds every request a client saw complete."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import openai

from gpufleet.store import Store
from tests.up_process import start_up, wait_ready

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
