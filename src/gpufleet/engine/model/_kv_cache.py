"""The KV cache manager: each request's block table over the block pool, and prefix lookups.

The scheduler asks for slots and gets blocks or ``None``; it never sees the pool. A request's
block table covers its computed tokens plus the ones scheduled this step (block size 4)::

    token     0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15 |
    computed  ================= c = 9 ==>|
    this step                             |== n = 5 ==>|          end = c + n = 14
    table     [  b3  ][  b8   ][   b1     ][    b6      ]         ceil(end / 4) = 4 blocks
    hashed    [  h0  ][  h1   ][   h2     ]  <- b1 is full at end = 14: registered now
                                             b6 is partly written: never shared

The scheduler calls ``allocate`` only when a step would pass the table's last slot
(``request.kv_checkpoint``), so a decode costs nothing here 15 steps out of 16. The
fast-forward over pure-decode steps calls ``grow``: the same ``allocate`` calls for one step's
crossings, all of them or none. Full blocks are
registered at those calls and when the request frees its blocks: a block that a decode fills
joins the cache when the next block is allocated (one step later) or when it is freed.

Full blocks are named by a hash chained over the token ids, so a block's name covers the whole
prefix up to its end::

    h0 = H(root || tokens[0:4])    h1 = H(h0 || tokens[4:8])    h2 = H(h1 || tokens[8:12])

``H`` is BLAKE2b (16 bytes) over 4-byte little-endian token ids: stable across processes and
machines, unlike Python's ``hash``. Generated tokens are hashed the same way as prompt tokens,
so a later prompt that repeats a conversation's earlier answer hits its blocks.

A new request's longest cached prefix stops one token short of its end (at least one token is
computed, to produce logits): a 64-token prompt already in the cache hits 3 blocks of 16 and
recomputes the last 16.

With ``events=True`` the manager also keeps what its cache did, in order, as vLLM's KV
events (``_kv_events``): ``BlockRemoved`` for the hashes an allocation evicted,
``BlockStored`` for each run of blocks it registered; ``take_events()`` drains them.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

from gpufleet.engine.model._block_pool import BlockPool
from gpufleet.engine.model._kv_events import (
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    external_hash,
)
from gpufleet.engine.model._request import Request
from gpufleet.engine.model._tokens import FillerTokens, pack_tokens, unpack_tokens

HASH_ROOT = blake2b(b"gpufleet prefix cache v1", digest_size=16).digest()


def hash_block(parent: bytes, token_bytes: bytes) -> bytes:
    """The name of a full block: its parent's name chained with its packed token ids."""
    return blake2b(parent + token_bytes, digest_size=16).digest()


def block_hash_chain(
    token_ids: Sequence[int], block_size: int, max_blocks: int | None = None
) -> tuple[int, ...]:
    """The external hashes of the full blocks of ``token_ids`` (at most ``max_blocks``),
    chained from the model's root as the KV cache names them; a partial tail is not hashed."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    packed, width = pack_tokens(token_ids[: count * block_size]), 4 * block_size
    parent = HASH_ROOT
    out = []
    for k in range(count):
        parent = hash_block(parent, packed[k * width : (k + 1) * width])
        out.append(parent)
    return tuple(external_hash(h) for h in out)


class _Table:
    __slots__ = ("blocks", "num_hashed")

    def __init__(self, blocks: list[int], num_hashed: int) -> None:
        self.blocks = blocks
        self.num_hashed = num_hashed
        """Leading full blocks already offered to the prefix cache."""


class KVCacheManager:
    """Block tables of running requests, allocated from one ``BlockPool``."""

    __slots__ = ("_events", "_filler", "_tables", "block_size", "caching", "pool")

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        caching: bool,
        filler: FillerTokens,
        events: bool = False,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.caching = caching
        self._filler = filler
        self._tables: dict[Request, _Table] = {}
        self._events: list[KvCacheEvent] | None = [] if events and caching else None
        if self._events is not None:
            self.pool.evicted = []

    def take_events(self) -> list[KvCacheEvent]:
        """What the prefix cache did since the last call, in order (empty: events off)."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def _note_evicted(self) -> None:
        evicted, events = self.pool.evicted, self._events
        if evicted and events is not None:
            events.append(BlockRemoved(tuple(evicted)))
            evicted.clear()

    @property
    def usage(self) -> float:
        """Referenced blocks / all blocks (cached free blocks count as free, as in vLLM)."""
        return self.pool.num_used / self.pool.num_blocks

    def lookup(self, request: Request) -> list[int]:
        """The cached blocks of ``request``'s longest cached prefix (none are touched).

        At most ``(num_tokens - 1) // block_size`` blocks: the last token is always computed.
        """
        if not self.caching:
            return []
        hits: list[int] = []
        cached_block = self.pool.cached_block
        for block_hash in self._hashes(request, (request.num_tokens - 1) // self.block_size):
            block = cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(
        self, request: Request, num_tokens: int, hits: Sequence[int] = ()
    ) -> list[int] | None:
        """Grow ``request``'s table to hold ``num_tokens`` tokens; the new blocks, or ``None``
        (and nothing changed) when the pool cannot supply them.

        ``hits`` (from ``lookup``) start a new table: they are shared, not copied. Full blocks
        up to ``num_tokens`` are offered to the prefix cache.
        """
        table = self._tables.get(request)
        if table is None:
            table = _Table(list(hits), len(hits))
        elif hits:
            raise ValueError(f"{request.request_id} already has blocks; hits start a table")
        pool = self.pool
        size = self.block_size
        blocks = table.blocks
        need = -(-num_tokens // size) - len(blocks)
        new: list[int] = []
        if need > 0 or hits:
            need = max(need, 0)
            if need + (pool.count_free(hits) if hits else 0) > pool.num_free:
                return None
            if hits:
                pool.touch(hits)
            taken = pool.take(need)
            assert taken is not None  # checked above
            if pool.evicted:
                self._note_evicted()
            blocks.extend(taken)
            new = taken
        self._tables[request] = table
        if self.caching and table.num_hashed < num_tokens // size:
            self._register(request, table, num_tokens // size)
        request.kv_checkpoint = len(blocks) * size + 1
        return new

    def grow(self, growth: Sequence[tuple[Request, int]]) -> bool:
        """Grow each request's table to hold its number of tokens, in the order given: all of
        them, or none (``False``, nothing changed) when the pool has too few free blocks.

        The fast-forward over decode steps uses it for the requests that cross a block
        boundary in one step: the same ``allocate`` calls, in the same order, as the step's
        running pass makes when they all fit, so the pool and the prefix cache end the same.
        When they do not, the step is left to ``plan_step``, which preempts.
        """
        size, tables = self.block_size, self._tables
        need = 0
        for request, num_tokens in growth:
            table = tables.get(request)
            need += max(0, -(-num_tokens // size) - (len(table.blocks) if table else 0))
        if need > self.pool.num_free:
            return False
        for request, num_tokens in growth:
            self.allocate(request, num_tokens)
        return True

    def free(self, request: Request) -> list[int]:
        """Release ``request``'s blocks; returns them in the order they join the free queue.

        Its full computed blocks are offered to the prefix cache first. Tail blocks go first,
        so they are evicted before the head blocks that other requests are likelier to share
        (the shared prefix is the head).
        """
        table = self._tables.pop(request, None)
        request.kv_checkpoint = 1
        if table is None:
            return []
        full = request.num_computed_tokens // self.block_size
        if self.caching and table.num_hashed < full:
            self._register(request, table, full)
        order = table.blocks[::-1]
        self.pool.release(order)
        return order

    def blocks_of(self, request: Request) -> tuple[int, ...]:
        table = self._tables.get(request)
        return tuple(table.blocks) if table is not None else ()

    def block_tables(self) -> list[list[int]]:
        """Every request's table (for consistency checks)."""
        return [table.blocks for table in self._tables.values()]

    def _register(self, request: Request, table: _Table, full: int) -> None:
        """Offer ``request``'s blocks ``num_hashed .. full - 1`` (now full) to the cache."""
        hashes = self._hashes(request, full)
        register, blocks = self.pool.register, table.blocks
        if self._events is not None:
            self._register_noted(request, table, full, hashes)
            return
        for k in range(table.num_hashed, full):
            register(blocks[k], hashes[k])
        table.num_hashed = full

    def _register_noted(
        self, request: Request, table: _Table, full: int, hashes: list[bytes]
    ) -> None:
        """``_register``, keeping a ``BlockStored`` for each run of newly cached blocks."""
        events = self._events
        assert events is not None
        register, blocks, size = self.pool.register, table.blocks, self.block_size
        run: list[int] = []

        def flush() -> None:
            if run:
                first, last = run[0], run[-1] + 1
                ids = unpack_tokens(request.token_bytes(first * size, last * size, self._filler))
                parent = hashes[first - 1] if first else None
                events.append(BlockStored(tuple(hashes[first:last]), parent, ids, size))
                run.clear()

        for k in range(table.num_hashed, full):
            if register(blocks[k], hashes[k]):
                run.append(k)
            else:
                flush()
        flush()
        table.num_hashed = full

    def _hashes(self, request: Request, count: int) -> list[bytes]:
        """``request``'s first ``count`` block hashes (or more), memoised on the request.

        All of a prompt's blocks are hashed eventually (each is registered once computed), so
        hashing ahead for a lookup costs nothing extra.
        """
        hashes = request.block_hashes
        first = len(hashes)
        if first >= count:
            return hashes
        size = self.block_size
        parent = hashes[-1] if hashes else HASH_ROOT
        # Blocks inside the prompt: slices of its packed bytes (the common, tight case).
        packed, width = request.prompt_bytes, 4 * size
        in_prompt = min(count, request.num_prompt_tokens // size)
        for k in range(first, in_prompt):
            parent = hash_block(parent, packed[k * width : (k + 1) * width])
            hashes.append(parent)
        # Blocks that reach into the generated tokens.
        for k in range(max(first, in_prompt), count):
            parent = hash_block(parent, request.token_bytes(k * size, (k + 1) * size, self._filler))
            hashes.append(parent)
        return hashes
