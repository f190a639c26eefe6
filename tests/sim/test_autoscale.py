"""Autoscaling in the simulator: start-up times, standbys, drains, the bill, determinism.

Short synthetic traces (minutes of simulated time) on small, KV-bound replicas (Llama-3.1-8B
on an A10G holds ~20 conversation-sized requests), so a step of a few requests/s moves
the pool. The policy is the real ``AutoscalePolicy``; these tests check the shell around it.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpufleet.cli import app
from gpufleet.config import FleetConfig, parse_fleet
from gpufleet.sim import FleetSimulation, Phase, SimOptions, TraceRequest

MODEL = "llama-3.1-8b"


def step_trace(
    *, low: float, high: float, up_at: float, down_at: float, end: float, seed: int = 1
) -> Iterator[TraceRequest]:
    """Poisson arrivals at ``low`` req/s, ``high`` from ``up_at`` to ``down_at``."""
    rng = random.Random(seed)
    t = 0.0
    while True:
        t += rng.expovariate(high if up_at <= t < down_at else low)
        if t >= end:
            return
        yield TraceRequest(t, rng.randrange(600, 1400), rng.randrange(40, 120))


def fleet(**autoscale: Any) -> FleetConfig:
    return parse_fleet(fleet_data(**autoscale))


def fleet_data(**autoscale: Any) -> dict[str, Any]:
    startup = autoscale.pop("startup", {"provision": 20.0, "load": 10.0, "promote": 5.0})
    settings = {
        "min_replicas": 2,
        "max_replicas": 8,
        "scale_down_cooldown": 30.0,
        "provisioning_horizon": 30.0,
        "forecast": {"enabled": False},
    }
    settings.update(autoscale)
    return {
        "gateway": {"scrape_interval": 1.0},
        "models": [
            {
                "name": MODEL,
                "gpu": "a10g",
                "replicas": 2,
                "routing": {"policy": "kv_aware", "max_scrape_age": 2.0},
                "startup": startup,
                "autoscale": settings,
            }
        ],
    }


def run(config: FleetConfig, trace: Iterator[TraceRequest], **options: Any) -> FleetSimulation:
    sim = FleetSimulation(config, SimOptions(seed=0, **options))
    sim.start(trace)
    sim.run()
    assert sim.check() == []
    return sim


STEP = {"low": 0.5, "high": 6.0, "up_at": 60.0, "down_at": 200.0, "end": 420.0}


@pytest.fixture(scope="module")
def stepped() -> FleetSimulation:
    """Cold starts only: 20 s to provision + 10 s to load."""
    return run(fleet(), step_trace(**STEP))


def test_a_step_up_grows_the_pool_after_the_modelled_start_up(stepped: FleetSimulation) -> None:
    cold = [i for i in stepped.autoscaling.instances if i.via == "cold"]
    assert cold, "the step should have asked for replicas"
    first_ask = min(i.asked_at for i in cold if i.asked_at is not None)
    assert first_ask > STEP["up_at"]
    for inst in cold:
        assert inst.asked_at is not None
        if inst.serving_at is not None:  # not cancelled by a drain while starting
            assert inst.serving_at == pytest.approx(inst.asked_at + 30.0)
            assert inst.provisioned_at == inst.asked_at  # charged from the decision on
    timeline = stepped.timeline
    serving = timeline.phases[MODEL]["serving"]
    grew = next(t for t, n in zip(timeline.t, serving, strict=True) if n > 2)
    assert grew >= first_ask + 30.0
    lag = stepped.report({})["autoscale"][MODEL]["lag"]
    assert lag["cold_s"]["p50"] == pytest.approx(30.0)
    assert lag["promoted_s"]["n"] == 0
    assert lag["over_target"]["episodes"] >= 1


def test_scale_down_drains_without_losing_a_request(stepped: FleetSimulation) -> None:
    report = stepped.report({})
    assert report["overall"]["failed"] == 0
    assert report["overall"]["rejected"] == 0
    assert report["autoscale"][MODEL]["drained"] >= 1
    drained = [
        i for i in stepped.autoscaling.instances if Phase.DRAINING in {p: t for t, p in i.history}
    ]
    assert drained
    by_replica: dict[int, list[Any]] = {}
    for record in stepped.harness.recorder.log:
        by_replica.setdefault(record.replica, []).append(record)
    for inst in drained:
        drain_at = next(t for t, p in inst.history if p is Phase.DRAINING)
        assert inst.gone_at is not None
        assert inst.driver is not None
        for record in by_replica.get(inst.driver, []):
            assert record.arrival_s < drain_at  # no new request once draining
            assert record.finish_s <= inst.gone_at  # it left after its last one ended
    assert report["timeline"]["phases"][MODEL]["serving"][-1] < max(
        report["timeline"]["phases"][MODEL]["serving"]
    )


def test_gpu_hours_charge_every_phase_from_provisioning_to_leaving(
    stepped: FleetSimulation,
) -> None:
    report = stepped.report({})
    end = report["simulated_s"]
    seconds = 0.0
    for inst in stepped.autoscaling.instances:
        left = end if inst.gone_at is None else min(inst.gone_at, end)
        seconds += max(0.0, left - min(inst.provisioned_at, end)) * inst.gpus
    cost = report["cost"]["models"][MODEL]
    assert cost["gpu_hours"] == pytest.approx(seconds / 3600, abs=1e-4)
    phases = cost["gpu_hours_by_phase"]
    assert math.fsum(phases.values()) == pytest.approx(cost["gpu_hours"], abs=1e-3)
    assert phases["starting"] > 0
    assert phases["draining"] >= 0
    assert phases["standby"] == 0
    assert report["cost"]["usd"] == pytest.approx(cost["gpu_hours"] * 1.0, abs=0.01)  # $1/h


def test_a_static_pool_is_charged_replicas_times_the_run() -> None:
    config = parse_fleet({"models": [{"name": MODEL, "gpu": "a10g", "tp": 2, "replicas": 3}]})
    sim = run(config, step_trace(low=2.0, high=2.0, up_at=0, down_at=0, end=60.0))
    report = sim.report({})
    hours = report["cost"]["models"][MODEL]["gpu_hours"]
    assert hours == pytest.approx(3 * 2 * report["simulated_s"] / 3600, abs=1e-4)
    assert report["autoscale"] == {}


def test_prewarmed_standbys_join_in_promote_seconds() -> None:
    sim = run(fleet(prewarm=1), step_trace(**STEP))
    scaling = sim.autoscaling
    promoted = [i for i in scaling.instances if i.via == "promoted"]
    ready = [i for i in promoted if i.ready_since is not None and i.ready_since <= i.asked_at]
    assert ready
    for inst in promoted:
        assert inst.asked_at is not None
        assert inst.serving_at is not None
        if inst in ready:  # a ready standby joins in `promote` seconds
            assert inst.serving_at - inst.asked_at == pytest.approx(5.0)
        else:  # one still warming finishes loading first
            assert inst.warm_at is not None
            assert inst.warm_at > inst.asked_at
            assert inst.serving_at == pytest.approx(inst.warm_at + 5.0)
    section = sim.report({})["autoscale"][MODEL]
    assert section["lag"]["promoted_s"]["p50"] == pytest.approx(5.0)
    assert section["prewarm_starts"] >= 1 + len(promoted)  # the pool, then each refill
    assert sim.report({})["cost"]["models"][MODEL]["gpu_hours_by_phase"]["standby"] > 0


def test_same_inputs_and_seed_give_the_same_report_bytes() -> None:
    trace = {"low": 0.5, "high": 5.0, "up_at": 30.0, "down_at": 120.0, "end": 240.0}
    first, second = (
        json.dumps(run(fleet(prewarm=1), step_trace(**trace)).report({}), sort_keys=False)
        for _ in range(2)
    )
    assert first == second


def test_a_crash_of_a_draining_or_added_replica_keeps_every_request() -> None:
    """Faults and scaling together: MTBF crashes hit replicas that joined mid-run."""
    from gpufleet.sim import MtbfFault  # noqa: PLC0415 - only here

    sim = run(
        fleet(prewarm=1),
        step_trace(**STEP),
        faults=(MtbfFault(hours=0.02, startup_s=15.0),),
    )
    report = sim.report({})
    assert sim.faults.crashes >= 1
    assert report["overall"]["requests"] == sum(1 for _ in step_trace(**STEP))


def test_simulate_cli_compares_a_static_and_an_autoscaled_fleet(tmp_path: Path) -> None:
    trace = tmp_path / "step.jsonl"
    with trace.open("w") as file:
        for r in step_trace(low=0.5, high=5.0, up_at=30.0, down_at=120.0, end=200.0):
            row = {"arrival_s": round(r.arrival_s, 6), "input_tokens": r.input_tokens}
            file.write(json.dumps({**row, "output_tokens": r.output_tokens}) + "\n")
    static = tmp_path / "static.yaml"
    static.write_text(f"models:\n  - {{name: {MODEL}, gpu: a10g, replicas: 4}}\n")
    scaled = tmp_path / "scaled.yaml"
    scaled.write_text(json.dumps(fleet_data(prewarm=1)))  # JSON is YAML
    result = CliRunner().invoke(
        app,
        [
            "simulate", "--compare", str(static), str(scaled), "--trace", str(trace),
            "--ttft-slo-ms", "2000", "--tpot-slo-ms", "100", "--out", str(tmp_path / "out"),
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    for row in ("scale-up lag", "replicas serving", "GPU-hours"):  # (rows wrap at 80 columns)
        assert row in result.output
    report = json.loads((tmp_path / "out" / "scaled" / "report.json").read_text())
    assert report["fleet"][0]["autoscale"] is True
    assert report["autoscale"][MODEL]["scale_ups"] >= 1
    assert (tmp_path / "out" / "scaled" / "replicas.png").read_bytes()[:4] == b"\x89PNG"
    compare = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert set(compare["fleets"]) == {"static", "scaled"}


def test_report_events_are_the_gateways_decision_records(stepped: FleetSimulation) -> None:
    """One record for a scale decision, live or simulated (``policy.decision_record``)."""
    from gpufleet.policy import decision_record  # noqa: PLC0415 - only here

    pool = stepped.autoscaling.pools[MODEL]
    assert pool.last is not None
    view = stepped.control.pools[MODEL].pool_view()
    expected = decision_record(pool.last, view).keys()
    events = stepped.report({})["autoscale"][MODEL]["events"]
    assert events
    for event in events:
        assert event.keys() == expected
        assert event["model"] == MODEL
        assert event["held"] == 0  # the simulator holds no request
    assert {e["direction"] for e in events} == {"up", "down"}
