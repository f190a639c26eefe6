"""``gpufleet keys`` and ``gpufleet usage``: tenants' API keys and what they used, and the
admin credentials (``--admin --role viewer|operator|admin``) of ``/admin`` and ``/console``.

They talk to the store directly (``$GPUFLEET_DB_URL``, or SQLite under ``$GPUFLEET_HOME``),
like the gateway does: a key made or revoked here takes effect in a running gateway within
its ``refresh_interval`` (0.5 s). Every change is written to the audit log.
"""

from __future__ import annotations

import csv
import dataclasses
import getpass
import io
import json
import time
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from gpufleet.cli._errors import user_errors
from gpufleet.store import ROLES, Store, StoreError, TenantSettings, parse_role

app = typer.Typer(help="Create, list, rotate and revoke tenants' API keys.", no_args_is_help=True)

DbOption = Annotated[
    str | None,
    typer.Option("--db", help="Database URL (default: $GPUFLEET_DB_URL or $GPUFLEET_HOME)."),
]


def _actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # pragma: no cover - no user name
        return "cli"


def _when(at: float | None) -> str:
    return "-" if at is None else datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


@app.command("create")
def create(
    tenant: Annotated[
        str | None, typer.Option(help="The tenant the key belongs to (created if new).")
    ] = None,
    models: Annotated[
        str | None, typer.Option(help="Models it may use, comma-separated (default: all).")
    ] = None,
    rpm: Annotated[int | None, typer.Option(help="Requests per minute.")] = None,
    tpm: Annotated[
        int | None, typer.Option(help="Tokens (prompt + completion) per minute.")
    ] = None,
    concurrency: Annotated[int | None, typer.Option(help="Requests at once.")] = None,
    priority: Annotated[str | None, typer.Option(help="interactive (default) or batch.")] = None,
    weight: Annotated[float | None, typer.Option(help="Fair-share weight (default 1).")] = None,
    batch_queue: Annotated[
        int | None,
        typer.Option(help="Lines its unfinished batches may hold at once (default: no limit)."),
    ] = None,
    admin: Annotated[
        bool, typer.Option("--admin", help="An admin credential (for /admin and /console).")
    ] = False,
    role: Annotated[
        str | None, typer.Option(help=f"The admin credential's role: {', '.join(ROLES)}.")
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Who holds the admin credential (shown in the audit log).")
    ] = None,
    db: DbOption = None,
) -> None:
    """A new key for TENANT; settings given replace the tenant's. With --admin --role R, an
    admin credential instead. The key is printed alone on the last line, once: it is stored
    only as a hash.

    Examples: gpufleet keys create --tenant team-a --models llama-3.1-8b --rpm 600;
    gpufleet keys create --admin --role operator --name alice
    """
    if admin or role is not None or name is not None:
        tenant_only = (models, rpm, tpm, concurrency, priority, weight, batch_queue)
        _create_admin(tenant, role, name, any(v is not None for v in tenant_only), db)
        return
    with user_errors():
        if tenant is None:
            raise ValueError("give --tenant NAME (or --admin --role R for an admin credential)")
        store = Store.open(db)
        try:
            given = {
                "models": None if models is None else tuple(m for m in models.split(",") if m),
                "rpm": rpm,
                "tpm": tpm,
                "concurrency": concurrency,
                "priority": priority,
                "weight": weight,
                "batch_queue": batch_queue,
            }
            old = store.tenant(tenant)
            base = TenantSettings() if old is None else old.settings
            changes: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
            settings = dataclasses.replace(base, **changes) if changes else base
            info, key = store.create_key(tenant, settings)
            store.audit_now(_actor(), "keys.create", info.key_id, detail={"tenant": tenant})
        finally:
            store.close()
    typer.echo(f"created key {info.key_id} for tenant {tenant} ({_describe(settings)})")
    typer.echo("the key is shown once; store it now:")
    typer.echo(key)


def _create_admin(
    tenant: str | None, role: str | None, name: str | None, settings: bool, db: str | None
) -> None:
    with user_errors():
        if tenant is not None or settings:
            raise ValueError("an admin credential has no tenant and no tenant settings")
        if role is None:
            raise ValueError(f"--admin needs --role ({', '.join(ROLES)})")
        chosen = parse_role(role)
        store = Store.open(db)
        try:
            info, key = store.admins.create(chosen, name)
            detail = {"role": chosen.value, "name": name}
            store.audit_now(_actor(), "admins.create", info.key_id, detail=detail)
        finally:
            store.close()
    holder = f" for {name}" if name else ""
    typer.echo(f"created admin key {info.key_id} ({chosen.value}){holder}")
    typer.echo("the key is shown once; store it now:")
    typer.echo(key)


def _describe(settings: TenantSettings) -> str:
    models = "all models" if settings.models is None else ",".join(settings.models)
    limits = [
        f"{name} {value}"
        for name in ("rpm", "tpm", "concurrency", "batch_queue")
        if (value := getattr(settings, name)) is not None
    ]
    return ", ".join([models, *limits, settings.priority, f"weight {settings.weight:g}"])


@app.command("list")
def list_keys(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
    all_keys: Annotated[bool, typer.Option("--all", help="Revoked keys too.")] = False,
    admin: Annotated[bool, typer.Option("--admin", help="Admin credentials instead.")] = False,
    db: DbOption = None,
) -> None:
    """Keys (ids only) and their tenants' settings; with --admin, admin credentials."""
    if admin:
        _list_admins(all_keys, db)
        return
    with user_errors():
        store = Store.open(db)
        try:
            keys = store.keys(tenant, include_revoked=all_keys)
            tenants = {t.name: t.settings for t in store.tenants()}
        finally:
            store.close()
    table = Table()
    for column in ("key id", "tenant", "created", "revoked", "settings"):
        table.add_column(column)
    for key in keys:
        settings = tenants.get(key.tenant)
        table.add_row(
            key.key_id,
            key.tenant,
            _when(key.created_at),
            _when(key.revoked_at),
            "-" if settings is None else _describe(settings),
        )
    Console(width=160).print(table)


def _list_admins(all_keys: bool, db: str | None) -> None:
    with user_errors():
        store = Store.open(db)
        try:
            admins = store.admins.list(include_revoked=all_keys)
        finally:
            store.close()
    table = Table()
    for column in ("key id", "role", "name", "created", "revoked"):
        table.add_column(column)
    for info in admins:
        created, revoked = _when(info.created_at), _when(info.revoked_at)
        table.add_row(info.key_id, info.role.value, info.name or "-", created, revoked)
    Console(width=160).print(table)


@app.command("rotate")
def rotate(
    key_id: Annotated[str, typer.Argument(help="The key id to replace.")], db: DbOption = None
) -> None:
    """Revoke KEY_ID and issue its tenant a new key (printed alone on the last line)."""
    with user_errors():
        store = Store.open(db)
        try:
            info, key = store.rotate_key(key_id)
            store.audit_now(_actor(), "keys.rotate", key_id, detail={"new": info.key_id})
        finally:
            store.close()
    typer.echo(f"revoked {key_id}; new key {info.key_id} for tenant {info.tenant}:")
    typer.echo(key)


@app.command("revoke")
def revoke(
    key_id: Annotated[str, typer.Argument(help="The key id to revoke.")], db: DbOption = None
) -> None:
    """Revoke KEY_ID (a tenant's key, else an admin credential): running gateways refuse it
    within half a second."""
    with user_errors():
        store = Store.open(db)
        try:
            try:
                info = store.revoke_key(key_id)
            except StoreError:
                found = store.admins.get(key_id)  # not a tenant's: an admin credential?
                if found is None or not found.active:
                    raise
                admin = store.admins.revoke(key_id)
                detail = {"role": admin.role.value, "name": admin.name}
                store.audit_now(_actor(), "admins.revoke", key_id, detail=detail)
                held = f", {admin.name}" if admin.name else ""
                typer.echo(f"revoked admin key {key_id} ({admin.role.value}{held})")
                return
            store.audit_now(_actor(), "keys.revoke", key_id, detail={"tenant": info.tenant})
        finally:
            store.close()
    typer.echo(f"revoked {key_id} (tenant {info.tenant})")


class Format(StrEnum):
    TABLE = "table"
    CSV = "csv"
    JSON = "json"


def _time(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{value!r}: give Unix seconds or an ISO date/time") from None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()


def usage(
    since: Annotated[
        str | None, typer.Option(help="From (ISO date/time, UTC if no zone, or Unix seconds).")
    ] = None,
    until: Annotated[str | None, typer.Option(help="Until (exclusive), same forms.")] = None,
    hours: Annotated[
        float | None, typer.Option(help="The last N hours (instead of --since).")
    ] = None,
    tenant: Annotated[str | None, typer.Option(help="Only this tenant.")] = None,
    fmt: Annotated[Format, typer.Option("--format", help="table, csv or json.")] = Format.TABLE,
    db: DbOption = None,
) -> None:
    """Requests and tokens per tenant and model over a time range, from the usage ledger.

    Example: gpufleet usage --hours 24 --format csv
    """
    with user_errors():
        start = time.time() - hours * 3600 if hours is not None else _time(since)
        store = Store.open(db)
        try:
            rows = store.usage(start, _time(until), tenant)
        finally:
            store.close()
    data = [dataclasses.asdict(r) for r in rows]
    if fmt is Format.JSON:
        typer.echo(json.dumps(data, indent=2))
        return
    columns = [f.name for f in dataclasses.fields(rows[0])] if rows else []
    if fmt is Format.CSV:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=columns or ["tenant", "model"])
        writer.writeheader()
        writer.writerows(data)
        typer.echo(out.getvalue(), nl=False)
        return
    table = Table(title="usage")
    for column in columns or ["tenant", "model", "requests"]:
        table.add_column(column, justify="left" if column in ("tenant", "model") else "right")
    for row in data:
        table.add_row(*(str(v) for v in row.values()))
    Console(width=160).print(table)
