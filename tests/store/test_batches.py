"""``/v1/batches`` in the store, on SQLite and PostgreSQL: the lifecycle from validation to
the output files, claims and leases, exactly-once results, cancel and expiry."""

from __future__ import annotations

import itertools
import json
import threading

import pytest
from sqlalchemy import func, inspect, select, text

from gpufleet.store import LineResult, Store, StoreError, Tenant, TenantSettings
from gpufleet.store import _schema as schema
from tests.store.batches import CHAT, T0, input_file, jsonl, reply, started

OPENAI_BATCH_KEYS = {
    "id",
    "object",
    "endpoint",
    "errors",
    "input_file_id",
    "completion_window",
    "status",
    "output_file_id",
    "error_file_id",
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
    "request_counts",
    "metadata",
}


def test_create_checks_its_arguments(db: Store) -> None:
    f = db.files.create("a", "batch", input_file(1), "in.jsonl", now=T0)
    out = db.files.create("a", "batch_output", b"", "out.jsonl", now=T0)
    with pytest.raises(StoreError, match="endpoint"):
        db.batches.create("a", f.id, "/v1/embeddings", now=T0)
    with pytest.raises(StoreError, match="completion_window"):
        db.batches.create("a", f.id, CHAT, completion_window="1h", now=T0)
    with pytest.raises(StoreError, match="metadata"):
        db.batches.create("a", f.id, CHAT, metadata={str(i): "" for i in range(17)}, now=T0)
    with pytest.raises(StoreError, match="no file"):
        db.batches.create("b", f.id, CHAT, now=T0)  # someone else's file
    with pytest.raises(StoreError, match="no file"):
        db.batches.create("a", out.id, CHAT, now=T0)  # not purpose batch


def test_a_new_batch_in_openai_shape(db: Store) -> None:
    f = db.files.create("a", "batch", input_file(3), "in.jsonl", now=T0)
    batch = db.batches.create("a", f.id, CHAT, metadata={"job": "nightly"}, now=T0 + 0.7)
    shape = batch.to_openai()
    assert set(shape) == OPENAI_BATCH_KEYS
    assert shape["object"] == "batch"
    assert shape["status"] == "validating"
    assert shape["created_at"] == int(T0)
    assert shape["expires_at"] == int(T0) + 24 * 3600
    assert shape["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert shape["metadata"] == {"job": "nightly"}
    assert shape["errors"] is None
    assert db.batches.get(batch.id, owner="a") == batch
    assert db.batches.get(batch.id, owner="b") is None


def test_a_bad_input_file_fails_the_batch_with_line_numbers(db: Store) -> None:
    data = input_file(3) + b"{not json\n" + input_file(1).replace(b"r-0", b"r-1")
    f = db.files.create("a", "batch", data, "in.jsonl", now=T0)
    batch = db.batches.advance(db.batches.create("a", f.id, CHAT, now=T0).id, now=T0 + 1)
    assert batch is not None
    assert batch.status == "failed"
    assert batch.failed_at == T0 + 1
    errors = batch.to_openai()["errors"]
    assert errors["object"] == "list"
    assert [(e["code"], e["line"]) for e in errors["data"]] == [
        ("invalid_json_line", 4),
        ("duplicate_custom_id", 5),
    ]
    assert db.batch_lines.pending(batch.id) == []


def test_a_batch_whose_input_file_is_gone_fails(db: Store) -> None:
    f = db.files.create("a", "batch", input_file(2), "in.jsonl", now=T0)
    batch = db.batches.create("a", f.id, CHAT, now=T0)
    db.files.delete(f.id, owner="a")
    after = db.batches.advance(batch.id, now=T0 + 1)
    assert after is not None
    assert after.status == "failed"
    assert after.errors[0].param == "input_file_id"


def test_a_batch_runs_to_completion_with_output_in_input_order(db: Store) -> None:
    batch = started(db, 6)
    assert batch.request_counts.total == 6
    assert batch.in_progress_at == T0 + 1
    claims = db.batch_lines.claim(batch.id, worker="w", now=T0 + 2, limit=10)
    assert [c.custom_id for c in claims] == [f"r-{i}" for i in range(6)]
    assert claims[0].body["messages"][0]["content"] == "000000"
    for c in reversed(claims):  # finishing out of order changes nothing
        i = int(c.custom_id[2:])
        result = (
            LineResult.response(200, reply(i), upstream_id=f"req-{i}")
            if i % 3
            else LineResult.response(400, {"error": {"message": "bad"}})
            if i == 0
            else LineResult.error("replica_unavailable", "no replica")
        )
        assert db.batch_lines.record(batch.id, c.line, result, now=T0 + 3)
    done = db.batches.advance(batch.id, now=T0 + 4)
    assert done is not None
    assert done.status == "completed"
    assert (done.finalizing_at, done.completed_at) == (T0 + 4, T0 + 4)
    assert done.request_counts.to_openai() == {"total": 6, "completed": 4, "failed": 2}
    output = jsonl(db, done.output_file_id)
    assert [o["custom_id"] for o in output] == ["r-1", "r-2", "r-4", "r-5"]
    assert output[0]["response"] == {"status_code": 200, "request_id": "req-1", "body": reply(1)}
    assert output[0]["error"] is None
    assert all(o["id"].startswith("batch_req_") for o in output)
    errors = jsonl(db, done.error_file_id)
    assert [(e["custom_id"], e["error"]) for e in errors] == [
        ("r-0", None),
        ("r-3", {"code": "replica_unavailable", "message": "no replica"}),
    ]
    assert errors[0]["response"]["status_code"] == 400
    out_file = db.files.get(done.output_file_id or "", owner="a")
    assert out_file is not None
    assert out_file.purpose == "batch_output"
    assert db.batches.advance(batch.id, now=T0 + 5) == done  # a terminal batch stays


def test_a_result_is_recorded_once(db: Store) -> None:
    batch = started(db, 2)
    (claim,) = db.batch_lines.claim(batch.id, worker="w", now=T0, limit=1)
    assert db.batch_lines.record(batch.id, claim.line, LineResult.response(200, reply(1)), now=T0)
    again = LineResult.response(200, {"different": True})
    assert not db.batch_lines.record(batch.id, claim.line, again, now=T0)
    assert db.batch_lines.pending(batch.id) == [2]
    (other,) = db.batch_lines.claim(batch.id, worker="w", now=T0, limit=5)
    db.batch_lines.record(batch.id, other.line, LineResult.response(200, reply(2)), now=T0)
    done = db.batches.advance(batch.id, now=T0)
    assert done is not None
    assert [o["response"]["body"] for o in jsonl(db, done.output_file_id)] == [reply(1), reply(2)]


def test_leases_renewal_and_release(db: Store) -> None:
    batch = started(db, 3)
    lines = db.batch_lines
    first = lines.claim(batch.id, worker="w1", now=T0, limit=2, lease_s=10)
    assert [c.attempt for c in first] == [1, 1]
    assert [c.line for c in lines.claim(batch.id, worker="w2", now=T0 + 1, limit=5)] == [3]
    assert lines.claim(batch.id, worker="w2", now=T0 + 9, limit=5) == []
    assert lines.renew(batch.id, [1], worker="w1", now=T0 + 9, lease_s=10) == 1
    assert lines.renew(batch.id, [1], worker="w2", now=T0 + 9, lease_s=10) == 0
    late = lines.claim(batch.id, worker="w2", now=T0 + 10, limit=5)  # line 2's lease ran out
    assert [(c.line, c.attempt) for c in late] == [(2, 2)]
    assert lines.release(batch.id, [1, 2], worker="w1") == 1  # w1 no longer holds line 2
    assert [c.line for c in lines.claim(batch.id, worker="w3", now=T0 + 11, limit=5)] == [1]
    progress = lines.progress(batch.id, T0 + 11)
    assert progress is not None
    assert (progress.in_flight, progress.unfinished) == (3, 3)


def test_nothing_is_claimed_unless_the_batch_is_in_progress(db: Store) -> None:
    f = db.files.create("a", "batch", input_file(2), "in.jsonl", now=T0)
    batch = db.batches.create("a", f.id, CHAT, now=T0)
    assert db.batch_lines.claim(batch.id, worker="w", now=T0, limit=5) == []
    running = started(db, 2)
    db.batches.cancel(running.id, owner="a", now=T0 + 2)
    assert db.batch_lines.claim(running.id, worker="w", now=T0 + 2, limit=5) == []


def test_cancel_keeps_finished_lines_and_waits_for_those_in_flight(db: Store) -> None:
    batch = started(db, 4)
    lines = db.batch_lines
    claims = lines.claim(batch.id, worker="w", now=T0 + 2, limit=2, lease_s=60)
    lines.record(batch.id, claims[0].line, LineResult.response(200, reply(0)), now=T0 + 3)
    cancelling = db.batches.cancel(batch.id, owner="a", now=T0 + 4)
    assert cancelling is not None
    assert (cancelling.status, cancelling.cancelling_at) == ("cancelling", T0 + 4)
    assert db.batches.cancel(batch.id, owner="a", now=T0 + 5) == cancelling  # idempotent
    assert db.batches.cancel(batch.id, owner="b", now=T0 + 5) is None
    still = db.batches.advance(batch.id, now=T0 + 5)
    assert still is not None
    assert still.status == "cancelling"  # line 2 is in flight
    assert lines.record(batch.id, claims[1].line, LineResult.response(200, reply(1)), now=T0 + 6)
    cancelled = db.batches.advance(batch.id, now=T0 + 6)
    assert cancelled is not None
    assert (cancelled.status, cancelled.cancelled_at) == ("cancelled", T0 + 6)
    assert [o["custom_id"] for o in jsonl(db, cancelled.output_file_id)] == ["r-0", "r-1"]
    assert [(e["custom_id"], e["error"]["code"]) for e in jsonl(db, cancelled.error_file_id)] == [
        ("r-2", "batch_cancelled"),
        ("r-3", "batch_cancelled"),
    ]
    assert cancelled.request_counts.to_openai() == {"total": 4, "completed": 2, "failed": 2}
    assert not lines.record(batch.id, 3, LineResult.response(200, reply(2)), now=T0 + 7)


def test_a_finished_batch_cannot_be_cancelled(db: Store) -> None:
    done = started(db, 1)
    (c,) = db.batch_lines.claim(done.id, worker="w", now=T0, limit=1)
    db.batch_lines.record(done.id, c.line, LineResult.response(200, reply(0)), now=T0)
    db.batches.advance(done.id, now=T0)
    with pytest.raises(StoreError, match="completed: it cannot be cancelled"):
        db.batches.cancel(done.id, owner="a", now=T0)
    assert db.batches.cancel("batch_nope", owner="a", now=T0) is None


def test_cancelling_gives_up_on_lines_in_flight_after_the_grace(db: Store) -> None:
    batch = started(db, 2)
    db.batch_lines.claim(batch.id, worker="w", now=T0, limit=2, lease_s=3600)
    db.batches.cancel(batch.id, owner="a", now=T0 + 1)
    waiting = db.batches.advance(batch.id, now=T0 + 2, cancel_grace_s=10)
    assert waiting is not None
    assert waiting.status == "cancelling"
    gone = db.batches.advance(batch.id, now=T0 + 11, cancel_grace_s=10)
    assert gone is not None
    assert gone.status == "cancelled"
    assert gone.output_file_id is None
    assert len(jsonl(db, gone.error_file_id)) == 2


def test_a_batch_expires_at_the_end_of_its_window(db: Store) -> None:
    batch = started(db, 3)
    (claim,) = db.batch_lines.claim(batch.id, worker="w", now=T0 + 2, limit=1)
    db.batch_lines.record(batch.id, claim.line, LineResult.response(200, reply(0)), now=T0 + 3)
    running = db.batches.advance(batch.id, now=batch.expires_at - 1)
    assert running is not None
    assert running.status == "in_progress"
    expired = db.batches.advance(batch.id, now=batch.expires_at)
    assert expired is not None
    assert (expired.status, expired.expired_at) == ("expired", batch.expires_at)
    assert [o["custom_id"] for o in jsonl(db, expired.output_file_id)] == ["r-0"]
    assert {e["error"]["code"] for e in jsonl(db, expired.error_file_id)} == {"batch_expired"}
    assert expired.request_counts.to_openai() == {"total": 3, "completed": 1, "failed": 2}


def test_list_newest_first_and_the_unfinished(db: Store) -> None:
    f = db.files.create("a", "batch", input_file(1), "in.jsonl", now=T0)
    made = [db.batches.create("a", f.id, CHAT, now=T0 + i) for i in range(5)]
    db.batches.cancel(made[0].id, owner="a", now=T0 + 9)
    db.batches.advance(made[0].id, now=T0 + 9)
    page = db.batches.list("a", limit=3)
    assert [b.id for b in page.data] == [b.id for b in reversed(made[2:])]
    assert page.has_more
    rest = db.batches.list("a", after=page.data[-1].id)
    assert [b.id for b in rest.data] == [made[1].id, made[0].id]
    assert not rest.has_more
    assert rest.to_openai()["last_id"] == made[0].id
    assert db.batches.list("b").data == ()
    assert [b.id for b in db.batches.unfinished()] == [b.id for b in made[1:]]
    with pytest.raises(StoreError, match="limit"):
        db.batches.list("a", limit=101)


def test_two_runners_advancing_one_batch_move_it_once(db: Store) -> None:
    batch = started(db, 20)
    for c in db.batch_lines.claim(batch.id, worker="w", now=T0, limit=20):
        db.batch_lines.record(batch.id, c.line, LineResult.response(200, reply(c.line)), now=T0)
    barrier = threading.Barrier(4)

    def advance() -> None:
        barrier.wait()
        db.batches.advance(batch.id, now=T0 + 5)

    threads = [threading.Thread(target=advance) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = db.batches.get(batch.id, owner="a")
    assert done is not None
    assert done.status == "completed"
    with db.engine.connect() as conn:
        outputs = conn.execute(
            select(func.count()).where(schema.files.c.purpose == "batch_output")
        ).scalar()
    assert outputs == 1
    assert len(jsonl(db, done.output_file_id)) == 20


def test_bodies_are_stored_as_json(db: Store) -> None:
    batch = started(db, 1)
    with db.engine.connect() as conn:
        body = conn.execute(select(schema.batch_lines.c.body)).scalar_one()
    assert json.loads(body)["model"] == "m"
    assert batch.metadata == {"job": "t"}


def _shuffled_prompts(n: int) -> bytes:
    """``n`` lines cycling through three long system prompts (the file's order mixes them),
    each with its own question."""
    systems = [f"You are assistant {k}. " * 40 for k in "CAB"]
    return b"".join(
        json.dumps(
            {
                "custom_id": f"r-{i}",
                "method": "POST",
                "url": CHAT,
                "body": {
                    "model": "m",
                    "messages": [
                        {"role": "system", "content": systems[i % 3]},
                        {"role": "user", "content": f"question {i:02d}"},
                    ],
                },
            }
        ).encode()
        + b"\n"
        for i in range(n)
    )


def _claimed(db: Store, order: str) -> list[str]:
    f = db.files.create("a", "batch", _shuffled_prompts(12), "in.jsonl", now=T0)
    batch = db.batches.create("a", f.id, CHAT, now=T0)
    assert db.batches.advance(batch.id, now=T0 + 1, order=order) is not None
    claims = []
    while more := db.batch_lines.claim(batch.id, worker="w", now=T0 + 2, limit=5):
        claims += more  # claimed in windows, as the runner does
    return [c.body["messages"][0]["content"][:20] for c in claims]


def test_lines_that_share_a_prompt_prefix_are_claimed_together(db: Store) -> None:
    runs = _claimed(db, "prefix")
    assert len(runs) == 12
    groups = [k for k, _ in itertools.groupby(runs)]
    assert len(groups) == 3  # each system prompt's lines in one run
    assert len({*_claimed(db, "input")[:3]}) == 3  # the file's order mixes them


def test_an_older_database_gains_the_run_order_and_keeps_its_batches(db_url: str) -> None:
    store = Store.open(db_url)
    old = started(store, 4)
    with store.engine.begin() as conn:  # as a database made before run_order was
        conn.execute(text("DROP INDEX batch_lines_run_order"))
        conn.execute(text("ALTER TABLE batch_lines DROP COLUMN run_order"))
        conn.execute(text("ALTER TABLE tenants DROP COLUMN batch_queue"))
    store.close()
    store = Store.open(db_url)  # the upgrade adds the column and its index back
    try:
        columns = {c["name"] for c in inspect(store.engine).get_columns("batch_lines")}
        assert "run_order" in columns
        indexes = {i["name"] for i in inspect(store.engine).get_indexes("batch_lines")}
        assert "batch_lines_run_order" in indexes
        assert "batch_queue" in {c["name"] for c in inspect(store.engine).get_columns("tenants")}
        claims = store.batch_lines.claim(old.id, worker="w", now=T0 + 2, limit=10)
        assert [c.custom_id for c in claims] == [f"r-{i}" for i in range(4)]  # input order
        assert len(started(store, 3).id) > 0  # and a new batch starts on it
    finally:
        store.close()


def test_a_tenants_batch_queue_fails_a_batch_that_would_pass_it(db: Store) -> None:
    """``batch_queue`` 10 lines: a 6-line batch starts; a second fails at validation while
    the first is unfinished (OpenAI's enqueued limit, in lines); once it ends, one starts."""
    db.create_key("a", TenantSettings(batch_queue=10))
    assert db.tenant("a") == Tenant("a", TenantSettings(batch_queue=10))  # stored, read back
    first = started(db, 6)
    f = db.files.create("a", "batch", input_file(6), "in.jsonl", now=T0)
    second = db.batches.advance(db.batches.create("a", f.id, CHAT, now=T0).id, now=T0 + 1)
    assert second is not None
    assert second.status == "failed"
    (error,) = second.errors
    assert error.code == "batch_queue_limit_exceeded"
    assert "limit 10 lines" in error.message
    assert "6 enqueued" in error.message
    assert started(db, 4).status == "in_progress"  # 6 + 4 fit
    for claim in db.batch_lines.claim(first.id, worker="w", now=T0 + 2, limit=10):
        db.batch_lines.record(first.id, claim.line, LineResult.response(200, {}), now=T0 + 3)
    assert (done := db.batches.advance(first.id, now=T0 + 4)) is not None
    assert done.status == "completed"
    assert started(db, 6).status == "in_progress"  # the first's lines left the queue
    # another tenant, no limit: its batches are its own
    assert started(db, 50, owner="b").status == "in_progress"
