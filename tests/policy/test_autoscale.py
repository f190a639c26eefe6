"""L0: saturation, each autoscaling guard, and the decision's actions, with explicit now."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable

import pytest
from pydantic import ValidationError

from gpufleet.fleet import ReplicaLoad, ReplicaState, ReplicaView
from gpufleet.policy import (
    AutoscaleConfig,
    AutoscalePolicy,
    PoolView,
    ScaleDirection,
    ScaleGuard,
    ScaleHistory,
    ScaleProposal,
    Standby,
    choose_drain,
    decision_record,
    pool_utilisation,
    redundancy_floor,
    saturation,
)
from gpufleet.policy._autoscale import (
    _apply_bounds,
    _apply_cold_start,
    _apply_forecast_floor,
    _apply_hysteresis,
    _apply_step,
)

from .factories import MODEL, rid, scraped

S = ReplicaState
SEQS = 100
G = ScaleGuard


def config(**overrides: object) -> AutoscaleConfig:
    base: dict[str, object] = {"max_replicas": 20}
    return AutoscaleConfig.model_validate(base | overrides)


def load_at(u: float, in_flight: int = 0) -> ReplicaLoad:
    """A scraped load whose saturation is ``u`` (in hundredths) with ``max_num_seqs=100``."""
    if u <= 1.0:
        return scraped(running=round(u * SEQS), in_flight=in_flight)
    return scraped(running=SEQS, waiting=round((u - 1.0) * SEQS), in_flight=in_flight)


def pool(
    n: int, u: float, demand: float = 0.0, starting: int = 0, standbys: tuple[Standby, ...] = ()
) -> PoolView:
    replicas = [ReplicaView(rid(i), MODEL, S.READY, load_at(u)) for i in range(n)]
    replicas += [ReplicaView(rid(n + i), MODEL, S.STARTING) for i in range(starting)]
    return PoolView(MODEL, tuple(replicas), demand, standbys)


def p(replicas: int) -> ScaleProposal:
    return ScaleProposal(replicas, G.STABLE, "test")


# -- saturation: the shared definition ---------------------------------------------------------


def test_saturation_is_the_binding_resource() -> None:
    assert saturation(scraped(running=50, kv=0.2), 100) == pytest.approx(0.5)
    assert saturation(scraped(running=10, kv=0.9), 100) == pytest.approx(0.9)
    assert saturation(scraped(), 100) == 0.0


def test_a_queue_scales_the_binding_resource_past_one() -> None:
    assert saturation(scraped(running=40, waiting=20, kv=0.95), 256) == pytest.approx(1.425)
    assert saturation(scraped(running=100, waiting=50), 100) == pytest.approx(1.5)
    assert saturation(scraped(waiting=10), 100) == pytest.approx(0.1)


def test_a_momentary_queue_at_low_load_barely_counts() -> None:
    assert saturation(scraped(running=1, waiting=1, kv=0.01), 256) == pytest.approx(0.02)


def test_an_unscraped_replica_is_judged_by_the_gateway_count() -> None:
    assert saturation(ReplicaLoad(in_flight=64), 256) == 0.25


def test_pool_utilisation_is_the_mean_over_ready_replicas() -> None:
    replicas = [
        ReplicaView(rid(0), MODEL, S.READY, load_at(0.2)),
        ReplicaView(rid(1), MODEL, S.READY, load_at(0.6)),
        ReplicaView(rid(2), MODEL, S.DRAINING, load_at(1.0)),
    ]
    assert pool_utilisation(replicas, SEQS) == pytest.approx(0.4)
    assert pool_utilisation(replicas[2:], SEQS) is None


# -- config -----------------------------------------------------------------------------------


def test_defaults_are_the_documented_ones() -> None:
    c = AutoscaleConfig()
    assert (c.min_replicas, c.target_utilisation, c.stable_window, c.panic_window) == (
        2,
        0.65,
        60.0,
        6.0,
    )
    assert c.panic_threshold == 2.0


@pytest.mark.parametrize(
    "bad",
    [
        {"min_replicas": 1},
        {"min_replicas": 5, "max_replicas": 4},
        {"panic_window": 60.0},
        {"target_utilisation": 0.0},
        {"panic_threshold": 1.0},
        {"unknown": 1},
    ],
)
def test_bad_configs_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        AutoscaleConfig.model_validate(bad)


def test_scale_to_zero_allows_min_zero() -> None:
    assert AutoscaleConfig(min_replicas=0, scale_to_zero=True).min_replicas == 0


# -- guards, one by one -----------------------------------------------------------------------


def test_forecast_floor_raises_never_lowers() -> None:
    assert _apply_forecast_floor(p(3), 5) == ScaleProposal(
        5, G.FORECAST, "forecast demand at the horizon"
    )
    assert _apply_forecast_floor(p(3), 2) == p(3)
    assert _apply_forecast_floor(p(3), None) == p(3)


def test_step_limits_scale_down_not_up() -> None:
    c = config(scale_down_step=2)
    assert _apply_step(p(1), 8, c).replicas == 6
    assert _apply_step(p(1), 8, c).bound_by is G.STEP
    assert _apply_step(p(7), 8, c) == p(7)
    assert _apply_step(p(15), 8, c) == p(15)


def test_bounds_clamp_to_min_max_and_n_plus_one() -> None:
    c = config(min_replicas=2, max_replicas=6)
    assert _apply_bounds(p(9), 0.0, c).bound_by is G.MAX
    assert _apply_bounds(p(9), 0.0, c).replicas == 6
    assert _apply_bounds(p(1), 0.0, c).bound_by is G.MIN
    assert _apply_bounds(p(2), 2.5, c) == ScaleProposal(4, G.REDUNDANCY, "N+1 for load 2.50")
    assert _apply_bounds(p(4), 2.5, c) == p(4)


def test_redundancy_floor() -> None:
    assert redundancy_floor(0.0, config()) == 0
    assert redundancy_floor(2.0, config()) == 3
    assert redundancy_floor(2.01, config()) == 4
    assert redundancy_floor(30.0, config(max_replicas=10)) == 10
    assert redundancy_floor(2.5, config(scale_to_zero=True, min_replicas=0)) == 3


def test_hysteresis_holds_scale_down_within_cooldown_of_any_change() -> None:
    c = config(scale_down_cooldown=300.0)
    after_up = ScaleHistory(last_up=100.0)
    assert _apply_hysteresis(p(3), 5, 399.0, after_up, c).bound_by is G.COOLDOWN
    assert _apply_hysteresis(p(3), 5, 399.0, after_up, c).replicas == 5
    assert _apply_hysteresis(p(3), 5, 400.0, after_up, c) == p(3)
    after_down = ScaleHistory(last_up=0.0, last_down=350.0)
    assert _apply_hysteresis(p(3), 5, 400.0, after_down, c).bound_by is G.COOLDOWN
    assert _apply_hysteresis(p(7), 5, 101.0, after_up, c) == p(7)  # up: at once


def test_hysteresis_holds_scale_down_in_panic() -> None:
    c = config(scale_down_cooldown=0.0)
    history = ScaleHistory(panic_until=50.0)
    assert _apply_hysteresis(p(3), 5, 49.0, history, c).bound_by is G.PANIC_HOLD
    assert _apply_hysteresis(p(3), 5, 50.0, history, c) == p(3)


def test_cold_start_only_with_scale_to_zero() -> None:
    c = config(scale_to_zero=True, min_replicas=0)
    waiting = PoolView(MODEL, (), demand=0.0, held=3)
    assert _apply_cold_start(p(0), 0, waiting, False, c).bound_by is G.COLD_START
    assert _apply_cold_start(p(0), 0, waiting, False, c).replicas == 1
    assert _apply_cold_start(p(0), 0, PoolView(MODEL, ()), True, c) == p(0)
    assert _apply_cold_start(p(0), 1, PoolView(MODEL, ()), False, c).bound_by is G.IDLE
    assert _apply_cold_start(p(0), 1, PoolView(MODEL, ()), True, c) == p(0)
    assert _apply_cold_start(p(0), 0, waiting, False, config()) == p(0)


# -- decisions ----------------------------------------------------------------------------------


def test_core_sizes_for_the_target() -> None:
    policy = AutoscalePolicy(config(), SEQS)
    decision = policy.decide(0.0, pool(4, 0.65))
    assert (decision.desired, decision.direction, decision.bound_by) == (
        4,
        ScaleDirection.HOLD,
        G.STABLE,
    )
    up = policy.decide(1.0, pool(4, 1.3))  # stable mean 0.975 → 3.9 / 0.65 = 6
    assert (up.desired, up.direction, up.cold_starts) == (6, ScaleDirection.UP, 2)


def test_no_ready_replica_keeps_what_is_starting() -> None:
    decision = AutoscalePolicy(config(), SEQS).decide(0.0, pool(0, 0.0, starting=3))
    assert (decision.desired, decision.bound_by, decision.drain) == (3, G.NO_SIGNAL, ())


def test_spike_scales_up_in_the_call_that_sees_panic() -> None:
    policy = AutoscalePolicy(config(), SEQS)
    now = 0.0
    for _ in range(60):
        policy.decide(now, pool(4, 0.5))
        now += 1.0
    seen = None
    for _ in range(10):
        d = policy.decide(now, pool(4, 2.0))
        now += 1.0
        if d.inputs.panic_utilisation >= 2 * 0.65:
            seen = d
            break
        assert d.desired == 4, "the stable window alone does not move this fast"
    assert seen is not None
    assert seen.direction is ScaleDirection.UP
    assert seen.bound_by is G.PANIC
    assert seen.desired > 4


def test_slow_decline_waits_for_the_cooldown_and_steps_one_at_a_time() -> None:
    c = config(scale_down_cooldown=120.0)
    policy = AutoscalePolicy(c, SEQS)
    n = policy.decide(0.0, pool(4, 1.3)).desired  # → 8, scale-up at 0
    assert n == 8
    downs: list[tuple[float, int]] = []
    for t in range(1, 1200):
        d = policy.decide(float(t), pool(n, 0.05))
        if d.direction is ScaleDirection.DOWN:
            assert d.desired == n - 1
            assert len(d.drain) == 1
            downs.append((float(t), d.desired))
        n = d.desired
    times = [t for t, _ in downs]
    assert times[0] >= 120.0
    assert all(b - a >= 120.0 for a, b in itertools.pairwise(times))
    assert downs[-1][1] == c.min_replicas


def test_scale_up_promotes_ready_standbys_first_then_cold_starts() -> None:
    standbys = (
        Standby(rid(10), ready=False, since=1.0),
        Standby(rid(11), ready=True, since=5.0),
        Standby(rid(12), ready=True, since=2.0),
    )
    c = config(prewarm=2)
    d = AutoscalePolicy(c, SEQS).decide(0.0, pool(2, 3.0, standbys=standbys))  # 6 / 0.65 → 10
    assert d.desired == 10
    assert d.promote == (rid(12), rid(11), rid(10))
    assert d.cold_starts == 5
    assert d.prewarm_starts == 2  # every standby promoted: refill the pool


def test_prewarm_pool_is_refilled_without_scaling() -> None:
    standbys = (Standby(rid(9), ready=True, since=0.0),)
    d = AutoscalePolicy(config(prewarm=3), SEQS).decide(0.0, pool(3, 0.6, standbys=standbys))
    assert (d.direction, d.promote, d.prewarm_starts) == (ScaleDirection.HOLD, (), 2)


def test_drain_prefers_idle_then_newest_and_never_ready_over_broken() -> None:
    replicas = (
        ReplicaView(rid(0), MODEL, S.READY, load_at(0.3, in_flight=3)),
        ReplicaView(rid(1), MODEL, S.READY, load_at(0.3, in_flight=1)),
        ReplicaView(rid(2), MODEL, S.READY, load_at(0.3, in_flight=1)),
        ReplicaView(rid(3), MODEL, S.FAILED),
        ReplicaView(rid(4), MODEL, S.DRAINING),
    )
    assert choose_drain(replicas, 1) == (rid(3),)
    assert choose_drain(replicas, 3) == (rid(3), rid(2), rid(1))
    assert choose_drain(replicas, 0) == ()


def test_scale_to_zero_after_idle_and_back_on_demand() -> None:
    c = config(scale_to_zero=True, min_replicas=0, idle_time=100.0, scale_down_cooldown=10.0)
    policy = AutoscalePolicy(c, SEQS)
    n, t = 1, 0.0
    while n > 0 and t < 1000.0:
        n = policy.decide(t, pool(n, 0.0)).desired
        t += 1.0
    assert n == 0
    assert t >= 100.0
    back = policy.decide(t, PoolView(MODEL, (), demand=0.0, held=2))
    assert (back.desired, back.bound_by, back.cold_starts) == (1, G.COLD_START, 1)


def test_snapshot_names_the_memory() -> None:
    policy = AutoscalePolicy(config(), SEQS)
    policy.decide(0.0, pool(4, 1.3, demand=10.0))
    snap = policy.snapshot()
    assert snap.last_up == 0.0
    assert snap.last_direction is ScaleDirection.UP
    assert [s.utilisation for s in snap.samples] == [pytest.approx(1.3)]
    assert snap.capacity == pytest.approx(10.0 / 5.2)


def test_time_going_back_is_a_bug() -> None:
    policy = AutoscalePolicy(config(), SEQS)
    policy.decide(5.0, pool(2, 0.5))
    with pytest.raises(ValueError, match="before the last decision"):
        policy.decide(4.0, pool(2, 0.5))


# -- one pool view, one decision record, for every shell ---------------------------------------


def test_pool_view_of_overlays_the_shells_in_flight_and_appends_what_still_starts() -> None:
    from gpufleet.fleet import FleetView  # noqa: PLC0415 - only here

    a, b = ReplicaView(rid(0), MODEL, S.READY, load_at(0.5)), ReplicaView(rid(1), MODEL, S.READY)
    other = ReplicaView(rid(9), "other", S.READY)
    view = FleetView.of(0.0, (a, b, other))
    counts = {rid(0): 0, rid(1): 4}
    standby = (Standby(rid(7), ready=True, since=1.0),)
    pool = PoolView.of(
        view,
        MODEL,
        in_flight=counts.__getitem__,
        starting=(rid(5),),
        demand=2.0,
        standbys=standby,
        held=3,
    )
    assert [r.id for r in pool.replicas] == [rid(0), rid(1), rid(5)]
    assert pool.replicas[0] is a  # unchanged count: the same object
    assert pool.replicas[1].load.in_flight == 4
    assert pool.replicas[2].state is S.STARTING
    assert (pool.demand, pool.standbys, pool.held) == (2.0, standby, 3)
    assert PoolView.of(view, MODEL).replicas == (a, b)  # no overlay: the view's pool


def test_a_decision_measures_utilisation_with_the_shared_pool_utilisation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gpufleet.policy._autoscale as autoscale  # noqa: PLC0415 - only here

    calls: list[int] = []

    def spy(replicas: Iterable[ReplicaView], seqs: int) -> float | None:
        listed = list(replicas)
        calls.append(len(listed))
        return pool_utilisation(listed, seqs)

    monkeypatch.setattr(autoscale, "pool_utilisation", spy)
    decision = AutoscalePolicy(config(), SEQS).decide(0.0, pool(3, 0.4, starting=1))
    assert calls == [3]
    assert decision.inputs.utilisation == pytest.approx(0.4)


def test_the_decision_record_carries_the_decision_its_inputs_and_the_pools_queue() -> None:
    standby = (Standby(rid(7), ready=True, since=1.0),)
    view = PoolView(MODEL, pool(2, 0.9).replicas, 1.5, standby, held=2)
    decision = AutoscalePolicy(config(prewarm=1), SEQS).decide(10.0, view)
    record = decision_record(decision, view)
    assert json.loads(json.dumps(record)) == record  # JSON as it is
    assert record["model"] == MODEL
    assert (record["current"], record["desired"]) == (2, decision.desired)
    assert (record["held"], record["standbys"]) == (2, 1)
    assert record["direction"] == decision.direction.value
    assert record["utilisation"] == pytest.approx(0.9)
