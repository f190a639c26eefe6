"""Helpers for the Batch API's gateway tests: input files, a gateway with a store, waiting
for a batch to end, reading its output back."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx
import openai
from openai.types import Batch
from prometheus_client import CollectorRegistry
from sqlalchemy import select

from gpufleet.config import FleetConfig
from gpufleet.engine.server import SimEngineConfig, create_app
from gpufleet.fleet import ReplicaId
from gpufleet.gateway import StaticReplicas, Tenancy, Upstream, create_gateway
from gpufleet.store import Store
from gpufleet.store import _schema as schema
from tests.gateway.conftest import MODEL, Running, serve_app

CHAT = "/v1/chat/completions"
ENDED = frozenset({"completed", "failed", "expired", "cancelled"})


def input_lines(
    n: int,
    *,
    max_tokens: int | Callable[[int], int] = 4,
    model: str = MODEL,
    prefix: str = "r",
) -> bytes:
    """``n`` chat requests, ``custom_id`` ``{prefix}-{i}``; ``max_tokens``: each line's, or
    line ``i``'s as ``max_tokens(i)``."""
    return b"".join(
        json.dumps(
            {
                "custom_id": f"{prefix}-{i}",
                "method": "POST",
                "url": CHAT,
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": f"line {i}"}],
                    "max_tokens": max_tokens(i) if callable(max_tokens) else max_tokens,
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


class BatchGateway(Running):
    store: Store
    tenancy: Tenancy | None

    def flush(self) -> None:
        """Move the ledger's journal into the database now (auth on)."""
        if self.tenancy is not None:
            self.tenancy.journal.flush()

    def ledger(self) -> list[dict[str, Any]]:
        """Every ledger row, after a flush."""
        self.flush()
        with self.store.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(select(schema.usage))]


@contextmanager
def serve_batch_gateway(
    tmp: Path,
    config: FleetConfig,
    urls: Sequence[str],
    *,
    store: Store | None = None,
    record: IO[str] | None = None,
    pools: Sequence[str] | None = None,
) -> Iterator[BatchGateway]:
    """A gateway over ``urls`` with a store (``store``, else its own SQLite file in ``tmp``):
    with auth on (``config.tenants.auth``) the tenancy's, its journal in ``tmp/journal``.
    ``pools``: each URL's pool (default: all ``MODEL``'s), its replica ``<pool>-<i>``."""
    own = store is None
    store = store or Store.open(f"sqlite:///{tmp / 'gpufleet.db'}")
    tenancy = None
    if config.tenants.auth:
        journal = store.journal(tmp / "journal", flush_interval=0.02)
        tenancy = Tenancy(config, store, journal=journal)
    names = pools or [MODEL] * len(urls)
    replicas = [
        Upstream(ReplicaId(f"{pool}-{i}"), pool, url)
        for i, (pool, url) in enumerate(zip(names, urls, strict=True))
    ]
    registry = CollectorRegistry()
    app = create_gateway(
        config, StaticReplicas(replicas), registry, store=store, tenancy=tenancy, record=record
    )
    try:
        with serve_app(app, "own") as url:
            deadline = time.monotonic() + 10
            while httpx.get(url + "/ready").status_code != 200:
                assert time.monotonic() < deadline, "gateway not ready"
                time.sleep(0.02)
            running = BatchGateway(url, app, registry)
            running.store = store
            running.tenancy = tenancy
            yield running
    finally:
        if own:
            store.close()


@contextmanager
def slow_replica(time_scale: float) -> Iterator[str]:
    """A sim replica whose modelled time runs ``time_scale`` times faster than real time."""
    with serve_app(create_app(SimEngineConfig(time_scale=time_scale, max_model_len=4096))) as url:
        yield url
