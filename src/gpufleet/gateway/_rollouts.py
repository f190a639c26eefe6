"""The gateway's side of rollouts: the controller decides (``control/_rollouts.py``), this
carries its decisions out and feeds it what only the gateway measures.

::

    start  ─► store's states (a restarted gateway: RolloutStart at its step and phase)
              else the fleet file's rollout blocks ─► RolloutStart
    request ends on a watched pool ─► sample(pool, ttft, itl) ─► Latencies, before each Tick
    RolloutStep ─► one JSON log line (logger ``gpufleet.rollout``)
                ─► gpufleet:rollout_decisions_total{model, verdict}, gpufleet:rollout_weight
                ─► the console's timeline, the audit log (auth on), the store's state

Without a store (auth off, no ``store``) a rollout still runs, but a restart forgets it:
the fleet file's block starts again from its first step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpufleet.control import RolloutConfig, RolloutStart, RolloutStep
from gpufleet.store import Store, audit_row

if TYPE_CHECKING:
    from gpufleet.gateway._control import LiveControl

logger = logging.getLogger("gpufleet.rollout")


class RolloutShell:
    """Carries out a gateway's ``RolloutStep`` commands; starts and restores rollouts."""

    def __init__(
        self,
        control: LiveControl,
        registry: CollectorRegistry,
        store: Store | None,
        *,
        audit: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.control = control
        self.store = store
        self._audit = audit
        self.decisions = Counter(
            "gpufleet:rollout_decisions",
            "Rollout steps and verdicts, by served name and verdict.",
            ["model", "verdict"],
            registry=registry,
        )
        self.weight = Gauge(
            "gpufleet:rollout_weight",
            "A served name's variant weights in force (a rollout's share, in %).",
            ["model", "variant"],
            registry=registry,
        )
        control.on_rollout = self.carry_out

    def begin(self) -> None:
        """Restore the store's rollouts (a restart), then start the fleet file's rollout
        blocks of the names the store has none of. A state that no longer fits the fleet
        file is logged and skipped."""
        states = {} if self.store is None else self.store.rollouts.all()
        for model, state in states.items():
            try:
                event = RolloutStart(
                    model,
                    RolloutConfig.model_validate(state["config"]),
                    int(state["step"]),
                    str(state["phase"]),
                    tuple((str(p), float(w)) for p, w in state["base"].items()),
                )
                self.control.handle(event)
            except (KeyError, TypeError, AttributeError, ValueError) as error:
                logger.warning("rollout of %s: its stored state is not restored: %s", model, error)
        for event in self.control.control.fleet_rollouts():
            if event.model not in states:
                self.control.handle(event)

    def carry_out(self, now: float, step: RolloutStep) -> None:
        decision = step.decision
        line = decision.to_json()
        logger.info(json.dumps({"event": "rollout", **line}))
        self.decisions.labels(decision.model, decision.verdict.value).inc()
        for pool, weight in decision.weights:
            self.weight.labels(decision.model, pool).set(weight)
        text = (
            f"{decision.model} → {decision.to}: {decision.verdict.value} "
            f"({decision.share:g} %, {decision.phase.value})"
            + (f": {decision.reason}" if decision.reason else "")
        )
        self.control.timeline.add(now, "rollout", decision.model, text, detail=line)
        if self._audit is not None:
            self._audit(
                audit_row(
                    "controller", f"rollout.{decision.verdict.value}", decision.model, "ok", line
                )
            )
        if self.store is not None:
            try:
                self.store.rollouts.put(decision.model, step.state)
            except Exception:  # a database down: the rollout goes on, a restart forgets it
                logger.exception("rollout of %s: its state was not stored", decision.model)
