"""N+1: a pool without a spare replica raises the gauge and warns once per transition."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from gpufleet.cli._up_cmd import spare_warnings
from gpufleet.config import FleetConfig
from gpufleet.control import Event, PoolController, PoolSettings, Replicas, ReplicaSeen, Tick
from gpufleet.fleet import ReplicaId, ReplicaState
from gpufleet.gateway import GatewayMetrics
from gpufleet.gateway._views import ViewExport
from gpufleet.runtime import EngineKind, RuntimeSnapshot
from gpufleet.runtime._reconcile import Phase
from gpufleet.runtime._snapshot import ReplicaStatus
from tests.gateway.conftest import MODEL, fleet

NAMES = [ReplicaId(f"{MODEL}-{i}") for i in range(3)]


def _replicas(*states: ReplicaState, incarnation: str = "a") -> Replicas:
    return Replicas(
        MODEL,
        tuple(
            ReplicaSeen(name, state, f"http://127.0.0.1:{9000 + i}/{incarnation}")
            for i, (name, state) in enumerate(zip(NAMES, states, strict=False))
        ),
    )


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


class _Shown:
    """A pool controller and the gateway's export of its view (the gateway's ``_after``)."""

    def __init__(self, config: FleetConfig, registry: CollectorRegistry) -> None:
        self.pool = PoolController(PoolSettings.of(config, config.models[0], admission=False))
        self.views = ViewExport(config, GatewayMetrics(registry))

    def handle(self, now: float, event: Event) -> None:
        self.pool.handle(now, event)
        self.views.export(MODEL, self.pool.view)


def test_losing_the_spare_warns_once_per_transition(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpufleet.gateway")
    registry = CollectorRegistry()
    config = fleet(replicas=3, health={"active": {"enabled": False}})
    shown = _Shown(config, registry)

    def gauge() -> float | None:
        return registry.get_sample_value("gpufleet:gateway_pool_without_spare", {"model": MODEL})

    ready, failed = ReplicaState.READY, ReplicaState.FAILED
    # new processes: STARTING for the first decision, then judged by the second (at once)
    shown.handle(0.0, _replicas(ready, ready, ready))
    assert gauge() == 0
    assert shown.views.spare[MODEL] is True
    assert not _warnings(caplog)

    shown.handle(1.0, _replicas(ready, failed, ready))
    shown.handle(2.0, Tick())
    assert gauge() == 1
    (warning,) = _warnings(caplog)
    assert warning == (
        "pool 'llama-3.1-8b' has no spare replica for N+1 redundancy: "
        "2 routable, 2 needed + 1 spare"
    )

    shown.handle(3.0, _replicas(ready, ready, ready))
    assert gauge() == 0
    assert any("spare replica again" in r.getMessage() for r in caplog.records)

    shown.handle(4.0, _replicas(ready, ready, failed))
    assert len(_warnings(caplog)) == 2


def test_a_pool_without_a_spare_from_the_start_warns_once_judged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = fleet(replicas=1)  # active checks on
    shown = _Shown(config, CollectorRegistry())
    shown.handle(0.0, _replicas(ReplicaState.STARTING))
    assert not _warnings(caplog)  # still starting: not judged
    assert shown.views.spare[MODEL] is None
    shown.handle(0.5, _replicas(ReplicaState.READY))  # the runtime's check: judged at once
    assert len(_warnings(caplog)) == 1
    shown.handle(1.0, _replicas(ReplicaState.FAILED))
    shown.handle(1.5, Tick())
    assert len(_warnings(caplog)) == 1


def _status(i: int, state: ReplicaState) -> ReplicaStatus:
    return ReplicaStatus(
        name=NAMES[i],
        pool=MODEL,
        model=MODEL,
        engine=EngineKind.SIM,
        state=state,
        phase=Phase.READY if state is ReplicaState.READY else Phase.CRASHED,
        url=None,
        pid=None,
        restarts=0,
        log=None,
        last_error=None,
    )


def test_up_prints_a_warning_for_a_pool_without_spare() -> None:
    one = fleet(replicas=1)
    two = fleet(replicas=2)
    both_ready = RuntimeSnapshot(
        1, (_status(0, ReplicaState.READY), _status(1, ReplicaState.READY))
    )
    one_ready = RuntimeSnapshot(
        1, (_status(0, ReplicaState.READY), _status(1, ReplicaState.FAILED))
    )
    assert spare_warnings(two, both_ready) == []
    assert spare_warnings(two, one_ready) == [
        "warning: pool 'llama-3.1-8b' has no spare replica for N+1 redundancy: "
        "1 routable, 1 needed + 1 spare"
    ]
    alone = RuntimeSnapshot(1, (_status(0, ReplicaState.READY),))
    assert len(spare_warnings(one, alone)) == 1  # one replica is never N+1
