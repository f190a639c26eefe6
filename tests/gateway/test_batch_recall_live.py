"""Recall under load, live: 16 interactive clients stream beside a batch that fills every
slot of two sim engine processes, through the real gateway with auth on. Interactive
requests that find their replica full take batch lines' slots back (the engine aborts the
line mid-answer); each recalled line waits at the gate and runs again. The failure path is
the abort in the middle of a line's answer: every interactive request is served, the batch
completes with every ``custom_id`` once and one ledger row per line, and the recording of
the run replays to the same decisions, recalls included."""

from __future__ import annotations

import io
import random
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import openai

from gpufleet.config import parse_fleet
from gpufleet.control import read_recording, replay
from gpufleet.store import TenantSettings
from tests.gateway.batches import input_lines, serve_batch_gateway, wait_ended
from tests.gateway.conftest import MODEL
from tests.gateway.fairness_live import replica_process
from tests.gateway.test_batch_runner import check_every_line_once, key_for, ledgered_once, start

SEQS = 4
LINES = 120
CLIENTS = 16


def _fleet() -> object:
    return parse_fleet(
        {
            "models": [
                {"name": MODEL, "routing": "least_request", "args": [f"--max-num-seqs={SEQS}"]}
            ],
            "gateway": {
                "batch": {
                    "lines_in_flight": 16,
                    "poll_interval": 0.1,
                    "max_backoff": 0.2,
                    # every slot may hold a line: only recall makes room for interactive
                    "spare": {"target": 1.0, "recall": True},
                }
            },
            "tenants": {"auth": True, "refresh_interval": 0.2},
        }
    )


class _Interactive:
    """``CLIENTS`` threads, each streaming short chat answers with a random pause between
    them, until stopped: bursts that find both engines' slots full of batch lines."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)
        ]

    def _run(self, i: int) -> None:
        rng = random.Random(i)
        with openai.OpenAI(base_url=self.url, api_key=self.key, max_retries=0) as client:
            while not self._stop.wait(rng.uniform(0.1, 0.6)):
                try:
                    stream = client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"hello {i}"}],
                        max_tokens=8,
                        stream=True,
                    )
                    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                    self.statuses.append(200 if text else 0)
                except openai.APIError as error:  # counted: the test fails on any
                    self.errors.append(repr(error))

    def __enter__(self) -> _Interactive:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


def test_recalled_lines_under_16_streaming_clients_run_once_and_interactive_is_served(
    tmp_path: Path,
) -> None:
    recording = io.StringIO()
    with ExitStack() as stack:
        urls = [stack.enter_context(replica_process(SEQS, 2.0, seed)) for seed in range(2)]
        gw = stack.enter_context(serve_batch_gateway(tmp_path, _fleet(), urls, record=recording))
        chat = key_for(gw, "chat", TenantSettings())
        nightly = key_for(gw, "nightly", TenantSettings())
        with openai.OpenAI(base_url=gw.v1, api_key=nightly, max_retries=0) as client:
            batch_id = start(client, input_lines(LINES, max_tokens=64))
            time.sleep(0.5)  # the batch fills the slots first
            with _Interactive(gw.v1, chat) as interactive:
                batch = wait_ended(client, batch_id, timeout=120.0)
            assert batch.status == "completed"
            out = check_every_line_once(client, batch_id, LINES)
        assert all(o["response"]["status_code"] == 200 for o in out)
        ledgered_once(gw, out)
        pool = gw.app.control.pools[MODEL]
        recalled = pool.counters.recalled
        assert gw.sample("gpufleet:gateway_batch_recalls_total", model=MODEL) == recalled
        # let every interactive stream end before counting the controller's books
        deadline = time.monotonic() + 10
        while pool.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (pool.in_flight, pool.batch_in_flight, pool.gated) == (0, 0, 0)
    assert interactive.errors == []
    assert len(interactive.statuses) > 100
    assert set(interactive.statuses) == {200}
    assert recalled >= 5  # bursts did find the slots full, and took them back
    head, lines = read_recording(recording.getvalue().splitlines())
    replayed = list(replay(head, lines))
    assert sum(c["do"] == "recall" for line, _ in replayed for c in line.commands) == recalled
    for line, commands in replayed:
        assert commands == line.commands, line
