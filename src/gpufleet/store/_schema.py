"""The tables, in SQLAlchemy Core (one schema for SQLite and PostgreSQL).

::

    tenants   name · models (JSON list or NULL: all) · rpm · tpm · concurrency · priority · weight
    api_keys  key_id · tenant · secret_hash (sha256) · created_at · revoked_at · replaced_by
    usage     id · request_id · time · tenant · key_id · model · replica · status · tokens · times
    audit     id · time · actor · action · target · outcome · detail (JSON)

Times are Unix seconds (float). ``usage.id`` and ``audit.id`` are random primary keys the
gateway gives each record, so replaying a journal twice inserts nothing twice
(``usage.request_id`` is the ``x-request-id``, which a client may reuse).
"""

from __future__ import annotations

from sqlalchemy import (
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
)

metadata = MetaData()

tenants = Table(
    "tenants",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("models", Text, nullable=True),
    Column("rpm", Integer, nullable=True),
    Column("tpm", Integer, nullable=True),
    Column("concurrency", Integer, nullable=True),
    Column("priority", String(32), nullable=False),
    Column("weight", Float, nullable=False),
    Column("created_at", Float, nullable=False),
)

api_keys = Table(
    "api_keys",
    metadata,
    Column("key_id", String(32), primary_key=True),
    Column("tenant", String(128), ForeignKey("tenants.name"), nullable=False, index=True),
    Column("secret_hash", String(64), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float, nullable=True),
    Column("replaced_by", String(32), nullable=True),
)

usage = Table(
    "usage",
    metadata,
    Column("id", String(32), primary_key=True),
    Column("request_id", String(256), nullable=False, index=True),
    Column("time", Float, nullable=False),
    Column("tenant", String(128), nullable=False),
    Column("key_id", String(32), nullable=True),
    Column("model", String(256), nullable=False),
    Column("replica", String(256), nullable=True),
    Column("status", Integer, nullable=False),
    Column("prompt_tokens", Integer, nullable=False),
    Column("cached_tokens", Integer, nullable=False),
    Column("completion_tokens", Integer, nullable=False),
    Column("queue_s", Float, nullable=True),
    Column("ttft_s", Float, nullable=True),
    Column("e2e_s", Float, nullable=False),
    Index("usage_time", "time"),
    Index("usage_tenant_time", "tenant", "time"),
)

audit = Table(
    "audit",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("time", Float, nullable=False, index=True),
    Column("actor", String(128), nullable=False),
    Column("action", String(64), nullable=False),
    Column("target", String(256), nullable=True),
    Column("outcome", String(32), nullable=False),
    Column("detail", Text, nullable=True),
)

JOURNALED = {"usage": usage, "audit": audit}
"""The tables the gateway writes through the journal, by the record kind that names them."""
