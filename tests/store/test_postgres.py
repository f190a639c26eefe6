"""The store and the journal against a real PostgreSQL server started by the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.store import Store, TenantSettings, database_url
from tests.store.postgres import unavailable
from tests.store.test_store import usage_row

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


@pytest.fixture(scope="module")
def url(postgres_url: str) -> str:
    return postgres_url


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    store = Store.open(url)
    yield store
    store.close()


def test_a_postgres_url_uses_psycopg_3(url: str) -> None:
    assert database_url(url).startswith("postgresql+psycopg://")


def test_keys_and_tenants(store: Store) -> None:
    assert store.dialect == "postgresql"
    info, _ = store.create_key("pg-team", TenantSettings(models=("m",), tpm=1000))
    snapshot = store.snapshot()
    assert snapshot.keys[info.key_id][1] == "pg-team"
    assert snapshot.tenants["pg-team"].tpm == 1000
    new, _ = store.rotate_key(info.key_id)
    assert set(store.snapshot().keys) >= {new.key_id}
    assert info.key_id not in store.snapshot().keys


def test_journal_replays_idempotently(store: Store, tmp_path: Path) -> None:
    journal = store.journal(tmp_path / "j", flush_interval=3600)
    journal.start()
    for i in range(20):
        journal.append("usage", usage_row(f"pg-{i}", tenant="pg"))
    journal.flush()
    store.write([("usage", usage_row("pg-0", tenant="pg"))])  # a replay of one already there
    journal.close()
    (row,) = store.usage(tenant="pg")
    assert row.requests == 20
