"""Spot pools in the simulator: Poisson preemptions with a notice, drained by the pool
controller (no new attempt on a noticed replica; what is still there is abandoned ahead of
the deadline and resumed or retried elsewhere), replacements, and the cost split."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpufleet.cli import app
from gpufleet.config import FleetConfig, parse_fleet
from gpufleet.control import read_recording, replay
from gpufleet.sim import FleetSimulation, SimOptions, parse_fault
from tests.sim.test_faults import requests

POOL = "llama-3.1-8b"


def spot_fleet(abandon_before: float = 5.0) -> FleetConfig:
    models = [
        {"name": POOL, "replicas": 4, "routing": "least_request", "capacity": "spot",
         "spot": {"abandon_before": abandon_before}},
        {"name": "on-demand", "model": POOL, "replicas": 1},
    ]  # fmt: skip
    return parse_fleet({"models": models}, source="test")


def run(config: FleetConfig, spec: str, seed: int = 1, n: int = 1500) -> FleetSimulation:
    sim = FleetSimulation(config, SimOptions(seed=seed, faults=(parse_fault(spec),)))
    sim.start(requests(n, rate=10.0, seed=seed))  # all to the first (spot) pool
    sim.run()
    assert sim.check() == []  # every request ends once
    return sim


SPOT = "spot:per_gpu_hour=40,notice_s=30,startup_s=20"
"""About one notice per replica every 90 s: several in a 150 s trace."""


def test_preempted_replicas_lose_no_request() -> None:
    sim = run(spot_fleet(), SPOT)
    report = sim.report({})
    faults = report["faults"]
    assert faults["preemptions"] >= 3
    assert faults["crashes"] == 0  # a preemption is not a crash
    assert report["overall"]["failed"] == faults["requests_failed"] == 0
    assert faults["lost_mid_stream"] == faults["cut_by_preemption"] == 0
    assert sim.control.pools[POOL].counters.retries_refused == 0
    # the on-demand pool is never preempted
    assert all(r["crashes"] == 0 for r in report["replicas"] if r["model"] == "on-demand")


SHORT = "spot:per_gpu_hour=40,notice_s=3,startup_s=20"
"""A notice shorter than many requests: some are still on the replica near its end."""


def test_what_is_left_near_the_deadline_moves_before_the_replica_goes() -> None:
    """``abandon_before: 2`` on a 3 s notice: the attempts still there 2 s before the end
    are abandoned, resumed (streams) or retried elsewhere, free; none is cut by the end
    itself."""
    sim = run(spot_fleet(2.0), SHORT)
    faults = sim.report({})["faults"]
    counters = sim.control.pools[POOL].counters
    assert faults["preemptions"] >= 3
    assert counters.free_retries + counters.resumes > 0
    assert faults["cut_by_preemption"] == 0
    assert faults["requests_failed"] == counters.retries_refused == 0


def test_no_attempt_starts_on_a_noticed_replica() -> None:
    """Between a notice and the replica's end, nothing new is routed there: each replica's
    served rows arrived outside its notice windows."""
    sim = run(spot_fleet(), SPOT, n=800)
    windows = sim.faults.notices  # (replica index, notice time, deadline)
    assert windows
    rows = sim.harness.recorder.log
    for replica, noticed, deadline in windows:
        started = [r for r in rows if r.replica == replica and noticed < r.arrival_s < deadline]
        assert not started, (replica, noticed, [r.arrival_s for r in started][:5])


def test_a_notice_lets_most_attempts_finish_where_they_are() -> None:
    """With 30 s of notice most attempts on the replica end before it goes; with none,
    every attempt there at the end has to move (retried, or resumed with its prompt and
    tokens sent again)."""

    def moved(spec: str) -> float:
        sim = run(spot_fleet(), spec)
        counters = sim.control.pools[POOL].counters
        assert sim.report({})["overall"]["failed"] == 0
        return (counters.free_retries + counters.resumes) / sim.faults.preemptions

    warned = moved(SPOT)
    sudden = moved("spot:per_gpu_hour=40,notice_s=0,startup_s=20")
    assert warned < 0.5 * sudden, (warned, sudden)


def test_spot_gpu_hours_are_split_and_priced_apart() -> None:
    sim = run(spot_fleet(), SPOT, n=400)
    cost = sim.report({})["cost"]
    spot, od = cost["models"][POOL], cost["models"]["on-demand"]
    assert (spot["capacity"], od["capacity"]) == ("spot", "on_demand")
    assert spot["usd_per_gpu_hour"] == pytest.approx(od["usd_per_gpu_hour"] * 0.3)
    split = cost["by_capacity"]
    assert split["spot"]["gpu_hours"] == spot["gpu_hours"]
    assert split["on_demand"]["usd"] == od["usd"]
    assert cost["usd"] == pytest.approx(split["spot"]["usd"] + split["on_demand"]["usd"])


def test_preemptions_are_seeded() -> None:
    def report(seed: int) -> str:
        return json.dumps(run(spot_fleet(), SPOT, seed=seed, n=600).report({}))

    first = report(2)
    assert first == report(2)
    assert json.loads(first)["faults"]["preemptions"] > 0
    assert report(3) != first


def test_a_fleet_without_spot_pools_is_never_preempted() -> None:
    config = parse_fleet({"models": [{"name": POOL, "replicas": 2}]}, source="test")
    report = run(config, SPOT, n=400).report({})
    assert report["faults"]["preemptions"] == 0
    assert report["cost"]["by_capacity"].keys() == {"on_demand"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("spot:per_gpu_hour=0", "fault spot: per_gpu_hour:"),
        ("spot:per_gpu_hour=1,notice_s=-5", "fault spot: notice_s:"),
        ("spot:notice_s=30", "fault spot: per_gpu_hour: Field required"),
    ],
)
def test_a_bad_spot_fault_is_one_clear_error(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_fault(spec)


def test_replicas_an_autoscaler_adds_to_a_spot_pool_are_preempted_too() -> None:
    pool = {"name": POOL, "replicas": 1, "routing": "least_request", "capacity": "spot",
            "args": ["--max-num-seqs", "8"], "startup": {"provision": 0, "load": 5},
            "autoscale": {"min_replicas": 1, "max_replicas": 4, "scale_to_zero": True,
                          "stable_window": 10, "panic_window": 2}}  # fmt: skip
    config = parse_fleet({"models": [pool]}, source="test")
    faults = (parse_fault("spot:per_gpu_hour=150,notice_s=5,startup_s=5"),)
    sim = FleetSimulation(config, SimOptions(seed=1, faults=faults))
    sim.start(requests(1500, rate=15.0))
    sim.run()
    assert sim.check() == []
    assert len(sim.replica_ids) > 1  # it scaled out
    assert any(replica >= 1 for replica, _, _ in sim.faults.notices)  # an added one
    assert sim.report({})["overall"]["failed"] == 0


def fallback_fleet(fallback: str) -> FleetConfig:
    models = [
        {"name": POOL, "replicas": 4, "routing": "least_request", "capacity": "spot",
         "spot": {"fallback": fallback}},
        {"name": "on-demand", "model": POOL, "replicas": 1},
    ]  # fmt: skip
    return parse_fleet({"models": models}, source="test")


def outage_run(fallback: str, seed: int = 1) -> FleetSimulation:
    """Preemptions through a 150 s trace, and no spot GPU to be had from 20 s to 100 s."""
    faults = (parse_fault(SPOT), parse_fault({"spot_outage": {"from": 20, "to": 100}}))
    sim = FleetSimulation(fallback_fleet(fallback), SimOptions(seed=seed, faults=faults))
    sim.control.record(recorded := io.StringIO())
    sim.start(requests(1500, rate=10.0, seed=seed))
    sim.run()
    assert sim.check() == []
    sim.recorded = recorded  # type: ignore[attr-defined]
    return sim


def test_in_a_spot_outage_reclaimed_replicas_stand_in_on_demand_and_move_back() -> None:
    """``spot.fallback: on_demand``: a replica reclaimed while spot GPUs are short gets an
    on-demand node at once; when they are back it moves to a spot node. The stand-in's
    hours are billed at the on-demand price, and no request is lost."""
    sim = outage_run("on_demand")
    report = sim.report({})
    faults, cost = report["faults"], report["cost"]["models"][POOL]
    assert faults["on_demand_stand_ins"] >= 1
    assert faults["moved_to_spot"] == faults["on_demand_stand_ins"]
    assert faults["requests_failed"] == 0
    split = cost["by_capacity"]
    assert split["on_demand"]["gpu_hours"] > 0
    assert split["spot"]["gpu_hours"] > 0
    od_price = report["cost"]["models"]["on-demand"]["usd_per_gpu_hour"]
    assert split["on_demand"]["usd"] == pytest.approx(
        split["on_demand"]["gpu_hours"] * od_price, abs=0.01
    )
    assert cost["usd"] == pytest.approx(split["spot"]["usd"] + split["on_demand"]["usd"])
    assert (
        report["cost"]["by_capacity"]["on_demand"]["gpu_hours"]
        > (report["cost"]["models"]["on-demand"]["gpu_hours"])
    )
    # the stand-ins are the controller's decision: the recorded run replays to it
    head, lines = read_recording(io.StringIO(sim.recorded.getvalue()))  # type: ignore[attr-defined]
    replayed = list(replay(head, lines))
    dos = [c for line, _ in replayed for c in line.commands if c["do"] == "replace"]
    assert {c["capacity"] for c in dos} == {"spot", "on_demand"}
    for line, commands in replayed:
        assert commands == line.commands, line


def test_in_a_spot_outage_reclaimed_replicas_wait_for_spot_by_default() -> None:
    """``spot.fallback: wait``: a replica reclaimed in the outage has no node until it
    ends (not billed meanwhile); the pool serves with the others, and loses nothing."""
    waiting, standing = outage_run("wait"), outage_run("on_demand")
    report = waiting.report({})
    assert report["faults"]["on_demand_stand_ins"] == 0
    assert report["faults"]["requests_failed"] == 0
    assert report["cost"]["models"][POOL]["by_capacity"].keys() == {"spot"}
    down = {r["id"]: r["downtime_s"] for r in report["replicas"] if r["model"] == POOL}
    stood = {r["id"]: r["downtime_s"] for r in standing.report({})["replicas"]}
    assert sum(down.values()) > sum(stood[r] for r in down) + 30  # it waited out the outage
    spot_hours = report["cost"]["models"][POOL]["gpu_hours"]
    assert spot_hours < standing.report({})["cost"]["models"][POOL]["gpu_hours"]


def test_spot_gpus_run_short_after_reclaims_when_unavailable_s_says_so() -> None:
    spec = SPOT + ",unavailable_s=60"
    sim = run(fallback_fleet("on_demand"), spec)
    faults = sim.report({})["faults"]
    assert faults["preemptions"] >= 3
    assert faults["on_demand_stand_ins"] == faults["preemptions"]  # each reclaim finds none
    assert faults["requests_failed"] == 0


def test_a_bad_spot_outage_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="must be after"):
        parse_fault({"spot_outage": {"from": 50, "to": 10}})
    outage = parse_fault({"spot_outage": {"model": "on-demand", "from": 1}})
    sim = FleetSimulation(fallback_fleet("wait"), SimOptions(faults=(outage,)))
    with pytest.raises(ValueError, match="not a spot pool"):
        sim.start(requests(10, rate=10.0))


@pytest.mark.parametrize("fallback", ["wait", "on_demand"])
def test_an_autoscaler_short_of_spot_gpus_waits_or_buys_on_demand(fallback: str) -> None:
    """An autoscaled spot pool that must scale out while no spot GPU can be had: with
    ``wait`` its starts wait for the outage's end; with ``on_demand`` it adds on-demand
    replicas (billed so, never reclaimed)."""
    pool = {"name": POOL, "replicas": 1, "routing": "least_request", "capacity": "spot",
            "spot": {"fallback": fallback},
            "args": ["--max-num-seqs", "8"], "startup": {"provision": 0, "load": 5},
            "autoscale": {"min_replicas": 1, "max_replicas": 4, "scale_to_zero": True,
                          "stable_window": 10, "panic_window": 2}}  # fmt: skip
    config = parse_fleet({"models": [pool]}, source="test")
    faults = (
        parse_fault("spot:per_gpu_hour=20,notice_s=5,startup_s=5"),
        parse_fault({"spot_outage": {"from": 0, "to": 60}}),
    )
    sim = FleetSimulation(config, SimOptions(seed=1, faults=faults))
    sim.start(requests(1500, rate=15.0))
    sim.run()
    assert sim.check() == []
    report = sim.report({})
    scaling, cost = report["autoscale"][POOL], report["cost"]["models"][POOL]["by_capacity"]
    joined = [i for i in sim.autoscaling.instances if i.via == "cold" and i.serving_at]
    assert joined  # it scaled out
    if fallback == "wait":
        assert scaling["held_starts"] > 0
        assert all(i.provisioned_at >= 60 for i in joined)  # none bought in the outage
        assert cost.keys() == {"spot"}
    else:
        assert scaling["held_starts"] == 0
        bought = [i for i in joined if i.provisioned_at < 60]
        assert bought
        assert all(i.id in sim.autoscaling.stand_ins for i in bought)
        assert cost["on_demand"]["gpu_hours"] > 0
        stood = {sim.replica_ids.index(i.id) for i in bought}
        assert not stood & {replica for replica, _, _ in sim.faults.notices}
    assert report["overall"]["failed"] == 0


def test_gpufleet_simulate_shows_the_stand_ins(tmp_path: Path) -> None:
    """The CLI on the spot example with an outage: the summary counts the on-demand
    stand-ins and the moves back, report.json prices the spot pool's hours by node."""
    trace = tmp_path / "t.jsonl"
    rows = [{"arrival_s": 0.1 * i, "input_tokens": 300, "output_tokens": 40} for i in range(600)]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    example = Path(__file__).parents[2] / "examples" / "spot-batch.yaml"
    out = tmp_path / "run"
    args = [
        "simulate", "--fleet", str(example), "--trace", str(trace), "--out", str(out),
        "--batch", "400:at=0,model=llama-3.1-8b,window=3600", "--no-plots",
        "--fault", "spot:per_gpu_hour=200,notice_s=5,startup_s=5",
        "--fault", "spot_outage:from=0,to=30",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "on-demand stand-ins / back to spot" in result.output
    report = json.loads((out / "report.json").read_text())
    assert report["faults"]["on_demand_stand_ins"] >= 1
    assert (
        report["cost"]["models"]["llama-3.1-8b-spot"]["by_capacity"]["on_demand"]["gpu_hours"] > 0
    )
