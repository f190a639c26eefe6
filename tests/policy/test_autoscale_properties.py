"""L1: autoscaler invariants under any utilisation sequence with increasing ``now``.

After every decision:

* ``min_replicas <= desired <= max_replicas``;
* ``desired`` is at least the N+1 floor of the stable load, unless scale to zero is on;
* a scale-down never comes within ``scale_down_cooldown`` seconds of the previous scale
  decision (up or down), nor while in panic, and removes at most ``scale_down_step``;
* the actions add up: ``current + promote + cold_starts - drain == desired``.

And one input sequence gives one sequence of decisions.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.fleet import ReplicaState, ReplicaView
from gpufleet.policy import (
    AutoscaleConfig,
    AutoscalePolicy,
    PoolView,
    ScaleDecision,
    ScaleDirection,
    Standby,
    redundancy_floor,
)

from .factories import MODEL, rid, scraped

Step = tuple[float, float, float, int, bool]
"""(seconds since the last decision, utilisation, demand, held requests, actuate now)."""

STEPS = st.lists(
    st.tuples(
        st.floats(0.0, 400.0),
        st.floats(0.0, 3.0),
        st.floats(0.0, 100.0),
        st.integers(0, 3),
        st.booleans(),
    ),
    min_size=1,
    max_size=60,
)


@st.composite
def configs(draw: st.DrawFn) -> AutoscaleConfig:
    to_zero = draw(st.booleans())
    low = draw(st.integers(0 if to_zero else 2, 4))
    return AutoscaleConfig(
        min_replicas=low,
        max_replicas=draw(st.integers(max(low, 1), 12)),
        scale_down_cooldown=draw(st.sampled_from([0.0, 30.0, 300.0])),
        scale_down_step=draw(st.integers(1, 3)),
        scale_to_zero=to_zero,
        idle_time=draw(st.sampled_from([10.0, 600.0])),
        prewarm=draw(st.integers(0, 2)),
        provisioning_horizon=draw(st.sampled_from([0.0, 300.0])),
    )


def _pool(n: int, u: float, demand: float, held: int, prewarm: int) -> PoolView:
    running = min(100, round(u * 100))
    waiting = max(0, round(u * 100) - 100)
    replicas = tuple(
        ReplicaView(rid(i), MODEL, ReplicaState.READY, scraped(running, waiting, at=0.0))
        for i in range(n)
    )
    standbys = tuple(Standby(rid(100 + i), ready=True, since=0.0) for i in range(prewarm))
    return PoolView(MODEL, replicas, demand, standbys, held)


def _drive(config: AutoscaleConfig, steps: list[Step]) -> list[ScaleDecision]:
    """Decide on each step; the actuator applies a decision only on steps that say so."""
    policy = AutoscalePolicy(config, 100)
    n, now, decisions = config.min_replicas, 0.0, []
    for dt, u, demand, held, actuate in steps:
        now += dt
        decision = policy.decide(now, _pool(n, u, demand, held, config.prewarm))
        decisions.append(decision)
        if actuate:
            n = decision.desired
    return decisions


@settings(max_examples=300, deadline=None)
@given(config=configs(), steps=STEPS)
def test_invariants(config: AutoscaleConfig, steps: list[Step]) -> None:
    last_change: float | None = None
    for d in _drive(config, steps):
        assert config.min_replicas <= d.desired <= config.max_replicas
        if not config.scale_to_zero:
            assert d.desired >= redundancy_floor(d.inputs.stable_load, config)
        current = d.inputs.current
        assert current + len(d.promote) + d.cold_starts - len(d.drain) == d.desired
        if d.direction is ScaleDirection.DOWN:
            assert not d.inputs.panic
            assert current - d.desired <= config.scale_down_step or current > config.max_replicas
            if last_change is not None:
                assert d.now - last_change >= config.scale_down_cooldown
        if d.direction is not ScaleDirection.HOLD:
            last_change = d.now


@settings(max_examples=100, deadline=None)
@given(config=configs(), steps=STEPS)
def test_one_input_sequence_gives_one_decision_sequence(
    config: AutoscaleConfig, steps: list[Step]
) -> None:
    assert _drive(config, steps) == _drive(config, steps)
