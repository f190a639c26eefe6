"""What the gateway shows of each pool's routing view: replica states, routable counts, N+1.

The pool controller (``gpufleet.control``) builds the view; this module only exports it, each
time it changes: the ``replica_state`` gauge (1 for each replica's state), the
``routable_replicas`` and ``pool_without_spare`` gauges, and the N+1 log lines.

N+1: a pool of ``replicas: n`` needs N = max(n - 1, 1) routable replicas and one spare. A
warning is logged (``gpufleet.gateway``) once each time a pool loses its spare, and an info
line when it has one again. Until a pool has been judged (no replica still ``STARTING``, or a
spare seen once) nothing is logged, so a fleet starting up does not warn.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Final

from gpufleet.config import FleetConfig, ModelConfig
from gpufleet.control import Redundancy, redundancy
from gpufleet.fleet import FleetView, ReplicaId, ReplicaState
from gpufleet.gateway._metrics import GatewayMetrics

logger = logging.getLogger("gpufleet.gateway")

_STATES: Final = tuple(ReplicaState)


def required_replicas(model: ModelConfig) -> int:
    """N of N+1 for a pool: all of its replicas but the spare (at least one)."""
    return max(model.replica_count - 1, 1)


def no_spare_message(check: Redundancy) -> str:
    """The N+1 warning for a pool without a spare (logged, and printed by ``gpufleet up``)."""
    return (
        f"pool {check.model!r} has no spare replica for N+1 redundancy: "
        f"{check.routable} routable, {check.required} needed + 1 spare"
    )


class ViewExport:
    """Exports each pool's routing view to the gateway's metrics and log."""

    def __init__(self, config: FleetConfig, metrics: GatewayMetrics) -> None:
        self._metrics = metrics
        self._required = {m.name: required_replicas(m) for m in config.models}
        self._shown: dict[str, FleetView] = {}
        self.spare: dict[str, bool | None] = dict.fromkeys(self._required)
        """Each pool's last judged N+1 state (``None`` until judged)."""
        for name in self._required:
            metrics.routable.labels(name).set(0)

    def export(self, model: str, view: FleetView) -> None:
        """Show ``model``'s view (a no-op when it is the one shown last)."""
        if self._shown.get(model) is view:
            return
        self._shown[model] = view
        gauge = self._metrics.replica_state
        for replica in view.pool(model):
            for state in _STATES:
                gauge.labels(replica.id, state.value).set(1 if replica.state is state else 0)
        self._metrics.routable.labels(model).set(len(view.routable(model)))
        check = redundancy(view, model, required=self._required[model])
        self._metrics.no_spare.labels(model).set(0 if check.spare else 1)
        self._judge_spare(check, view)

    def forget(self, replica: ReplicaId) -> None:
        """A replica left: drop its state series."""
        for state in _STATES:
            with contextlib.suppress(KeyError):
                self._metrics.replica_state.remove(replica, state.value)

    def _judge_spare(self, check: Redundancy, view: FleetView) -> None:
        """Log a pool's N+1 transitions, once each."""
        last = self.spare[check.model]
        if last is check.spare:
            return
        if (
            last is None
            and not check.spare
            and any(r.state is ReplicaState.STARTING for r in view.pool(check.model))
        ):
            return  # still starting up: not judged yet
        self.spare[check.model] = check.spare
        if not check.spare:
            logger.warning(no_spare_message(check))
        elif last is not None:
            logger.info(
                "pool %r has a spare replica again (%d routable)", check.model, check.routable
            )
