"""Rollouts inside the controller: the served names' :class:`~gpufleet.policy.Rollout`\\ s,
fed the samples they analyse and driven by the controller's clock. Written once, for the
gateway and the simulator (both drive :class:`~gpufleet.control.FleetController`).

::

    RolloutStart(name, config) ─► Rollout(base = the name's weights now) ─► weights: step 0
    AttemptFailed(5xx, timeout, connect) / Finished(success) of a request in a watched pool
                               ─► that side's window: requests, errors
    Latencies(pool, ttft, itl) ─► that side's window: latency samples (the shell measures)
    Tick at next_wakeup()      ─► Rollout.decide(now, routable replicas per pool)
                               ─► weights ─► RolloutStep (the shell logs, counts, audits,
                                                          persists its state)
    RolloutAct(name, action)   ─► promote · pause · resume · abort ─► RolloutStep

A rollback (and an abort) sets the new variant's weight to 0: no new session goes to it, and
the requests it has in flight end there (no stream is cut); the status shows what is left in
flight. A pool is *watched* while a rollout of a name it serves is active: only then do its
requests' outcomes cost a dictionary lookup more.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from gpufleet.control._events import (
    AttemptFailed,
    Command,
    Finished,
    Latencies,
    RolloutAct,
    RolloutStart,
    RolloutStep,
)
from gpufleet.control._served import ServedModel
from gpufleet.fleet import FAILURES, Outcome
from gpufleet.policy import (
    ACTIVE_ROLLOUT,
    Rollout,
    RolloutDecision,
    RolloutPhase,
)

_COUNTED: Final = FAILURES | {Outcome.SUCCESS}
"""Outcomes a window counts: answers and replica failures (not a client's 4xx or leave)."""


class Rollouts:
    """Every served name's rollout (the last one of each name, active or over)."""

    __slots__ = ("by_name", "last", "served", "watched")

    def __init__(self, served: Mapping[str, ServedModel]) -> None:
        self.served = served
        self.by_name: dict[str, Rollout] = {}
        self.last: dict[str, RolloutDecision] = {}
        """Each name's latest decision (its status)."""
        self.watched: dict[str, Rollout] = {}
        """Pool → the active rollout it is a variant of."""

    def start(self, now: float, event: RolloutStart, ready: Mapping[str, int]) -> list[Command]:
        """A new rollout (``ValueError``: an unknown name or variant, or one in progress)."""
        served = self.served.get(event.model)
        if served is None:
            raise ValueError(f"rollout: no served model {event.model!r}")
        current = self.by_name.get(event.model)
        if current is not None and current.phase in ACTIVE_ROLLOUT:
            raise ValueError(
                f"rollout: {event.model!r} is rolling out to {current.config.to!r} already "
                f"({current.phase.value}); abort it first"
            )
        for pool in served.weights():
            other = self.watched.get(pool)
            if other is not None:
                raise ValueError(
                    f"rollout: pool {pool!r} is in the rollout of {other.model!r} already"
                )
        base = dict(event.base) if event.base is not None else served.weights()
        phase = None if event.phase is None else RolloutPhase(event.phase)
        rollout = Rollout(event.model, event.config, base, now, step=event.step, phase=phase)
        decision = rollout.begin(now)
        served.reweigh(decision.weights)  # ValueError (nothing changed): a pool it lacks
        self.by_name[event.model] = rollout
        self._watch(rollout)
        return [self._apply(rollout, decision)]

    def act(self, now: float, event: RolloutAct) -> list[Command]:
        rollout = self.by_name.get(event.model)
        if rollout is None:
            raise ValueError(f"rollout: {event.model!r} has no rollout")
        decision = rollout.act(now, event.action)
        return [self._apply(rollout, decision)]

    def outcome(self, now: float, event: AttemptFailed | Finished) -> None:
        """A request's attempt on a watched pool ended."""
        rollout = self.watched.get(event.model)
        if rollout is not None and event.outcome in _COUNTED:
            rollout.outcome(event.model, error=event.outcome is not Outcome.SUCCESS, now=now)

    def latencies(self, now: float, event: Latencies) -> None:
        rollout = self.watched.get(event.model)
        if rollout is not None:
            rollout.latencies(event.model, event.ttft, event.itl, now)

    def due(self, now: float, ready: Mapping[str, int]) -> list[Command]:
        out: list[Command] = []
        for rollout in list(self.by_name.values()):
            decision = rollout.decide(now, ready)
            if decision is not None:
                out.append(self._apply(rollout, decision))
        return out

    def next_wakeup(self) -> float | None:
        due = None
        for rollout in self.by_name.values():
            t = rollout.next_wakeup()
            if t is not None and (due is None or t < due):
                due = t
        return due

    def status(self, model: str) -> dict[str, Any] | None:
        """``model``'s rollout as the admin API shows it (``None``: it never had one)."""
        decision = self.last.get(model)
        if decision is None:
            return None
        rollout = self.by_name[model]
        return {
            **decision.to_json(),
            "phase": rollout.phase.value,
            "next_decision_at": rollout.next_wakeup(),
            "window": {
                "new": {"requests": rollout.new.requests, "errors": rollout.new.errors},
                "old": {"requests": rollout.old.requests, "errors": rollout.old.errors},
            },
        }

    def _apply(self, rollout: Rollout, decision: RolloutDecision) -> RolloutStep:
        """Put the decision's weights in force; stop watching a rollout that is over."""
        self.served[rollout.model].reweigh(decision.weights)
        self.last[rollout.model] = decision
        if rollout.phase not in ACTIVE_ROLLOUT:
            for pool in rollout.base:
                if self.watched.get(pool) is rollout:
                    del self.watched[pool]
        return RolloutStep(decision, rollout.snapshot())

    def _watch(self, rollout: Rollout) -> None:
        if rollout.phase in ACTIVE_ROLLOUT:
            for pool in rollout.base:
                self.watched[pool] = rollout
