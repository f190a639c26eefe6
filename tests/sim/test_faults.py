"""Fault workloads (L5): crashes, MTBF, slow replicas, blackouts, with the real policies."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpufleet.cli import app
from gpufleet.config import FleetConfig, load_fleet, parse_fleet
from gpufleet.sim import FleetSimulation, SimOptions, TraceRequest, load_faults, parse_fault

runner = CliRunner()


def fleet(
    replicas: int = 3, policy: str = "least_request", args: tuple[str, ...] = ()
) -> FleetConfig:
    model = {"name": "llama-3.1-8b", "replicas": replicas, "routing": policy, "args": list(args)}
    return parse_fleet({"models": [model]}, source="test")


def requests(n: int = 400, rate: float = 10.0, seed: int = 1) -> list[TraceRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(TraceRequest(t, rng.randrange(50, 1500), rng.randrange(20, 300)))
    return out


def run(config: FleetConfig, *specs: str, seed: int = 1, n: int = 400) -> FleetSimulation:
    faults = tuple(parse_fault(s) for s in specs)
    sim = FleetSimulation(config, SimOptions(seed=seed, faults=faults))
    sim.start(requests(n, seed=seed))
    sim.run()
    assert sim.check() == []  # the global check: every request ends once
    return sim


def test_a_crash_loses_requests_retries_unstarted_ones_and_restarts() -> None:
    sim = run(fleet(), "crash:replica=llama-3.1-8b-1,at=20,startup_s=15")
    report = sim.report({})
    faults = report["faults"]
    assert faults["crashes"] == 1
    # started streams resumed on the other replicas: no request failed
    assert faults["requests_failed"] == report["overall"]["failed"] == 0
    assert faults["lost_mid_stream"] == 0
    assert faults["resumed_streams"] > 0
    assert faults["retries"] >= 0
    crashed = report["replicas"][1]
    assert crashed["crashes"] == 1
    assert crashed["downtime_s"] == 15.0
    log = faults["ejections"]["log"]
    assert all(e["replica"] == "llama-3.1-8b-1" for e in log)
    # no request started on the replica while it was down
    for record in sim.harness.recorder.log:
        if record.replica == 1 and not record.failed:
            assert not 20.0 < record.arrival_s < 35.0 or record.finish_s < 20.0


def test_streams_lost_mid_way_resume_elsewhere_with_the_whole_answer_and_its_extra_prefill() -> (
    None
):
    trace = requests(400, seed=1)
    sim = run(fleet(), "crash:replica=llama-3.1-8b-1,at=20,startup_s=15")
    harness = sim.harness
    resumed = sim.control.pools["llama-3.1-8b"].counters.resumes
    assert resumed == harness.resumed > 0
    rows = {r.index: r for r in harness.recorder.log}
    assert len(rows) == len(trace)
    # every row is the whole answer: the client's prompt and every token, once
    for index, request in enumerate(trace):
        row = rows[index]
        assert not row.failed
        assert (row.input_tokens, row.output_tokens) == (
            request.input_tokens,
            request.output_tokens,
        )
    # the resumed rows finished on another replica, after the crash, with their first token
    # from before it; their re-sent prompts are the extra prefill
    moved = [
        r
        for r in rows.values()
        if r.first_token_s is not None
        and r.first_token_s < 20.0
        and r.finish_s > 20.0
        and r.replica != 1
        and r.arrival_s < 20.0
    ]
    assert moved
    extra = sim.report({})["faults"]["resume_prefill_tokens"]
    assert extra == harness.resume_prefill_tokens
    # each resume re-sends its prompt (at least 50 tokens here) and a token or more
    assert extra >= resumed * 51


def test_without_resumes_a_crash_fails_its_started_streams() -> None:
    config = fleet()
    config = config.model_copy(
        update={
            "gateway": config.gateway.model_copy(
                update={"retry": config.gateway.retry.model_copy(update={"max_resumes": 0})}
            )
        }
    )
    sim = run(config, "crash:replica=llama-3.1-8b-1,at=20,startup_s=15")
    faults = sim.report({})["faults"]
    assert faults["resumed_streams"] == 0
    assert faults["requests_failed"] == faults["lost_mid_stream"] + faults["no_replica"]
    assert faults["lost_mid_stream"] > 0


def test_requests_lost_before_their_first_token_are_retried_elsewhere() -> None:
    # four sequences at a time: requests queue, so some are lost before their first token
    sim = run(fleet(2, args=("--max-num-seqs", "4")), "crash:replica=llama-3.1-8b-0,at=5", n=300)
    assert sim.control.pools["llama-3.1-8b"].counters.retries > 0
    served_after = [
        r for r in sim.harness.recorder.log if not r.failed and r.arrival_s < 5.0 < r.finish_s
    ]
    assert served_after
    assert all(r.replica == 1 for r in served_after)


def test_a_pool_with_every_replica_down_holds_requests_until_it_is_back() -> None:
    sim = run(fleet(1), "crash:replica=llama-3.1-8b-0,at=3,startup_s=10", n=200)
    faults = sim.report({})["faults"]
    assert faults["no_replica"] == faults["hold_timeouts"] == 0
    assert faults["held"] > 50
    log = sim.harness.recorder.log
    assert not [r for r in log if r.failed and r.replica == -1]  # none refused
    held = [r for r in log if 3.5 <= r.arrival_s < 13.0]
    assert held
    assert all(r.first_token_s is not None and r.first_token_s >= 13.0 for r in held)


def test_a_pool_down_past_the_hold_timeout_answers_errors_not_hangs() -> None:
    config = parse_fleet(
        {
            "models": [{"name": "llama-3.1-8b", "replicas": 1}],
            "gateway": {"autoscaler": {"hold_timeout": 2.0}},
        }
    )
    sim = run(config, "crash:replica=llama-3.1-8b-0,at=3,startup_s=10", n=200)
    faults = sim.report({})["faults"]
    assert faults["hold_timeouts"] > 0
    errors = [r for r in sim.harness.recorder.log if r.failed and r.replica == -1]
    assert len(errors) == faults["hold_timeouts"]
    assert all(3.0 <= r.arrival_s <= 13.0 - 2.0 for r in errors)


def test_slow_replica_is_slower_only_while_slow() -> None:
    plain = run(fleet(2, "round_robin"))
    slow = run(fleet(2, "round_robin"), "slow:replica=llama-3.1-8b-0,factor=4,from=10,to=20")

    def mean_e2e(sim: FleetSimulation, replica: int, lo: float, hi: float) -> float:
        rows = [
            r.e2e_s
            for r in sim.harness.recorder.log
            if r.replica == replica and lo <= r.arrival_s < hi
        ]
        return sum(rows) / len(rows)

    assert mean_e2e(slow, 0, 10, 18) > 2 * mean_e2e(plain, 0, 10, 18)
    assert mean_e2e(slow, 1, 10, 18) == mean_e2e(plain, 1, 10, 18)
    before = [r for r in slow.harness.recorder.log if r.finish_s < 10.0]
    assert before == [r for r in plain.harness.recorder.log if r.finish_s < 10.0]


def test_a_replica_answering_5xx_is_ejected_while_alive_and_its_requests_served_elsewhere() -> None:
    """A gray failure: the process lives and its probes pass, its answers are 5xx. Outlier
    detection takes it out (consecutive_5xx), the retries go to the other replicas, and no
    request is routed to it while it is ejected."""
    config = parse_fleet(
        {
            "models": [
                {
                    "name": "llama-3.1-8b",
                    "replicas": 3,
                    "routing": "least_request",
                    "health": {"outlier": {"consecutive_5xx": 3, "base_ejection_time": 30}},
                }
            ]
        },
        source="test",
    )
    sim = run(config, "errors:replica=llama-3.1-8b-1,from=5,to=25")
    report = sim.report({})
    faults = report["faults"]
    assert faults["error_answers"] >= 3
    assert faults["crashes"] == 0
    (ejection, *_) = faults["ejections"]["log"]
    assert ejection["replica"] == "llama-3.1-8b-1"
    assert ejection["cause"] == "consecutive_5xx"
    assert 5.0 <= ejection["at"] < 25.0
    assert report["overall"]["failed"] <= faults["retries_refused"] + faults["no_replica"]
    window = (ejection["at"], ejection["at"] + 30.0)
    served_there = [
        r for r in sim.harness.recorder.log if r.replica == 1 and not (r.failed or r.rejected)
    ]
    assert served_there  # before the errors began, and after the ejection
    # a request that arrived while it was ejected was never served there
    assert not [r for r in served_there if window[0] <= r.arrival_s < window[1]]


def hang_fleet(abandon: bool) -> FleetConfig:
    health = {"active": {"interval": 1.0, "timeout": 1.0, "unhealthy_threshold": 2}}
    health["active"]["abandon"] = abandon
    model = {"name": "llama-3.1-8b", "replicas": 3, "routing": "least_request", "health": health}
    return parse_fleet({"models": [model]}, source="test")


@pytest.mark.parametrize("abandon", [True, False])
def test_a_hung_replica_fails_its_checks_and_its_attempts_are_abandoned(abandon: bool) -> None:
    """A 40 s hang: probes time out, health fails the replica (2 checks, 1 s apart, 1 s
    timeouts), and the controller abandons its attempts: unstarted ones retried, started
    streams resumed, none waiting out the hang. With ``abandon`` off they wait the whole
    hang (the gateway's timeouts are longer here), which is what the rule is for."""
    sim = run(hang_fleet(abandon), "hang:replica=llama-3.1-8b-1,from=10,to=50", n=800)
    report = sim.report({})
    assert report["overall"]["failed"] == 0
    rows = sim.harness.recorder.log
    caught = [r for r in rows if r.arrival_s < 10.0 < r.finish_s and r.replica == 1]
    counters = sim.control.pools["llama-3.1-8b"].counters
    # requests that were on the replica when it stopped (or came before health failed it)
    stuck = [r for r in rows if r.arrival_s <= 13.0 and r.finish_s >= 50.0]
    if abandon:
        assert not stuck, [(r.index, r.arrival_s, r.finish_s) for r in stuck]
        assert counters.resumes + counters.free_retries > 0
        assert not caught  # every one moved: none finished on the hung replica
        # nothing was routed to it while it was failed, and it serves again after the hang
        assert not [r for r in rows if r.replica == 1 and 14.0 < r.arrival_s < 50.0]
        assert [r for r in rows if r.replica == 1 and r.arrival_s > 52.0]
    else:
        assert stuck  # they waited for the process to go on
        assert counters.resumes == counters.free_retries == 0
        assert min(r.finish_s for r in stuck) >= 50.0


def test_a_blackout_freezes_the_replicas_scraped_load() -> None:
    config = fleet(2, "kv_aware")
    faults = (parse_fault("blackout:replica=llama-3.1-8b-1,from=5,to=15"),)
    sim = FleetSimulation(config, SimOptions(seed=1, faults=faults))
    sim.start(requests())
    sim.run(10.0)
    view = sim.control.pools["llama-3.1-8b"].view
    frozen = view.pool("llama-3.1-8b")[1].load.observed_at
    assert frozen is not None
    assert frozen <= 5.0
    assert view.pool("llama-3.1-8b")[0].load.observed_at == pytest.approx(10.0, abs=0.25)
    sim.run(16.0)
    resumed = sim.control.pools["llama-3.1-8b"].view.pool("llama-3.1-8b")[1].load.observed_at
    assert resumed is not None
    assert resumed > 15.0
    sim.run()
    assert sim.check() == []


def test_mtbf_crashes_are_seeded_and_the_report_is_byte_identical() -> None:
    def report(seed: int) -> str:
        sim = run(fleet(4), "mtbf:hours=0.005,startup_s=5", seed=seed)
        return json.dumps(sim.report({}), sort_keys=False)

    first, second = report(3), report(3)
    assert first == second
    assert json.loads(first)["faults"]["crashes"] >= 2
    assert report(4) != first


def test_no_faults_no_change_health_keeps_every_replica_routable() -> None:
    sim = run(fleet())
    report = sim.report({})
    assert report["faults"]["crashes"] == report["overall"]["failed"] == 0
    assert report["faults"]["ejections"]["log"] == []
    assert all(r.state.value == "ready" for r in sim.control.pools["llama-3.1-8b"].view.replicas())


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("explode:replica=x", "unknown fault 'explode'"),
        ("crash:replica=x", "fault crash: at: Field required"),
        ("crash:replica=x,at=-1", "fault crash: at:"),
        ("slow:replica=x,factor=2,from=10,to=5", "'to' (5.0) must be after 'from' (10.0)"),
        ("slow:replica=x,factor=0,from=1", "fault slow: factor:"),
        ("blackout:replica=x,from=1,when=2", "fault blackout: when: Extra inputs"),
        ("crash:replica", "is not key=value"),
        ("mtbf:hours=0", "fault mtbf: hours:"),
    ],
)
def test_bad_faults_are_one_clear_error(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_fault(spec)


def test_an_unknown_replica_is_refused_before_the_run() -> None:
    with pytest.raises(ValueError, match=re.escape("no replica 'llama-3.1-8b-9'")):
        FleetSimulation(
            fleet(), SimOptions(faults=(parse_fault("crash:replica=llama-3.1-8b-9,at=1"),))
        )


def test_scenario_file_and_cli(tmp_path: Path) -> None:
    scenario = tmp_path / "faults.yaml"
    scenario.write_text(
        "faults:\n"
        "  - crash: {replica: llama-3.1-8b-1, at: 2, startup_s: 3}\n"
        "  - slow: {replica: llama-3.1-8b-0, factor: 2, from: 1, to: 4}\n"
    )
    assert [f.kind for f in load_faults(scenario)] == ["crash", "slow"]
    source = tmp_path / "trace.jsonl"
    source.write_text(
        "".join(
            json.dumps(
                {
                    "arrival_s": r.arrival_s,
                    "input_tokens": r.input_tokens,
                    "output_tokens": r.output_tokens,
                }
            )
            + "\n"
            for r in requests(80)
        )
    )
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text("models:\n  - name: llama-3.1-8b\n    replicas: 2\n")
    args = ["simulate", "--fleet", str(fleet_file), "--trace", str(source), "--no-plots"]
    args += ["--faults", str(scenario), "--fault", "blackout:replica=llama-3.1-8b-0,from=1"]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert "crashes / ejections" in result.output
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "b")])
    a = (tmp_path / "a" / "report.json").read_bytes()
    assert a == (tmp_path / "b" / "report.json").read_bytes()
    assert len(json.loads(a)["faults"]["scenario"]) == 3
    bad = tmp_path / "bad.yaml"
    bad.write_text("faults:\n  - crash: {replica: llama-3.1-8b-1}\n")
    result = runner.invoke(
        app,
        ["simulate", "--trace", str(source), "--faults", str(bad), "--out", str(tmp_path / "c")],
    )
    assert result.exit_code == 2
    assert "faults[0]: fault crash: at: Field required" in result.output


def test_the_example_scenario_fits_the_example_fleet() -> None:
    root = Path(__file__).resolve().parents[2]
    faults = tuple(load_faults(root / "examples" / "faults" / "crash-slow.yaml"))
    config = load_fleet(root / "examples" / "azure-conv-8x-h100.yaml")
    FleetSimulation(config, SimOptions(faults=faults))  # names every replica right
