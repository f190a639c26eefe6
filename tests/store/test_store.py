"""Tenants, keys and records in a real SQLite database (WAL) in a temporary directory."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from gpufleet.store import (
    Journal,
    Store,
    StoreError,
    TenantSettings,
    audit_row,
    secret_matches,
    split_key,
)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = Store.open(f"sqlite:///{tmp_path / 'db.sqlite'}")
    yield store
    store.close()


def usage_row(request_id: str, tenant: str = "a", status: int = 200) -> dict[str, object]:
    return {
        "id": request_id,
        "request_id": request_id,
        "time": 1000.0,
        "tenant": tenant,
        "key_id": "k",
        "model": "m",
        "replica": "m-0",
        "status": status,
        "prompt_tokens": 10,
        "cached_tokens": 4,
        "completion_tokens": 5,
        "queue_s": 0.0,
        "ttft_s": 0.01,
        "e2e_s": 0.02,
    }


def test_sqlite_runs_in_wal_mode(store: Store) -> None:
    with store.engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"


def test_a_key_is_stored_only_as_its_hash(store: Store) -> None:
    info, key = store.create_key("team-a", TenantSettings(rpm=60, models=("m",)))
    parts = split_key(key)
    assert parts is not None
    key_id, secret = parts
    assert key_id == info.key_id
    with store.engine.connect() as conn:
        dump = "\n".join(str(r) for r in conn.execute(text("SELECT * FROM api_keys")))
    assert secret not in dump
    hashed, tenant = store.snapshot().keys[key_id]
    assert tenant == "team-a"
    assert secret_matches(secret, hashed)
    assert not secret_matches(secret + "x", hashed)
    assert store.snapshot().tenants["team-a"] == TenantSettings(rpm=60, models=("m",))


def test_rotate_revokes_the_old_key_and_issues_a_new_one(store: Store) -> None:
    old, _ = store.create_key("team-a")
    new, key = store.rotate_key(old.key_id)
    assert new.tenant == "team-a"
    assert split_key(key) is not None
    assert set(store.snapshot().keys) == {new.key_id}
    (revoked,) = [k for k in store.keys(include_revoked=True) if k.key_id == old.key_id]
    assert revoked.replaced_by == new.key_id
    assert not revoked.active
    with pytest.raises(StoreError, match="no active key"):
        store.revoke_key(old.key_id)


def test_settings_are_validated() -> None:
    with pytest.raises(StoreError, match="priority"):
        TenantSettings(priority="urgent")  # type: ignore[arg-type]
    with pytest.raises(StoreError, match="weight"):
        TenantSettings(weight=0)


def test_records_are_written_once_however_often_replayed(store: Store) -> None:
    records = [("usage", usage_row("r1")), ("usage", usage_row("r2", status=500))]
    store.write(records)
    store.write(records)
    (row,) = store.usage()
    assert (row.requests, row.errors, row.prompt_tokens, row.cached_tokens) == (2, 1, 20, 8)


def test_the_journal_flushes_in_batches_and_cleans_up(store: Store, tmp_path: Path) -> None:
    journal = store.journal(tmp_path / "journal", flush_interval=3600)
    journal.start()
    for i in range(50):
        journal.append("usage", usage_row(f"r{i}"))
    journal.append("audit", audit_row("admin", "keys.create", "team-a"))
    assert store.usage_ids() == set()  # nothing reached the database yet
    journal.flush()
    assert len(store.usage_ids()) == 50
    assert store.audit_entries()[0]["action"] == "keys.create"
    journal.close()
    assert list((tmp_path / "journal").iterdir()) == []


def test_a_dead_writers_journal_is_replayed_by_the_next(store: Store, tmp_path: Path) -> None:
    root = tmp_path / "journal"
    folder = root / "dead"
    folder.mkdir(parents=True)
    (folder / "lock").touch()
    good = b'{"k":"usage","r":' + str(usage_row("x")).replace("'", '"').encode() + b"}\n"
    (folder / "sealed-1.jsonl").write_bytes(good)
    (folder / "open.jsonl").write_bytes(b'{"k":"usage","r":{"request_')  # torn
    journal = Journal(root, store.write)
    assert journal.start() == 1
    journal.close()
    assert store.usage_ids() == {"x"}


def test_a_live_writers_journal_is_left_alone(store: Store, tmp_path: Path) -> None:
    root = tmp_path / "journal"
    live = Journal(root, store.write, flush_interval=3600)
    live.start()
    live.append("usage", usage_row("live"))
    other = Journal(root, store.write, flush_interval=3600)
    assert other.start() == 0
    other.close()
    live.close()
    assert store.usage_ids() == {"live"}


def test_a_failing_database_keeps_the_records_for_the_next_flush(tmp_path: Path) -> None:
    calls: list[int] = []

    def flaky(records: object) -> None:
        calls.append(len(records))  # type: ignore[arg-type]
        if len(calls) == 1:
            raise ConnectionError("database away")

    journal = Journal(tmp_path / "j", flaky, flush_interval=3600)
    journal.start()
    journal.append("usage", usage_row("a"))
    journal.flush()
    journal.append("usage", usage_row("b"))
    journal.flush()
    journal.close()
    assert calls == [1, 2]
    assert journal.failures == 1


class StalledFlush:
    """A flush held inside its ``fsync`` (a stand-in that blocks until released: a real disk
    cannot be made slow on demand), on the flusher's own thread."""

    def __init__(self, journal: Journal, monkeypatch: pytest.MonkeyPatch) -> None:
        self.syncing, self.release = threading.Event(), threading.Event()
        real_fsync = os.fsync

        def slow_fsync(fd: int) -> None:
            self.syncing.set()
            self.release.wait(10)
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", slow_fsync)
        self.flusher = threading.Thread(target=journal.flush)
        self.flusher.start()
        assert self.syncing.wait(5)

    def finish(self) -> None:
        self.release.set()
        self.flusher.join()


def test_append_never_waits_for_the_flushers_fsync(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``append`` runs on the gateway's event loop: a slow disk must not stall it."""
    journal = store.journal(tmp_path / "journal", flush_interval=3600)
    journal.start()
    journal.append("usage", usage_row("before"))
    stalled = StalledFlush(journal, monkeypatch)
    try:
        appender = threading.Thread(target=journal.append, args=("usage", usage_row("during")))
        appender.start()
        appender.join(2.0)
        assert not appender.is_alive(), "append waited for the fsync"
    finally:
        stalled.finish()
    monkeypatch.undo()
    journal.close()
    assert store.usage_ids() == {"before", "during"}


def test_a_flush_returns_only_when_what_came_before_is_in_the_database(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flusher may be between taking a batch and committing it when another flush
    (``close``, a test) starts: that flush must wait for it, not return with the batch still
    in flight."""
    journal = store.journal(tmp_path / "journal", flush_interval=3600)
    journal.start()
    journal.append("usage", usage_row("r1"))
    stalled = StalledFlush(journal, monkeypatch)
    try:
        second = threading.Thread(target=journal.flush)
        second.start()
        second.join(0.5)
        assert second.is_alive(), "a flush returned while the batch before it was uncommitted"
    finally:
        stalled.finish()
    second.join()
    assert store.usage_ids() == {"r1"}
    monkeypatch.undo()
    journal.close()
