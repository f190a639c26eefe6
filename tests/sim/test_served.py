"""Served names simulated: the controller's weighted split and fallbacks, in the report."""

from __future__ import annotations

import io
import random
from typing import Any

import pytest
from typer.testing import CliRunner

from gpufleet.cli import app
from gpufleet.config import FleetConfig, load_fleet, parse_fleet
from gpufleet.control import read_recording, replay
from gpufleet.sim import FleetSimulation, SimOptions, TraceRequest, parse_fault

runner = CliRunner()
MODEL = "llama-3.1-8b"


def fleet(
    served: list[dict[str, Any]], gateway: dict[str, Any] | None = None, **pools: dict[str, Any]
) -> FleetConfig:
    models = [
        {"name": name, "model": MODEL, "routing": "least_request", **extra}
        for name, extra in pools.items()
    ]
    data = {"models": models, "served": served, "gateway": gateway or {}}
    return parse_fleet(data, source="test")


def requests(
    n: int, *, sessions: int = 200, rate: float = 8.0, long_every: int = 0, seed: int = 1
) -> list[TraceRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        prompt = 3000 if long_every and i % long_every == 0 else rng.randrange(50, 800)
        out.append(
            TraceRequest(t, prompt, rng.randrange(20, 200), session=f"s{rng.randrange(sessions)}")
        )
    return out


def run(config: FleetConfig, trace: list[TraceRequest], *faults: str) -> FleetSimulation:
    options = SimOptions(seed=1, faults=tuple(parse_fault(f) for f in faults))
    sim = FleetSimulation(config, options)
    sim.start(trace)
    sim.run()
    assert sim.check() == []
    return sim


def test_a_weighted_split_shows_in_the_report_and_sessions_stay_put() -> None:
    config = fleet(
        [{"name": "chat", "variants": {"v1": 80, "v2": 20}}],
        v1={"replicas": 2},
        v2={"replicas": 1},
    )
    log = io.StringIO()
    sim = FleetSimulation(config, SimOptions(seed=1))
    sim.control.record(log)
    sim.start(requests(1500, sessions=600))
    sim.run()
    report = sim.report({})
    chat = report["served"]["chat"]
    assert chat["requests"] == 1500
    v1, v2 = chat["variants"]["v1"], chat["variants"]["v2"]
    assert (v1["weight_share"], v2["weight_share"]) == (0.8, 0.2)
    assert v2["share"] == pytest.approx(0.2, abs=0.05)
    assert v1["requests"] + v2["requests"] == 1500
    # the pools served what the controller chose
    assert report["models"]["v1"]["requests"] == v1["requests"]
    assert report["models"]["v2"]["requests"] == v2["requests"]
    assert report["fallbacks"] == []
    # sticky: every session's requests went to one variant
    by_session: dict[str, set[str]] = {}
    head, lines = read_recording(log.getvalue().splitlines())
    for line in lines:
        for command in line.commands:
            if command["do"] == "route" and line.event.__class__.__name__ == "Arrived":
                session = line.event.request.session_key  # type: ignore[union-attr]
                by_session.setdefault(session, set()).add(command["model"])
    assert len(by_session) > 400
    assert all(len(pools) == 1 for pools in by_session.values())
    # and the recording replays to the same decisions
    head, lines = read_recording(log.getvalue().splitlines())
    for recorded, commands in replay(head, lines):
        assert commands == recorded.commands


@pytest.mark.parametrize("hold", [True, False])
def test_long_prompts_and_a_crashed_variant_fall_back(hold: bool) -> None:
    """A request at a pool whose only replica is restarting waits for it (the hold), as
    without fallbacks, and falls back if the hold gives up; with no hold it falls back at
    once (no replica)."""
    config = fleet(
        [{"name": "chat", "variants": ["short"], "fallbacks": ["long"]}],
        None if hold else {"autoscaler": {"hold_requests": 0}},
        short={"replicas": 1, "max_model_len": 2048},
        long={"replicas": 2},
    )
    trace = requests(600, long_every=10)
    sim = run(config, trace, "crash:replica=short-0,at=30,startup_s=20")
    report = sim.report({})
    assert report["overall"]["rejected"] == 0
    # only streams cut mid-way by the crash fail: a stream is resumed in its own pool (short
    # has no other replica), never in a fallback's (another model's continuation)
    assert report["overall"]["failed"] == report["faults"]["lost_mid_stream"] > 0
    reasons = {f["reason"]: f["requests"] for f in report["fallbacks"]}
    assert reasons["context"] == 60  # every tenth prompt: 3,000 tokens past 2,048
    if hold:
        assert report["faults"]["held"] > 0
        assert report["faults"]["hold_timeouts"] == 0
        assert "no_replica" not in reasons
    else:
        assert report["faults"]["held"] == 0
        assert reasons["no_replica"] > 50  # 20 s of arrivals at 8/s, a tenth of them long
        assert report["models"]["long"]["requests"] == 60 + reasons["no_replica"]


def test_a_fleet_without_served_names_reports_as_before() -> None:
    config = parse_fleet({"models": [{"name": MODEL, "replicas": 1}]})
    report = run(config, requests(50)).report({})
    assert "served" not in report
    assert "fallbacks" not in report


def test_the_example_fleet_simulates_its_split(tmp_path: Any) -> None:
    config = load_fleet("examples/variants-fallback.yaml")
    assert [s.name for s in config.served_names()][:2] == ["llama-3.1-8b", "chat"]
    result = runner.invoke(
        app,
        [
            "simulate",
            "--fleet",
            "examples/variants-fallback.yaml",
            "--duration",
            "120",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "served llama-3.1-8b: split" in result.output
