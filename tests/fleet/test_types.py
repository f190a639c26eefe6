"""L0: the domain types validate their input and answer the questions asked of them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.fleet import (
    FAILURES,
    IN_SERVICE,
    LOCAL_ORIGIN_FAILURES,
    REPLICA_ORIGIN_FAILURES,
    ROUTABLE,
    FleetView,
    Outcome,
    ReplicaId,
    ReplicaLoad,
    ReplicaState,
    ReplicaView,
    text_prefix_hashes,
)


def _replica(name: str, model: str = "a", state: ReplicaState = ReplicaState.READY) -> ReplicaView:
    return ReplicaView(ReplicaId(name), model, state)


def test_state_sets_are_explicit() -> None:
    assert frozenset({ReplicaState.READY}) == ROUTABLE
    assert ROUTABLE <= IN_SERVICE
    assert ReplicaState.DRAINING not in IN_SERVICE
    assert ReplicaState.STARTING not in IN_SERVICE
    assert ReplicaState.STOPPED not in IN_SERVICE


def test_failures_are_local_or_replica_origin_and_nothing_else() -> None:
    assert LOCAL_ORIGIN_FAILURES | REPLICA_ORIGIN_FAILURES == FAILURES
    assert not LOCAL_ORIGIN_FAILURES & REPLICA_ORIGIN_FAILURES
    for neutral in (Outcome.SUCCESS, Outcome.CLIENT_ERROR, Outcome.CANCELLED):
        assert neutral not in FAILURES


@pytest.mark.parametrize(
    "fields",
    [
        {"in_flight": -1},
        {"running": -1},
        {"waiting": -2},
        {"kv_cache_usage": 1.01},
        {"kv_cache_usage": -0.1},
        {"prefix_cache_hit_rate": 2.0},
        {"observed_at": float("nan")},
    ],
)
def test_replica_load_rejects_impossible_values(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(fields))):
        ReplicaLoad(**fields)  # type: ignore[arg-type]


def test_view_groups_pools_by_model_keeping_order() -> None:
    view = FleetView.of(3.0, [_replica("a1"), _replica("b1", "b"), _replica("a2")])
    assert [r.id for r in view.pool("a")] == ["a1", "a2"]
    assert [r.id for r in view.pool("b")] == ["b1"]
    assert view.pool("nope") == ()
    assert len(view) == 3
    assert view.now == 3.0
    assert view.replica(ReplicaId("b1")) == _replica("b1", "b")
    assert view.replica(ReplicaId("zz")) is None
    assert [r.id for r in view.replicas()] == ["a1", "a2", "b1"]


def test_view_rejects_duplicates_and_misfiled_replicas() -> None:
    with pytest.raises(ValueError, match="twice"):
        FleetView.of(0.0, [_replica("x"), _replica("x", "b")])
    with pytest.raises(ValueError, match="not pool"):
        FleetView(0.0, {"a": (_replica("x", "b"),)})


def test_view_is_read_only() -> None:
    view = FleetView.of(0.0, [_replica("a1")])
    with pytest.raises(TypeError):
        view.pools["b"] = ()  # type: ignore[index]


def test_with_states_replaces_only_the_named_replicas() -> None:
    view = FleetView.of(0.0, [_replica("a1"), _replica("a2")])
    after = view.with_states({ReplicaId("a2"): ReplicaState.EJECTED}, now=1.0)
    assert [r.state for r in after.pool("a")] == [ReplicaState.READY, ReplicaState.EJECTED]
    assert after.pool("a")[0] is view.pool("a")[0]
    assert after.now == 1.0
    assert view.pool("a")[1].state is ReplicaState.READY


def test_prefix_hashes_name_whole_prefixes() -> None:
    a = "x" * 100 + "y" * 100 + "tail"
    b = "x" * 100 + "z" * 100
    ha, hb = text_prefix_hashes(a, 100), text_prefix_hashes(b, 100)
    assert len(ha) == 2  # the partial tail is not hashed
    assert ha[0] == hb[0]
    assert ha[1] != hb[1]
    assert text_prefix_hashes("short", 100) == ()
    assert len(text_prefix_hashes("x" * 1000, 10, max_blocks=7)) == 7
    with pytest.raises(ValueError, match="block_chars"):
        text_prefix_hashes("abc", 0)


@given(st.text(max_size=300), st.text(max_size=300), st.integers(1, 40))
def test_prefix_hashes_agree_exactly_as_far_as_the_texts_do(a: str, b: str, size: int) -> None:
    ha, hb = text_prefix_hashes(a, size), text_prefix_hashes(b, size)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    shared_blocks = common // size
    assert ha[:shared_blocks] == hb[:shared_blocks]
    # chained: once two hashes differ, every later one differs too (barring collisions)
    for i in range(shared_blocks, min(len(ha), len(hb))):
        assert ha[i] != hb[i]


def test_view_knows_each_pools_routable_and_in_service_replicas() -> None:
    view = FleetView.of(
        0.0,
        [
            _replica("a1"),
            _replica("a2", state=ReplicaState.EJECTED),
            _replica("a3", state=ReplicaState.DRAINING),
            _replica("b1", "b"),
        ],
    )
    assert [r.id for r in view.routable("a")] == ["a1"]
    assert [r.id for r in view.in_service("a")] == ["a1", "a2"]
    assert view.routable("b") is view.pool("b")  # all routable: the pool itself
    assert view.routable("zz") == view.in_service("zz") == ()
