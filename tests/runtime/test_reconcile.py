"""The reconciler on its own: explicit ``now``, hand-built observed states, no processes."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.fleet import ReplicaProfile
from gpufleet.runtime import (
    Abort,
    Action,
    Create,
    Drain,
    EngineSpec,
    Forget,
    Kill,
    Launch,
    Phase,
    Plan,
    PoolSpec,
    ProcessState,
    ReplicaSpec,
    ResetBackoff,
    RuntimeSettings,
    Terminate,
    backoff_delay,
    desired_replicas,
    reconcile,
)

SETTINGS = RuntimeSettings(
    backoff_base_s=1.0,
    backoff_max_s=30.0,
    healthy_after_s=10.0,
    ready_timeout_s=60.0,
    drain_timeout_s=20.0,
    terminate_timeout_s=5.0,
)
POOL = PoolSpec("llama-3.1-8b", EngineSpec(), replicas=2)


def spec(index: int = 0, pool: PoolSpec = POOL) -> ReplicaSpec:
    return pool.replica(index)


def state(phase: Phase, since: float = 0.0, index: int = 0, **fields: object) -> ProcessState:
    return replace(ProcessState(spec(index), phase, since), **fields)  # type: ignore[arg-type]


def run(
    now: float,
    desired: Sequence[ReplicaSpec],
    observed: Mapping[str, ProcessState],
) -> Plan:
    return reconcile(now, desired, observed, SETTINGS)


def only(now: float, observed: ProcessState, *, desired: bool = True) -> Plan:
    """Reconcile one replica, desired as observed or not desired at all."""
    return run(now, [observed.spec] if desired else [], {observed.spec.name: observed})


# -- names and scaling --------------------------------------------------------------------


def test_replica_names_are_pool_dash_index() -> None:
    names = [s.name for s in desired_replicas([POOL], {"llama-3.1-8b": 3})]
    assert names == ["llama-3.1-8b-0", "llama-3.1-8b-1", "llama-3.1-8b-2"]
    assert spec(1) == spec(1)
    assert spec(1).name == "llama-3.1-8b-1"


def test_a_new_replica_is_created_then_launched() -> None:
    plan = run(0.0, [spec(0), spec(1)], {})
    assert plan == Plan((Create(spec(0)), Create(spec(1))), 0.0)
    pending = state(Phase.PENDING, since=0.0)
    assert only(0.0, pending) == Plan((Launch(spec(0), restart=False),), 0.0)


def test_start_delay_emulates_provisioning() -> None:
    slow = PoolSpec("big", EngineSpec(model="llama-3.1-70b"), start_delay_s=90.0)
    pending = ProcessState(slow.replica(0), Phase.PENDING, since=100.0)
    assert only(150.0, pending) == Plan((), 40.0)
    assert only(190.0, pending).actions == (Launch(slow.replica(0), restart=False),)


def test_scale_up_adds_the_next_indices_and_keeps_the_others() -> None:
    observed = {"llama-3.1-8b-0": state(Phase.READY), "llama-3.1-8b-1": state(Phase.READY, index=1)}
    desired = desired_replicas([POOL], {"llama-3.1-8b": 4})
    assert run(5.0, desired, observed).actions == (Create(spec(2)), Create(spec(3)))


def test_scale_down_drains_the_highest_indices_only() -> None:
    observed = {s.name: state(Phase.READY, index=s.index) for s in spec_range(4)}
    desired = desired_replicas([POOL], {"llama-3.1-8b": 2})
    assert run(5.0, desired, observed).actions == (
        Drain(spec(2).name),
        Drain(spec(3).name),
    )


def spec_range(n: int) -> list[ReplicaSpec]:
    return [spec(i) for i in range(n)]


def test_retiring_what_does_not_serve_skips_the_drain() -> None:
    assert only(1.0, state(Phase.PENDING), desired=False).actions == (Forget(spec(0).name),)
    assert only(1.0, state(Phase.CRASHED), desired=False).actions == (Forget(spec(0).name),)
    assert only(1.0, state(Phase.STOPPED), desired=False).actions == (Forget(spec(0).name),)
    assert only(1.0, state(Phase.STARTING), desired=False).actions == (
        Terminate(spec(0).name, "not_serving"),
    )


def test_a_changed_spec_retires_the_old_replica_then_creates_the_new() -> None:
    new = ReplicaSpec(POOL.name, 0, EngineSpec(profile=ReplicaProfile(max_num_seqs=64)))
    assert new.name == spec(0).name
    ready = {new.name: state(Phase.READY)}
    assert run(1.0, [new], ready).actions == (Drain(new.name),)
    stopped = {new.name: state(Phase.STOPPED)}
    assert run(2.0, [new], stopped).actions == (Forget(new.name),)
    assert run(2.0, [new], {}).actions == (Create(new),)


# -- drain and stop -----------------------------------------------------------------------


def test_drain_ends_when_idle_or_at_its_deadline() -> None:
    draining = state(Phase.DRAINING, since=10.0)
    assert only(15.0, draining, desired=False) == Plan((), 15.0)
    assert only(15.0, replace(draining, idle=True), desired=False).actions == (
        Terminate(spec(0).name, "drained"),
    )
    assert only(30.0, draining, desired=False).actions == (
        Terminate(spec(0).name, "drain_timeout"),
    )


def test_sigkill_follows_sigterm_after_the_timeout_once() -> None:
    stopping = state(Phase.STOPPING, since=40.0)
    assert only(42.0, stopping, desired=False) == Plan((), 3.0)
    assert only(45.0, stopping, desired=False).actions == (Kill(spec(0).name),)
    assert only(99.0, replace(stopping, killed=True), desired=False) == Plan((), None)


def test_retiring_is_one_way_scale_back_up_waits_for_the_stop() -> None:
    # Scaled in, then out again while it drains: it finishes draining and stopping...
    draining = state(Phase.DRAINING, since=10.0)
    assert only(12.0, draining) == Plan((), 18.0)
    assert only(12.0, replace(draining, idle=True)).actions == (Terminate(spec(0).name, "drained"),)
    assert only(20.0, state(Phase.STOPPING, since=13.0)).actions == (Kill(spec(0).name),)
    # ... and comes back as a new replica.
    assert only(21.0, state(Phase.STOPPED, since=21.0)).actions == (Forget(spec(0).name),)


# -- starts, crashes, backoff ---------------------------------------------------------------


def test_a_start_that_never_gets_ready_is_aborted_once() -> None:
    starting = state(Phase.STARTING, since=100.0)
    assert only(159.0, starting) == Plan((), 1.0)
    assert only(160.0, starting).actions == (Abort(spec(0).name),)
    assert only(300.0, replace(starting, killed=True)) == Plan((), None)


def test_an_engines_own_startup_budget_replaces_the_runtimes() -> None:
    slow = PoolSpec("big", EngineSpec(ready_timeout_s=900.0), replicas=1)
    starting = ProcessState(slow.replica(0), Phase.STARTING, 100.0)
    assert only(160.0, starting) == Plan((), 840.0)  # the runtime's 60 s do not apply
    assert only(1000.0, starting).actions == (Abort(slow.replica(0).name),)


def test_backoff_doubles_per_crash_up_to_the_cap() -> None:
    delays = [backoff_delay(n, SETTINGS) for n in range(1, 9)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert backoff_delay(0, SETTINGS) == 0.0
    assert backoff_delay(10_000, SETTINGS) == 30.0


@pytest.mark.parametrize(("crashes", "delay"), [(1, 1.0), (2, 2.0), (3, 4.0), (7, 30.0)])
def test_a_crashed_replica_restarts_after_its_backoff(crashes: int, delay: float) -> None:
    crashed = state(Phase.CRASHED, since=50.0, crashes=crashes)
    assert only(50.0, crashed) == Plan((), delay)
    assert only(50.0 + delay - 0.001, crashed).actions == ()
    assert only(50.0 + delay, crashed).actions == (Launch(spec(0), restart=True),)


def test_backoff_resets_after_a_healthy_period() -> None:
    ready = state(Phase.READY, since=200.0, crashes=4)
    assert only(205.0, ready) == Plan((), 5.0)
    assert only(210.0, ready).actions == (ResetBackoff(spec(0).name),)
    assert only(210.0, replace(ready, crashes=0)) == Plan((), None)


def test_a_crash_loop_keeps_growing_the_backoff() -> None:
    """Crashes shortly after each start: the reconciler never resets, every wait doubles."""
    now, observed = 0.0, state(Phase.PENDING)
    launches: list[float] = []
    for _ in range(5):
        plan = only(now, observed)
        if not plan.actions:
            assert plan.requeue_after is not None
            now += plan.requeue_after
            plan = only(now, observed)
        assert isinstance(plan.actions[0], Launch)
        launches.append(now)
        # The shell's facts: ready after 1 s, crashed 2 s later (before healthy_after_s).
        ready = ProcessState(observed.spec, Phase.READY, now + 1.0, observed.crashes)
        assert only(now + 2.0, ready) == (Plan((), 9.0) if ready.crashes else Plan((), None))
        now += 3.0
        observed = ProcessState(observed.spec, Phase.CRASHED, now, observed.crashes + 1)
    gaps = [b - a for a, b in itertools.pairwise(launches)]
    assert gaps == [3.0 + 1.0, 3.0 + 2.0, 3.0 + 4.0, 3.0 + 8.0]


# -- level-triggered: no flapping -----------------------------------------------------------


def test_a_converged_fleet_produces_no_action_and_no_timer() -> None:
    observed = {s.name: state(Phase.READY, index=s.index) for s in spec_range(2)}
    assert run(1e6, spec_range(2), observed) == Plan((), None)


def test_replicas_in_progress_are_left_alone() -> None:
    observed = {
        spec(0).name: state(Phase.STARTING, since=10.0),
        spec(1).name: state(Phase.READY, since=10.0, index=1),
    }
    for now in (10.0, 20.0, 69.9):
        plan = run(now, spec_range(2), observed)
        assert plan.actions == ()
        assert plan.requeue_after == pytest.approx(70.0 - now)


def test_duplicate_desired_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="desired twice"):
        run(0.0, [spec(0), spec(0)], {})


PHASES = st.sampled_from(list(Phase))


@st.composite
def observed_states(draw: st.DrawFn) -> dict[str, ProcessState]:
    out: dict[str, ProcessState] = {}
    for index in draw(st.sets(st.integers(0, 5), max_size=5)):
        out[spec(index).name] = ProcessState(
            spec(index),
            draw(PHASES),
            since=draw(st.floats(0, 1000)),
            crashes=draw(st.integers(0, 12)),
            idle=draw(st.booleans()),
            killed=draw(st.booleans()),
        )
    return out


@given(
    now=st.floats(0, 2000),
    count=st.integers(0, 5),
    observed=observed_states(),
)
def test_plan_properties(now: float, count: int, observed: dict[str, ProcessState]) -> None:
    desired = spec_range(count)
    plan = run(now, desired, observed)
    assert plan == run(now, desired, observed)  # pure
    names = [action.name for action in plan.actions]
    assert len(names) == len(set(names))  # at most one action per replica
    assert set(names) <= {s.name for s in desired} | observed.keys()
    for action in plan.actions:
        assert not isinstance(action, Create) or action.name not in observed
        if not isinstance(action, Create):
            assert action.name in observed
        assert not _is_start(action) or action.name in {s.name for s in desired}
    if plan.actions:
        assert plan.requeue_after == 0.0
    else:
        assert plan.requeue_after is None or plan.requeue_after >= 0.0


def _is_start(action: Action) -> bool:
    return isinstance(action, Create | Launch)
