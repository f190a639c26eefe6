"""The spot fallback rule (control/_spot.py): where a reclaimed replica's new node comes
from when the provider has no spot GPUs left, through the pool controller as the shells
drive it, and as a property over any order of reclaims and market news."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.config import Capacity, SpotFallback, parse_fleet
from gpufleet.control import (
    FleetController,
    Reclaimed,
    Replace,
    SpotMarket,
    command_to_json,
    event_from_json,
    event_to_json,
)
from gpufleet.control._spot import SpotCapacity
from gpufleet.fleet import ReplicaId

POOL = "spot-pool"
R = [ReplicaId(f"{POOL}-{i}") for i in range(4)]


def controller(fallback: str | None, capacity: str = "spot") -> FleetController:
    model: dict[str, object] = {"name": POOL, "model": "llama-3.1-8b", "replicas": 4}
    model["capacity"] = capacity
    if fallback is not None:
        model["spot"] = {"fallback": fallback}
    return FleetController.of(parse_fleet({"models": [model]}, source="test"))


def test_with_spot_gpus_to_be_had_a_reclaimed_replica_gets_a_spot_node() -> None:
    fleet = controller("on_demand")
    assert fleet.handle(0.0, Reclaimed(POOL, R[0])) == [Replace(POOL, R[0], Capacity.SPOT)]


def test_without_them_it_waits_and_gets_one_when_they_are_back() -> None:
    fleet = controller(None)  # fallback: wait (the default)
    assert fleet.handle(0.0, SpotMarket(POOL, False)) == []
    assert fleet.handle(1.0, Reclaimed(POOL, R[0])) == []
    assert fleet.handle(2.0, Reclaimed(POOL, R[1])) == []
    back = fleet.handle(3.0, SpotMarket(POOL, True))
    assert back == [Replace(POOL, R[0], Capacity.SPOT), Replace(POOL, R[1], Capacity.SPOT)]
    assert fleet.handle(4.0, SpotMarket(POOL, True)) == []  # told twice: nothing more


def test_with_the_on_demand_fallback_it_stands_in_and_moves_back() -> None:
    fleet = controller("on_demand")
    fleet.handle(0.0, SpotMarket(POOL, False))
    assert fleet.handle(1.0, Reclaimed(POOL, R[2])) == [Replace(POOL, R[2], Capacity.ON_DEMAND)]
    assert fleet.pools[POOL].spot.on == {R[2]: Capacity.ON_DEMAND}
    assert fleet.handle(2.0, SpotMarket(POOL, True)) == [Replace(POOL, R[2], Capacity.SPOT)]
    assert fleet.pools[POOL].spot.on == {}


def test_an_on_demand_pool_replaces_on_demand() -> None:
    fleet = controller(None, capacity="on_demand")
    fleet.handle(0.0, SpotMarket(POOL, False))  # not its market
    assert fleet.handle(1.0, Reclaimed(POOL, R[0])) == [Replace(POOL, R[0], Capacity.ON_DEMAND)]


def test_the_events_and_the_command_have_a_json_form() -> None:
    for event in (Reclaimed(POOL, R[1]), SpotMarket(POOL, False)):
        assert event_from_json(event_to_json(event)) == event
    assert command_to_json(Replace(POOL, R[1], Capacity.ON_DEMAND)) == {
        "do": "replace",
        "model": POOL,
        "replica": R[1],
        "capacity": "on_demand",
    }


_STEP = st.one_of(
    st.tuples(st.just("reclaim"), st.integers(0, 3)),
    st.tuples(st.just("market"), st.booleans()),
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(SpotFallback)), st.lists(_STEP, max_size=40))
def test_no_replica_is_left_without_a_node_once_spot_is_back(
    fallback: SpotFallback, steps: list[tuple[str, object]]
) -> None:
    """Any order of reclaims and market news: each reclaim is answered at once (with spot
    GPUs, or on demand) or waits, and only while spot GPUs are short; once they are back
    every replica is on a spot node."""
    spot = SpotCapacity(POOL, Capacity.SPOT, fallback)
    node: dict[ReplicaId, Capacity | None] = dict.fromkeys(R, Capacity.SPOT)
    available = True
    for kind, arg in [*steps, ("market", True)]:
        if kind == "reclaim":
            replica = R[int(arg)]  # type: ignore[call-overload]
            if node[replica] is None:
                continue  # a waiting replica has no node to take
            node[replica] = None
            out = spot.reclaimed(replica)
            if available:
                assert out == [Replace(POOL, replica, Capacity.SPOT)]
            elif fallback is SpotFallback.ON_DEMAND:
                assert out == [Replace(POOL, replica, Capacity.ON_DEMAND)]
            else:
                assert out == []
        else:
            available = bool(arg)
            out = spot.market(available)
            assert available or out == []
        for command in out:
            assert command.capacity is Capacity.SPOT or node[command.replica] is None
            node[command.replica] = command.capacity
    assert all(capacity is Capacity.SPOT for capacity in node.values()), node


def test_what_an_autoscaler_buys_follows_the_market_and_the_fallback() -> None:
    for fallback, short in ((SpotFallback.WAIT, "none"), (SpotFallback.ON_DEMAND, "on_demand")):
        spot = SpotCapacity(POOL, Capacity.SPOT, fallback)
        assert spot.buy() == ""  # the pool's own capacity
        spot.market(False)
        assert spot.buy() == short
        spot.market(True)
        assert spot.buy() == ""
    on_demand = SpotCapacity(POOL, Capacity.ON_DEMAND, SpotFallback.WAIT)
    on_demand.market(False)
    assert on_demand.buy() == ""
