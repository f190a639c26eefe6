"""L0: session affinity by consistent hashing with bounded load."""

from __future__ import annotations

import random
from collections import Counter

from gpufleet.fleet import ReplicaState
from gpufleet.policy import SessionConfig, SessionRouter
from gpufleet.policy._session import HashRing, stable_hash

from .factories import make_request, make_view, rid

S = ReplicaState


def _router(**settings: object) -> SessionRouter:
    return SessionRouter(SessionConfig(**settings), random.Random(0))  # type: ignore[arg-type]


def test_a_session_sticks_to_one_replica() -> None:
    router, view = _router(), make_view(4)
    firsts = {router.rank(0.0, make_request(i, session="alice"), view).first() for i in range(20)}
    assert len(firsts) == 1
    ranking = router.rank(0.0, make_request(session="alice"), view)
    assert len(ranking.tiers) == 2
    assert sorted(ranking.replicas()) == [rid(i) for i in range(4)]


def test_sessions_spread_over_the_pool() -> None:
    router, view = _router(), make_view(4)
    owners = Counter(
        router.rank(0.0, make_request(session=f"s{i}"), view).first() for i in range(400)
    )
    assert set(owners) == {rid(i) for i in range(4)}
    assert min(owners.values()) > 50


def test_a_full_replica_passes_its_sessions_on_clockwise() -> None:
    router, view = _router(load_factor=1.25), make_view(4)
    home = router.rank(0.0, make_request(session="bob"), view).first()
    assert home is not None
    for _ in range(3):
        router.on_request_start(0.0, make_request(), home)
    # bound = ceil(1.25 × (3 + 1) / 4) = 2: home holds 3, so bob goes elsewhere, consistently
    away = router.rank(0.0, make_request(session="bob"), view).first()
    assert away not in (home, None)
    assert router.rank(0.0, make_request(session="bob"), view).first() == away


def test_losing_a_replica_moves_only_its_sessions() -> None:
    router = _router()
    keys = [f"user-{i}" for i in range(300)]
    before = {k: router.rank(0.0, make_request(session=k), make_view(4)).first() for k in keys}
    shrunk = make_view([S.READY, S.READY, S.EJECTED, S.READY])
    after = {k: router.rank(0.0, make_request(session=k), shrunk).first() for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == rid(2)}


def test_requests_without_a_key_go_least_loaded() -> None:
    router, view = _router(), make_view(3)
    router.on_request_start(0.0, make_request(), rid(0))
    router.on_request_start(0.0, make_request(), rid(2))
    ranking = router.rank(0.0, make_request(), view)
    assert ranking.first() == rid(1)
    assert len(ranking.tiers) == 1
    assert set(ranking.tiers[0][1:]) == {rid(0), rid(2)}


def test_ring_and_hash_are_stable() -> None:
    assert stable_hash("abc") == stable_hash("abc") != stable_hash("abd")
    ring = HashRing([rid(0), rid(1)], vnodes=8)
    walk = list(ring.walk(stable_hash("k")))
    assert len(walk) == 16
    assert Counter(walk) == {rid(0): 8, rid(1): 8}
    assert list(HashRing([rid(1), rid(0)], vnodes=8).walk(stable_hash("k"))) == walk
