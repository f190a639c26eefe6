"""LoRA adapters in the admin API (docs/residency.md, "LoRA adapters")::

    GET  /admin/adapters    viewer    per pool with a ``lora`` block: its settings, every
                                      adapter it serves (name, path), which replica holds
                                      which (least recently used first), what placement did
    POST /admin/adapters    operator  register an adapter at run time:
                                      {"model": POOL, "name": …, "path": …, "rank": 8}

A registered adapter is a served name at once (``/v1/models`` lists it), loaded where it is
needed as the fleet file's are. It is the controller's event (``AdapterAdded``: recorded and
replayed), and a row of the store's ``adapters`` table (auth on): a restarted gateway
registers it again (``restore_adapters``). With auth off there is no store: it lives as long
as the gateway does (the fleet file keeps adapters for good).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Final

from gpufleet.control import AdapterAdded, AdapterConfig
from gpufleet.gateway._admin_routes import AdminRoute, named_body
from gpufleet.gateway._errors import BadRequestError, ConflictError, NotFoundError
from gpufleet.store import Role

if TYPE_CHECKING:
    from gpufleet.gateway._admin import AdminCall
    from gpufleet.gateway._control import LiveControl
    from gpufleet.store import Store

logger = logging.getLogger("gpufleet.gateway")


async def _list(call: AdminCall) -> tuple[int, Any]:
    pools: dict[str, Any] = {}
    for name, pool in call.api.control.pools.items():
        adapters = pool.adapters
        if adapters is None:
            continue
        config, c = adapters.config, adapters.counters
        pools[name] = {
            "max_loras": config.max_loras,
            "max_lora_rank": config.max_lora_rank,
            "affinity": config.affinity,
            "evict": config.evict,
            "adapters": [{"name": a, "path": p} for a, p in adapters.registered.items()],
            "held": {r: list(held) for r, held in sorted(adapters.held().items())},
            "counters": {
                "requests": c.requests,
                "loads": c.loads,
                "unloads": c.unloads,
                "over_cap": c.over_cap,
                "waits": c.waits,
            },
        }
    return 200, {"pools": pools}


async def _add(call: AdminCall) -> tuple[int, Any]:
    model, adapter = named_body(
        call.body, "model", "name the pool that serves the adapter", AdapterConfig
    )
    control = call.api.control
    pool = control.pools.get(model)
    if pool is None:
        raise NotFoundError(f"no pool {model!r} (pools: {', '.join(control.pools)})")
    try:
        control.handle(AdapterAdded(model, adapter.name, adapter.path, adapter.rank))
    except ValueError as error:
        kind = ConflictError if "already" in str(error) else BadRequestError
        raise kind(str(error)) from None
    tenancy = call.api.tenancy
    if tenancy is not None:  # kept for the next start (auth off: no store, this run only)
        store = tenancy.store
        await asyncio.to_thread(store.adapters.put, adapter.name, model, adapter.path, adapter.rank)
    now = call.api.clock()
    text = f"adapter {adapter.name} registered by {call.principal.actor}"
    control.timeline.add(now, "action", model, text)
    return 201, {"model": model, "name": adapter.name, "path": adapter.path, "rank": adapter.rank}


def restore_adapters(control: LiveControl, store: Store) -> None:
    """At the gateway's start: register again the adapters the store kept. One that no
    longer fits the fleet file (its pool gone or without ``lora``, its name now taken, its
    rank too big) is logged and skipped."""
    for name, model, path, rank in store.adapters.all():
        try:
            control.handle(AdapterAdded(model, name, path, rank))
        except ValueError as error:
            logger.warning("adapter %s: not registered again: %s", name, error)


ADAPTER_ROUTES: Final = (
    AdminRoute("GET", ("adapters",), Role.VIEWER, _list, store=False),
    AdminRoute("POST", ("adapters",), Role.OPERATOR, _add, store=False),
)
"""LoRA adapters' routes, after the rollouts' in the gateway's table."""
