"""Admin credentials: keys for ``/admin`` (and ``/console``), each with a role.

::

    info, key = store.admins.create(Role.OPERATOR, name="alice")   # key: gfa_<id>_<secret>
    store.admins.list()                    # ids, roles, names (never secrets)
    store.admins.revoke(info.key_id)

Roles are ordered: ``viewer`` < ``operator`` < ``admin``; a credential may do what its role
and every lower one may (the gateway's table of which route needs which: docs/console.md).

They live in their own table, ``admin_keys``, not in ``api_keys``: an admin credential
belongs to no tenant (``api_keys.tenant`` is a non-null foreign key), and a table of its own
is created on an existing database by ``create_all`` with no ``ALTER`` of the tenants' keys,
so opening an older database with this version adds it and loses nothing. The key's own
prefix (``gfa_``, tenants' are ``gfk_``) says which table to look in, so a tenant key can
never pass for an admin one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from sqlalchemy import Engine, insert, select, update

from gpufleet.store import _schema as s
from gpufleet.store._errors import StoreError
from gpufleet.store._keys import new_key

ADMIN_PREFIX: Final = "gfa_"


class Role(StrEnum):
    """What an admin credential may do; each role includes the ones below it."""

    VIEWER = "viewer"
    """Reads: the fleet, events, tenants, keys (ids), usage, the audit log, ``/metrics``."""
    OPERATOR = "operator"
    """Acts on the fleet and its tenants: drain a replica, change a tenant, a tenant's keys."""
    ADMIN = "admin"
    """Manages admin credentials (creates and revokes them, with any role)."""

    @property
    def rank(self) -> int:
        return _RANKS[self]

    def allows(self, needed: Role) -> bool:
        return self.rank >= needed.rank


_RANKS: Final = {Role.VIEWER: 0, Role.OPERATOR: 1, Role.ADMIN: 2}
ROLES: Final = tuple(Role)


def parse_role(value: object) -> Role:
    """``value`` as a :class:`Role`, or a ``StoreError`` naming the roles."""
    try:
        return Role(str(value))
    except ValueError:
        raise StoreError(f"role must be one of {', '.join(ROLES)}") from None


@dataclass(frozen=True, slots=True)
class AdminKeyInfo:
    key_id: str
    role: Role
    name: str | None
    """Who holds it (a label for listings and the audit log), if given."""
    created_at: float
    revoked_at: float | None = None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


class AdminKeys:
    """The ``admin_keys`` table."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def create(self, role: Role, name: str | None = None) -> tuple[AdminKeyInfo, str]:
        """A new admin credential; returns its info and the key, shown once, never kept."""
        role = parse_role(role)
        if name is not None and not 1 <= len(name) <= 128:
            raise StoreError("an admin key's name is 1 to 128 characters")
        key = new_key(ADMIN_PREFIX)
        info = AdminKeyInfo(key.key_id, role, name, time.time())
        with self._engine.begin() as conn:
            conn.execute(
                insert(s.admin_keys).values(
                    key_id=key.key_id,
                    role=role.value,
                    name=name,
                    secret_hash=key.secret_hash,
                    created_at=info.created_at,
                )
            )
        return info, key.key

    def list(self, *, include_revoked: bool = False) -> list[AdminKeyInfo]:
        query = select(s.admin_keys).order_by(s.admin_keys.c.created_at)
        if not include_revoked:
            query = query.where(s.admin_keys.c.revoked_at.is_(None))
        with self._engine.connect() as conn:
            return [_info(r) for r in conn.execute(query).all()]

    def get(self, key_id: str) -> AdminKeyInfo | None:
        with self._engine.connect() as conn:
            row = conn.execute(select(s.admin_keys).where(s.admin_keys.c.key_id == key_id)).first()
        return None if row is None else _info(row)

    def revoke(self, key_id: str) -> AdminKeyInfo:
        with self._engine.begin() as conn:
            done = conn.execute(
                update(s.admin_keys)
                .where(s.admin_keys.c.key_id == key_id, s.admin_keys.c.revoked_at.is_(None))
                .values(revoked_at=time.time())
            )
            if done.rowcount != 1:
                raise StoreError(f"no active admin key {key_id!r}")
            row = conn.execute(select(s.admin_keys).where(s.admin_keys.c.key_id == key_id)).one()
        return _info(row)


def _info(row: object) -> AdminKeyInfo:
    r = row._mapping  # type: ignore[attr-defined]
    return AdminKeyInfo(r["key_id"], Role(r["role"]), r["name"], r["created_at"], r["revoked_at"])
