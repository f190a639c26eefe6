"""N+1: a pool without a spare replica raises the gauge and warns once per transition."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from gpufleet.cli._up_cmd import spare_warnings
from gpufleet.fleet import ReplicaId, ReplicaState
from gpufleet.gateway import GatewayMetrics, Upstream
from gpufleet.gateway._state import FleetState
from gpufleet.runtime import EngineKind, RuntimeSnapshot
from gpufleet.runtime._reconcile import Phase
from gpufleet.runtime._snapshot import ReplicaStatus
from tests.gateway.conftest import MODEL, fleet

NAMES = [ReplicaId(f"{MODEL}-{i}") for i in range(3)]


def _replicas(*states: ReplicaState) -> list[Upstream]:
    return [
        Upstream(name, MODEL, f"http://127.0.0.1:{9000 + i}", state)
        for i, (name, state) in enumerate(zip(NAMES, states, strict=False))
    ]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_losing_the_spare_warns_once_per_transition(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpufleet.gateway")
    registry = CollectorRegistry()
    config = fleet(replicas=3, health={"active": {"enabled": False}})
    state = FleetState(config, GatewayMetrics(registry), lambda: 0.0, lambda: None)

    def gauge() -> float | None:
        return registry.get_sample_value("gpufleet:gateway_pool_without_spare", {"model": MODEL})

    ready, failed = ReplicaState.READY, ReplicaState.FAILED
    state.set_replicas(_replicas(ready, ready, ready))
    assert not _warnings(caplog)  # not judged until the health policy has decided
    state.decide(0.0)  # new processes: STARTING, then judged by the next decision
    state.decide(0.1)
    assert gauge() == 0
    assert state.spare[MODEL] is True
    assert not _warnings(caplog)

    state.set_replicas(_replicas(ready, failed, ready))
    state.decide(1.0)
    state.refresh(2.0)
    assert gauge() == 1
    (warning,) = _warnings(caplog)
    assert warning == (
        "pool 'llama-3.1-8b' has no spare replica for N+1 redundancy: "
        "2 routable, 2 needed + 1 spare"
    )

    state.set_replicas(_replicas(ready, ready, ready))
    state.decide(3.0)
    assert gauge() == 0
    assert any("spare replica again" in r.getMessage() for r in caplog.records)

    state.set_replicas(_replicas(ready, ready, failed))
    state.decide(4.0)
    assert len(_warnings(caplog)) == 2


def test_a_pool_without_a_spare_from_the_start_warns_once_judged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = fleet(replicas=1)  # active checks on: STARTING until the first probe answers
    state = FleetState(config, GatewayMetrics(CollectorRegistry()), lambda: 0.0, lambda: None)
    state.set_replicas(_replicas(ReplicaState.READY))
    state.decide(0.0)
    assert not _warnings(caplog)  # probing: still starting
    assert state.spare[MODEL] is None
    state.set_replicas(_replicas(ReplicaState.FAILED))
    assert len(_warnings(caplog)) == 1
    state.refresh(1.0)
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
