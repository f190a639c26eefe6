"""Fixtures for store tests on both databases: ``db_url`` is a fresh SQLite file, then a
fresh database on one PostgreSQL server started for the session (skipped, saying why, where
the server cannot run: tests/store/postgres.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from gpufleet.store import Store, database_url
from tests.store.postgres import postgres_server, unavailable


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'db.sqlite'}"
        return
    server: str = request.getfixturevalue("postgres_url")
    name = "t_" + uuid.uuid4().hex[:12]
    admin = create_engine(database_url(server), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    try:
        yield server.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE {name} WITH (FORCE)")
        admin.dispose()


@pytest.fixture
def db(db_url: str) -> Iterator[Store]:
    store = Store.open(db_url)
    yield store
    store.close()
