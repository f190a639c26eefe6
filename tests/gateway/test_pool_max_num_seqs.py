"""One running-batch cap per pool: the ``--max-num-seqs`` of the model's ``args``.

The pool controller's admission (the gateway's), the pool's autoscaler and the simulator's
replicas all judge a pool by ``ModelConfig.max_num_seqs``; a pool running ``--max-num-seqs
8`` is full at 8 everywhere, not at vLLM's 256.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpufleet.config import FleetConfig, FleetFileError, parse_fleet
from gpufleet.control import PoolController, PoolSettings
from gpufleet.fleet import FleetView, ReplicaId, ReplicaLoad, ReplicaState, ReplicaView
from gpufleet.policy import AutoscalePolicy, PoolView
from gpufleet.sim import FleetSimulation, SimOptions
from gpufleet.sim._simulate import replica_config

MODEL = "llama-3.1-8b"
SEQS = 8


def fleet(args: list[str], **extra: Any) -> FleetConfig:
    return parse_fleet(
        {
            "models": [
                {
                    "name": MODEL,
                    "replicas": 2,
                    "args": args,
                    "routing": "least_request",
                    "autoscale": {"max_replicas": 8, "forecast": {"enabled": False}},
                }
            ],
            **extra,
        }
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--max-num-seqs", "8"],
        ["--max-num-seqs=8"],
        ["--time-scale", "2", "--max-num-seqs", "64", "--max-num-seqs=8"],  # the last wins
    ],
)
def test_the_fleet_file_and_the_simulated_engine_read_the_same_cap(args: list[str]) -> None:
    model = fleet(args).models[0]
    assert model.max_num_seqs == SEQS
    assert replica_config(model, seed=0).max_num_seqs == SEQS


def test_without_the_flag_the_cap_is_vllms_default() -> None:
    model = fleet([]).models[0]
    assert model.max_num_seqs == 256 == replica_config(model, seed=0).max_num_seqs


@pytest.mark.parametrize("value", ["eight", "0"])
def test_a_bad_cap_is_the_fleet_files_error(value: str) -> None:
    with pytest.raises(FleetFileError, match="max-num-seqs"):
        fleet(["--max-num-seqs", value])


def _replicas(running: int, observed: bool = True) -> tuple[ReplicaView, ...]:
    load = ReplicaLoad(running=running, observed_at=0.0 if observed else None)
    return tuple(
        ReplicaView(ReplicaId(f"{MODEL}-{i}"), MODEL, ReplicaState.READY, load) for i in range(2)
    )


def test_the_pool_controllers_admission_is_saturated_at_the_pools_cap() -> None:
    config = fleet(["--max-num-seqs", str(SEQS)], tenants={"auth": True})
    pool = PoolController(PoolSettings.of(config, config.models[0]))  # what the gateway runs
    admission = pool.admission
    assert admission is not None
    unscraped = FleetView.of(0.0, _replicas(0, observed=False)).routable(MODEL)
    admission.in_flight = 2 * (SEQS - 1)  # the own count: 7 a replica
    assert not admission.saturated(unscraped)
    admission.in_flight += 1  # 8 on the fuller one (rounded up)
    assert admission.saturated(unscraped)
    scraped = FleetView.of(1.0, _replicas(SEQS)).routable(MODEL)  # 8 running on each
    admission.in_flight = 0
    assert admission.saturated(scraped)


def test_the_autoscaler_is_saturated_at_the_pools_cap() -> None:
    model = fleet(["--max-num-seqs", str(SEQS)]).models[0]
    assert model.autoscale is not None
    decision = AutoscalePolicy(model.autoscale, model.max_num_seqs).decide(
        0.0, PoolView(MODEL, _replicas(SEQS))
    )
    assert decision.inputs.utilisation == 1.0
    assert decision.desired > 2  # full at 8: scale out (at 256 it would be 3 % busy)


def test_the_simulators_gate_and_autoscaler_take_the_pools_cap() -> None:
    sim = FleetSimulation(
        fleet([f"--max-num-seqs={SEQS}"], tenants={"auth": True}), SimOptions(seed=0)
    )
    admission = sim.control.pools[MODEL].admission
    assert admission is not None
    assert admission.gauge.max_num_seqs == SEQS
    autoscaler = sim.control.pools[MODEL].autoscaler  # the controller's, which the sim acts for
    assert autoscaler is not None
    assert autoscaler.max_num_seqs == SEQS
    assert all(d.model.config.max_num_seqs == SEQS for d in sim.harness.drivers)
