"""The tables, in SQLAlchemy Core (one schema for SQLite and PostgreSQL).

::

    tenants   name · models (JSON list or NULL: all) · rpm · tpm · concurrency · priority · weight
              · batch_queue (lines in unfinished batches)
    api_keys  key_id · tenant · secret_hash (sha256) · created_at · revoked_at · replaced_by
    admin_keys  key_id · role (viewer|operator|admin) · name · secret_hash · created_at ·
                revoked_at   (admin credentials: no tenant; a table of their own, _admins.py)
    usage     id · request_id · time · tenant · key_id · model · replica · status · tokens · times
    audit     id · time · actor · action · target · outcome · detail (JSON)
    files        id · owner · purpose · filename · bytes · created_at
    file_chunks  file_id · seq · data (≤ 1 MiB each, in order)
    batches      id · owner · endpoint · input_file_id · status · one time per status ·
                 output/error file ids · errors (JSON) · meta (JSON)
    rollouts     model · state (JSON: a rollout's step, phase, settings) · updated_at
    adapters     name · model (its pool) · path · rank · created_at (LoRA adapters registered
                 at run time: POST /admin/adapters)
    batch_lines  batch_id · line · custom_id · request_id · body (JSON) · state · worker ·
                 lease_until · attempts · result (status code, response JSON, or error) ·
                 run_order (lines sharing a prompt prefix run together)

Times are Unix seconds (float). ``usage.id`` and ``audit.id`` are random primary keys the
gateway gives each record, so replaying a journal twice inserts nothing twice
(``usage.request_id`` is the ``x-request-id``, which a client may reuse). File bodies live in
the database, cut into chunks so that no single value is large (docs/batch.md says why); a
batch line's ``request_id`` (``batch_req_…``) is fixed when the batch starts, so it can key the
line's ledger record too.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
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
    Column("batch_queue", Integer, nullable=True),  # added by _upgrade to older databases
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

admin_keys = Table(
    "admin_keys",
    metadata,
    Column("key_id", String(32), primary_key=True),
    Column("role", String(16), nullable=False),
    Column("name", String(128), nullable=True),
    Column("secret_hash", String(64), nullable=False),
    Column("created_at", Float, nullable=False),
    Column("revoked_at", Float, nullable=True),
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

files = Table(
    "files",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(128), nullable=False),
    Column("purpose", String(32), nullable=False),
    Column("filename", String(512), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("created_at", Float, nullable=False),
    Index("files_owner_created", "owner", "created_at"),
)

file_chunks = Table(
    "file_chunks",
    metadata,
    Column("file_id", String(64), ForeignKey("files.id", ondelete="CASCADE"), primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("data", LargeBinary, nullable=False),
)

batches = Table(
    "batches",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(128), nullable=False),
    Column("endpoint", String(64), nullable=False),
    Column("input_file_id", String(64), nullable=False),
    Column("completion_window", String(16), nullable=False),
    Column("status", String(16), nullable=False, index=True),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
    *(
        Column(name, Float, nullable=True)
        for name in (
            "in_progress_at",
            "finalizing_at",
            "completed_at",
            "failed_at",
            "expired_at",
            "cancelling_at",
            "cancelled_at",
        )
    ),
    Column("output_file_id", String(64), nullable=True),
    Column("error_file_id", String(64), nullable=True),
    Column("errors", Text, nullable=True),
    Column("meta", Text, nullable=True),
    Index("batches_owner_created", "owner", "created_at"),
)

batch_lines = Table(
    "batch_lines",
    metadata,
    Column("batch_id", String(64), ForeignKey("batches.id"), primary_key=True),
    Column("line", Integer, primary_key=True),
    Column("custom_id", String(512), nullable=False),
    Column("request_id", String(32), nullable=False, unique=True),
    Column("body", Text, nullable=False),
    Column("state", String(16), nullable=False),
    Column("worker", String(128), nullable=True),
    Column("lease_until", Float, nullable=True),
    Column("attempts", Integer, nullable=False),
    Column("status_code", Integer, nullable=True),
    Column("response", Text, nullable=True),
    Column("error_code", String(64), nullable=True),
    Column("error_message", Text, nullable=True),
    Column("done_at", Float, nullable=True),
    Column("run_order", Integer, nullable=True),
    # the order lines are claimed in (fleet.prefix_ranks); NULL for a batch started by an
    # earlier version, whose lines run in input order. Added to an older database's table
    # when the store opens (store/_store.py, _upgrade).
    UniqueConstraint("batch_id", "custom_id"),
    Index("batch_lines_state", "batch_id", "state", "line"),
    Index("batch_lines_run_order", "batch_id", "state", "run_order"),
)

rollouts = Table(
    "rollouts",
    metadata,
    Column("model", String(256), primary_key=True),
    Column("state", Text, nullable=False),
    Column("updated_at", Float, nullable=False),
)

adapters = Table(
    "adapters",
    metadata,
    Column("name", String(256), primary_key=True),
    Column("model", String(256), nullable=False),
    Column("path", Text, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
)

JOURNALED = {"usage": usage, "audit": audit}
"""The tables the gateway writes through the journal, by the record kind that names them."""
