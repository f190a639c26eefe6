"""L0/L1: the precise prefix index (KV events per replica) and the prefix_precise router."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.fleet import KvBatch, KvCleared, KvRemoved, KvStored, Outcome, RouteRequest
from gpufleet.policy import KvBlockIndex, PrecisePrefixConfig, PrecisePrefixRouter, make_router

from .factories import MODEL, make_view, rid


def _index(capacity: int = 1000, stale_after: float = 10.0) -> KvBlockIndex:
    return KvBlockIndex(capacity, stale_after=stale_after)


def _stored(seq: int, *hashes: int) -> KvBatch:
    return KvBatch(seq, (KvStored(hashes),))


def _removed(seq: int, *hashes: int) -> KvBatch:
    return KvBatch(seq, (KvRemoved(hashes),))


# -- store, remove, clear ---------------------------------------------------------------------


def test_stored_removed_and_cleared_blocks_are_what_match_sees() -> None:
    index = _index()
    assert index.apply(0.0, rid(0), "a", [_stored(0, 1, 2, 3)]) is None
    assert index.apply(0.0, rid(1), "b", [_stored(0, 1, 2), _stored(1, 9)]) is None
    assert index.match(0.0, [1, 2, 3, 4]) == {rid(0): 3, rid(1): 2}
    index.apply(1.0, rid(0), "a", [_removed(1, 2)])
    assert index.match(1.0, [1, 2, 3]) == {rid(0): 1, rid(1): 2}  # a hole cuts the prefix
    index.apply(2.0, rid(1), "b", [KvBatch(2, (KvCleared(), KvStored((7,))))])
    assert index.match(2.0, [1, 2]) == {rid(0): 1}
    assert index.holds(rid(1), 7)
    assert not index.holds(rid(1), 1)
    index.check()


def test_the_memory_bound_drops_the_oldest_stored_blocks() -> None:
    index = _index(capacity=4)
    index.apply(0.0, rid(0), "a", [_stored(0, 1, 2, 3), _stored(1, 4, 5, 6)])
    assert index.size(rid(0)) == 4
    assert not index.holds(rid(0), 1)
    assert not index.holds(rid(0), 2)
    assert index.holds(rid(0), 6)
    index.check()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["s", "r", "c"]), st.lists(st.integers(0, 30), max_size=6)),
        max_size=40,
    ),
    st.integers(1, 12),
)
def test_the_index_is_the_engines_cache_within_its_bound(
    ops: list[tuple[str, list[int]]], capacity: int
) -> None:
    """Applied in order, the events leave a subset of the engine's cached set: all of it
    while it fits, else what the bound kept (the most recently stored), and the structures
    agree."""
    index = _index(capacity)
    engine: set[int] = set()
    bounded: dict[int, None] = {}  # the bound's own model: store order, oldest dropped
    for seq, (kind, hashes) in enumerate(ops):
        if kind == "s":
            event: KvStored | KvRemoved | KvCleared = KvStored(tuple(hashes))
            engine.update(hashes)
            for h in hashes:
                bounded.pop(h, None)
                bounded[h] = None
            while len(bounded) > capacity:
                del bounded[next(iter(bounded))]
        elif kind == "r":
            event = KvRemoved(tuple(hashes))
            engine.difference_update(hashes)
            for h in hashes:
                bounded.pop(h, None)
        else:
            event = KvCleared()
            engine.clear()
            bounded.clear()
        index.apply(float(seq), rid(0), "a", [KvBatch(seq, (event,))])
        index.check()
        held = {h for h in range(31) if index.holds(rid(0), h)}
        assert held == set(bounded)
        assert held <= engine


# -- sequence numbers: gaps, replays, restarts ------------------------------------------------


def test_a_gap_asks_for_a_replay_and_the_replay_fills_it_in_order() -> None:
    index = _index()
    index.apply(0.0, rid(0), "a", [_stored(0, 1)])
    # batches 1 and 2 are lost; 3 arrives: hold it, ask from 1, match without this replica
    assert index.apply(1.0, rid(0), "a", [_removed(3, 2)]) == 1
    assert index.feeds()[rid(0)].resync_from == 1
    assert index.match(1.0, [1]) == {}  # not live while the hole is open
    assert index.apply(1.1, rid(0), "a", [_stored(4, 5)]) is None  # held too, no second ask
    assert index.feeds()[rid(0)].pending == 2
    # the replay answers from 1 (with 3 again, already held): applied 1, 2, 3, 4 in order
    index.apply(1.2, rid(0), "a", [_stored(1, 2), _stored(2, 3), _removed(3, 2)], replay=True)
    feed = index.feeds()[rid(0)]
    assert (feed.next_seq, feed.resync_from, feed.pending) == (5, None, 0)
    assert [h for h in (1, 2, 3, 5) if index.holds(rid(0), h)] == [1, 3, 5]
    assert index.match(1.2, [1]) == {rid(0): 1}
    assert index.resyncs == 1
    index.check()


def test_a_replay_that_cannot_fill_the_gap_clears_the_replica_no_ghosts() -> None:
    index = _index()
    index.apply(0.0, rid(0), "a", [_stored(0, 1, 2)])
    assert index.apply(1.0, rid(0), "a", [_stored(5, 8)]) == 1
    # the engine's buffer starts at 4: 1..3 (which may have removed 1 and 2) are gone
    index.apply(1.1, rid(0), "a", [_stored(4, 7)], replay=True)
    assert not index.holds(rid(0), 1)  # cleared: it may have been evicted in 1..3
    assert index.holds(rid(0), 7)
    assert index.holds(rid(0), 8)
    assert index.feeds()[rid(0)].next_seq == 6
    # no replay socket at all (an empty answer): the same, from the held batches
    assert index.apply(2.0, rid(0), "a", [_stored(9, 10)]) == 6
    index.apply(2.1, rid(0), "a", [], replay=True)
    assert not index.holds(rid(0), 7)
    assert index.holds(rid(0), 10)
    index.check()


def test_a_first_batch_past_zero_asks_for_the_history() -> None:
    index = _index()
    assert index.apply(0.0, rid(0), "a", [_stored(40, 3)]) == 0
    index.apply(0.1, rid(0), "a", [_stored(0, 1), _stored(39, 2)], replay=True)  # 1..38 lost
    assert not index.holds(rid(0), 1)
    assert index.holds(rid(0), 2)
    assert index.holds(rid(0), 3)


def test_an_unasked_replay_and_a_duplicate_batch_change_nothing() -> None:
    index = _index()
    index.apply(0.0, rid(0), "a", [_stored(0, 1), _stored(1, 2)])
    index.apply(0.1, rid(0), "a", [_removed(5, 1)], replay=True)
    assert index.holds(rid(0), 1)
    assert index.feeds()[rid(0)].next_seq == 2


def test_a_restart_clears_the_replica_before_its_new_process_publishes() -> None:
    index = _index()
    index.apply(0.0, rid(0), "a", [_stored(0, 1, 2)])
    index.apply(0.0, rid(1), "b", [_stored(0, 1, 2)])
    index.restarted(rid(0), "a2")  # a new process: its cache is empty, and we know it
    assert index.match(0.0, [1, 2]) == {rid(1): 2}
    assert index.live(0.0) == {rid(0), rid(1)}  # live, and empty
    assert index.size(rid(0)) == 0
    index.restarted(rid(0), "a3")
    # the publisher's count begins again behind the same address: seq 0 after 5 clears
    index.apply(0.2, rid(0), "a3", [_stored(0, 4), _stored(1, 5)])
    index.apply(0.3, rid(0), "a3", [_stored(0, 6)])
    assert not index.holds(rid(0), 4)
    assert index.holds(rid(0), 6)
    index.check()


def test_a_replica_never_indexed_stays_unindexed_after_a_restart() -> None:
    index = _index()
    index.restarted(rid(0), "a")
    assert index.live(0.0) == frozenset()


def test_a_feed_goes_stale_when_requests_start_and_no_batch_comes() -> None:
    index = _index(stale_after=5.0)
    index.apply(0.0, rid(0), "a", [_stored(0, 1)])
    index.started(1.0, rid(0), [1])
    assert index.live(6.0) == {rid(0)}
    assert index.live(6.5) == frozenset()
    assert index.match(6.5, [1]) == {}
    index.apply(7.0, rid(0), "a", [_stored(1, 2)])
    assert index.live(100.0) == {rid(0)}  # an idle replica is not stale


def test_blocks_in_flight_match_until_their_request_ends() -> None:
    index = _index()
    index.apply(0.0, rid(0), "a", [])
    index.apply(0.0, rid(1), "b", [])
    index.started(0.0, rid(1), [1, 2, 3])
    index.started(0.0, rid(1), [1, 2])
    assert index.match(0.0, [1, 2, 3]) == {rid(1): 3}
    index.ended(rid(1), [1, 2, 3])
    assert index.match(0.0, [1, 2, 3]) == {rid(1): 2}
    index.ended(rid(1), [1, 2])
    assert index.match(0.0, [1, 2, 3]) == {}
    index.check()


def test_forget_frees_the_slot() -> None:
    index = _index()
    index.apply(0.0, rid(0), "a", [_stored(0, 1)])
    index.forget(rid(0))
    index.apply(0.0, rid(1), "b", [_stored(0, 1)])
    assert index.match(0.0, [1]) == {rid(1): 1}
    assert set(index.feeds()) == {rid(1)}
    index.check()


# -- the router -------------------------------------------------------------------------------


def _request(n: int, blocks: tuple[int, ...], text: tuple[int, ...] = ()) -> RouteRequest:
    return RouteRequest(f"q{n}", MODEL, text, 100, block_hashes=blocks)


def test_precise_routing_follows_what_the_engine_holds_not_what_was_sent() -> None:
    router = make_router({"policy": "prefix_precise"}, random.Random(0))
    assert isinstance(router, PrecisePrefixRouter)
    view = make_view(3)
    prompt = (11, 12, 13, 14)
    # r0 got the prompt earlier, but its engine evicted it; r2's engine holds it
    router.on_kv_events(0.0, rid(0), "a", (_stored(0, 11, 12), _removed(1, 11, 12)), False)
    router.on_kv_events(0.0, rid(1), "b", (), False)
    router.on_kv_events(0.0, rid(2), "c", (_stored(0, 11, 12, 13),), False)
    ranking = router.rank(1.0, _request(1, prompt), view)
    assert ranking.first() == rid(2)
    assert ranking.matched(rid(2)) == 3
    assert ranking.matched(rid(0)) == 0


def test_a_replica_without_events_is_matched_on_what_was_routed_there() -> None:
    router = PrecisePrefixRouter(PrecisePrefixConfig(), random.Random(0))
    view = make_view(2)
    prompt = (21, 22, 23)
    router.on_kv_events(0.0, rid(0), "a", (), False)  # r0 publishes (nothing cached)
    router.on_request_start(0.0, _request(1, prompt), rid(1))  # r1 publishes nothing
    router.on_request_end(0.5, _request(1, prompt), rid(1), Outcome.SUCCESS)
    ranking = router.rank(1.0, _request(2, prompt), view)
    assert ranking.first() == rid(1)
    assert ranking.matched(rid(1)) == 3
    # r0 routed the prompt too, but its engine reports nothing cached: no match there
    router.on_request_start(1.0, _request(2, prompt), rid(0))
    router.on_request_end(1.5, _request(2, prompt), rid(0), Outcome.SUCCESS)
    assert router.rank(2.0, _request(3, prompt), view).matched(rid(0)) == 0


def test_a_restart_seen_by_the_controller_stops_routing_to_old_prefixes() -> None:
    router = PrecisePrefixRouter(PrecisePrefixConfig(), random.Random(0))
    view = make_view(2)
    prompt = (31, 32)
    router.on_kv_events(0.0, rid(0), "a", (_stored(0, 31, 32),), False)
    router.on_kv_events(0.0, rid(1), "b", (), False)
    assert router.rank(0.0, _request(1, prompt), view).first() == rid(0)
    router.restarted(rid(0), "a2")
    ranking = router.rank(0.1, _request(2, prompt), view)
    assert ranking.matched_blocks == {}
    router.check()


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["s", "s", "r", "c"]),
            st.lists(st.integers(0, 20), min_size=1, max_size=4),
            st.booleans(),  # the batch is lost on the way
        ),
        max_size=40,
    ),
    st.integers(0, 6),
)
def test_lost_batches_never_leave_a_ghost(
    ops: list[tuple[str, list[int], bool]], buffered: int
) -> None:
    """Batches lost on the way, a replay buffer of ``buffered`` batches: once every gap is
    resolved, the index holds nothing the engine dropped, and all of it when the replay
    could fill every gap."""
    index = _index()
    engine: set[int] = set()
    sent: list[KvBatch] = []
    filled = True
    for seq, (kind, hashes, lost) in enumerate(ops):
        if kind == "s":
            event: KvStored | KvRemoved | KvCleared = KvStored(tuple(hashes))
            engine.update(hashes)
        elif kind == "r":
            event = KvRemoved(tuple(hashes))
            engine.difference_update(hashes)
        else:
            event = KvCleared()
            engine.clear()
        batch = KvBatch(seq, (event,))
        sent.append(batch)
        if lost:
            continue
        ask = index.apply(float(seq), rid(0), "a", [batch])
        if ask is not None:  # the replay socket answers from its buffer at once
            kept = sent[-buffered:] if buffered else []
            answer = [b for b in kept if b.seq >= ask]
            filled = filled and bool(answer) and answer[0].seq == ask
            index.apply(float(seq), rid(0), "a", answer, replay=True)
        index.check()
        held = {h for h in range(21) if index.holds(rid(0), h)}
        assert held <= engine  # no ghosts, ever, once the batch is in
        if filled:  # every gap so far was replayed in full: the index is the engine's cache
            assert held == engine
