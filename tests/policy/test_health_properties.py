"""L1: health invariants under any sequence of outcomes, probe answers and clock steps.

Invariants (after every decision):

* the ejected share of a pool never exceeds ``max_ejection_percent`` (floor);
* each ejection lasts ``min(base × n, max)`` for the replica's n-th ejection, so ejection
  time grows with the count;
* a replica is never readmitted before its ejection time has passed *and* its last probe,
  answered after that, was OK;
* routing states follow the breaker: ejected iff the breaker is open or half-open.

And one seed gives one run, dry-run draws included.
"""

from __future__ import annotations

import math
import random

from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gpufleet.fleet import Outcome, ProbeResult, ReplicaId, ReplicaState, RequestFinished
from gpufleet.policy import (
    ActiveCheckConfig,
    BreakerPhase,
    HealthConfig,
    HealthDecision,
    HealthPolicy,
    OutlierConfig,
)

from .factories import make_view, rid

OUTCOMES = st.sampled_from(list(Outcome))


class HealthMachine(RuleBasedStateMachine):
    """A fixed pool of READY replicas; failures, probes and time in any order."""

    @initialize(
        size=st.integers(1, 6),
        percent=st.sampled_from([0.0, 20.0, 34.0, 50.0, 100.0]),
        threshold=st.integers(1, 3),
        enforcing=st.sampled_from([0.0, 0.5, 1.0]),
        active=st.booleans(),
        seed=st.integers(0, 2**32 - 1),
    )
    def setup(
        self,
        *,
        size: int,
        percent: float,
        threshold: int,
        enforcing: float,
        active: bool,
        seed: int,
    ) -> None:
        self.outlier = OutlierConfig(
            consecutive_5xx=threshold,
            consecutive_local_origin_failure=threshold,
            base_ejection_time=2.0,
            max_ejection_time=5.0,
            max_ejection_percent=percent,
            enforcing=enforcing,
        )
        config = HealthConfig(
            outlier=self.outlier, active=ActiveCheckConfig(enabled=active, interval=1.0)
        )
        self.rng = random.Random(seed)
        self.policy = HealthPolicy(config, self.rng)
        self.size = size
        self.view = make_view(size)
        self.now = 0.0
        self.ejected_until: dict[ReplicaId, float] = {}
        self.last_probe: dict[ReplicaId, tuple[float, bool]] = {}
        self.decision: HealthDecision = self.policy.decide(self.now, self.view)

    @rule(i=st.integers(0, 5), outcome=OUTCOMES, n=st.integers(1, 3))
    def finish(self, i: int, outcome: Outcome, n: int) -> None:
        due = [
            self.policy.on_event(self.now, RequestFinished(rid(i % self.size), outcome))
            for _ in range(n)
        ]
        if any(due):  # as the shell does: a threshold was crossed, decide now
            self.decide()

    @rule(i=st.integers(0, 5), ok=st.booleans())
    def probe(self, i: int, ok: bool) -> None:
        replica = rid(i % self.size)
        self.policy.on_event(self.now, ProbeResult(replica, ok))
        self.last_probe[replica] = (self.now, ok)

    @rule(ok=st.booleans())
    def answer_probes(self, ok: bool) -> None:
        """The shell answers the probes the last decision asked for."""
        for replica in self.decision.probes:
            self.probe(int(replica[1:]), ok)
        self.decide()

    @rule(dt=st.sampled_from([0.5, 1.0, 2.0, 3.0, 7.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.decide()

    @rule()
    def decide(self) -> None:
        before = self.decision
        decision = self.policy.decide(self.now, self.view)
        for record in decision.ejections:
            event("overflow" if record.overflow else "ejected" if record.enforced else "dry run")
            if record.enforced:
                n = record.ejections
                expected = min(self.outlier.base_ejection_time * n, self.outlier.max_ejection_time)
                assert math.isclose(record.duration, expected)
                self.ejected_until[record.replica] = record.at + record.duration
        for replica, state in decision.states.items():
            if (
                before.states.get(replica) is ReplicaState.EJECTED
                and state is not ReplicaState.EJECTED
            ):
                until = self.ejected_until[replica]
                assert self.now >= until, "readmitted before its ejection time passed"
                answered_at, ok = self.last_probe.get(replica, (-1.0, False))
                assert ok, "readmitted after a failed probe"
                assert answered_at >= until, "readmitted without a probe after its ejection"
                event("readmitted")
        self.decision = decision

    @invariant()
    def ejected_share_within_limit(self) -> None:
        if not hasattr(self, "decision"):
            return
        limit = math.floor(self.size * self.outlier.max_ejection_percent / 100.0 + 1e-9)
        assert len(self.decision.ejected()) <= limit

    @invariant()
    def states_follow_breakers(self) -> None:
        if not hasattr(self, "decision"):
            return
        for replica, health in self.decision.replicas.items():
            ejected = health.breaker.phase in (BreakerPhase.OPEN, BreakerPhase.HALF_OPEN)
            assert ejected == (self.decision.states[replica] is ReplicaState.EJECTED)


TestHealth = HealthMachine.TestCase
TestHealth.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_one_seed_gives_one_run(seed: int) -> None:
    def run() -> list[HealthDecision]:
        script = random.Random(seed)
        policy = HealthPolicy(
            HealthConfig(outlier=OutlierConfig(consecutive_5xx=2, enforcing=0.5)),
            random.Random(seed),
        )
        view, decisions = make_view(4), []
        for step in range(80):
            now = step * 0.5
            replica = rid(script.randrange(4))
            if script.random() < 0.3:
                policy.on_event(now, ProbeResult(replica, script.random() < 0.7))
            else:
                outcome = script.choice([Outcome.SUCCESS, Outcome.REPLICA_ERROR, Outcome.TIMEOUT])
                policy.on_event(now, RequestFinished(replica, outcome))
            decisions.append(policy.decide(now, view))
        return decisions

    assert run() == run()
