"""A batch's lines under crashes and contention, on SQLite and PostgreSQL.

Real child processes claim and record lines. One is killed with SIGKILL mid-run: every line
it acknowledged is recorded once, the rest are pending, and a new worker finishes the batch
with each line once in the output. Several claim at once: each line goes to exactly one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gpufleet.store import LineResult, Store
from tests.store.batches import T0, jsonl, started

WORKER = """
import os, sys, time
from gpufleet.store import LineResult, Store

url, batch_id, worker, record, limit, go = sys.argv[1:7]
store = Store.open(url)
print("ready", flush=True)
while go and not os.path.exists(go):  # start together: contention, not turns
    time.sleep(0.005)
while claims := store.batch_lines.claim(batch_id, worker=worker, now=1e6, limit=int(limit)):
    for claim in claims:
        if record == "record":
            result = LineResult.response(200, {"line": claim.line, "by": worker})
            store.batch_lines.record(batch_id, claim.line, result, now=1e6)
        print(claim.line, flush=True)
print("end", flush=True)
"""


def worker(
    url: str, batch_id: str, name: str, *, record: bool, limit: int, go: str = ""
) -> subprocess.Popen[str]:
    """A child that claims (and records) lines; with ``go``, it waits for that file first.
    Its first line of output is ``ready``."""
    args = [url, batch_id, name, "record" if record else "claim", str(limit), go]
    child = subprocess.Popen(
        [sys.executable, "-c", WORKER, *args], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    return child


def test_a_worker_killed_mid_batch_loses_no_line_and_runs_none_twice(db_url: str) -> None:
    store = Store.open(db_url)
    batch = started(store, 1000)
    child = worker(db_url, batch.id, "doomed", record=True, limit=5)
    assert child.stdout is not None
    acknowledged: list[int] = []
    deadline = time.monotonic() + 60
    while len(acknowledged) < 300 and time.monotonic() < deadline:
        acknowledged.append(int(child.stdout.readline()))
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    acknowledged += [int(line) for line in child.stdout if line.strip().isdigit()]
    child.stdout.close()
    store.close()

    store = Store.open(db_url)  # as a restarted gateway would
    pending = store.batch_lines.pending(batch.id)
    recorded = sorted(set(range(1, 1001)) - set(pending))
    assert len(acknowledged) >= 300
    assert set(acknowledged) <= set(recorded)
    assert len(recorded) < 1000, "the child finished before it was killed"
    resumed = store.batch_lines.claim(batch.id, worker="next", now=T0 + 10_000, limit=2000)
    assert [c.line for c in resumed] == pending  # the rest, once each, in input order
    for c in resumed:
        result = LineResult.response(200, {"line": c.line, "by": "next"})
        assert store.batch_lines.record(batch.id, c.line, result, now=T0 + 10_001)
    done = store.batches.advance(batch.id, now=T0 + 10_002)
    assert done is not None
    assert done.status == "completed"
    output = jsonl(store, done.output_file_id)
    assert [o["custom_id"] for o in output] == [f"r-{i}" for i in range(1000)]
    by = {o["response"]["body"]["line"]: o["response"]["body"]["by"] for o in output}
    assert {line for line, who in by.items() if who == "doomed"} == set(recorded)
    store.close()


def test_lines_claimed_by_several_processes_go_to_exactly_one(db_url: str, tmp_path: Path) -> None:
    store = Store.open(db_url)
    try:
        batch = started(store, 400)
        go = tmp_path / "go"
        children = [
            worker(db_url, batch.id, f"w{i}", record=False, limit=7, go=str(go)) for i in range(4)
        ]
        go.touch()  # every child is connected and waiting: they claim at once
        claimed: dict[str, list[int]] = {}
        for i, child in enumerate(children):
            out, _ = child.communicate(timeout=120)
            lines = out.split()
            assert lines[-1] == "end"
            claimed[f"w{i}"] = [int(x) for x in lines[:-1]]
        every = [line for lines in claimed.values() for line in lines]
        assert sorted(every) == list(range(1, 401))
        assert sum(1 for lines in claimed.values() if lines) >= 2, claimed
    finally:
        store.close()


def test_lines_claimed_by_several_threads_go_to_exactly_one(db: Store) -> None:
    batch = started(db, 300)
    claimed: dict[int, list[int]] = {i: [] for i in range(6)}
    barrier = threading.Barrier(6)

    def claim(i: int) -> None:
        barrier.wait()
        while claims := db.batch_lines.claim(batch.id, worker=f"t{i}", now=T0, limit=3):
            claimed[i] += [c.line for c in claims]
            for c in claims:
                db.batch_lines.record(batch.id, c.line, LineResult.response(200, {}), now=T0)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [line for lines in claimed.values() for line in lines]
    assert sorted(every) == list(range(1, 301))
    assert db.batch_lines.pending(batch.id) == []
