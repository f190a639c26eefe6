"""L0: the prefix index and the prefix-aware router."""

from __future__ import annotations

import random

import pytest

from gpufleet.fleet import Outcome, ReplicaState
from gpufleet.policy import PrefixAwareConfig, PrefixAwareRouter, PrefixIndex

from .factories import make_request, make_view, rid, scraped

S = ReplicaState


def _router(**settings: object) -> PrefixAwareRouter:
    return PrefixAwareRouter(PrefixAwareConfig(**settings), random.Random(0))  # type: ignore[arg-type]


# -- the index --------------------------------------------------------------------------------


def test_match_is_the_longest_common_prefix_per_replica() -> None:
    index = PrefixIndex(capacity=100)
    index.insert(rid(0), [1, 2, 3, 4])
    index.insert(rid(1), [1, 2, 9])
    index.insert(rid(2), [7, 8])
    assert index.match([1, 2, 3, 5]) == {rid(0): 3, rid(1): 2}
    assert index.match([1, 2, 3, 4, 5, 6]) == {rid(0): 4, rid(1): 2}
    assert index.match([7]) == {rid(2): 1}
    assert index.match([99, 1, 2]) == {}  # the walk stops at the first block nobody holds
    assert index.match([]) == {}
    index.check()


def test_lru_evicts_a_prefix_tail_before_its_head() -> None:
    index = PrefixIndex(capacity=4)
    index.insert(rid(0), [1, 2, 3])
    index.insert(rid(0), [1, 5, 6])  # 5 entries: the oldest tail block (3) goes
    assert index.size(rid(0)) == 4
    assert index.match([1, 2, 3]) == {rid(0): 2}
    assert index.match([1, 5, 6]) == {rid(0): 3}
    index.insert(rid(0), [10, 11, 12, 13, 14, 15])  # longer than the capacity
    assert index.match([10, 11, 12, 13, 14, 15]) == {rid(0): 4}
    assert index.match([1]) == {}
    index.check()


def test_forget_drops_a_replica_and_its_slot_is_reused() -> None:
    index = PrefixIndex(capacity=8)
    index.insert(rid(0), [1, 2])
    index.insert(rid(1), [1, 3])
    index.forget(rid(0))
    index.forget(rid(9))  # unknown: nothing to do
    assert index.match([1, 2]) == {rid(1): 1}
    assert index.replicas() == (rid(1),)
    index.insert(rid(2), [1, 2])
    assert index.match([1, 2]) == {rid(1): 1, rid(2): 2}
    assert len(index) == 3  # hashes 1, 2, 3
    index.check()
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(0)


# -- the router -------------------------------------------------------------------------------


def _start(router: PrefixAwareRouter, replica: int, prefix: list[int], n: int = 1) -> None:
    for _ in range(n):
        router.on_request_start(0.0, make_request(prefix=prefix), rid(replica))


def test_routes_to_the_longest_cached_prefix_and_reports_it() -> None:
    router, view = _router(), make_view(3)
    _start(router, 0, [1, 2])
    _start(router, 1, [1, 2, 3, 4])
    ranking = router.rank(0.0, make_request(prefix=[1, 2, 3, 4, 5]), view)
    assert ranking.tiers[0] == (rid(1),)
    assert set(ranking.tiers[1]) == {rid(0), rid(2)}
    assert ranking.matched(rid(1)) == 4
    assert ranking.matched(rid(0)) == 2
    assert ranking.matched(rid(2)) == 0


def test_no_match_routes_by_load_alone() -> None:
    router, view = _router(), make_view(3)
    _start(router, 0, [1], n=2)
    _start(router, 2, [1], n=1)
    ranking = router.rank(0.0, make_request(prefix=[50, 51]), view)
    assert ranking.tiers == ((rid(1), rid(2), rid(0)),)
    assert ranking.matched_blocks == {}


def test_an_overloaded_holder_loses_the_request_to_the_next_best() -> None:
    router, view = _router(balance_abs=2, balance_rel=1.5), make_view(3)
    _start(router, 0, [1, 2, 3], n=4)  # the best match, but 4 in flight
    _start(router, 1, [1, 2], n=1)  # a shorter match, lightly loaded
    # least = 0 (r2); limit = max(0 + 2, 1.5 × 0) = 2: r0 is overloaded, r1 is not
    ranking = router.rank(0.0, make_request(prefix=[1, 2, 3]), view)
    assert ranking.tiers[0] == (rid(1),)
    assert ranking.tiers[1] == (rid(2), rid(0))


def test_a_holder_within_the_margin_keeps_the_request() -> None:
    router, view = _router(balance_abs=4, balance_rel=1.5), make_view(2)
    _start(router, 0, [1, 2], n=3)
    assert router.rank(0.0, make_request(prefix=[1, 2]), view).first() == rid(0)
    _start(router, 0, [1, 2], n=2)  # 5 > 0 + 4: overloaded now
    assert router.rank(0.0, make_request(prefix=[1, 2]), view).first() == rid(1)


def test_scraped_queues_count_as_load() -> None:
    router = _router(balance_abs=2)
    view = make_view(2, loads=[scraped(running=6, waiting=4, at=0.0), scraped(at=0.0)])
    _start(router, 0, [1, 2])
    assert router.rank(0.1, make_request(prefix=[1, 2]), view).first() == rid(1)
    assert router.rank(5.0, make_request(prefix=[1, 2]), view).first() == rid(0)  # stale


def test_equal_matches_go_to_the_least_loaded_then_at_random() -> None:
    router, view = _router(), make_view(3)
    for replica in range(3):
        _start(router, replica, [1, 2])
    _start(router, 0, [9])
    ranking = router.rank(0.0, make_request(prefix=[1, 2, 3]), view)
    assert ranking.tiers[0][-1] == rid(0)
    assert set(ranking.tiers[0]) == {rid(0), rid(1), rid(2)}
    firsts = {router.rank(0.0, make_request(prefix=[1, 2]), view).first() for _ in range(50)}
    assert firsts == {rid(1), rid(2)}


def test_min_match_blocks_ignores_short_matches() -> None:
    router, view = _router(min_match_blocks=2), make_view(2)
    _start(router, 0, [1, 5])
    _start(router, 1, [7], n=1)
    _start(router, 0, [8], n=2)
    assert router.rank(0.0, make_request(prefix=[1, 2]), view).tiers == ((rid(1), rid(0)),)


def test_restarted_or_removed_replicas_are_forgotten() -> None:
    router = _router()
    _start(router, 0, [1, 2])
    _start(router, 1, [1, 2])
    router.on_request_end(0.0, make_request(prefix=[1, 2]), rid(1), Outcome.SUCCESS)
    router.rank(0.0, make_request(prefix=[1, 2]), make_view(2))
    assert set(router.snapshot().index_sizes) == {rid(0), rid(1)}
    restarted = make_view([S.STARTING, S.READY])
    router.rank(1.0, make_request(prefix=[1, 2]), restarted)
    assert set(router.snapshot().index_sizes) == {rid(1)}
    router.rank(2.0, make_request(prefix=[1, 2]), make_view(0))
    assert router.snapshot().index_sizes == {}
    router.check()
