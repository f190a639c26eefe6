"""The fleet's side of the admin API, what the console reads and does::

    GET  /admin/fleet                  viewer    pools, replicas and their state, load, rates,
                                                 TTFT/ITL P50/P99 over the window, chart series
    GET  /admin/events[?after=SEQ]     viewer    ejections, scale decisions, replica changes,
                                                 operators' actions (newest last)
    GET  /admin/quotas                 viewer    each tenant's use against its quotas (auth on)
    POST /admin/replicas/{name}/drain  operator  no new requests; stopped when idle
    POST /admin/replicas/{name}/preempt operator a preemption notice ({"notice_s": 30}):
                                                 drained by the controller; its GPUs go
                                                 at the deadline (docs/spot.md)

A drain goes through :class:`FleetActions`, which ``gpufleet up`` implements on its local
runtime (the same drain as a scale-in: the replica is published ``draining`` at once, the
controller stops routing to it, and the runtime stops it once its in-flight requests are
done); a gateway given none (a fixed list of replicas) answers 409.

A preemption notice is the controller's (``Preempting``): the replica takes no new attempt
and what is left on it moves ``spot.abandon_before`` seconds ahead of the deadline. The
local runtime then emulates the provider (it kills the replica at the deadline and starts a
replacement); a gateway without a runtime takes the notice alone (a node termination
handler calls it, and the provider does the rest).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import TYPE_CHECKING, Any, Final, Protocol

from gpufleet.control import Preempting
from gpufleet.fleet import ReplicaId, ReplicaState
from gpufleet.gateway._admin_routes import AdminRoute
from gpufleet.gateway._errors import BadRequestError, GatewayError
from gpufleet.store import Role

if TYPE_CHECKING:
    from gpufleet.gateway._admin import AdminCall


class FleetActions(Protocol):
    """What the console's operators may do to replicas (``gpufleet up``: the runtime)."""

    def drain(self, pool: str, replica: ReplicaId) -> None:
        """Take ``replica`` out of ``pool``: no new requests, stopped once idle; the pool
        wants one replica fewer. ``ValueError`` (with why) when it cannot."""
        ...

    def preempt(self, pool: str, replica: ReplicaId, notice_s: float) -> bool:
        """The provider takes ``replica``'s GPUs ``notice_s`` from now: end its processes
        then (as the provider would) and replace it; ``False`` when they are not ours (an
        external endpoint). ``ValueError`` when it cannot."""
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


DEFAULT_NOTICE_S: Final = 30.0
"""A notice's lead when the call names none: the shortest a cloud gives (30 s; others give
up to 2 minutes)."""
MAX_NOTICE_S: Final = 3600.0


def _notice_s(body: bytes) -> float:
    try:
        data = json.loads(body or b"{}")
    except ValueError as error:
        raise BadRequestError(f"the body is not valid JSON: {error}") from None
    if not isinstance(data, dict) or data.keys() - {"notice_s"}:
        raise BadRequestError('the body is a JSON object with at most "notice_s"')
    notice = data.get("notice_s", DEFAULT_NOTICE_S)
    ok = isinstance(notice, int | float) and not isinstance(notice, bool)
    if not ok or not math.isfinite(notice) or not 0 <= notice <= MAX_NOTICE_S:
        raise BadRequestError(f"notice_s: seconds from 0 to {MAX_NOTICE_S:g}, got {notice!r}")
    return float(notice)


async def _preempt(call: AdminCall) -> tuple[int, Any]:
    (name,) = call.args
    api = call.api
    notice = _notice_s(call.body)
    upstream = api.control.upstreams.get(ReplicaId(name))
    if upstream is None:
        raise ReplicaNotFoundError(f"no replica {name!r}")
    if upstream.state is ReplicaState.STOPPED:
        raise ConflictError(f"replica {name!r} is stopped")
    ours = False
    if api.actions is not None:
        try:
            ours = api.actions.preempt(upstream.model, upstream.name, notice)
        except (ValueError, KeyError) as error:
            raise ConflictError(f"cannot preempt {name!r}: {error}") from None
    now = api.clock()  # the controller's clock too
    api.control.handle(Preempting(upstream.model, upstream.name, now + notice))
    text = f"{name}: preemption notice ({notice:g} s) from {call.principal.actor}"
    api.control.timeline.add(now, "action", upstream.model, text, replica=name)
    reclaim = "runtime" if ours else "provider"
    return 202, {"replica": name, "model": upstream.model, "notice_s": notice, "reclaim": reclaim}


FLEET_ROUTES: Final = (
    AdminRoute("GET", ("fleet",), Role.VIEWER, _fleet, store=False),
    AdminRoute("GET", ("events",), Role.VIEWER, _events, store=False),
    AdminRoute("GET", ("quotas",), Role.VIEWER, _quotas),
    AdminRoute("POST", ("replicas", "{}", "drain"), Role.OPERATOR, _drain, store=False),
    AdminRoute("POST", ("replicas", "{}", "preempt"), Role.OPERATOR, _preempt, store=False),
)
"""The fleet's routes, after ``_admin.ROUTES`` in the gateway's table."""
