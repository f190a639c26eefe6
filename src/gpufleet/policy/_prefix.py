"""Prefix-aware routing: send a request where its longest prompt prefix is likely cached.

The router cannot see the replicas' KV caches, so it keeps its own approximate index of
what it sent where: per replica, the prefix-block hashes of the prompts it routed there, in
a bounded LRU. Two structures, one owner (:class:`PrefixIndex`)::

    lru[replica]     OrderedDict  h → None, least recently sent first, at most `capacity`
    holders          dict         h → bitmask of replicas whose LRU holds h

    request hashes    h0    h1    h2    h3
    holders          1011  1001  0001  ----       (bit i = replica in slot i)
    alive            1011  1001  0001  0000  →  slot 1: 1 block, slot 3: 2 … slot 0: 3 blocks

Matching walks the request's hashes once, AND-ing the holder masks: a replica drops out at
the first block it lacks, and its match length is the depth where it dropped. The cost is
the length of the longest match, whatever the number of replicas.

A prompt's blocks are inserted deepest first and its root last, so within a prompt the root
is the most recently used: LRU eviction takes a prefix's tail before its head, and a
replica's entries stay (nearly) prefix-closed, as an engine's cache does.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from random import Random
from types import MappingProxyType

from gpufleet.fleet import (
    FleetView,
    Outcome,
    ReplicaId,
    ReplicaState,
    RouteRequest,
)
from gpufleet.policy._config import PrefixSettings
from gpufleet.policy._ranking import (
    CandidateFilter,
    CandidateMemo,
    LoadSnapshot,
    LoadTracker,
    PoolShape,
    Ranking,
    order_by_key,
    outstanding,
    shape_of,
)
from gpufleet.policy._routers import default_filters

_FRESH_CACHE = frozenset({ReplicaState.STARTING, ReplicaState.STOPPED})
"""States in which a replica's real cache is empty (or gone): its index entries are dropped."""


def record_depth(
    owner: Mapping[int, ReplicaId], mask: int, depth: int, matched: dict[ReplicaId, int]
) -> None:
    """``matched[r] = depth`` for each replica whose bit (its slot in ``owner``) is in
    ``mask``: the index walks a prompt's blocks with one bit per replica."""
    while mask:
        low = mask & -mask
        matched[owner[low.bit_length() - 1]] = depth
        mask ^= low


class PrefixIndex:
    """Per replica, the last ``capacity`` prefix blocks routed to it; longest-prefix lookup."""

    __slots__ = ("_free", "_holders", "_lru", "_owner", "_slot", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a prefix index needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity
        self._slot: dict[ReplicaId, int] = {}
        self._owner: dict[int, ReplicaId] = {}
        self._free: list[int] = []  # a heap of released slots: masks stay small
        self._lru: dict[ReplicaId, OrderedDict[int, None]] = {}
        self._holders: dict[int, int] = {}

    def __len__(self) -> int:
        """Distinct hashes indexed (at most ``capacity`` × replicas)."""
        return len(self._holders)

    def replicas(self) -> tuple[ReplicaId, ...]:
        return tuple(self._lru)

    def size(self, replica: ReplicaId) -> int:
        """Hashes held for ``replica`` (at most ``capacity``)."""
        lru = self._lru.get(replica)
        return 0 if lru is None else len(lru)

    def match(self, hashes: Sequence[int]) -> dict[ReplicaId, int]:
        """Per replica holding the first block, how many leading blocks of ``hashes`` it holds."""
        if not hashes:
            return {}
        holders = self._holders
        alive = holders.get(hashes[0], 0)
        if not alive:
            return {}
        matched: dict[ReplicaId, int] = {}
        for depth in range(1, len(hashes)):
            still = alive & holders.get(hashes[depth], 0)
            if still != alive:
                record_depth(self._owner, alive & ~still, depth, matched)
                if not still:
                    return matched
                alive = still
        record_depth(self._owner, alive, len(hashes), matched)
        return matched

    def insert(self, replica: ReplicaId, hashes: Sequence[int]) -> None:
        """Record that ``replica`` was sent a prompt with these prefix blocks."""
        if not hashes:
            return
        lru = self._lru.get(replica)
        if lru is None:
            slot = heapq.heappop(self._free) if self._free else len(self._slot)
            self._slot[replica] = slot
            self._owner[slot] = replica
            lru = self._lru[replica] = OrderedDict()
        bit = 1 << self._slot[replica]
        holders = self._holders
        held, move = holders.get, lru.move_to_end  # (bound once: a long prompt has 256)
        for h in reversed(hashes):
            if h in lru:
                move(h)
            else:
                lru[h] = None
                holders[h] = held(h, 0) | bit
        excess = len(lru) - self.capacity
        if excess > 0:  # the oldest leave: _drop, inlined (a long prompt evicts ~its length)
            pop, keep = lru.popitem, ~bit
            for _ in range(excess):
                old = pop(last=False)[0]
                mask = holders[old] & keep
                if mask:
                    holders[old] = mask
                else:
                    del holders[old]

    def forget(self, replica: ReplicaId) -> None:
        """Drop everything indexed for ``replica`` (its cache is gone)."""
        lru = self._lru.pop(replica, None)
        if lru is None:
            return
        slot = self._slot.pop(replica)
        del self._owner[slot]
        heapq.heappush(self._free, slot)
        bit = 1 << slot
        for h in lru:
            self._drop(h, bit)

    def _drop(self, h: int, bit: int) -> None:
        mask = self._holders[h] & ~bit
        if mask:
            self._holders[h] = mask
        else:
            del self._holders[h]

    def check(self) -> None:
        """Assert the two structures agree and the bound holds (for tests)."""
        for replica, lru in self._lru.items():
            assert len(lru) <= self.capacity, f"{replica}: {len(lru)} > {self.capacity}"
            bit = 1 << self._slot[replica]
            for h in lru:
                assert self._holders[h] & bit, f"{replica}: {h} missing from holders"
        for h, mask in self._holders.items():
            assert mask, f"{h}: empty holder mask"
            for slot, replica in self._owner.items():
                assert bool(mask & (1 << slot)) == (h in self._lru[replica]), (h, replica)
        assert set(self._owner.values()) == set(self._lru), "slot table out of sync"


@dataclass(frozen=True, slots=True)
class PrefixSnapshot:
    index_sizes: Mapping[ReplicaId, int]
    """Prefix blocks indexed per replica."""
    indexed_hashes: int
    load: LoadSnapshot


class PrefixAwareRouter:
    """Longest cached prefix among replicas that are not overloaded; else least loaded.

    With ``load`` = :func:`outstanding` requests and ``least`` the smallest among the
    candidates, a replica is *overloaded* when::

        load > least + balance_abs   and   load > balance_rel × least

    Tier 0 holds the non-overloaded replicas with the longest match (at least
    ``min_match_blocks``), least loaded first, equal loads in random order; tier 1 holds
    everyone else by load. With no match worth the name there is one tier, by load.
    """

    name = "prefix_aware"

    def __init__(
        self,
        config: PrefixSettings,
        rng: Random,
        filters: tuple[CandidateFilter, ...] | None = None,
    ) -> None:
        self.config = config
        self._rng = rng
        self._candidates = CandidateMemo(
            default_filters(config.panic_threshold) if filters is None else filters
        )
        self._index = PrefixIndex(config.index_blocks)
        self._load = LoadTracker()
        self._synced_view: FleetView | None = None
        self._shapes: dict[str, PoolShape] = {}

    def rank(self, now: float, request: RouteRequest, view: FleetView) -> Ranking:
        if view is not self._synced_view:
            self._sync(view)
        candidates = self._candidates(request, view)
        replicas = candidates.replicas
        if not replicas:
            return Ranking((), self.name, candidates.panic)
        config, rng = self.config, self._rng
        shape = shape_of(self._shapes, request.model, replicas)
        ids = shape.ids
        loads = outstanding(shape, self._load.counts, now, config.max_scrape_age)
        matches = self._matches(now, request)
        if not matches:
            return Ranking((order_by_key(ids, loads, rng),), self.name, candidates.panic)

        least = min(loads)
        limit = max(least + config.balance_abs, least * config.balance_rel)
        position = shape.position
        best = 0
        matched: dict[ReplicaId, int] = {}
        for replica, found in matches.items():
            i = position.get(replica)
            if i is None:  # indexed, but not a candidate now
                continue
            matched[replica] = found
            if found > best and loads[i] <= limit:
                best = found
        if best < config.min_match_blocks:
            tiers: tuple[tuple[ReplicaId, ...], ...] = (order_by_key(ids, loads, rng),)
            return Ranking(tiers, self.name, candidates.panic, matched)
        hit = [
            k
            for replica, found in matched.items()
            if found == best and loads[k := position[replica]] <= limit
        ]
        first: tuple[ReplicaId, ...]
        if len(hit) == 1:  # mostly: one replica holds the longest prefix (no draw for it)
            first, rest = (ids[hit[0]],), [i for i in range(len(ids)) if i != hit[0]]
        else:
            hit.sort()
            taken = set(hit)
            rest = [i for i in range(len(ids)) if i not in taken]
            first = order_by_key([ids[i] for i in hit], [loads[i] for i in hit], rng)
        if not rest:
            return Ranking((first,), self.name, candidates.panic, matched)
        tiers = (first, order_by_key([ids[i] for i in rest], [loads[i] for i in rest], rng))
        return Ranking(tiers, self.name, candidates.panic, matched)

    def _matches(self, now: float, request: RouteRequest) -> dict[ReplicaId, int]:
        """Per indexed replica, the leading blocks of the request it is believed to hold."""
        return self._index.match(request.prefix_hashes)

    def _sync(self, view: FleetView) -> None:
        """Forget replicas that left the view or restarted (their caches are empty)."""
        for replica in self._index.replicas():
            seen = view.replica(replica)
            if seen is None or seen.state in _FRESH_CACHE:
                self._index.forget(replica)
        self._synced_view = view

    def on_request_start(self, now: float, request: RouteRequest, replica: ReplicaId) -> None:
        self._load.start(request, replica)
        self._index.insert(replica, request.prefix_hashes)

    def on_request_end(
        self, now: float, request: RouteRequest, replica: ReplicaId, outcome: Outcome
    ) -> None:
        self._load.end(request, replica)

    def snapshot(self) -> PrefixSnapshot:
        index = self._index
        sizes = {r: index.size(r) for r in index.replicas()}
        return PrefixSnapshot(MappingProxyType(sizes), len(index), self._load.snapshot())

    def check(self) -> None:
        """Assert the index's invariants (for tests)."""
        self._index.check()
