"""What the runtime publishes: a frozen, versioned snapshot of every replica it manages."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Final

from gpufleet.fleet import ReplicaId, ReplicaState
from gpufleet.runtime._reconcile import Phase
from gpufleet.runtime._spec import EngineKind

FLEET_STATE: Final[Mapping[Phase, ReplicaState]] = MappingProxyType(
    {
        Phase.PENDING: ReplicaState.STARTING,
        Phase.STARTING: ReplicaState.STARTING,
        Phase.READY: ReplicaState.READY,
        Phase.DRAINING: ReplicaState.DRAINING,
        Phase.STOPPING: ReplicaState.DRAINING,
        Phase.CRASHED: ReplicaState.FAILED,
        Phase.STOPPED: ReplicaState.STOPPED,
    }
)
"""The runtime's phases as the fleet's states: only READY takes traffic."""


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """One replica as the gateway and the CLI see it.

    ``url`` is the base URL (``http://127.0.0.1:41235``, no ``/v1``) of the current process;
    a restarted sim replica listens on a new port, so key routing state by ``name``.
    """

    name: ReplicaId
    pool: str
    model: str
    """The served model name (what clients send as ``model``)."""
    engine: EngineKind
    state: ReplicaState
    phase: Phase
    url: str | None
    pid: int | None
    restarts: int
    """Launches after a crash, over the replica's life."""
    log: Path | None
    """Its log file (stdout and stderr of every launch); ``None`` for external replicas."""
    last_error: str | None
    """Why it last failed, with the last lines of its log; cleared when it is ready again."""
    standby: bool = False
    """A prewarmed standby: started (and, once ``phase`` is READY, ready) but not to be
    routed to until it is promoted. ``state`` is its process's state."""
    since: float = 0.0
    """When it entered ``phase`` (the runtime's loop clock)."""
    kv_events: tuple[str, str] | None = None
    """Its process's KV-event and replay endpoints (``EngineSpec.kv_events``), once known."""
    reclaim_at: float | None = None
    """When the provider takes it back (wall clock, Unix seconds): a preemption notice the
    runtime saw (operator mode: its node's taint or cordon); ``None``: none. The gateway
    hands it to the controller as ``Preempting`` (docs/spot.md)."""


@dataclass(frozen=True, slots=True)
class RuntimeSnapshot:
    """Every replica the runtime manages, at one ``version`` (which grows with every change)."""

    version: int
    replicas: tuple[ReplicaStatus, ...]
    """In pool then index order."""
    desired: Mapping[str, int] = field(default_factory=dict)
    """Wanted serving replica count per pool (standbys not counted)."""
    standby: Mapping[str, int] = field(default_factory=dict)
    """Wanted standby count per pool."""
    closed: bool = False
    """The runtime has stopped: nothing runs, no further snapshot comes."""

    def ready(self, pool: str | None = None) -> tuple[ReplicaStatus, ...]:
        """Replicas that take traffic (ready, not standing by), of one pool or all."""
        return tuple(
            r
            for r in self.replicas
            if r.state is ReplicaState.READY and not r.standby and (pool is None or r.pool == pool)
        )

    def standbys(self, pool: str | None = None) -> tuple[ReplicaStatus, ...]:
        """Prewarmed standbys (ready or still warming), of one pool or all."""
        return tuple(r for r in self.replicas if r.standby and (pool is None or r.pool == pool))

    def get(self, name: str) -> ReplicaStatus | None:
        """The replica called ``name``, if the runtime manages it."""
        return next((r for r in self.replicas if r.name == name), None)

    def all_ready(self) -> bool:
        """Every pool has exactly its desired count of serving replicas and of standbys,
        all ready."""
        for pool, count in self.desired.items():
            mine = [r for r in self.replicas if r.pool == pool]
            serving = [r for r in mine if not r.standby]
            standby = [r for r in mine if r.standby]
            if len(serving) != count or len(standby) != self.standby.get(pool, 0):
                return False
            if any(r.state is not ReplicaState.READY for r in mine):
                return False
        return True
