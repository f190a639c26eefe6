"""The replica model's KV events: applied in order, they rebuild exactly its prefix cache."""

from __future__ import annotations

import random

from gpufleet.engine.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    ReplicaModel,
    block_hash_chain,
    external_hash,
)
from tests.engine.model.factories import Driver, make_replica, request, tokens


def _cached(model: ReplicaModel) -> set[bytes]:
    return set(model._kv.pool._cached)


def _apply(held: set[bytes], events: list[KvCacheEvent]) -> None:
    for event in events:
        match event:
            case BlockStored(block_hashes=hashes):
                assert not held & set(hashes), "a block announced twice"
                held.update(hashes)
            case BlockRemoved(block_hashes=hashes):
                assert set(hashes) <= held, "a block removed that was never stored"
                held.difference_update(hashes)
            case AllBlocksCleared():
                held.clear()


def test_events_rebuild_the_cache_step_by_step_under_eviction() -> None:
    # 64 blocks of 16: shared prefixes and unique tails evict each other
    driver = Driver(make_replica(kv_events=True))
    rng = random.Random(7)
    held: set[bytes] = set()
    stored = removed = 0
    for i in range(60):
        shared = tokens(16 * rng.randrange(1, 6), start=500 * rng.randrange(4))
        driver.add(request(f"r{i}", shared + tokens(rng.randrange(1, 80), 20_000 + 100 * i), 24))
        for _ in range(rng.randrange(1, 6)):
            driver.step()
            events = driver.model.take_kv_events()
            stored += sum(isinstance(e, BlockStored) for e in events)
            removed += sum(isinstance(e, BlockRemoved) for e in events)
            _apply(held, events)
            assert held == _cached(driver.model)
    driver.run()
    _apply(held, driver.model.take_kv_events())
    assert held == _cached(driver.model)
    assert stored > 20
    assert removed > 5


def test_a_stored_event_names_its_tokens_parent_and_the_routers_hashes() -> None:
    driver = Driver(make_replica(kv_events=True))
    prompt = tokens(50, start=900)
    driver.add(request("a", prompt, 1))
    driver.run()
    events = driver.model.take_kv_events()
    first = events[0]
    assert isinstance(first, BlockStored)
    assert first.parent is None
    assert first.block_size == 16
    assert first.token_ids[:48] == prompt[:48]
    announced = [
        external_hash(h) for e in events if isinstance(e, BlockStored) for h in e.block_hashes
    ]
    # what a router computes from the prompt alone: the same integers, in order
    assert announced[:3] == list(block_hash_chain(prompt, 16))
    assert block_hash_chain(prompt, 16, max_blocks=2) == tuple(announced[:2])
    # a second request with the same prefix hits: nothing new for the shared blocks
    driver.add(request("b", prompt[:48] + tokens(20, start=7000), 1))
    driver.run()
    again = driver.model.take_kv_events()
    assert not {
        external_hash(h) for e in again if isinstance(e, BlockStored) for h in e.block_hashes
    } & set(announced[:3])


def test_no_events_are_kept_unless_asked() -> None:
    driver = Driver(make_replica())
    driver.add(request("a", 64, 4))
    driver.run()
    assert driver.model.take_kv_events() == []
    assert driver.model._kv.pool.evicted is None
