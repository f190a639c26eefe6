"""The fleet's side of the admin API, what the console reads and does::

    GET  /admin/fleet                  viewer    pools, replicas and their state, load, rates,
                                                 TTFT/ITL P50/P99 over the window, chart series
    GET  /admin/events[?after=SEQ]     viewer    ejections, scale decisions, replica changes,
                                                 operators' actions (newest last)
    GET  /admin/quotas                 viewer    each tenant's use against its quotas (auth on)
    POST /admin/replicas/{name}/drain  operator  no new requests; stopped when idle

A drain goes through :class:`FleetActions`, which ``gpufleet up`` implements on its local
runtime (the same drain as a scale-in: the replica is published ``draining`` at once, the
controller stops routing to it, and the runtime stops it once its in-flight requests are
done); a gateway given none (a fixed list of replicas) answers 409.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Final, Protocol

from gpufleet.fleet import ReplicaId, ReplicaState
from gpufleet.gateway._admin_routes import AdminRoute
from gpufleet.gateway._errors import GatewayError
from gpufleet.store import Role

if TYPE_CHECKING:
    from gpufleet.gateway._admin import AdminCall


class FleetActions(Protocol):
    """What the console's operators may do to replicas (``gpufleet up``: the runtime)."""

    def drain(self, pool: str, replica: ReplicaId) -> None:
        """Take ``replica`` out of ``pool``: no new requests, stopped once idle; the pool
        wants one replica fewer. ``ValueError`` (with why) when it cannot."""
        ...


class ConflictError(GatewayError):
    status = 409
    type = "invalid_request_error"


class ReplicaNotFoundError(GatewayError):
    status = 404
    type = "not_found_error"


async def _fleet(call: AdminCall) -> tuple[int, Any]:
    return 200, call.api.watch.fleet()


async def _events(call: AdminCall) -> tuple[int, Any]:
    after = call.query.get("after", "0")
    seq = int(after) if after.isdigit() else 0
    timeline = call.api.control.timeline
    return 200, {"last": timeline.last, "events": timeline.after(seq)}


async def _quotas(call: AdminCall) -> tuple[int, Any]:
    tenancy = call.tenancy
    now = call.api.clock()
    hour = await asyncio.to_thread(tenancy.store.usage, time.time() - 3600.0)
    used: dict[str, dict[str, int]] = {}
    for row in hour:
        mine = used.setdefault(row.tenant, {"requests": 0, "errors": 0, "tokens": 0})
        mine["requests"] += row.requests
        mine["errors"] += row.errors
        mine["tokens"] += row.prompt_tokens + row.completion_tokens
    tenants = []
    for name, settings in sorted(tenancy.snapshot.tenants.items()):
        quota = tenancy.quotas.local(name)  # this gateway's book (with Redis: its mirror)
        tenants.append(
            {
                "name": name,
                "priority": settings.priority,
                "weight": settings.weight,
                "rpm": {"used": quota.requests_in_window(now), "limit": settings.rpm},
                "tpm": {"used": quota.tokens_in_window(now), "limit": settings.tpm},
                "concurrency": {"used": quota.running, "limit": settings.concurrency},
                "last_hour": used.get(name, {"requests": 0, "errors": 0, "tokens": 0}),
            }
        )
    return 200, {"tenants": tenants}


async def _drain(call: AdminCall) -> tuple[int, Any]:
    (name,) = call.args
    api = call.api
    upstream = api.control.upstreams.get(ReplicaId(name))
    if upstream is None:
        raise ReplicaNotFoundError(f"no replica {name!r}")
    if api.actions is None:
        raise ConflictError("this gateway does not run its replicas: nothing here can drain one")
    if upstream.state in (ReplicaState.DRAINING, ReplicaState.STOPPED):
        raise ConflictError(f"replica {name!r} is already {upstream.state.value}")
    try:
        api.actions.drain(upstream.model, upstream.name)
    except (ValueError, KeyError) as error:
        raise ConflictError(f"cannot drain {name!r}: {error}") from None
    text = f"{name}: drain asked by {call.principal.actor}"
    api.control.timeline.add(api.clock(), "action", upstream.model, text, replica=name)
    return 202, {"replica": name, "model": upstream.model, "drain": "started"}


FLEET_ROUTES: Final = (
    AdminRoute("GET", ("fleet",), Role.VIEWER, _fleet, store=False),
    AdminRoute("GET", ("events",), Role.VIEWER, _events, store=False),
    AdminRoute("GET", ("quotas",), Role.VIEWER, _quotas),
    AdminRoute("POST", ("replicas", "{}", "drain"), Role.OPERATOR, _drain, store=False),
)
"""The fleet's routes, after ``_admin.ROUTES`` in the gateway's table."""
