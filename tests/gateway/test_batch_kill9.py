"""The Batch API as a user would test it: ``gpufleet up --auth`` over a sim replica, the
official ``openai`` client, 1,000 lines, ``kill -9`` mid-run, restart. The batch completes
with every ``custom_id`` once, and the ledger has exactly one row per line; then ``cancel``
on a second batch stops it with its finished lines kept."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import openai
from sqlalchemy import func, select

from gpufleet.store import Store
from gpufleet.store import _schema as schema
from tests.gateway.batches import CHAT, input_lines, jsonl, wait_ended
from tests.up_process import start_up, stop, wait_ready

FLEET = """
models:
  - name: llama-3.1-8b
    replicas: 1
    args: ["--time-scale", "20", "--max-model-len", "2048"]
    health: {active: {interval: 0.2}}
gateway:
  batch: {lease: 2, poll_interval: 0.2, lines_in_flight: 32}
"""
LINES = 1000


def _staggered(i: int) -> int:
    """Answers of 8 to 248 tokens (up to about 0.3 s at time scale 20): lines end one by
    one, so lines run at most moments."""
    return 8 + (i % 7) * 40


def _start(tmp: Path, env: dict[str, str], name: str) -> tuple[subprocess.Popen[bytes], str]:
    process, base = start_up(
        tmp / "fleet.yaml", tmp / f"{name}.out", "--auth", run_dir=tmp / name, env=env
    )
    wait_ready(base, timeout=30)
    return process, base


def _completed(client: openai.OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    return 0 if counts is None else counts.completed


def _wait_for(client: openai.OpenAI, batch_id: str, completed: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while _completed(client, batch_id) < completed:
        assert time.monotonic() < deadline, f"fewer than {completed} lines after {timeout} s"
        time.sleep(0.02)


def _wait_claimed(store: Store, batch_id: str) -> None:
    """Until the store shows lines claimed (the runner claims its next window a moment after
    the last one's lines end: a busy machine can be found in that gap)."""
    deadline = time.monotonic() + 30
    lines = schema.batch_lines.c
    while time.monotonic() < deadline:
        with store.engine.connect() as conn:
            claimed = conn.execute(
                select(func.count()).where(lines.batch_id == batch_id, lines.state == "claimed")
            ).scalar_one()
        if claimed:
            return
        time.sleep(0.005)
    raise AssertionError("no line claimed for 30 s")


def test_kill_9_mid_batch_then_restart_runs_every_line_once(tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text(FLEET)
    home = tmp_path / "home"
    home.mkdir()
    url = f"sqlite:///{home / 'gpufleet.db'}"
    env = {**os.environ, "GPUFLEET_HOME": str(home), "GPUFLEET_DB_URL": url}
    store = Store.open(url)
    _, key = store.create_key("team-a")
    began = time.monotonic()
    process, base = _start(tmp_path, env, "first")
    try:
        with openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0) as client:
            file_id = client.files.create(
                file=("in.jsonl", io.BytesIO(input_lines(LINES, max_tokens=_staggered))),
                purpose="batch",
            ).id
            batch_id = client.batches.create(
                input_file_id=file_id, endpoint=CHAT, completion_window="24h"
            ).id
            created = time.monotonic()
            _wait_for(client, batch_id, 200, timeout=60)
        _wait_claimed(store, batch_id)
        killed, killed_wall = time.monotonic(), time.time()
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        with store.engine.connect() as conn:
            lines = schema.batch_lines.c
            states = dict(
                conn.execute(
                    select(lines.state, func.count())
                    .where(lines.batch_id == batch_id)
                    .group_by(lines.state)
                ).all()
            )
            held = set(
                conn.execute(
                    select(lines.request_id).where(
                        lines.batch_id == batch_id, lines.state == "claimed"
                    )
                ).scalars()
            )
        print(f"at the kill: {states}")
        assert states.get("claimed", 0) > 0  # killed mid-line
        assert 200 <= states.get("done", 0) < LINES

        process, base = _start(tmp_path, env, "second")
        restarted = time.monotonic()
        with openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0) as client:
            done = wait_ended(client, batch_id, timeout=120)
            print(
                f"first start {created - began:.1f} s, 200 lines {killed - created:.1f} s, "
                f"restart {restarted - killed:.1f} s, the rest {time.monotonic() - restarted:.1f} s"
            )
            assert done.status == "completed", done
            assert done.request_counts is not None
            assert done.request_counts.completed == LINES
            out = jsonl(client, done.output_file_id)
            assert len(out) == LINES
            assert Counter(o["custom_id"] for o in out) == Counter(f"r-{i}" for i in range(LINES))
            assert done.error_file_id is None

            # a second batch, cancelled while it runs: its finished lines are kept
            slow = client.files.create(
                file=("slow.jsonl", io.BytesIO(input_lines(400, max_tokens=400))),
                purpose="batch",
            ).id
            second = client.batches.create(
                input_file_id=slow, endpoint=CHAT, completion_window="24h"
            ).id
            _wait_for(client, second, 10, timeout=60)
            assert client.batches.cancel(second).status == "cancelling"
            cancelled = wait_ended(client, second, timeout=60)
            assert cancelled.status == "cancelled"
            kept = jsonl(client, cancelled.output_file_id)
            ended = jsonl(client, cancelled.error_file_id)
            assert 10 <= len(kept) < 400
            assert {e["error"]["code"] for e in ended} == {"batch_cancelled"}
            assert Counter(o["custom_id"] for o in kept + ended) == Counter(
                f"r-{i}" for i in range(400)
            )
        process.send_signal(signal.SIGTERM)  # the journal's last records reach the database
        process.wait(timeout=30)

        with store.engine.connect() as conn:
            attempts = conn.execute(
                select(func.count()).where(
                    schema.batch_lines.c.batch_id == batch_id, schema.batch_lines.c.attempts > 1
                )
            ).scalar_one()
            rows = conn.execute(
                select(schema.usage.c.id, schema.usage.c.time).where(
                    schema.usage.c.id.like("batch_req_%")
                )
            ).all()
        ledger = Counter(r.id for r in rows)
        # the killed gateway's lines that had answered (their rows journaled before the kill)
        # and ran again after the restart: ledgered once, with the first answer
        twice = sum(1 for r in rows if r.id in held and r.time < killed_wall)
        print(f"lines claimed twice (the killed gateway's): {attempts}, ran twice: {twice}")
        assert attempts > 0
        ids = [o["id"] for o in out] + [o["id"] for o in kept]
        assert sorted(ledger) == sorted(ids), "one ledger row per line that answered"
        assert set(ledger.values()) == {1}
    finally:
        stop(process)
        store.close()
