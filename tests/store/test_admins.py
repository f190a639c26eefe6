"""Admin credentials with roles, on SQLite and PostgreSQL (``db_url`` runs each test on both)."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect

from gpufleet.store import (
    ADMIN_PREFIX,
    KEY_PREFIX,
    Role,
    Store,
    StoreError,
    TenantSettings,
    parse_role,
    secret_matches,
    split_key,
)
from gpufleet.store import _schema as s


def test_roles_are_ordered() -> None:
    assert [r.value for r in Role] == ["viewer", "operator", "admin"]
    assert Role.ADMIN.allows(Role.VIEWER)
    assert Role.OPERATOR.allows(Role.OPERATOR)
    assert not Role.VIEWER.allows(Role.OPERATOR)
    assert not Role.OPERATOR.allows(Role.ADMIN)
    assert parse_role("operator") is Role.OPERATOR
    with pytest.raises(StoreError, match="viewer, operator, admin"):
        parse_role("root")


def test_create_list_revoke(db: Store) -> None:
    info, key = db.admins.create(Role.OPERATOR, name="alice")
    assert key.startswith(ADMIN_PREFIX)
    assert split_key(key, KEY_PREFIX) is None  # never read as a tenant's key
    parts = split_key(key, ADMIN_PREFIX)
    assert parts is not None
    assert parts[0] == info.key_id
    secret_hash, role = db.snapshot().admins[info.key_id]
    assert role is Role.OPERATOR
    assert secret_matches(parts[1], secret_hash)
    viewer, _ = db.admins.create(Role.VIEWER)
    assert [(a.key_id, a.role, a.name) for a in db.admins.list()] == [
        (info.key_id, Role.OPERATOR, "alice"),
        (viewer.key_id, Role.VIEWER, None),
    ]
    revoked = db.admins.revoke(info.key_id)
    assert not revoked.active
    assert info.key_id not in db.snapshot().admins
    assert [a.key_id for a in db.admins.list()] == [viewer.key_id]
    assert len(db.admins.list(include_revoked=True)) == 2
    with pytest.raises(StoreError, match="no active admin key"):
        db.admins.revoke(info.key_id)
    with pytest.raises(StoreError, match="1 to 128"):
        db.admins.create(Role.ADMIN, name="")


def test_an_older_database_gains_the_table_and_keeps_its_keys(db_url: str) -> None:
    """A database made before admin credentials (no ``admin_keys`` table) opens with this
    version: the table is created beside the others and every tenant key still works."""
    store = Store.open(db_url)
    info, key = store.create_key("team-a", TenantSettings(rpm=60))
    s.admin_keys.drop(store.engine)  # what a database from before this change looks like
    assert "admin_keys" not in inspect(store.engine).get_table_names()
    store.close()

    store = Store.open(db_url)
    try:
        assert "admin_keys" in inspect(store.engine).get_table_names()
        snapshot = store.snapshot()
        parts = split_key(key)
        assert parts is not None
        assert secret_matches(parts[1], snapshot.keys[info.key_id][0])
        assert snapshot.tenants["team-a"].rpm == 60
        assert snapshot.admins == {}
        made, _ = store.admins.create(Role.ADMIN)
        assert made.key_id in store.snapshot().admins
    finally:
        store.close()
