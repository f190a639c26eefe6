"""The admin API under ``/admin``, behind its own credential (``Authorization: Bearer
$GPUFLEET_ADMIN_KEY``); every call is audited::

    GET    /admin/tenants                      every tenant and its settings
    PUT    /admin/tenants/{name}               create or replace a tenant's settings
    GET    /admin/keys[?tenant=NAME]           active keys (ids, never secrets)
    POST   /admin/keys                         {"tenant": …, settings…} → {"key": …} (shown once)
    POST   /admin/keys/{key_id}/rotate         revoke it, issue its tenant a new key
    DELETE /admin/keys/{key_id}                revoke
    GET    /admin/usage[?since=&until=&tenant=]  per tenant and model (Unix seconds)
    GET    /admin/audit[?limit=N]              the latest audit entries

Changes apply in this gateway at once (its key snapshot is reloaded before answering).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from gpufleet.gateway._errors import (
    BadRequestError,
    GatewayError,
    MethodNotAllowedError,
    PayloadTooLargeError,
    RouteNotFoundError,
)
from gpufleet.gateway._tenancy import Tenancy
from gpufleet.gateway._tenancy_errors import ForbiddenError, UnauthorizedError
from gpufleet.store import StoreError, TenantSettings, settings_dict

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
_MAX = 1 << 20
_MAX_QUOTA = 10**15
"""Largest rpm, tpm or concurrency (a database integer holds it; no real tenant needs more)."""
_MAX_WEIGHT = 1e6
_MAX_AUDIT = 10_000
_SETTINGS = frozenset(f.name for f in dataclasses.fields(TenantSettings))


class NotFoundError(GatewayError):
    status = 404
    type = "not_found_error"


async def handle_admin(
    tenancy: Tenancy, scope: Any, receive: Receive, send: Send, rid: tuple[bytes, bytes]
) -> None:
    if tenancy.admin_key is None:
        raise ForbiddenError(
            f"the admin API is off: set ${tenancy.config.admin_key_env} (or "
            "tenants.admin_key_file) for the gateway"
        )
    path, method = scope["path"], scope["method"]
    if not tenancy.is_admin(scope):
        tenancy.audit("anonymous", "admin.denied", f"{method} {path}", "denied")
        raise UnauthorizedError("The admin API needs the admin credential.")
    parts = [p for p in path.split("/") if p][1:]
    raw_query = scope.get("query_string", b"").decode("utf-8", "replace")
    query = {k: v[-1] for k, v in parse_qs(raw_query).items()}
    body = await _read(receive) if method in ("POST", "PUT") else b""
    try:
        status, answer = await _route(tenancy, method, parts, query, body)
    except StoreError as error:
        tenancy.audit("admin", f"admin.{method.lower()}", path, "failed", {"error": str(error)})
        raise (NotFoundError if "no active key" in str(error) else BadRequestError)(
            str(error)
        ) from None
    if method != "GET":
        tenancy.audit("admin", f"admin.{method.lower()}", path, "ok", _redacted(answer))
        await tenancy.reload_async()
    data = json.dumps(answer).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(data)),
                rid,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


async def _route(  # noqa: PLR0911 - one return per route
    tenancy: Tenancy, method: str, parts: list[str], query: dict[str, str], body: bytes
) -> tuple[int, Any]:
    store = tenancy.store
    match parts:
        case ["tenants"]:
            _only(method, "GET")
            return 200, [
                {"name": t.name, **settings_dict(t.settings)}
                for t in await asyncio.to_thread(store.tenants)
            ]
        case ["tenants", name]:
            _only(method, "PUT")
            settings = _settings(_json(body))
            await asyncio.to_thread(store.put_tenant, _name(name), settings)
            return 200, {"name": name, **settings_dict(settings)}
        case ["keys"] if method == "GET":
            keys = await asyncio.to_thread(store.keys, query.get("tenant"))
            return 200, [dataclasses.asdict(k) for k in keys]
        case ["keys"]:
            _only(method, "POST")
            data = _json(body)
            tenant = data.pop("tenant", None)
            if not isinstance(tenant, str):
                raise BadRequestError("`tenant` is required (a string)")
            new = _settings(data) if data else None
            info, key = await asyncio.to_thread(store.create_key, _name(tenant), new)
            return 201, {**dataclasses.asdict(info), "key": key}
        case ["keys", key_id, "rotate"]:
            _only(method, "POST")
            info, key = await asyncio.to_thread(store.rotate_key, key_id)
            return 201, {**dataclasses.asdict(info), "key": key}
        case ["keys", key_id]:
            _only(method, "DELETE")
            return 200, dataclasses.asdict(await asyncio.to_thread(store.revoke_key, key_id))
        case ["usage"]:
            _only(method, "GET")
            since, until = _number(query, "since"), _number(query, "until")
            rows = await asyncio.to_thread(store.usage, since, until, query.get("tenant"))
            return 200, [dataclasses.asdict(r) for r in rows]
        case ["audit"]:
            _only(method, "GET")
            limit = _number(query, "limit")
            limit = 100 if limit is None else int(min(max(limit, 1), _MAX_AUDIT))
            return 200, await asyncio.to_thread(store.audit_entries, limit)
    raise RouteNotFoundError(f"no admin route {method} /admin/{'/'.join(parts)}")


def _only(method: str, allowed: str) -> None:
    if method != allowed:
        raise MethodNotAllowedError(f"{method} is not allowed here (use {allowed})")


def _json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body or b"{}")
    except ValueError as error:
        raise BadRequestError(f"the body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise BadRequestError("the body must be a JSON object")
    return data


def _settings(data: dict[str, Any]) -> TenantSettings:
    """Settings from a JSON object, every field's type and range checked here: what reaches
    the store is what its columns hold (a 400 otherwise, never a 500 from the database)."""
    unknown = set(data) - _SETTINGS
    if unknown:
        raise BadRequestError(f"unknown settings: {', '.join(sorted(unknown))}")
    models = data.get("models")
    if models is not None:
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise BadRequestError("`models` must be a list of model names (or null)")
        data["models"] = tuple(_text(m, "a model name") for m in models)
    for name in ("rpm", "tpm", "concurrency"):
        value = data.get(name)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= _MAX_QUOTA
        ):
            raise BadRequestError(
                f"`{name}` must be a whole number from 1 to {_MAX_QUOTA} (or null)"
            )
    if "weight" in data:
        weight = data["weight"]
        if (
            not isinstance(weight, int | float)
            or isinstance(weight, bool)
            or not 0 < weight <= _MAX_WEIGHT  # (NaN fails this too)
        ):
            raise BadRequestError(f"`weight` must be a number over 0, at most {_MAX_WEIGHT:g}")
        data["weight"] = float(weight)
    if "priority" in data and not isinstance(data["priority"], str):
        raise BadRequestError("`priority` must be a string")
    try:
        return TenantSettings(**data)
    except (TypeError, StoreError) as error:
        raise BadRequestError(str(error)) from None


def _text(value: str, what: str) -> str:
    """``value`` if a database can hold it: UTF-8 (no lone surrogates) and no control
    characters (PostgreSQL refuses NUL)."""
    try:
        value.encode()
    except UnicodeEncodeError:
        raise BadRequestError(f"{what} must be valid Unicode text") from None
    if not value.isprintable():
        raise BadRequestError(f"{what} must hold no control characters")
    return value


def _name(tenant: str) -> str:
    if not 1 <= len(tenant) <= 128:
        raise BadRequestError("a tenant name is 1 to 128 characters")
    return _text(tenant, "a tenant name")


def _number(query: dict[str, str], name: str) -> float | None:
    value = query.get(name)
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if math.isnan(number):
        raise BadRequestError(f"`{name}` must be a number")
    return number


def _redacted(answer: Any) -> dict[str, Any] | None:
    if not isinstance(answer, dict):
        return None
    return {k: v for k, v in answer.items() if k != "key"}


async def _read(receive: Receive) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequestError("the client left")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > _MAX:
            raise PayloadTooLargeError("admin request body over 1 MiB")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)
