"""The store: tenants, API keys, the usage ledger, the audit log, and the Batch API's files,
batches and batch lines, in one database.

::

    store = Store.open()                 # $GPUFLEET_DB_URL, or SQLite under $GPUFLEET_HOME
    tenant, key = store.create_key("team-a", TenantSettings(rpm=600))   # key: shown once
    snapshot = store.snapshot()          # every key and tenant, what the gateway checks
    journal = store.journal()            # the gateway's durable, batched ledger writer
    store.files, store.batches, store.batch_lines   # the Batch API (docs/batch.md)
    store.admins                         # admin credentials with roles (docs/console.md)
    store.rollouts                       # rollouts' state across gateway restarts
    store.adapters                       # LoRA adapters registered at run time

SQLite (the default) runs in WAL mode: readers (``gpufleet keys list``, ``gpufleet usage``)
never block the gateway's writer. PostgreSQL is used when the URL says so
(``postgresql://…``; the driver is psycopg 3).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from sqlalchemy import (
    Engine,
    Integer,
    create_engine,
    event,
    func,
    insert,
    inspect,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from gpufleet.store import _schema as s
from gpufleet.store._adapters import AdapterRows
from gpufleet.store._admins import AdminKeys, Role
from gpufleet.store._batch_lines import BatchLines
from gpufleet.store._batches import Batches
from gpufleet.store._errors import StoreError
from gpufleet.store._files import Files
from gpufleet.store._journal import Journal, Record
from gpufleet.store._keys import new_key
from gpufleet.store._rollouts import RolloutStates

HOME_ENV: Final = "GPUFLEET_HOME"
URL_ENV: Final = "GPUFLEET_DB_URL"
Priority = Literal["interactive", "batch"]
PRIORITIES: Final = ("interactive", "batch")


def home() -> Path:
    """``$GPUFLEET_HOME``, default ``./.gpufleet``."""
    return Path(os.environ.get(HOME_ENV) or ".gpufleet")


def database_url(url: str | None = None) -> str:
    """``url``, ``$GPUFLEET_DB_URL``, or SQLite at ``$GPUFLEET_HOME/gpufleet.db``."""
    url = url or os.environ.get(URL_ENV)
    if not url:
        return f"sqlite:///{home() / 'gpufleet.db'}"
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


@dataclass(frozen=True, slots=True)
class TenantSettings:
    """What a tenant may do. ``None`` quotas are unlimited; ``models=None``: every model."""

    models: tuple[str, ...] | None = None
    rpm: int | None = None
    tpm: int | None = None
    concurrency: int | None = None
    priority: Priority = "interactive"
    weight: float = 1.0
    batch_queue: int | None = None
    """The most lines the tenant's unfinished batches may hold at once (OpenAI's enqueued
    limit, counted in lines): a batch that would pass it fails at validation
    (``batch_queue_limit_exceeded``); ``None``: no limit."""

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:
            raise StoreError(f"priority must be one of {', '.join(PRIORITIES)}")
        if not self.weight > 0:
            raise StoreError("weight must be > 0")
        for name in ("rpm", "tpm", "concurrency", "batch_queue"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise StoreError(f"{name} must be >= 1")


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    settings: TenantSettings


@dataclass(frozen=True, slots=True)
class KeyInfo:
    key_id: str
    tenant: str
    created_at: float
    revoked_at: float | None = None
    replaced_by: str | None = None

    @property
    def active(self) -> bool:
        return self.revoked_at is None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every active key's hash and every tenant: what the gateway authenticates against."""

    keys: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """key id → (secret hash, tenant)."""
    tenants: Mapping[str, TenantSettings] = field(default_factory=dict)
    admins: Mapping[str, tuple[str, Role]] = field(default_factory=dict)
    """Admin credentials: key id → (secret hash, role)."""


@dataclass(frozen=True, slots=True)
class UsageRow:
    tenant: str
    model: str
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class Store:
    """One database's tenants, keys, ledger and audit log, files and batches."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        s.metadata.create_all(engine)
        _upgrade(engine)
        self.admins = AdminKeys(engine)
        self.files = Files(engine)
        self.batch_lines = BatchLines(engine)
        self.batches = Batches(engine, self.files, self.batch_lines)
        self.rollouts = RolloutStates(engine)
        self.adapters = AdapterRows(engine)

    @classmethod
    def open(cls, url: str | None = None) -> Store:
        url = database_url(url)
        if url.startswith("sqlite"):
            path = url.split(":///", 1)[1] if ":///" in url else ""
            if path and path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            engine = create_engine(url, connect_args={"timeout": 30})
            event.listen(engine, "connect", _sqlite_pragmas)
        else:
            engine = create_engine(url, pool_pre_ping=True)
        return cls(engine)

    def close(self) -> None:
        self.engine.dispose()

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    # -- tenants and keys -----------------------------------------------------------------

    def put_tenant(self, name: str, settings: TenantSettings) -> Tenant:
        """Create ``name`` or replace its settings."""
        if not name or len(name) > 128:
            raise StoreError("a tenant name is 1 to 128 characters")
        row = _tenant_row(settings)
        with self.engine.begin() as conn:
            exists = conn.execute(select(s.tenants.c.name).where(s.tenants.c.name == name)).first()
            if exists:
                conn.execute(update(s.tenants).where(s.tenants.c.name == name).values(**row))
            else:
                conn.execute(insert(s.tenants).values(name=name, created_at=time.time(), **row))
        return Tenant(name, settings)

    def tenant(self, name: str) -> Tenant | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(s.tenants).where(s.tenants.c.name == name)).first()
        return None if row is None else Tenant(name, _settings(row._mapping))

    def tenants(self) -> list[Tenant]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(s.tenants).order_by(s.tenants.c.name)).all()
        return [Tenant(r.name, _settings(r._mapping)) for r in rows]

    def create_key(
        self, tenant: str, settings: TenantSettings | None = None
    ) -> tuple[KeyInfo, str]:
        """A new key for ``tenant`` (created with ``settings``, or updated when given);
        returns its info and the key itself, which is shown once and not kept."""
        if settings is not None:
            self.put_tenant(tenant, settings)
        elif self.tenant(tenant) is None:
            self.put_tenant(tenant, TenantSettings())
        key = new_key()
        info = KeyInfo(key.key_id, tenant, time.time())
        with self.engine.begin() as conn:
            conn.execute(
                insert(s.api_keys).values(
                    key_id=key.key_id,
                    tenant=tenant,
                    secret_hash=key.secret_hash,
                    created_at=info.created_at,
                )
            )
        return info, key.key

    def keys(self, tenant: str | None = None, *, include_revoked: bool = False) -> list[KeyInfo]:
        query = select(s.api_keys).order_by(s.api_keys.c.tenant, s.api_keys.c.created_at)
        if tenant is not None:
            query = query.where(s.api_keys.c.tenant == tenant)
        if not include_revoked:
            query = query.where(s.api_keys.c.revoked_at.is_(None))
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [
            KeyInfo(r.key_id, r.tenant, r.created_at, r.revoked_at, r.replaced_by) for r in rows
        ]

    def revoke_key(self, key_id: str) -> KeyInfo:
        with self.engine.begin() as conn:
            done = conn.execute(
                update(s.api_keys)
                .where(s.api_keys.c.key_id == key_id, s.api_keys.c.revoked_at.is_(None))
                .values(revoked_at=time.time())
            )
            if done.rowcount != 1:
                raise StoreError(f"no active key {key_id!r}")
            row = conn.execute(select(s.api_keys).where(s.api_keys.c.key_id == key_id)).one()
        return KeyInfo(row.key_id, row.tenant, row.created_at, row.revoked_at, row.replaced_by)

    def rotate_key(self, key_id: str) -> tuple[KeyInfo, str]:
        """Revoke ``key_id`` and issue its tenant a new key, in one transaction."""
        fresh = new_key()
        now = time.time()
        with self.engine.begin() as conn:
            row = conn.execute(
                select(s.api_keys).where(
                    s.api_keys.c.key_id == key_id, s.api_keys.c.revoked_at.is_(None)
                )
            ).first()
            if row is None:
                raise StoreError(f"no active key {key_id!r}")
            conn.execute(
                insert(s.api_keys).values(
                    key_id=fresh.key_id,
                    tenant=row.tenant,
                    secret_hash=fresh.secret_hash,
                    created_at=now,
                )
            )
            conn.execute(
                update(s.api_keys)
                .where(s.api_keys.c.key_id == key_id)
                .values(revoked_at=now, replaced_by=fresh.key_id)
            )
        return KeyInfo(fresh.key_id, row.tenant, now), fresh.key

    def snapshot(self) -> Snapshot:
        with self.engine.connect() as conn:
            keys = conn.execute(
                select(s.api_keys.c.key_id, s.api_keys.c.secret_hash, s.api_keys.c.tenant).where(
                    s.api_keys.c.revoked_at.is_(None)
                )
            ).all()
            tenants = conn.execute(select(s.tenants)).all()
            admins = conn.execute(
                select(
                    s.admin_keys.c.key_id, s.admin_keys.c.secret_hash, s.admin_keys.c.role
                ).where(s.admin_keys.c.revoked_at.is_(None))
            ).all()
        return Snapshot(
            {k.key_id: (k.secret_hash, k.tenant) for k in keys},
            {t.name: _settings(t._mapping) for t in tenants},
            {a.key_id: (a.secret_hash, Role(a.role)) for a in admins},
        )

    # -- records --------------------------------------------------------------------------

    def journal(self, root: Path | None = None, *, flush_interval: float = 0.05) -> Journal:
        """A journal (not started) whose records land in this store."""
        return Journal(root or home() / "journal", self.write, flush_interval=flush_interval)

    def write(self, records: Sequence[Record]) -> None:
        """Insert journaled records in one transaction; rows already present are skipped."""
        by_kind: dict[str, list[dict[str, Any]]] = {}
        for kind, row in records:
            by_kind.setdefault(kind, []).append(row)
        dialect = postgresql if self.dialect == "postgresql" else sqlite
        with self.engine.begin() as conn:
            for kind, rows in by_kind.items():
                table = s.JOURNALED.get(kind)
                if table is None:
                    continue
                conn.execute(dialect.insert(table).on_conflict_do_nothing(), rows)

    def audit_now(
        self,
        actor: str,
        action: str,
        target: str | None,
        outcome: str = "ok",
        detail: Mapping[str, Any] | None = None,
    ) -> None:
        """Write one audit entry at once (the CLI's; the gateway journals its own)."""
        self.write([("audit", audit_row(actor, action, target, outcome, detail))])

    def usage(
        self, since: float | None = None, until: float | None = None, tenant: str | None = None
    ) -> list[UsageRow]:
        u = s.usage.c
        query = select(
            u.tenant,
            u.model,
            func.count(),
            func.sum((u.status >= 400).cast(Integer)),
            func.sum(u.prompt_tokens),
            func.sum(u.cached_tokens),
            func.sum(u.completion_tokens),
        ).group_by(u.tenant, u.model)
        if since is not None:
            query = query.where(u.time >= since)
        if until is not None:
            query = query.where(u.time < until)
        if tenant is not None:
            query = query.where(u.tenant == tenant)
        with self.engine.connect() as conn:
            rows = conn.execute(query.order_by(u.tenant, u.model)).all()
        return [UsageRow(r[0], r[1], *(int(v or 0) for v in r[2:])) for r in rows]

    def usage_ids(self) -> set[str]:
        """Every ledgered ``x-request-id`` (tests and audits)."""
        with self.engine.connect() as conn:
            return set(conn.execute(select(s.usage.c.request_id)).scalars())

    def audit_entries(self, limit: int = 100) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(s.audit).order_by(s.audit.c.time.desc()).limit(limit)).all()
        return [dict(r._mapping) for r in rows]


def audit_row(
    actor: str,
    action: str,
    target: str | None,
    outcome: str = "ok",
    detail: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "id": uuid.uuid4().hex,
        "time": time.time(),
        "actor": actor,
        "action": action,
        "target": target,
        "outcome": outcome,
        "detail": None if detail is None else json.dumps(dict(detail), sort_keys=True),
    }


def settings_dict(settings: TenantSettings) -> dict[str, Any]:
    out = asdict(settings)
    out["models"] = None if settings.models is None else list(settings.models)
    return out


def _tenant_row(settings: TenantSettings) -> dict[str, Any]:
    row = settings_dict(settings)
    row["models"] = None if settings.models is None else json.dumps(list(settings.models))
    return row


def _settings(row: Any) -> TenantSettings:
    models = row["models"]
    return TenantSettings(
        models=None if models is None else tuple(json.loads(models)),
        rpm=row["rpm"],
        tpm=row["tpm"],
        concurrency=row["concurrency"],
        priority=row["priority"],
        weight=row["weight"],
        batch_queue=row["batch_queue"],
    )


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL: the CLI reads while the gateway writes; NORMAL is durable against a process
    # crash in WAL mode (the journal covers the rest)
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _upgrade(engine: Engine) -> None:
    """Bring a database made by an earlier version up to this schema: ``create_all`` adds
    missing tables, not missing columns. Added, nullable, where missing:
    ``batch_lines.run_order`` (the claim order) with its index (old batches keep input
    order), and ``tenants.batch_queue`` (no limit). Nothing is rewritten."""
    found = inspect(engine)
    lines = {c["name"] for c in found.get_columns("batch_lines")}
    tenants = {c["name"] for c in found.get_columns("tenants")}
    with engine.begin() as conn:
        if "run_order" not in lines:
            conn.execute(text("ALTER TABLE batch_lines ADD COLUMN run_order INTEGER"))
        if "batch_queue" not in tenants:
            conn.execute(text("ALTER TABLE tenants ADD COLUMN batch_queue INTEGER"))
    if "run_order" not in lines:
        for index in s.batch_lines.indexes:
            if index.name == "batch_lines_run_order":
                index.create(engine, checkfirst=True)
