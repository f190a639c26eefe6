"""Served names over pools: which pool a request goes to, and where it goes when that pool
cannot answer. Written once, for the gateway and the simulator (both drive
:class:`~gpufleet.control.FleetController`, which owns these).

::

    Arrived(model="chat") ─► chain = chat, *chat.fallbacks      (the name the client sent)
                             step 0: chat's variants ─► choose_variant(session key) ─► pool
                                     (only variants whose context holds the prompt and the
                                      output asked for, when one in the chain does; one no
                                      pool holds goes where it would have: its engine
                                      answers the 400; a batch request to its spot variants,
                                      another to the others, when it has both: docs/spot.md)
    Reject(shed | expired | no_replica | hold_* | exhausted) from that pool
                           ─► Fallback ─► step 1: the next name's variant (same key) …
                           ─► the last name's Reject is the request's

A name is *plain* when it is one pool's own name with no fallbacks: its requests take the
old path (no bookkeeping, no ``model`` in their commands), so fleet files without variants
decide, and record, exactly as before.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from gpufleet.config import FleetConfig
from gpufleet.control._events import Arrived, Route
from gpufleet.control._settings import PoolSettings
from gpufleet.fleet import RouteRequest
from gpufleet.policy import BATCH, choose_variant


@dataclass(slots=True)
class ServedModel:
    """One served name: its variants (pool, weight), its fallbacks and what it counted."""

    name: str
    variants: list[tuple[str, float]]
    """``(pool, weight)``; the weights change at run time (a ``Weights`` event)."""
    fallbacks: tuple[str, ...]
    hashes: bool
    """Whether a pool it can reach reads prefix hashes (only then are they computed)."""
    plain: bool
    """One variant, the pool of its own name, no fallbacks: no bookkeeping."""
    batch_only: frozenset[str] = frozenset()
    """Its variants that take only the ``batch`` class (spot pools, ``spot.interactive``
    off): batch requests go to them, the others to the other variants."""
    reach: int | None = None
    """The longest context among the pools it can reach (``None``: some pool's is not
    known): a request within it (prompt and asked-for output) is sent only to variants
    whose context holds it."""
    adapter: bool = False
    """It is a LoRA adapter of its one variant (pool): its requests go there as requests
    for the adapter (``RouteRequest.adapter``)."""
    arrived: int = 0
    """Requests that named it (counted for the names that are not plain)."""
    chosen: dict[str, int] = field(default_factory=dict)
    """Per pool: requests that named this name and were sent to that variant (the weighted
    split as it came out; a request no variant could hold went to a fallback instead)."""

    @property
    def chain(self) -> tuple[str, ...]:
        return (self.name, *self.fallbacks)

    def weights(self) -> dict[str, float]:
        return dict(self.variants)

    def reweigh(self, weights: tuple[tuple[str, float], ...]) -> None:
        """Set the named variants' weights (``ValueError``: an unknown pool, a negative
        weight, or no positive weight left)."""
        current = dict(self.variants)
        for pool, weight in weights:
            if pool not in current:
                raise ValueError(
                    f"weights: {pool!r} is not a variant of {self.name!r} "
                    f"(variants: {', '.join(current)})"
                )
            if not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"weights: {pool!r}: {weight!r} is not a weight (≥ 0)")
            current[pool] = weight
        if not any(w > 0 for w in current.values()):
            raise ValueError(f"weights: {self.name!r} needs one variant of positive weight")
        self.variants = list(current.items())


def served_models(fleet: FleetConfig, settings: dict[str, PoolSettings]) -> dict[str, ServedModel]:
    """Every served name of ``fleet`` (``FleetConfig.served_names``), over pools with
    ``settings``."""
    routes = fleet.served_names()
    adapters = fleet.adapters()
    by_name = {r.name: r for r in routes}
    out: dict[str, ServedModel] = {}
    for route in routes:
        pools = [v.pool for name in (route.name, *route.fallbacks) for v in by_name[name].variants]
        contexts = [settings[p].context for p in pools]
        out[route.name] = ServedModel(
            route.name,
            [(v.pool, v.weight) for v in route.variants],
            route.fallbacks,
            hashes=any(settings[p].hashes for p in pools),
            plain=(
                len(route.variants) == 1
                and route.variants[0].pool == route.name
                and not route.fallbacks
            ),
            reach=None if any(c is None for c in contexts) else max(c for c in contexts if c),
            batch_only=frozenset(v.pool for v in route.variants if settings[v.pool].batch_only),
            adapter=route.name in adapters,
        )
    return out


class Flight:
    """A request of a name that is not plain, from its arrival until it ends: where it is
    and what it tried (a plain class: one per such request)."""

    __slots__ = ("arrived", "fit", "key", "name", "need", "pool", "step", "tried")

    def __init__(self, arrived: Arrived, reach: int | None) -> None:
        self.arrived = arrived
        request = arrived.request
        self.key = request.session_key or request.request_id
        """What picks its variant at every step: its session key, else its own id."""
        self.need = request.prompt_tokens + (request.max_tokens or 0)
        """The context it needs: its prompt and the output it asks for."""
        self.fit = reach is None or self.need <= reach
        """Whether only variants whose context holds it are chosen (some pool of its chain
        does; else it goes where it would without a context rule, and its engine says no)."""
        self.name = request.model
        """The served name it is in now (a step of its chain)."""
        self.step = -1
        self.pool = ""
        self.tried: list[str] = []


def choose(
    served: ServedModel,
    flight: Flight,
    contexts: dict[str, int | None],
    budgeted: Callable[[list[tuple[str, float]], Flight], str | None] | None = None,
) -> str | None:
    """The pool of ``served`` that ``flight`` goes to: not one it tried, holding its prompt
    and output if it must; ``None``: none. A request with a latency budget is placed by
    ``budgeted`` (the cheapest variant predicted to meet it) when the controller has one."""
    need = flight.need
    candidates = [
        (pool, weight)
        for pool, weight in served.variants
        if pool not in flight.tried
        and (not flight.fit or (context := contexts[pool]) is None or need <= context)
    ]
    if served.batch_only and candidates:
        candidates = by_class(candidates, served.batch_only, flight.arrived.priority == BATCH)
    if not candidates:
        return None
    if budgeted is not None and flight.arrived.budget is not None and len(candidates) > 1:
        pool = budgeted(candidates, flight)
        if pool is not None:
            return pool
    return choose_variant(flight.key, candidates)


def within_budget(
    candidates: list[tuple[str, float]],
    budget: float,
    predict: Callable[[str], float],
    price: Callable[[str], float],
) -> str | None:
    """The variant of positive weight (any, if none has) predicted to answer within
    ``budget`` seconds on the cheapest replicas (``price``: a replica-hour's), the faster
    of two as cheap; none does: the one predicted fastest. ``None``: no prediction for any.

    Cheapest, not cheapest per request: a loose budget goes to the cheap GPUs, and the
    dear, fast ones stay free for the budgets only they meet (as tiered serving does)."""
    pools = [p for p, w in candidates if w > 0] or [p for p, _ in candidates]
    scored = [(predict(p), p) for p in pools]
    scored = [(t, p) for t, p in scored if math.isfinite(t)]
    if not scored:
        return None
    meets = [(price(p), t, p) for t, p in scored if t <= budget]
    if meets:
        return min(meets)[2]
    return min(scored)[1]


def by_class(
    candidates: list[tuple[str, float]], batch_only: frozenset[str], batch: bool
) -> list[tuple[str, float]]:
    """A batch request's candidates are the batch-only (spot) variants, another request's
    the others; all of them when its own side has none left of positive weight (a name
    whose on-demand variants are weighted 0, or tried, serves interactive work on spot
    rather than none)."""
    own = [(p, w) for p, w in candidates if (p in batch_only) == batch and w > 0]
    return own or candidates


# built field by field: dataclasses.replace costs ~4 µs a call, on every such request's path


def adapter_hashes(hashes: tuple[int, ...], adapter: str) -> tuple[int, ...]:
    """A LoRA adapter's prompt's prefix hashes: vLLM keys its prefix cache by adapter (a
    prompt cached for the base model or another adapter is no hit), so the router's index
    does too: each hash chained with a stable key of the adapter's name (CRC-32: the same
    in every process, as the simulator's hashes must be)."""
    if not hashes:
        return hashes
    key = zlib.crc32(adapter.encode())
    return tuple(hash((key, h)) for h in hashes)


def in_pool(arrived: Arrived, pool: str, adapter: str | None = None) -> Arrived:
    """``arrived`` as the pool sees it: the request under the pool's name (asking for
    ``adapter``, a LoRA adapter the pool serves: its prefix hashes are the adapter's)."""
    r = arrived.request
    request = RouteRequest(
        r.request_id,
        pool,
        r.prefix_hashes if adapter is None else adapter_hashes(r.prefix_hashes, adapter),
        r.prompt_tokens,
        r.session_key,
        r.tenant,
        r.max_tokens,
        r.block_hashes,
        adapter,
    )
    return Arrived(
        request,
        arrived.priority,
        arrived.weight,
        arrived.deadline,
        arrived.resumable,
        arrived.recallable,
        arrived.budget,
    )


def route_in(route: Route, pool: str) -> Route:
    """``route`` naming its ``pool``."""
    return Route(
        route.request_id,
        route.replica,
        route.retry,
        route.policy,
        route.panic,
        route.matched,
        route.held,
        route.resume,
        pool,
        route.load,
        route.priority,
    )
