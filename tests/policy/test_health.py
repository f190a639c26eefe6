"""L0: outlier detection, circuit breakers, active checks and the N+1 check, with explicit now."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from gpufleet.fleet import FleetView, Outcome, ProbeResult, ReplicaState, RequestFinished
from gpufleet.policy import (
    ActiveCheckConfig,
    BreakerPhase,
    EjectionCause,
    HealthConfig,
    HealthPolicy,
    OutlierConfig,
    ejection_time,
    redundancy,
)
from gpufleet.policy._breaker import BreakerState, decay
from gpufleet.policy._probe import ProbeState, overdue

from .factories import make_view, rid

S = ReplicaState
PASSIVE = ActiveCheckConfig(enabled=False)


def _policy(
    outlier: OutlierConfig | None = None, active: ActiveCheckConfig = PASSIVE, seed: int = 0
) -> HealthPolicy:
    return HealthPolicy(
        HealthConfig(outlier=outlier or OutlierConfig(), active=active), random.Random(seed)
    )


def _fail(
    policy: HealthPolicy, now: float, replica: int, n: int, outcome: Outcome = Outcome.REPLICA_ERROR
) -> list[bool]:
    return [policy.on_event(now, RequestFinished(rid(replica), outcome)) for _ in range(n)]


def _probe(policy: HealthPolicy, now: float, replica: int, ok: bool) -> bool:
    return policy.on_event(now, ProbeResult(rid(replica), ok))


def _state(policy: HealthPolicy, now: float, view: FleetView, replica: int) -> ReplicaState:
    return policy.decide(now, view).states[rid(replica)]


# -- passive outlier detection ----------------------------------------------------------------


def test_consecutive_5xx_eject_for_the_base_time() -> None:
    policy, view = _policy(), make_view(4)
    assert _fail(policy, 1.0, 0, 5) == [False, False, False, False, True]
    decision = policy.decide(1.0, view)
    assert decision.states[rid(0)] is S.EJECTED
    assert decision.ejected() == {rid(0)}
    (record,) = decision.ejections
    assert (record.replica, record.model, record.cause) == (
        rid(0),
        "m",
        EjectionCause.CONSECUTIVE_5XX,
    )
    assert (record.enforced, record.overflow, record.ejections, record.duration) == (
        True,
        False,
        1,
        5.0,
    )
    assert decision.next_at == 6.0
    assert decision.apply(view).pool("m")[0].state is S.EJECTED


def test_a_response_resets_the_runs_and_a_cancel_changes_nothing() -> None:
    policy, view = _policy(), make_view(2)
    _fail(policy, 0.0, 0, 4)
    policy.on_event(0.0, RequestFinished(rid(0), Outcome.CLIENT_ERROR))
    _fail(policy, 0.0, 0, 4)
    policy.on_event(0.0, RequestFinished(rid(0), Outcome.CANCELLED))
    assert _state(policy, 0.0, view, 0) is S.READY
    assert _fail(policy, 0.0, 0, 1) == [True]


def test_local_and_replica_origin_failures_are_counted_apart() -> None:
    outlier = OutlierConfig(consecutive_5xx=3, consecutive_local_origin_failure=3)
    policy, view = _policy(outlier), make_view(2)
    _fail(policy, 0.0, 0, 2, Outcome.TIMEOUT)
    _fail(policy, 0.0, 0, 2, Outcome.REPLICA_ERROR)  # a 5xx proves the connection: local run resets
    assert _fail(policy, 0.0, 0, 2, Outcome.CONNECT_FAILURE) == [False, False]
    assert _state(policy, 0.0, view, 0) is S.READY
    assert _fail(policy, 0.0, 0, 1, Outcome.TIMEOUT) == [True]
    (record,) = policy.decide(0.0, view).ejections
    assert record.cause is EjectionCause.CONSECUTIVE_LOCAL_ORIGIN


def test_ejection_time_grows_with_the_count_and_is_capped() -> None:
    outlier = OutlierConfig(base_ejection_time=10.0, max_ejection_time=25.0)
    assert [ejection_time(n, outlier) for n in (1, 2, 3, 4)] == [10.0, 20.0, 25.0, 25.0]


def test_readmission_needs_the_time_to_pass_and_a_recovery_probe() -> None:
    policy, view = _policy(OutlierConfig(base_ejection_time=10.0)), make_view(4)
    _fail(policy, 0.0, 1, 5)
    assert policy.decide(0.0, view).states[rid(1)] is S.EJECTED
    _probe(policy, 5.0, 1, ok=True)  # an answer before the time is up does not count
    decision = policy.decide(9.9, view)
    assert decision.states[rid(1)] is S.EJECTED
    assert decision.probes == ()
    decision = policy.decide(10.0, view)  # half-open: still no traffic, probe it now
    assert decision.states[rid(1)] is S.EJECTED
    assert decision.probes == (rid(1),)
    assert decision.replicas[rid(1)].breaker.phase is BreakerPhase.HALF_OPEN
    assert policy.decide(10.1, view).probes == ()  # one recovery probe at a time
    assert _probe(policy, 10.2, 1, ok=True)
    decision = policy.decide(10.2, view)
    assert decision.states[rid(1)] is S.READY
    assert decision.replicas[rid(1)].breaker.ejections == 1


def test_a_failed_recovery_probe_reopens_for_longer() -> None:
    policy, view = _policy(OutlierConfig(base_ejection_time=10.0)), make_view(4)
    _fail(policy, 0.0, 1, 5)
    policy.decide(0.0, view)
    policy.decide(10.0, view)
    _probe(policy, 10.5, 1, ok=False)
    decision = policy.decide(10.5, view)
    assert decision.states[rid(1)] is S.EJECTED
    (record,) = decision.ejections
    assert (record.cause, record.ejections, record.duration) == (
        EjectionCause.RECOVERY_PROBE_FAILED,
        2,
        20.0,
    )
    assert decision.next_at == 30.5


def test_a_lost_recovery_probe_is_asked_for_again() -> None:
    active = ActiveCheckConfig(enabled=False, timeout=1.0)
    policy, view = _policy(OutlierConfig(base_ejection_time=10.0), active), make_view(4)
    _fail(policy, 0.0, 1, 5)
    policy.decide(0.0, view)
    assert policy.decide(10.0, view).probes == (rid(1),)
    assert policy.decide(11.0, view).probes == ()
    assert policy.decide(12.0, view).probes == (rid(1),)  # 2 × timeout without an answer


def test_the_ejection_count_decays_while_closed() -> None:
    policy, view = _policy(OutlierConfig(base_ejection_time=10.0)), make_view(4)
    _fail(policy, 0.0, 0, 5)
    policy.decide(0.0, view)
    policy.decide(10.0, view)
    _probe(policy, 10.0, 0, ok=True)
    assert policy.decide(10.0, view).replicas[rid(0)].breaker.ejections == 1
    assert policy.decide(19.0, view).replicas[rid(0)].breaker.ejections == 1
    assert policy.decide(20.0, view).replicas[rid(0)].breaker.ejections == 0


def test_at_most_max_ejection_percent_of_a_pool_is_ejected() -> None:
    policy, view = _policy(OutlierConfig(max_ejection_percent=50.0)), make_view(4)
    for replica in range(3):
        _fail(policy, 0.0, replica, 5)
    decision = policy.decide(0.0, view)
    assert decision.ejected() == {rid(0), rid(1)}
    overflow = decision.ejections[-1]
    assert (overflow.replica, overflow.enforced, overflow.overflow) == (rid(2), False, True)
    assert decision.states[rid(2)] is S.READY


def test_a_dry_run_logs_without_ejecting() -> None:
    policy, view = _policy(OutlierConfig(enforcing=0.0)), make_view(4)
    _fail(policy, 0.0, 0, 5)
    decision = policy.decide(0.0, view)
    assert decision.states[rid(0)] is S.READY
    (record,) = decision.ejections
    assert (record.enforced, record.overflow, record.duration) == (False, False, 0.0)
    assert _fail(policy, 0.0, 0, 4) == [False] * 4  # the run started over


def test_partial_enforcement_draws_from_the_seeded_rng() -> None:
    def enforced(seed: int) -> list[bool]:
        policy = _policy(OutlierConfig(enforcing=0.5, max_ejection_percent=100.0), seed=seed)
        view, out = make_view(1), []
        for t in range(40):
            _fail(policy, float(t * 1000), 0, 5)
            out += [r.enforced for r in policy.decide(float(t * 1000), view).ejections]
            policy.decide(float(t * 1000 + 500), view)
            _probe(policy, float(t * 1000 + 500), 0, ok=True)
            policy.decide(float(t * 1000 + 500), view)
        return out

    assert enforced(1) == enforced(1)
    assert 5 < sum(enforced(1)) < 35


# -- active checks ----------------------------------------------------------------------------


def test_a_new_replica_is_routable_after_its_first_probe() -> None:
    policy, view = _policy(active=ActiveCheckConfig(interval=1.0)), make_view(2)
    decision = policy.decide(0.0, view)
    assert decision.probes == (rid(0), rid(1))
    assert set(decision.states.values()) == {S.STARTING}
    assert _probe(policy, 0.1, 0, ok=True)
    assert _state(policy, 0.1, view, 0) is S.READY
    assert _state(policy, 0.1, view, 1) is S.STARTING


def test_probes_come_every_interval_and_not_while_one_is_in_flight() -> None:
    policy, view = _policy(active=ActiveCheckConfig(interval=1.0, timeout=0.5)), make_view(1)
    assert policy.decide(0.0, view).probes == (rid(0),)
    assert policy.decide(0.5, view).probes == ()
    _probe(policy, 0.6, 0, ok=True)
    decision = policy.decide(0.6, view)
    assert (decision.probes, decision.next_at) == ((), 1.0)
    assert policy.decide(1.0, view).probes == (rid(0),)
    assert policy.decide(2.0, view).probes == (rid(0),)  # overdue after 2 × timeout: again


def test_failing_probes_mark_a_replica_failed_until_it_recovers() -> None:
    active = ActiveCheckConfig(interval=1.0, healthy_threshold=2, unhealthy_threshold=2)
    policy, view = _policy(active=active), make_view(2)
    _probe(policy, 0.0, 0, ok=True)
    _probe(policy, 1.0, 0, ok=False)
    assert _state(policy, 1.0, view, 0) is S.READY
    assert _probe(policy, 2.0, 0, ok=False)
    assert _state(policy, 2.0, view, 0) is S.FAILED
    assert not _probe(policy, 3.0, 0, ok=True)
    assert _state(policy, 3.0, view, 0) is S.FAILED
    assert _probe(policy, 4.0, 0, ok=True)
    assert _state(policy, 4.0, view, 0) is S.READY


def test_a_restarted_replica_must_prove_itself_again() -> None:
    policy = _policy(active=ActiveCheckConfig())
    _probe(policy, 0.0, 0, ok=True)
    assert _state(policy, 0.0, make_view(1), 0) is S.READY
    decision = policy.decide(1.0, make_view([S.STARTING]))
    assert (decision.states[rid(0)], decision.probes) == (S.STARTING, ())
    assert _state(policy, 2.0, make_view(1), 0) is S.STARTING


def test_a_restarted_replica_does_not_inherit_its_old_process_ejection() -> None:
    policy = _policy()
    _fail(policy, 1.0, 0, 5)
    assert _state(policy, 1.0, make_view(2), 0) is S.EJECTED  # for 5 s
    _fail(policy, 1.5, 1, 4)  # a failure run that its process's restart ends too
    # the runtime restarts both (new processes): no ejection or run carries over
    policy.decide(2.0, make_view([S.STARTING, S.STARTING]))
    assert _state(policy, 2.5, make_view(2), 0) is S.READY
    _fail(policy, 2.5, 1, 1)
    assert _state(policy, 2.5, make_view(2), 1) is S.READY  # 1 failure, not 5
    # the count is kept: failing again, the new process is ejected for twice the base time
    _fail(policy, 3.0, 0, 5)
    decision = policy.decide(3.0, make_view(2))
    assert decision.states[rid(0)] is S.EJECTED
    assert [(r.ejections, r.duration) for r in decision.ejections] == [(2, 10.0)]


def test_a_replica_down_for_long_still_decays_its_count_and_asks_to_wake_later() -> None:
    # the chaos run hung here once: a stopped replica's count was due to decay, was not
    # decayed, and the decision asked to be woken at once, again and again
    policy = _policy()
    _fail(policy, 0.0, 0, 5)
    policy.decide(0.0, make_view(1))  # ejected: count 1
    policy.decide(6.0, make_view([S.STOPPED]))
    decision = policy.decide(20.0, make_view([S.STOPPED]))
    assert decision.next_at is None or decision.next_at > 20.0
    assert policy.snapshot().replicas[rid(0)].breaker.ejections == 0


def test_runtime_states_other_than_ready_pass_through_and_gone_replicas_are_forgotten() -> None:
    policy = _policy()
    _fail(policy, 0.0, 1, 5)
    decision = policy.decide(0.0, make_view([S.DRAINING, S.READY, S.STOPPED, S.FAILED]))
    assert [decision.states[rid(i)] for i in range(4)] == [
        S.DRAINING,
        S.EJECTED,
        S.STOPPED,
        S.FAILED,
    ]
    policy.decide(1.0, make_view(1))
    assert set(policy.snapshot().replicas) == {rid(0)}


def test_health_configs_are_validated() -> None:
    with pytest.raises(ValidationError, match="max_ejection_time"):
        OutlierConfig(base_ejection_time=10.0, max_ejection_time=5.0)
    with pytest.raises(ValidationError, match="enforcing"):
        OutlierConfig(enforcing=1.5)
    with pytest.raises(ValidationError, match="extra"):
        HealthConfig.model_validate({"outlier": {"consecutive_500": 3}})


# -- N+1 --------------------------------------------------------------------------------------


def test_redundancy_says_whether_a_spare_replica_exists() -> None:
    view = make_view([S.READY, S.READY, S.READY, S.EJECTED])
    assert redundancy(view, "m", required=2).spare
    short = redundancy(view, "m", required=3)
    assert (short.spare, short.missing, short.routable) == (False, 1, 3)
    assert redundancy(view, "other", required=0).missing == 1
    with pytest.raises(ValueError, match="required"):
        redundancy(view, "m", required=-1)


# -- wake times are the instants the rules fire ------------------------------------------------


def test_a_breaker_decays_at_the_instant_it_asked_to_wake() -> None:
    """Found by the chaos run (seed 18): closed at 7.06 s with a 5 s base, the policy asked to
    wake at 7.06 + 5.0 = 12.059999999999999, where ``now - since`` is 4.999999999999999 < 5:
    nothing decayed, the wake time stayed ``now``, and the simulator spun at one instant."""
    rng = random.Random(18)
    draws = [(rng.uniform(0, 1e4), rng.choice((1.0, 5.0, 30.0))) for _ in range(2000)]
    pairs = [(7.06, 5.0), *draws]
    for since, base in pairs:
        closed = BreakerState(since=since, phase=BreakerPhase.CLOSED, ejections=1)
        decayed = decay(closed, since + base, OutlierConfig(base_ejection_time=base))
        assert decayed.ejections == 0, (since, base)


def test_a_probe_is_overdue_at_the_instant_it_asked_to_wake() -> None:
    rng = random.Random(18)
    for _ in range(2000):
        since, timeout = rng.uniform(0, 1e4), rng.choice((0.5, 1.0, 0.3))
        config = ActiveCheckConfig(timeout=timeout)
        assert overdue(ProbeState(pending_since=since), since + 2 * timeout, config)
