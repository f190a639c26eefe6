"""Durable records: tenants, API keys, the usage ledger and the audit log (docs/tenants.md);
admin credentials with roles (docs/console.md); the Batch API's files, batches and per-line
progress (docs/batch.md).

SQLite (WAL) under ``$GPUFLEET_HOME`` by default, PostgreSQL when ``$GPUFLEET_DB_URL`` (or a
fleet file's ``tenants.database_url``) says so, through SQLAlchemy Core. The gateway writes
its ledger through a :class:`Journal`: a record is on disk (in the kernel) before the client
sees its response end, and reaches the database in batches off the hot path.
"""

from gpufleet.store._admins import ADMIN_PREFIX, ROLES, AdminKeyInfo, AdminKeys, Role, parse_role
from gpufleet.store._batch_lines import DEFAULT_LEASE_S, BatchLines, LineClaim, LineResult
from gpufleet.store._batches import MAX_BATCHES_PAGE, Batch, Batches, BatchPage
from gpufleet.store._errors import StoreError
from gpufleet.store._files import (
    CHUNK_BYTES,
    FILE_PURPOSES,
    MAX_FILE_BYTES,
    MAX_FILES_PAGE,
    FileObject,
    FilePage,
    FilePurpose,
    Files,
)
from gpufleet.store._journal import Journal, read_records, recover
from gpufleet.store._keys import PREFIX as KEY_PREFIX
from gpufleet.store._keys import secret_matches, split_key
from gpufleet.store._rollouts import RolloutStates
from gpufleet.store._store import (
    HOME_ENV,
    PRIORITIES,
    URL_ENV,
    KeyInfo,
    Priority,
    Snapshot,
    Store,
    Tenant,
    TenantSettings,
    UsageRow,
    audit_row,
    database_url,
    home,
    settings_dict,
)

__all__ = [
    "ADMIN_PREFIX",
    "CHUNK_BYTES",
    "DEFAULT_LEASE_S",
    "FILE_PURPOSES",
    "HOME_ENV",
    "KEY_PREFIX",
    "MAX_BATCHES_PAGE",
    "MAX_FILES_PAGE",
    "MAX_FILE_BYTES",
    "PRIORITIES",
    "ROLES",
    "URL_ENV",
    "AdminKeyInfo",
    "AdminKeys",
    "Batch",
    "BatchLines",
    "BatchPage",
    "Batches",
    "FileObject",
    "FilePage",
    "FilePurpose",
    "Files",
    "Journal",
    "KeyInfo",
    "LineClaim",
    "LineResult",
    "Priority",
    "Role",
    "RolloutStates",
    "Snapshot",
    "Store",
    "StoreError",
    "Tenant",
    "TenantSettings",
    "UsageRow",
    "audit_row",
    "database_url",
    "home",
    "parse_role",
    "read_records",
    "recover",
    "secret_matches",
    "settings_dict",
    "split_key",
]
