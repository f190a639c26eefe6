"""Durability: a writer killed with SIGKILL loses no record it acknowledged.

A real child process journals records and prints each id after ``append`` returns (as the
gateway sends a response's last byte only then); the test kills it with SIGKILL mid-stream,
then a new writer replays the journal, and every acknowledged id is in the database.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpufleet.store import Store

CHILD = """
import sys, time
from gpufleet.store import Store
store = Store.open(sys.argv[1])
journal = store.journal(__import__("pathlib").Path(sys.argv[2]), flush_interval=0.02)
journal.start()
i = 0
while True:
    rid = f"req-{i}"
    journal.append("usage", {"id": rid, "request_id": rid, "time": time.time(), "tenant": "t",
        "key_id": "k", "model": "m", "replica": "m-0", "status": 200, "prompt_tokens": 1,
        "cached_tokens": 0, "completion_tokens": 1, "queue_s": 0.0, "ttft_s": 0.0,
        "e2e_s": 0.0})
    print(rid, flush=True)
    i += 1
    if i % 50 == 0:
        time.sleep(0.001)
"""


def test_sigkill_loses_no_acknowledged_record(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    journal = tmp_path / "journal"
    Store.open(url).close()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, url, str(journal)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    acknowledged: list[str] = []
    started = time.monotonic()
    while len(acknowledged) < 3000 and time.monotonic() - started < 30:
        acknowledged.append(child.stdout.readline().strip())
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    acknowledged.extend(line.strip() for line in child.stdout if line.strip())
    child.stdout.close()
    store = Store.open(url)
    in_db_before = len(store.usage_ids())
    recovered = store.journal(journal)
    recovered.start()
    recovered.close()
    ids = store.usage_ids()
    store.close()
    print(f"acknowledged {len(acknowledged)}, in db {in_db_before}, replayed {len(ids)}")
    assert len(acknowledged) >= 3000
    assert set(acknowledged) <= ids
