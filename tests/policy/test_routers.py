"""L0: the load-only routers, the candidate pipeline, panic and the registry."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from pydantic import ValidationError

from gpufleet.fleet import FleetView, Outcome, ReplicaState, RouteRequest
from gpufleet.policy import (
    ROUTER_POLICIES,
    Candidates,
    KVAwareConfig,
    KVAwareRouter,
    LeastRequestRouter,
    PrecisePrefixRouter,
    PrefixAwareRouter,
    RoundRobinRouter,
    RoutableFilter,
    Router,
    SessionRouter,
    in_panic,
    kv_scores,
    make_router,
    parse_router_config,
)

from .factories import MODEL, make_request, make_view, rid, scraped

S = ReplicaState


def _router(name: str, seed: int = 0, **settings: object) -> Router:
    return make_router({"policy": name, **settings}, random.Random(seed))


# -- the contract every router keeps ----------------------------------------------------------


@pytest.mark.parametrize("name", ROUTER_POLICIES)
def test_no_candidates_gives_an_empty_ranking(name: str) -> None:
    router = _router(name)
    assert router.rank(0.0, make_request(), make_view(0)).tiers == ()
    assert router.rank(0.0, make_request(model="other"), make_view(3)).first() is None
    down = make_view([S.STARTING, S.DRAINING, S.STOPPED])
    assert router.rank(0.0, make_request(), down).tiers == ()


@pytest.mark.parametrize("name", ROUTER_POLICIES)
def test_every_router_ranks_each_ready_replica_once(name: str) -> None:
    view = make_view([S.READY, S.EJECTED, S.READY, S.DRAINING, S.READY, S.STARTING, S.FAILED])
    ranking = _router(name).rank(0.0, make_request(session="s", prefix=[1, 2]), view)
    assert sorted(ranking.replicas()) == [rid(0), rid(2), rid(4)]
    assert not ranking.panic
    assert ranking.policy == name


@pytest.mark.parametrize("name", ROUTER_POLICIES)
def test_routers_count_in_flight_from_start_to_end(name: str) -> None:
    router = _router(name)
    request = make_request(tokens=7)
    router.on_request_start(0.0, request, rid(1))
    router.on_request_start(0.0, request, rid(1))
    load = router.snapshot().load  # type: ignore[attr-defined]
    assert load.in_flight == {rid(1): 2}
    assert load.in_flight_tokens == {rid(1): 14}
    router.on_request_end(1.0, request, rid(1), Outcome.SUCCESS)
    router.on_request_end(1.0, request, rid(1), Outcome.TIMEOUT)
    assert router.snapshot().load.in_flight == {}  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="none started"):
        router.on_request_end(2.0, request, rid(1), Outcome.SUCCESS)


def test_registry_builds_each_policy() -> None:
    kinds = {
        "round_robin": RoundRobinRouter,
        "least_request": LeastRequestRouter,
        "kv_aware": KVAwareRouter,
        "prefix_aware": PrefixAwareRouter,
        "prefix_precise": PrecisePrefixRouter,
        "session": SessionRouter,
    }
    assert set(kinds) == set(ROUTER_POLICIES)
    for name, kind in kinds.items():
        assert isinstance(make_router(name, random.Random(0)), kind)
        assert make_router(name, random.Random(0)).name == name


def test_configs_are_validated_and_name_the_bad_field() -> None:
    assert parse_router_config({"policy": "kv_aware", "kv_weight": 2}).kv_weight == 2  # type: ignore[union-attr]
    with pytest.raises(ValidationError, match="policy"):
        parse_router_config("fastest")
    with pytest.raises(ValidationError, match="balance_rel"):
        parse_router_config({"policy": "prefix_aware", "balance_rel": 0.5})
    with pytest.raises(ValidationError, match="extra"):
        parse_router_config({"policy": "round_robin", "kv_weight": 1})
    with pytest.raises(ValidationError, match="panic_threshold"):
        parse_router_config({"policy": "session", "panic_threshold": 1.5})
    assert isinstance(parse_router_config("session").model_dump(), dict)


# -- round robin ------------------------------------------------------------------------------


def test_round_robin_takes_turns_and_keeps_the_ring_for_retries() -> None:
    router, view = _router("round_robin"), make_view(3)
    rankings = [router.rank(0.0, make_request(i), view) for i in range(4)]
    assert [r.first() for r in rankings] == [rid(0), rid(1), rid(2), rid(0)]
    assert rankings[1].tiers == ((rid(1), rid(2), rid(0)),)
    assert router.snapshot().cursors == {MODEL: 4}  # type: ignore[attr-defined]


def test_round_robin_skips_unroutable_replicas() -> None:
    router = _router("round_robin")
    view = make_view([S.READY, S.EJECTED, S.READY])
    firsts = [router.rank(0.0, make_request(i), view).first() for i in range(4)]
    assert firsts == [rid(0), rid(2), rid(0), rid(2)]


# -- least request ----------------------------------------------------------------------------


def test_least_request_picks_the_fewest_in_flight() -> None:
    router, view = _router("least_request"), make_view(3)
    for replica, count in ((rid(0), 2), (rid(1), 0), (rid(2), 1)):
        for _ in range(count):
            router.on_request_start(0.0, make_request(), replica)
    assert router.rank(0.0, make_request(), view).tiers == ((rid(1), rid(2), rid(0)),)


def test_ties_are_broken_at_random_so_load_spreads() -> None:
    view = make_view(4)
    router = _router("least_request", seed=7)
    firsts = Counter(router.rank(0.0, make_request(i), view).first() for i in range(400))
    assert set(firsts) == {rid(i) for i in range(4)}  # no herding on r0
    assert min(firsts.values()) > 60


def test_the_same_seed_gives_the_same_rankings() -> None:
    view = make_view(5)

    def run(seed: int) -> list[object]:
        router = _router("least_request", seed=seed)
        return [router.rank(0.0, make_request(i), view).tiers for i in range(30)]

    assert run(3) == run(3)
    assert run(3) != run(4)


# -- KV-aware ---------------------------------------------------------------------------------


def test_kv_score_is_documented_arithmetic() -> None:
    config = KVAwareConfig(waiting_weight=1.0, kv_weight=4.0, max_scrape_age=1.0)
    pool = make_view(1, loads=[scraped(running=3, waiting=2, kv=0.5, at=10.0)]).pool(MODEL)
    # outstanding = max(1, 3 + 2) = 5; + 1 × 2 waiting; + 4 × 0.5 KV
    assert kv_scores(pool, {rid(0): 1}, 10.5, config) == [5 + 2 + 2]
    # the fresher gateway count wins when it is larger
    assert kv_scores(pool, {rid(0): 9}, 10.5, config) == [9 + 2 + 2]
    # a stale scrape counts for nothing
    assert kv_scores(pool, {rid(0): 1}, 11.5, config) == [1]


def test_kv_aware_prefers_free_cache_and_short_queues() -> None:
    router = _router("kv_aware")
    loads = [
        scraped(running=4, waiting=0, kv=0.9, at=0.0),
        scraped(running=4, waiting=0, kv=0.2, at=0.0),
        scraped(running=4, waiting=3, kv=0.1, at=0.0),
    ]
    ranking = router.rank(0.1, make_request(), make_view(3, loads=loads))
    assert ranking.tiers == ((rid(1), rid(0), rid(2)),)


def test_kv_aware_counts_requests_placed_since_the_scrape() -> None:
    router = _router("kv_aware")
    view = make_view(2, loads=[scraped(running=1, at=0.0), scraped(running=2, at=0.0)])
    assert router.rank(0.1, make_request(), view).first() == rid(0)
    for _ in range(3):  # a burst lands on r0 before the next scrape
        router.on_request_start(0.1, make_request(), rid(0))
    assert router.rank(0.1, make_request(), view).first() == rid(1)


# -- panic and filters ------------------------------------------------------------------------


def test_panic_routes_over_every_in_service_replica() -> None:
    view = make_view([S.READY, S.EJECTED, S.FAILED, S.EJECTED, S.DRAINING, S.STARTING])
    ranking = _router("least_request").rank(0.0, make_request(), view)
    assert ranking.panic
    assert sorted(ranking.replicas()) == [rid(0), rid(1), rid(2), rid(3)]


def test_panic_threshold_is_a_share_of_in_service_replicas() -> None:
    half = make_view([S.READY, S.READY, S.EJECTED, S.FAILED, S.DRAINING])
    assert not _router("round_robin").rank(0.0, make_request(), half).panic
    assert _router("round_robin", panic_threshold=0.6).rank(0.0, make_request(), half).panic
    none_ready = make_view([S.EJECTED, S.EJECTED])
    assert (
        not _router("round_robin", panic_threshold=0.0).rank(0.0, make_request(), none_ready).tiers
    )
    assert in_panic(routable=1, in_service=4, threshold=0.5)
    assert not in_panic(routable=2, in_service=4, threshold=0.5)
    assert not in_panic(routable=0, in_service=0, threshold=0.5)


def test_filters_run_in_order_and_can_be_replaced() -> None:
    def even_only(request: RouteRequest, view: FleetView, candidates: Candidates) -> Candidates:
        return Candidates(
            tuple(r for r in candidates.replicas if int(r.id[1:]) % 2 == 0), candidates.panic
        )

    router = make_router("round_robin", random.Random(0), (RoutableFilter(0.5), even_only))
    view = make_view([S.READY, S.READY, S.EJECTED, S.READY, S.READY])
    assert router.rank(0.0, make_request(), view).tiers == ((rid(0), rid(4)),)
