"""LoRA adapters: where a request for an adapter goes, and which adapter a load evicts.

::

    lora: {max_loras: 8, load_guard: 8, adapters: [{name: sql, path: /adapters/sql, rank: 8}]}

    placement = place_adapter(adapter, order, slots, busy, value=value, config=config)
    placement.replica   # where the request goes
    placement.load      # the replica must load the adapter first (POST /v1/load_lora_adapter)
    placement.evict     # the adapter it unloads first to make room (or None)

An adapter is served under its own name on the replicas of its base model's pool. Each
replica holds at most ``max_loras`` adapters (vLLM's ``--max-loras``, and
``--max-cpu-loras`` set to the same, so what the engine registers is what it holds); a
request for one it does not hold pays a load (~0.1 s: ``gpufleet.perf.lora_load_seconds``).

**Affinity with a load guard.** ``order`` is the pool router's ranking (best first). The
request goes to the best-ranked replica that holds the adapter, unless that replica is
busier than the least busy candidate by more than ``load_guard`` requests in flight: then
the adapter is loaded on another replica (a hot adapter spreads over as many replicas as
its load needs, as llm-d's LoRA-affinity scorer and AIBrix's placement do). Without
``affinity`` (the baseline a plain router gives): the best-ranked replica, loading the
adapter if it lacks it.

**Where a load goes.** Among the replicas without the adapter that are within the guard of
the least busy, the one whose eviction costs least (a free slot costs nothing), ties by
rank; else the best-ranked that can load at all. **Which adapter a load evicts**: among the
replica's adapters with no request in flight, the one of least ``value``: its decayed
request rate over the fleet divided by how many replicas hold it (the rate a copy serves),
ties least recently used (``evict: lru``: the least recently used, as vLLM's own adapter
cache evicts). Plain LRU evicts a hot adapter that was idle a moment on this
replica as readily as a cold one; frequency keeps the Zipf head resident. An adapter with
requests in flight is never evicted: when every candidate's every slot is busy, the request
goes to the best holder (guard or not), else it waits at the gateway until an attempt ends
and frees a slot (the pool controller holds it). A retry or a resume goes where it is sent,
over that replica's cap if it must (the engine keeps the adapter cached: its
``--max-cpu-loras`` is twice ``max_loras``); the next load there evicts back down.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpufleet.fleet import ReplicaId

ADAPTER_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$"
"""A served name's characters (``config/_fleet.py``): clients send it as ``model``."""
_EMPTY: Mapping[str, int] = {}


class AdapterConfig(BaseModel):
    """One adapter: the name clients send as ``model``, where the engine loads it from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=ADAPTER_NAME)
    path: str = Field(min_length=1)
    """What vLLM's ``lora_path`` is: a directory with ``adapter_config.json`` and the
    weights, on the engine's machine (the sim engine reads the rank there if it exists)."""
    rank: int = Field(8, ge=1)
    """The adapter's rank (its load time grows with it; at most ``max_lora_rank``)."""


class LoraConfig(BaseModel):
    """A pool's LoRA adapters and how they are placed (docs/residency.md, "LoRA adapters")."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_loras: int = Field(8, ge=1)
    """Adapters one replica holds at once (vLLM's ``--max-loras``: adapters in one batch;
    its ``--max-cpu-loras``, the adapters it keeps loaded, is set to twice this, room for
    the loads that go over the cap when every slot is busy)."""
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16
    """The largest rank the engines accept (vLLM's ``--max-lora-rank``, one of its values)."""
    affinity: bool = True
    """Send an adapter's requests to replicas that hold it (``false``: to the router's
    pick, loading it there: the baseline)."""
    evict: Literal["demand", "lru"] = "demand"
    """Which idle adapter a full replica unloads: the least demanded per copy (``demand``),
    or the least recently used (``lru``: what vLLM's own adapter cache does)."""
    load_guard: int = Field(16, ge=0)
    """Requests in flight a holder may have beyond the least busy candidate before the
    adapter is loaded on another replica instead. 16 is ~6 % of vLLM's default batch cap
    (256), where a decode step is barely slower; a smaller guard copies hot adapters more
    often, each copy a slot the Zipf tail then misses (``bench/lora_affinity.py``: 8
    instead of 16 costs 26 % more loads at 8 req/s, and a higher TTFT P99)."""
    adapters: tuple[AdapterConfig, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> LoraConfig:
        seen: set[str] = set()
        for a in self.adapters:
            if a.name in seen:
                raise ValueError(f"adapter {a.name!r} is given twice")
            seen.add(a.name)
            if a.rank > self.max_lora_rank:
                raise ValueError(
                    f"adapter {a.name!r}: rank {a.rank} is above max_lora_rank {self.max_lora_rank}"
                )
        return self


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request for an adapter goes."""

    replica: ReplicaId
    load: bool = False
    """The replica does not hold the adapter: it loads it before the request."""
    evict: str | None = None
    """The adapter it unloads first (its slots are full)."""


def place_adapter(
    adapter: str,
    order: Sequence[ReplicaId],
    slots: Mapping[ReplicaId, Mapping[str, int]],
    busy: Mapping[ReplicaId, int],
    *,
    value: Callable[[str], float],
    config: LoraConfig,
) -> Placement | None:
    """Where a request for ``adapter`` goes among ``order`` (the router's ranking, best
    first). ``None``: nowhere now (``order`` is empty, or no replica holds the adapter and
    every slot of every one is busy: the request waits for one). ``slots[r]``: the adapters
    ``r`` holds, least recently used
    first, each with its requests in flight; ``busy[r]``: ``r``'s requests in flight;
    ``value(a)``: what keeping ``a`` is worth (see the module docstring)."""
    if not order:
        return None
    if not config.affinity:
        first = order[0]
        held = slots.get(first, _EMPTY)
        if adapter in held:
            return Placement(first)
        return load_on(first, adapter, held, value, config, force=True)
    ceiling = min(busy.get(r, 0) for r in order) + config.load_guard
    holders = [r for r in order if adapter in slots.get(r, _EMPTY)]
    for r in holders:
        if busy.get(r, 0) <= ceiling:
            return Placement(r)
    placed = _new_copy(adapter, order, slots, busy, ceiling, value, config)
    if placed is None and holders:  # every slot busy: the best holder, guard or not
        placed = Placement(holders[0])
    return placed


def _new_copy(  # noqa: PLR0917 - place_adapter's arguments, passed on
    adapter: str,
    order: Sequence[ReplicaId],
    slots: Mapping[ReplicaId, Mapping[str, int]],
    busy: Mapping[ReplicaId, int],
    ceiling: int,
    value: Callable[[str], float],
    config: LoraConfig,
) -> Placement | None:
    """A load of ``adapter`` on a replica that lacks it: within the guard, the cheapest
    eviction (ties by rank); else the best-ranked that can load; ``None``: none can."""
    best: tuple[float, int, Placement] | None = None
    fallback: Placement | None = None
    for i, r in enumerate(order):
        held = slots.get(r, _EMPTY)
        if adapter in held:
            continue
        placed = load_on(r, adapter, held, value, config, force=False)
        if placed is None:
            continue
        if busy.get(r, 0) <= ceiling:
            cost = 0.0 if placed.evict is None else value(placed.evict)
            if best is None or (cost, i) < best[:2]:
                best = (cost, i, placed)
        elif fallback is None:
            fallback = placed
    return best[2] if best is not None else fallback


def load_on(
    replica: ReplicaId,
    adapter: str,
    held: Mapping[str, int],
    value: Callable[[str], float],
    config: LoraConfig,
    *,
    force: bool,
) -> Placement | None:
    """A load of ``adapter`` on ``replica``, evicting its least valuable idle adapter if its
    slots are full; ``None`` when every slot is busy (unless ``force``: then over its cap)."""
    if len(held) < config.max_loras:
        return Placement(replica, load=True)
    idle = [a for a, n in held.items() if n == 0]  # least recently used first
    if not idle:
        return Placement(replica, load=True) if force else None
    # min keeps the first of equal values: the least recently used
    victim = idle[0] if config.evict == "lru" else min(idle, key=value)
    return Placement(replica, load=True, evict=victim)
