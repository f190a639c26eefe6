"""The batch runner in a live gateway over sim replicas, with the official ``openai`` client:
lines go through the gateway's own request path in the ``batch`` class, at most
``lines_in_flight`` at once, each recorded and ledgered once; refused lines wait and run
later; cancel keeps finished lines; the window's end; a stopped gateway's lines resumed by
the next; two gateways on one store (SQLite, PostgreSQL) run each line once."""

from __future__ import annotations

import io
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from sqlalchemy import create_engine, func, select

from gpufleet.config import FleetConfig, parse_fleet
from gpufleet.store import Store, TenantSettings, database_url
from gpufleet.store import _schema as schema
from tests.gateway.batches import (
    CHAT,
    BatchGateway,
    input_lines,
    jsonl,
    serve_batch_gateway,
    slow_replica,
    upload,
    wait_ended,
)
from tests.gateway.conftest import MODEL, sim_replica
from tests.store.postgres import postgres_server, unavailable


def batch_fleet(*, auth: bool = True, **batch: Any) -> FleetConfig:
    return parse_fleet(
        {
            "models": [{"name": MODEL, "routing": "least_request"}],
            "gateway": {"batch": {"poll_interval": 0.1, "max_backoff": 0.2, **batch}},
            "tenants": {"auth": auth, "refresh_interval": 0.2},
        }
    )


def key_for(gw: BatchGateway, tenant: str, settings: TenantSettings | None = None) -> str:
    _, key = gw.store.create_key(tenant, settings)
    assert gw.tenancy is not None
    gw.tenancy.reload()
    return key


def start(client: openai.OpenAI, data: bytes) -> str:
    file_id = upload(client, data)
    return client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id


def check_every_line_once(client: openai.OpenAI, batch_id: str, n: int) -> list[dict[str, Any]]:
    """The ended batch's output and error lines: every ``custom_id`` once, in order."""
    done = client.batches.retrieve(batch_id)
    out = jsonl(client, done.output_file_id)
    errors = jsonl(client, done.error_file_id)
    seen = Counter(o["custom_id"] for o in out + errors)
    assert seen == Counter(f"r-{i}" for i in range(n))
    counts = done.request_counts
    assert counts is not None
    assert (counts.total, counts.completed, counts.failed) == (n, len(out), len(errors))
    return out


def ledgered_once(gw: BatchGateway, out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ledger's rows of batch lines: one per answered line, keyed by its id."""
    rows = [r for r in gw.ledger() if r["id"].startswith("batch_req_")]
    assert sorted(r["id"] for r in rows) == sorted(o["id"] for o in out)
    return rows


class Peak:
    """The largest value a gauge showed, sampled every 2 ms while the block runs."""

    def __init__(self, gw: BatchGateway, name: str) -> None:
        self.gw, self.name, self.peak = gw, name, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.gw.sample(self.name))

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def test_lines_run_in_the_batch_class_bounded_and_ledgered_once(tmp_path: Path) -> None:
    record = (tmp_path / "control.jsonl").open("w")
    with (
        slow_replica(50.0) as url,
        serve_batch_gateway(tmp_path, batch_fleet(lines_in_flight=4), [url], record=record) as gw,
    ):
        key = key_for(gw, "team-a", TenantSettings(priority="interactive"))
        with openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0) as client:
            with Peak(gw, "gpufleet:gateway_batch_lines_running") as peak:
                batch_id = start(client, input_lines(40, max_tokens=64))
                assert wait_ended(client, batch_id).status == "completed"
            assert 2 <= peak.peak <= 4
            out = check_every_line_once(client, batch_id, 40)
            assert all(o["response"]["status_code"] == 200 for o in out)
        rows = ledgered_once(gw, out)
        assert {(r["tenant"], r["key_id"], r["status"]) for r in rows} == {
            ("team-a", batch_id, 200)
        }
        usage = {o["id"]: o["response"]["body"]["usage"]["completion_tokens"] for o in out}
        assert {r["id"]: r["completion_tokens"] for r in rows} == usage  # what it answered
    record.close()
    arrived = [
        json.loads(line)["event"]
        for line in (tmp_path / "control.jsonl").read_text().splitlines()[1:]
    ]
    lines = [e for e in arrived if e["kind"] == "arrived" and e["id"].startswith("batch_req_")]
    assert len(lines) == 40
    assert {(e["priority"], e["tenant"]) for e in lines} == {(1, "team-a")}  # CLASSES[1]


def test_lines_refused_for_now_wait_and_run_later(tmp_path: Path) -> None:
    """A tenant's concurrency quota of 1 refuses three of every four lines (429): they wait
    and run later; only the tries that ran are ledgered, once per line."""
    with (
        sim_replica() as url,
        serve_batch_gateway(tmp_path, batch_fleet(lines_in_flight=4), [url]) as gw,
    ):
        key = key_for(gw, "narrow", TenantSettings(concurrency=1))
        with openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0) as client:
            batch_id = start(client, input_lines(12))
            assert wait_ended(client, batch_id).status == "completed"
            out = check_every_line_once(client, batch_id, 12)
        assert gw.sample("gpufleet:gateway_batch_lines_total", outcome="deferred") > 0
        assert gw.sample("gpufleet:gateway_requests_total", model=MODEL, status="429") > 0
        rows = ledgered_once(gw, out)
        assert {r["status"] for r in rows} == {200}


def test_cancel_stops_the_batch_and_keeps_finished_lines(tmp_path: Path) -> None:
    with (
        slow_replica(20.0) as url,
        serve_batch_gateway(tmp_path, batch_fleet(lines_in_flight=2), [url]) as gw,
    ):
        key = key_for(gw, "team-a")
        with openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0) as client:
            batch_id = start(client, input_lines(40, max_tokens=200))
            deadline = time.monotonic() + 20
            while (counts := client.batches.retrieve(batch_id).request_counts) is not None:
                if counts.completed >= 4:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.02)
            cancelling = client.batches.cancel(batch_id)
            assert cancelling.status == "cancelling"
            assert cancelling.cancelling_at is not None
            done = wait_ended(client, batch_id)
            assert done.status == "cancelled"
            out = check_every_line_once(client, batch_id, 40)
            errors = jsonl(client, done.error_file_id)
            assert 4 <= len(out) < 40
            assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
            assert all(e["response"] is None for e in errors)
            # the same batch cancelled again is left as it is
            assert client.batches.cancel(batch_id).status == "cancelled"
        rows = ledgered_once(gw, out)
        assert len(rows) == len(out)


def test_the_window_ends_a_batch_with_what_finished(tmp_path: Path) -> None:
    """A batch whose 24 h window ends while it runs: expired, done lines kept, the rest
    ended with ``batch_expired``, the lines still running stopped."""
    with (
        slow_replica(20.0) as url,
        serve_batch_gateway(tmp_path, batch_fleet(lines_in_flight=2), [url]) as gw,
    ):
        key = key_for(gw, "team-a")
        created = time.time() - 24 * 3600 + 1.5  # its window ends 1.5 s from now
        data = input_lines(400, max_tokens=200)  # ~20 s of work, two lines at a time
        f = gw.store.files.create("team-a", "batch", data, "in.jsonl", now=0)
        batch = gw.store.batches.create("team-a", f.id, CHAT, now=created)
        with openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0) as client:
            done = wait_ended(client, batch.id)
            assert done.status == "expired"
            out = check_every_line_once(client, batch.id, 400)
            assert 1 <= len(out) < 400
            errors = jsonl(client, done.error_file_id)
            assert {e["error"]["code"] for e in errors} == {"batch_expired"}
        deadline = time.monotonic() + 5
        while gw.sample("gpufleet:gateway_batch_lines_running") != 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)


def test_a_stopped_gateways_lines_are_resumed_by_the_next(tmp_path: Path) -> None:
    store = Store.open(f"sqlite:///{tmp_path / 'gpufleet.db'}")
    config = batch_fleet(lines_in_flight=4)
    with slow_replica(50.0) as url:
        with serve_batch_gateway(tmp_path, config, [url], store=store) as first:
            key = key_for(first, "team-a")
            with openai.OpenAI(base_url=first.v1, api_key=key, max_retries=0) as client:
                batch_id = start(client, input_lines(60, max_tokens=64))
                while (client.batches.retrieve(batch_id).request_counts or _none()).completed < 8:
                    time.sleep(0.02)
        # stopped mid-batch: the lines it held are given back at once, not after the lease
        with store.engine.connect() as conn:
            claimed = conn.execute(
                select(func.count()).where(schema.batch_lines.c.state == "claimed")
            ).scalar_one()
        assert claimed == 0
        with serve_batch_gateway(tmp_path, config, [url], store=store) as second:
            with openai.OpenAI(base_url=second.v1, api_key=key, max_retries=0) as client:
                assert wait_ended(client, batch_id).status == "completed"
                out = check_every_line_once(client, batch_id, 60)
            assert second.sample("gpufleet:gateway_batch_lines_total", outcome="completed") < 60
            ledgered_once(second, out)
    store.close()


def _none() -> Any:
    return type("Counts", (), {"completed": 0})()


@pytest.fixture(params=["sqlite", "postgresql"])
def shared_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'shared.db'}"
        return
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with postgres_server() as url:
        yield url


def test_two_gateways_on_one_store_run_each_line_once(tmp_path: Path, shared_url: str) -> None:
    config = batch_fleet(lines_in_flight=8)
    stores = [Store.open(shared_url), Store.open(shared_url)]
    try:
        with (
            sim_replica() as url,
            serve_batch_gateway(tmp_path / "a", config, [url], store=stores[0]) as a,
            serve_batch_gateway(tmp_path / "b", config, [url], store=stores[1]) as b,
        ):
            key = key_for(a, "team-a")
            assert b.tenancy is not None
            b.tenancy.reload()
            with openai.OpenAI(base_url=a.v1, api_key=key, max_retries=0) as client:
                file_id = client.files.create(
                    file=("in.jsonl", io.BytesIO(input_lines(300))), purpose="batch"
                ).id
                batch_id = client.batches.create(
                    input_file_id=file_id, endpoint=CHAT, completion_window="24h"
                ).id
                assert wait_ended(client, batch_id, timeout=60).status == "completed"
                out = check_every_line_once(client, batch_id, 300)
            metric = "gpufleet:gateway_batch_lines_total"
            ran = [gw.sample(metric, outcome="completed") for gw in (a, b)]
            assert sum(ran) == 300
            assert min(ran) > 0, ran  # both gateways ran lines
            b.flush()
            ledgered_once(a, out)
            with stores[0].engine.connect() as conn:
                files = conn.execute(
                    select(func.count()).where(schema.files.c.purpose == "batch_output")
                ).scalar_one()
            assert files == 1  # one output file, however many gateways finalized
    finally:
        for store in stores:
            store.close()
        if shared_url.startswith("postgres"):
            create_engine(database_url(shared_url)).dispose()


def test_a_batch_to_a_served_name_runs_on_its_spot_variant(tmp_path: Path) -> None:
    """One name over an on-demand pool and a spot one (docs/spot.md, "Batch to spot, by
    class"): the batch's lines, in the batch class, go to the spot pool; the same tenant's
    interactive requests to the other."""
    config = parse_fleet(
        {
            "models": [
                {"name": "od", "model": MODEL, "replicas": 1, "routing": "least_request"},
                {"name": "spot", "model": MODEL, "replicas": 1, "routing": "least_request",
                 "capacity": "spot"},
            ],
            "served": [{"name": "chat", "variants": {"od": 1, "spot": 1}}],
            "gateway": {"batch": {"poll_interval": 0.1, "max_backoff": 0.2}},
            "tenants": {"auth": True, "refresh_interval": 0.2},
        }
    )  # fmt: skip
    with (
        sim_replica(seed=1, name="od") as a,
        sim_replica(seed=2, name="spot") as b,
        serve_batch_gateway(tmp_path, config, [a, b], pools=["od", "spot"]) as gw,
    ):
        key = key_for(gw, "team-a", TenantSettings(priority="interactive"))
        with openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0) as client:
            batch_id = start(client, input_lines(20, model="chat"))
            for i in range(10):
                answer = client.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=2
                )
                assert answer.choices
            assert wait_ended(client, batch_id).status == "completed"
            check_every_line_once(client, batch_id, 20)
        attempts = "gpufleet:gateway_upstream_attempts_total"
        assert gw.sample(attempts, replica="spot-1", outcome="success") == 20
        assert gw.sample(attempts, replica="od-0", outcome="success") == 10
