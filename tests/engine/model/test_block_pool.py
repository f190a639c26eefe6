"""L0: the block pool and the KV cache manager (free queue order, prefix hits, eviction)."""

from __future__ import annotations

import pytest

from gpufleet.engine.model._block_pool import BlockPool
from gpufleet.engine.model._kv_cache import HASH_ROOT, KVCacheManager, hash_block
from gpufleet.engine.model._request import Request
from gpufleet.engine.model._tokens import FillerTokens, pack_tokens

from .factories import request, tokens

FILLER = FillerTokens(seed=0, vocab_size=1000)


def _state(prompt: tuple[int, ...], rid: str = "r") -> Request:
    return Request(
        request(rid, prompt, max_tokens=8),
        arrival_time=0.0,
        seq=0,
        target_output_tokens=8,
        output_offset=0,
    )


def _kv(blocks: int = 8, block_size: int = 4, *, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(blocks, block_size, caching=caching, filler=FILLER)


# -- the pool ---------------------------------------------------------------------------------


def test_take_pops_the_free_queue_head_in_order() -> None:
    pool = BlockPool(4)
    assert pool.take(3) == [0, 1, 2]
    assert pool.free_queue() == [3]
    assert (pool.num_free, pool.num_used) == (1, 3)
    assert pool.take(2) is None  # does not fit: a value, not an exception
    assert pool.free_queue() == [3]
    pool.check([[0, 1, 2]])


def test_release_appends_in_the_order_given() -> None:
    pool = BlockPool(4)
    pool.take(4)
    pool.release([2, 0])
    pool.release([3])
    assert pool.free_queue() == [2, 0, 3]
    pool.check([[1]])


def test_shared_block_is_free_only_after_its_last_reference() -> None:
    pool = BlockPool(2)
    (block,) = pool.take(1) or []
    assert pool.register(block, b"h")
    pool.touch([block])  # a second request hits it
    assert pool.ref_count(block) == 2
    pool.release([block])
    assert pool.free_queue() == [1]
    pool.release([block])
    assert pool.free_queue() == [1, block]
    assert pool.cached_block(b"h") == block  # free, but still cached


def test_touching_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    pool = BlockPool(3)
    blocks = pool.take(3) or []
    pool.register(blocks[1], b"h")
    pool.release(blocks)
    pool.touch([blocks[1]])
    assert pool.free_queue() == [blocks[0], blocks[2]]
    pool.check([[blocks[1]]])


def test_taking_a_cached_free_block_evicts_its_hash() -> None:
    pool = BlockPool(2)
    blocks = pool.take(2) or []
    pool.register(blocks[0], b"a")
    pool.register(blocks[1], b"b")
    pool.release(blocks)
    assert pool.take(1) == [blocks[0]]
    assert pool.cached_block(b"a") is None
    assert pool.cached_block(b"b") == blocks[1]
    assert pool.num_cached == 1


def test_first_registered_copy_of_a_hash_wins() -> None:
    pool = BlockPool(2)
    a, b = pool.take(2) or []
    assert pool.register(a, b"h")
    assert not pool.register(b, b"h")
    assert pool.cached_block(b"h") == a
    pool.check([[a], [b]])


def test_releasing_more_than_referenced_is_a_bug() -> None:
    pool = BlockPool(1)
    with pytest.raises(RuntimeError, match="released more often than referenced"):
        pool.release([0])


def test_a_pool_needs_blocks() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


# -- hashing ----------------------------------------------------------------------------------


def test_block_hashes_chain_over_the_prefix() -> None:
    h0 = hash_block(HASH_ROOT, pack_tokens((1, 2, 3, 4)))
    assert hash_block(h0, pack_tokens((5, 6, 7, 8))) != hash_block(
        hash_block(HASH_ROOT, pack_tokens((9, 2, 3, 4))), pack_tokens((5, 6, 7, 8))
    )
    # the same in every process and on every machine (not Python's salted hash())
    assert pack_tokens((1, 2)) == bytes([1, 0, 0, 0, 2, 0, 0, 0])
    assert h0.hex() == "2166b535e16ba77df26c1689624b68cc"


# -- the KV cache manager ---------------------------------------------------------------------


def test_second_request_shares_the_full_blocks_of_a_common_prefix() -> None:
    kv = _kv(blocks=8, block_size=4)
    a = _state(tokens(10), "a")  # blocks [0-3] [4-7] [8-9 partial]
    assert kv.allocate(a, 10) == [0, 1, 2]
    b = _state((*tokens(10), 77, 78), "b")
    hits = kv.lookup(b)
    assert hits == [0, 1]  # the partial third block is not shared
    assert kv.allocate(b, 12, hits) == [3]
    assert kv.blocks_of(b) == (0, 1, 3)
    assert kv.pool.ref_count(0) == 2
    kv.pool.check(kv.block_tables())


def test_lookup_leaves_the_last_token_to_compute() -> None:
    kv = _kv(blocks=8, block_size=4)
    a = _state(tokens(8), "a")
    kv.allocate(a, 8)
    same = _state(tokens(8), "same")
    assert len(kv.lookup(same)) == 1  # 7 tokens may hit: one full block
    longer = _state(tokens(9), "longer")
    assert len(kv.lookup(longer)) == 2


def test_free_returns_exactly_the_request_blocks_tail_first() -> None:
    kv = _kv(blocks=8, block_size=4)
    a = _state(tokens(12), "a")
    kv.allocate(a, 12)
    held = kv.blocks_of(a)
    freed = kv.free(a)
    assert freed == list(reversed(held))
    assert kv.pool.free_queue()[-3:] == freed
    assert kv.free(a) == []  # nothing left to free
    assert kv.usage == 0.0


def test_eviction_takes_the_tail_of_the_least_recently_freed_request_first() -> None:
    kv = _kv(blocks=6, block_size=4)
    a, b = _state(tokens(12, 0), "a"), _state(tokens(12, 100), "b")
    kv.allocate(a, 12)
    kv.allocate(b, 12)
    kv.free(a)  # freed first: evicted first, its tail block before its head
    kv.free(b)
    c = _state(tokens(8, 500), "c")
    kv.allocate(c, 8)  # takes two blocks: a's last two
    assert len(kv.lookup(_state((*tokens(12, 0), 1), "a2"))) == 1  # a keeps its head block
    assert len(kv.lookup(_state((*tokens(12, 100), 1), "b2"))) == 3  # b untouched


def test_allocate_that_does_not_fit_changes_nothing() -> None:
    kv = _kv(blocks=4, block_size=4)
    a = _state(tokens(12), "a")
    kv.allocate(a, 12)
    b = _state(tokens(8, 100), "b")
    before = kv.pool.free_queue()
    assert kv.allocate(b, 8) is None
    assert kv.pool.free_queue() == before
    assert kv.blocks_of(b) == ()
    kv.pool.check(kv.block_tables())


def test_hits_on_free_blocks_count_against_the_free_blocks() -> None:
    kv = _kv(blocks=3, block_size=4)
    a = _state(tokens(8), "a")
    kv.allocate(a, 8)
    kv.free(a)  # two cached free blocks, one plain free block
    b = _state(tokens(8) + tuple(range(100, 106)), "b")  # 14 tokens: 4 blocks > 3
    hits = kv.lookup(b)
    assert len(hits) == 2
    assert kv.allocate(b, 14, hits) is None
    kv.pool.check(kv.block_tables())


def test_without_prefix_caching_nothing_is_shared() -> None:
    kv = _kv(blocks=8, block_size=4, caching=False)
    a = _state(tokens(8), "a")
    kv.allocate(a, 8)
    assert kv.lookup(_state(tokens(9), "b")) == []
    assert kv.pool.num_cached == 0


def test_generated_tokens_are_hashed_like_prompt_tokens() -> None:
    kv = _kv(blocks=8, block_size=4)
    a = _state(tokens(6), "a")
    a.num_tokens = 10  # 4 tokens generated: filler positions 0..3
    kv.allocate(a, 10)
    follow_up = _state(tokens(6) + tuple(FILLER.ids[:4]) + (5,), "f")
    assert kv.lookup(follow_up) == list(kv.blocks_of(a)[:2])


def test_naming_a_named_block_again_is_a_bug() -> None:
    pool = BlockPool(1)
    pool.take(1)
    pool.register(0, b"a")
    with pytest.raises(RuntimeError, match="already holds a cached prefix"):
        pool.register(0, b"b")
