"""Helpers for the Batch API's gateway tests: input files, a gateway with a store, waiting
for a batch to end, reading its output back."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
from openai.types import Batch
from prometheus_client import CollectorRegistry

from gpufleet.config import FleetConfig
from gpufleet.fleet import ReplicaId
from gpufleet.gateway import StaticReplicas, Upstream, create_gateway
from gpufleet.store import Store
from tests.gateway.conftest import MODEL, Running, serve_app

CHAT = "/v1/chat/completions"
ENDED = frozenset({"completed", "failed", "expired", "cancelled"})


def input_lines(n: int, *, max_tokens: int = 4, model: str = MODEL, prefix: str = "r") -> bytes:
    """``n`` chat requests, ``custom_id`` ``{prefix}-{i}``."""
    return b"".join(
        json.dumps(
            {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": CHAT,
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": f"line {i}"}],
                    "max_tokens": max_tokens,
                },
            }
        ).encode()
        + b"\n"
        for i in range(n)
    )


def upload(client: openai.OpenAI, data: bytes, name: str = "in.jsonl") -> str:
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch").id


def wait_ended(client: openai.OpenAI, batch_id: str, timeout: float = 30.0) -> Batch:
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in ENDED:
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.05)
    return batch


def jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@contextmanager
def serve_batch_gateway(
    tmp: Path, config: FleetConfig, urls: Sequence[str], *, store: Store | None = None
) -> Iterator[Running]:
    """A gateway with auth off and a store of its own (SQLite in ``tmp``) over ``urls``."""
    own = store is None
    store = store or Store.open(f"sqlite:///{tmp / 'gpufleet.db'}")
    replicas = [Upstream(ReplicaId(f"{MODEL}-{i}"), MODEL, url) for i, url in enumerate(urls)]
    registry = CollectorRegistry()
    app = create_gateway(config, StaticReplicas(replicas), registry, store=store)
    try:
        with serve_app(app, "own") as url:
            deadline = time.monotonic() + 10
            while httpx.get(url + "/ready").status_code != 200:
                assert time.monotonic() < deadline, "gateway not ready"
                time.sleep(0.02)
            yield Running(url, app, registry)
    finally:
        if own:
            store.close()
