"""The admin API under ``/admin``: tenants, keys, usage, the audit log, admin credentials,
and (auth on or off) the fleet's state for the console. Every route names the least role
that may call it (viewer < operator < admin; the table is ``ROUTES`` here and
``FLEET_ROUTES`` in ``_admin_fleet``, written out in docs/console.md)::

    GET    /admin/whoami                       viewer    the caller's role
    GET    /admin/fleet, /admin/events, /admin/quotas,
    POST   /admin/replicas/{name}/drain        (the fleet's: ``_admin_fleet``)
    GET    /admin/rollouts[/{model}],
    POST   /admin/rollouts[/{model}/{action}]  (rollouts': ``_admin_rollouts``)
    GET    /admin/adapters,
    POST   /admin/adapters                     (LoRA adapters': ``_admin_adapters``)
    GET    /admin/tenants                      viewer    every tenant and its settings
    PUT    /admin/tenants/{name}               operator  create or replace a tenant's settings
    GET    /admin/keys[?tenant=NAME]           viewer    active keys (ids, never secrets)
    POST   /admin/keys                         operator  {"tenant": …, settings…} → {"key": …}
    POST   /admin/keys/{key_id}/rotate         operator  revoke it, issue its tenant a new key
    DELETE /admin/keys/{key_id}                operator  revoke
    GET    /admin/usage[?since=&until=&tenant=]  viewer  per tenant and model (Unix seconds)
    GET    /admin/audit[?limit=N]              viewer    the latest audit entries
    GET    /admin/admins                       admin     admin credentials (ids, roles, names)
    POST   /admin/admins                       admin     {"role": …, "name": …} → {"key": …}
    DELETE /admin/admins/{key_id}              admin     revoke an admin credential

Credentials: ``Authorization: Bearer`` the ``$GPUFLEET_ADMIN_KEY`` (role admin) or a ``gfa_``
key from ``gpufleet keys create --admin --role R``. No valid credential: 401; a role below
the route's: 403 (``permission_error``). Every action (any method but GET) and every refusal
is audited; reads are not (the console polls them every second). With auth off there is no
store and no credential: the fleet's reads are open, as ``/metrics`` is, and nothing else.
Changes apply in this gateway at once (its key snapshot is reloaded before answering).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import parse_qs, unquote

from gpufleet.config import FleetConfig
from gpufleet.gateway._admin_adapters import ADAPTER_ROUTES
from gpufleet.gateway._admin_fleet import FLEET_ROUTES, FleetActions
from gpufleet.gateway._admin_rollouts import ROLLOUT_ROUTES
from gpufleet.gateway._admin_routes import AdminRoute, match
from gpufleet.gateway._control import LiveControl
from gpufleet.gateway._errors import (
    BadRequestError,
    GatewayError,
    PayloadTooLargeError,
)
from gpufleet.gateway._tenancy import AdminPrincipal, Tenancy
from gpufleet.gateway._tenancy_errors import ForbiddenError, UnauthorizedError
from gpufleet.gateway._watch import FleetWatch
from gpufleet.store import Role, StoreError, TenantSettings, parse_role, settings_dict

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
_MAX = 1 << 20
_MAX_QUOTA = 10**15
"""Largest rpm, tpm or concurrency (a database integer holds it; no real tenant needs more)."""
_MAX_WEIGHT = 1e6
_MAX_AUDIT = 10_000
_SETTINGS = frozenset(f.name for f in dataclasses.fields(TenantSettings))
ANONYMOUS: Final = AdminPrincipal("anonymous", Role.VIEWER)
"""Who reads the fleet with auth off: nobody in particular, and only a viewer."""


class NotFoundError(GatewayError):
    status = 404
    type = "not_found_error"


@dataclass(slots=True)
class AdminCall:
    """One admin request, authorised: what a route's handler reads."""

    api: AdminApi
    principal: AdminPrincipal
    args: list[str]
    """The route's ``{}`` segments."""
    query: dict[str, str]
    body: bytes

    @property
    def tenancy(self) -> Tenancy:
        tenancy = self.api.tenancy
        assert tenancy is not None  # routes that need it are refused with auth off
        return tenancy


class AdminApi:
    """Authenticates, authorises by role, audits, and dispatches ``/admin`` requests."""

    def __init__(
        self,
        config: FleetConfig,
        tenancy: Tenancy | None,
        control: LiveControl,
        watch: FleetWatch,
        *,
        actions: FleetActions | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.tenancy = tenancy
        self.control = control
        self.watch = watch
        self.actions = actions
        """What operators may do to replicas (``None``: nothing; the gateway does not run
        them)."""
        self.clock = clock
        self.routes = (*ROUTES, *FLEET_ROUTES, *ROLLOUT_ROUTES, *ADAPTER_ROUTES)
        self._metrics_allow = tuple(
            ipaddress.ip_network(n, strict=False) for n in config.gateway.metrics_allow
        )

    async def handle(
        self, scope: Any, receive: Receive, send: Send, rid: tuple[bytes, bytes]
    ) -> None:
        path, method = scope["path"], scope["method"]
        tenancy = self.tenancy
        principal = self._principal(scope, path)
        route, args = match(self.routes, method, _segments(scope))
        if route.store and tenancy is None:
            raise NotFoundError(
                f"{method} {path} needs auth on (tenants, keys and the audit log live in its store)"
            )
        if not principal.role.allows(route.role):
            if tenancy is not None:
                detail = {"role": principal.role.value, "needs": route.role.value}
                tenancy.audit(
                    principal.actor, "admin.forbidden", f"{method} {path}", "denied", detail
                )
                raise ForbiddenError(
                    f"This credential's role is {principal.role.value}; {method} {path} needs "
                    f"{route.role.value}."
                )
            raise ForbiddenError(
                f"{method} {path} needs {route.role.value}: auth is off, so no credential can "
                "act (`gpufleet up --auth` and `gpufleet keys create --admin --role R`)"
            )
        raw_query = scope.get("query_string", b"").decode("utf-8", "replace")
        query = {k: v[-1] for k, v in parse_qs(raw_query).items()}
        body = await _read(receive) if method in ("POST", "PUT") else b""
        call = AdminCall(self, principal, args, query, body)
        try:
            status, answer = await route.handler(call)
        except (StoreError, GatewayError) as error:
            if method != "GET" and tenancy is not None:
                detail = {"error": str(error)}
                tenancy.audit(principal.actor, _action(method), path, "failed", detail)
            if isinstance(error, GatewayError):
                raise
            raise (NotFoundError if "no active" in str(error) else BadRequestError)(
                str(error)
            ) from None
        if method != "GET" and tenancy is not None:
            tenancy.audit(principal.actor, _action(method), path, "ok", _redacted(answer))
            await tenancy.reload_async()
        data = json.dumps(answer).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(data)),
                    (b"cache-control", b"no-store"),
                    rid,
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})

    def _principal(self, scope: Any, path: str) -> AdminPrincipal:
        """The caller's credential (401 without a valid one, audited); anyone with auth off."""
        tenancy = self.tenancy
        if tenancy is None:
            return ANONYMOUS
        if not tenancy.admin_enabled:
            raise ForbiddenError(
                f"the admin API is off: set ${tenancy.config.admin_key_env} (or "
                "tenants.admin_key_file) for the gateway, or create an admin credential "
                "(`gpufleet keys create --admin --role R`)"
            )
        principal = tenancy.admin_principal(scope)
        if principal is None:
            tenancy.deny(scope, path, "no valid admin credential")
            raise UnauthorizedError("The admin API needs an admin credential.")
        return principal

    def authorize(self, scope: Any, path: str) -> None:
        """A request outside ``/admin`` with auth on: a tenant's key (401 otherwise, audited),
        except that ``/metrics`` is also read from an allowed network
        (``gateway.metrics_allow``) or with an admin credential of any role."""
        tenancy = self.tenancy
        if tenancy is None:
            return
        if path != "/metrics":
            tenancy.authenticate(scope, path)
            return
        client = scope.get("client")
        if client and self._metrics_allow:
            try:
                address = ipaddress.ip_address(client[0])
            except ValueError:
                address = None
            if address is not None and any(address in n for n in self._metrics_allow):
                return
        if tenancy.admin_principal(scope) is not None:
            return
        tenancy.authenticate(scope, path)


def _action(method: str) -> str:
    return f"admin.{method.lower()}"


# -- tenants, keys, usage, audit, admin credentials ---------------------------------------


async def _whoami(call: AdminCall) -> tuple[int, Any]:
    tenancy = call.api.tenancy
    return 200, {
        "actor": call.principal.actor,
        "role": call.principal.role.value,
        "auth": tenancy is not None,
    }


async def _tenants(call: AdminCall) -> tuple[int, Any]:
    tenants = await asyncio.to_thread(call.tenancy.store.tenants)
    return 200, [{"name": t.name, **settings_dict(t.settings)} for t in tenants]


async def _put_tenant(call: AdminCall) -> tuple[int, Any]:
    (name,) = call.args
    settings = _settings(_json(call.body))
    await asyncio.to_thread(call.tenancy.store.put_tenant, _name(name), settings)
    return 200, {"name": name, **settings_dict(settings)}


async def _keys(call: AdminCall) -> tuple[int, Any]:
    keys = await asyncio.to_thread(call.tenancy.store.keys, call.query.get("tenant"))
    return 200, [dataclasses.asdict(k) for k in keys]


async def _create_key(call: AdminCall) -> tuple[int, Any]:
    data = _json(call.body)
    tenant = data.pop("tenant", None)
    if not isinstance(tenant, str):
        raise BadRequestError("`tenant` is required (a string)")
    new = _settings(data) if data else None
    info, key = await asyncio.to_thread(call.tenancy.store.create_key, _name(tenant), new)
    return 201, {**dataclasses.asdict(info), "key": key}


async def _rotate_key(call: AdminCall) -> tuple[int, Any]:
    info, key = await asyncio.to_thread(call.tenancy.store.rotate_key, call.args[0])
    return 201, {**dataclasses.asdict(info), "key": key}


async def _revoke_key(call: AdminCall) -> tuple[int, Any]:
    info = await asyncio.to_thread(call.tenancy.store.revoke_key, call.args[0])
    return 200, dataclasses.asdict(info)


async def _usage(call: AdminCall) -> tuple[int, Any]:
    since, until = _number(call.query, "since"), _number(call.query, "until")
    store = call.tenancy.store
    rows = await asyncio.to_thread(store.usage, since, until, call.query.get("tenant"))
    return 200, [dataclasses.asdict(r) for r in rows]


async def _audit(call: AdminCall) -> tuple[int, Any]:
    limit = _number(call.query, "limit")
    limit = 100 if limit is None else int(min(max(limit, 1), _MAX_AUDIT))
    return 200, await asyncio.to_thread(call.tenancy.store.audit_entries, limit)


def _admin_json(info: Any) -> dict[str, Any]:
    return {**dataclasses.asdict(info), "role": info.role.value}


async def _admins(call: AdminCall) -> tuple[int, Any]:
    admins = await asyncio.to_thread(call.tenancy.store.admins.list)
    return 200, [_admin_json(a) for a in admins]


async def _create_admin(call: AdminCall) -> tuple[int, Any]:
    data = _json(call.body)
    unknown = set(data) - {"role", "name"}
    if unknown:
        raise BadRequestError(f"unknown fields: {', '.join(sorted(unknown))}")
    name = data.get("name")
    if name is not None and not isinstance(name, str):
        raise BadRequestError("`name` must be a string (or null)")
    role = parse_role(data.get("role"))
    store = call.tenancy.store
    info, key = await asyncio.to_thread(
        store.admins.create, role, None if name is None else _text(name, "a name")
    )
    return 201, {**_admin_json(info), "key": key}


async def _revoke_admin(call: AdminCall) -> tuple[int, Any]:
    info = await asyncio.to_thread(call.tenancy.store.admins.revoke, call.args[0])
    return 200, _admin_json(info)


VIEWER, OPERATOR, ADMIN = Role.VIEWER, Role.OPERATOR, Role.ADMIN
ROUTES: Final = (
    AdminRoute("GET", ("whoami",), VIEWER, _whoami, store=False),
    AdminRoute("GET", ("tenants",), VIEWER, _tenants),
    AdminRoute("PUT", ("tenants", "{}"), OPERATOR, _put_tenant),
    AdminRoute("GET", ("keys",), VIEWER, _keys),
    AdminRoute("POST", ("keys",), OPERATOR, _create_key),
    AdminRoute("POST", ("keys", "{}", "rotate"), OPERATOR, _rotate_key),
    AdminRoute("DELETE", ("keys", "{}"), OPERATOR, _revoke_key),
    AdminRoute("GET", ("usage",), VIEWER, _usage),
    AdminRoute("GET", ("audit",), VIEWER, _audit),
    AdminRoute("GET", ("admins",), ADMIN, _admins),
    AdminRoute("POST", ("admins",), ADMIN, _create_admin),
    AdminRoute("DELETE", ("admins", "{}"), ADMIN, _revoke_admin),
)
"""The tenancy side of the admin API (the fleet's side: ``_admin_fleet.FLEET_ROUTES``)."""


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
    for name in ("rpm", "tpm", "concurrency", "batch_queue"):
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


def _segments(scope: Any) -> list[str]:
    """The path's segments after ``/admin``, each percent-decoded on its own: a served name
    with a ``/`` (``meta-llama/Llama-3.1-8B``) is one segment when sent as ``%2F``. Split
    from ``raw_path``, where the server gives one (the decoded ``path`` has lost the
    difference)."""
    raw = scope.get("raw_path")
    if raw:
        text = raw.decode("latin-1")
        return [unquote(p) for p in text.split("/") if p][1:]
    return [p for p in scope["path"].split("/") if p][1:]
