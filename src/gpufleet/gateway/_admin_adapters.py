"""LoRA adapters in the admin API (docs/residency.md, "LoRA adapters")::

    GET  /admin/adapters    viewer    per pool with a ``lora`` block: its settings, every
                                      adapter it serves (name, path), which replica holds
                                      which (least recently used first), what placement did
    POST /admin/adapters    operator  register an adapter at run time:
                                      {"model": POOL, "name": …, "path": …, "rank": 8}

A registered adapter is a served name at once (``/v1/models`` lists it), loaded where it is
needed as the fleet file's are. It is the controller's event (``AdapterAdded``: recorded and
replayed). It lives as long as the gateway does: put it in the fleet file to keep it across a
restart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from gpufleet.control import AdapterAdded, AdapterConfig
from gpufleet.gateway._admin_routes import AdminRoute, named_body
from gpufleet.gateway._errors import BadRequestError, ConflictError, NotFoundError
from gpufleet.store import Role

if TYPE_CHECKING:
    from gpufleet.gateway._admin import AdminCall


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
        control.add_adapter(AdapterAdded(model, adapter.name, adapter.path, adapter.rank))
    except ValueError as error:
        kind = ConflictError if "already" in str(error) else BadRequestError
        raise kind(str(error)) from None
    now = call.api.clock()
    text = f"adapter {adapter.name} registered by {call.principal.actor}"
    control.timeline.add(now, "action", model, text)
    return 201, {"model": model, "name": adapter.name, "path": adapter.path, "rank": adapter.rank}


ADAPTER_ROUTES: Final = (
    AdminRoute("GET", ("adapters",), Role.VIEWER, _list, store=False),
    AdminRoute("POST", ("adapters",), Role.OPERATOR, _add, store=False),
)
"""LoRA adapters' routes, after the rollouts' in the gateway's table."""
