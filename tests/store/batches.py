"""Helpers for batch tests: an input file, a batch started on it, its output read back."""

from __future__ import annotations

import json
from typing import Any

from gpufleet.store import Batch, Store

CHAT = "/v1/chat/completions"
T0 = 1_000_000.0
"""Every test's clock starts here (times are parameters; no test reads a real clock)."""


def input_file(n: int, endpoint: str = CHAT) -> bytes:
    return b"".join(
        json.dumps(
            {
                "custom_id": f"r-{i}",
                "method": "POST",
                "url": endpoint,
                # zero-padded: lines run sorted by prompt (prefix order), here input order
                "body": {"model": "m", "messages": [{"role": "user", "content": f"{i:06d}"}]},
            }
        ).encode()
        + b"\n"
        for i in range(n)
    )


def started(store: Store, n: int, owner: str = "a", now: float = T0) -> Batch:
    """A batch of ``n`` lines, validated and ``in_progress``."""
    f = store.files.create(owner, "batch", input_file(n), "in.jsonl", now=now)
    batch = store.batches.create(owner, f.id, CHAT, metadata={"job": "t"}, now=now)
    advanced = store.batches.advance(batch.id, now=now + 1)
    assert advanced is not None
    assert advanced.status == "in_progress", advanced.errors
    return advanced


def jsonl(store: Store, file_id: str | None, owner: str = "a") -> list[dict[str, Any]]:
    if file_id is None:
        return []
    data = store.files.content(file_id, owner=owner)
    assert data is not None
    return [json.loads(line) for line in data.splitlines()]


def reply(i: int) -> dict[str, Any]:
    return {"id": f"chatcmpl-{i}", "object": "chat.completion", "choices": []}
