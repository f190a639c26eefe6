"""A batch job in the simulator: lines submitted at once, gated on spare capacity by the
pool controller, finished within their window, reported apart from the trace's requests."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gpufleet.cli import app
from gpufleet.config import FleetConfig, load_fleet, parse_fleet
from gpufleet.control import Finished, read_recording, replay
from gpufleet.engine.model import NewRequest
from gpufleet.fleet import prompt_text
from gpufleet.sim import FleetSimulation, SimOptions, parse_fault
from gpufleet.sim._batch_job import BATCH_JOB, BatchJob, parse_batch_job
from gpufleet.sim._replica_driver import ReplicaDriver
from tests.sim.test_faults import requests

POOL = "llama-3.1-8b"
SPOT = "batch-spot"
runner = CliRunner()


def fleet(spare: object = "default", slots: int = 256) -> FleetConfig:
    args = ["--max-num-seqs", str(slots)]
    models = [
        {"name": POOL, "replicas": 2, "routing": "least_request", "args": args},
        {"name": SPOT, "model": POOL, "replicas": 2, "routing": "least_request",
         "capacity": "spot", "args": args},
    ]  # fmt: skip
    data: dict[str, object] = {"models": models}
    if spare != "default":
        data["gateway"] = {"batch": {"spare": spare}}
    return parse_fleet(data, source="test")


def run(config: FleetConfig, job: BatchJob, *faults: str, n: int = 400) -> FleetSimulation:
    options = SimOptions(seed=1, batch=job, faults=tuple(parse_fault(f) for f in faults))
    sim = FleetSimulation(config, options)
    sim.start(requests(n, rate=10.0))  # interactive: the first pool
    sim.run()
    assert sim.check() == []  # every request, every line, ends once
    return sim


def test_a_batch_job_runs_on_its_pool_and_finishes_in_its_window() -> None:
    job = BatchJob(lines=600, at=5.0, model=SPOT, window_s=3600.0)
    sim = run(fleet(), job)
    report = sim.report({})
    batch = report["batch"]
    assert batch["completed"] == 600
    assert batch["failed"] == 0
    assert batch["within_window"] is True
    assert 0 < batch["took_s"] < 3600.0
    assert batch["finished_s"] == pytest.approx(5.0 + batch["took_s"])
    # the lines ran on the batch pool, the trace's requests on the first
    lines = {
        i for i, t in enumerate(sim.tenants.tenant_ids) if sim.tenants.tenants()[t] == BATCH_JOB
    }
    assert len(lines) == 600
    spot = {i for i, m in enumerate(sim.replica_models) if m == SPOT}
    rows = sim.harness.recorder.log
    assert all(r.replica in spot for r in rows if r.index in lines)
    assert not [r for r in rows if r.index not in lines and r.replica in spot]
    # through the gate: it held them, nothing expired
    counters = sim.control.pools[SPOT].counters
    assert counters.gated == 600
    assert counters.gate_expired == 0
    assert report["tenants"]["tenants"][BATCH_JOB]["requests"] == 600


def test_the_gate_keeps_the_lines_to_its_share_of_the_slots() -> None:
    """The gate lets no more lines run than ``target`` × the pool's slots (16 a replica
    here), however many wait."""
    config = fleet({"target": 0.5}, slots=16)
    sim = FleetSimulation(config, SimOptions(seed=1, batch=BatchJob(300, 0.0, SPOT, 3600.0)))
    sim.start(requests(50))
    peak = 0
    for t in range(1, 60):
        sim.run(float(t))
        peak = max(peak, sim.control.pools[SPOT].batch_in_flight)
    sim.run()
    assert 0 < peak <= 16  # 0.5 of 2 replicas × 16 slots
    assert sim.report({})["batch"]["completed"] == 300


def test_lines_that_cannot_start_in_their_window_fail_as_expired() -> None:
    """Room for ~25 lines at a time (2 × 16 slots × 0.8): 400 cannot all start in 2 s."""
    job = BatchJob(lines=400, at=0.0, model=SPOT, window_s=2.0)
    sim = run(fleet(slots=16), job)
    batch = sim.report({})["batch"]
    assert batch["failed"] > 0
    assert batch["completed"] + batch["failed"] == 400
    assert batch["within_window"] is False
    assert sim.control.pools[SPOT].counters.gate_expired == batch["failed"]


def test_a_batch_job_on_a_preempted_spot_pool_loses_no_line() -> None:
    job = BatchJob(lines=800, at=0.0, model=SPOT, window_s=3600.0)
    sim = run(fleet(slots=16), job, "spot:per_gpu_hour=120,notice_s=5,startup_s=10")
    report = sim.report({})
    faults = report["faults"]
    assert faults["preemptions"] > 0
    assert report["batch"]["completed"] == 800
    assert report["overall"]["failed"] == 0
    # a line is a whole answer, as the runner asks: one caught on a noticed replica is sent
    # again from the start, not resumed (only streams are)
    assert faults["resumed_streams"] == 0
    assert faults["free_retries"] > 0


def test_the_job_is_seeded_and_checked() -> None:
    job = BatchJob(lines=200, at=1.0, model=SPOT)
    first = json.dumps(run(fleet(), job, n=100).report({}))
    assert first == json.dumps(run(fleet(), job, n=100).report({}))
    with pytest.raises(ValueError, match="no served model 'nope'"):
        FleetSimulation(fleet(), SimOptions(batch=BatchJob(10, model="nope")))
    with pytest.raises(ValueError, match="at least one line"):
        BatchJob(0)


def test_the_cli_runs_a_batch_job_on_a_spot_pool(tmp_path: Path) -> None:
    source = tmp_path / "trace.jsonl"
    source.write_text(
        "".join(
            json.dumps({"arrival_s": r.arrival_s, "input_tokens": r.input_tokens,
                        "output_tokens": r.output_tokens}) + "\n"
            for r in requests(80)
        )
    )  # fmt: skip
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text(
        "models:\n"
        "  - {name: llama-3.1-8b, replicas: 1}\n"
        "  - {name: batch-spot, model: llama-3.1-8b, replicas: 2, capacity: spot}\n"
    )
    args = ["simulate", "--fleet", str(fleet_file), "--trace", str(source), "--no-plots"]
    args += ["--batch", "300:at=2,model=batch-spot,window=3600"]
    args += ["--fault", "spot:per_gpu_hour=100,notice_s=5,startup_s=5"]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert "batch job" in result.output
    assert "300 of 300 lines" in result.output
    assert "on-demand / spot" in result.output
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert report["batch"]["completed"] == 300
    assert report["cost"]["by_capacity"]["spot"]["gpu_hours"] > 0
    for spec, message in [
        ("many", "'many' is neither a number of lines nor a batch file"),
        ("10:when=3", "unknown key 'when'"),
        ("10:model=nope", "no served model 'nope'"),
        ("0", "at least one line"),
    ]:
        bad = runner.invoke(app, [*args[:6], "--batch", spec, "--out", str(tmp_path / "b")])
        assert bad.exit_code == 2, bad.output
        assert message in bad.output, bad.output


def test_the_example_fleet_sends_its_batch_to_spot_and_the_rest_on_demand() -> None:
    """``examples/spot-batch.yaml``: one served name over an on-demand pool and a spot one;
    the job names the served name, and its lines land on the spot pool, the trace's
    requests on the other (the controller's class rule, docs/spot.md)."""
    config = load_fleet(Path(__file__).parents[2] / "examples" / "spot-batch.yaml")
    od, spot = config.models
    assert spot.spot_settings is not None
    assert spot.usd_per_gpu_hour() == 0.60
    job = BatchJob(lines=300, at=0.0, model="llama-3.1-8b", window_s=3600.0)
    sim = run(config, job, "spot:per_gpu_hour=50,notice_s=5,startup_s=10", n=200)
    report = sim.report({})
    assert report["batch"]["within_window"] is True
    assert report["cost"]["models"][spot.name]["usd_per_gpu_hour"] == 0.60
    book = sim.tenants
    assert book is not None
    names = book.tenants()
    pools = sim.replica_models
    for row in sim.harness.recorder.log:
        assert not row.failed
        line = names[book.tenant_ids[row.index]] == BATCH_JOB
        assert pools[row.replica] == (spot.name if line else od.name), row


def _ttft_p99(sim: FleetSimulation) -> float:
    """The trace's (interactive) requests' TTFT P99, in seconds."""
    tenants, ids = sim.tenants.tenants(), sim.tenants.tenant_ids
    ttfts = sorted(
        r.first_token_s - r.arrival_s
        for r in sim.harness.recorder.log
        if r.first_token_s is not None and tenants[ids[r.index]] != BATCH_JOB
    )
    return ttfts[int(0.99 * (len(ttfts) - 1))]


def test_recalled_lines_give_interactive_its_slots_and_still_all_finish() -> None:
    """A batch job beside the interactive trace on one pool, the gate filling 95 % of the
    slots: with recall, an interactive request that finds its replica full takes a line's
    slot at once instead of queueing in the engine; the line runs again later, once."""
    args = ["--max-num-seqs", "16"]
    runs = {}
    for recall in (False, True):
        config = parse_fleet(
            {
                "models": [{"name": POOL, "replicas": 2, "routing": "least_request", "args": args}],
                "gateway": {"batch": {"spare": {"target": 0.95, "recall": recall}}},
            },
            source="test",
        )
        job = BatchJob(lines=1500, at=0.0, model=POOL, window_s=3600.0)
        sim = runs[recall] = FleetSimulation(config, SimOptions(seed=1, batch=job))
        sim.control.record(recorded := io.StringIO())
        sim.start(requests(600, rate=10.0))
        sim.run()
        assert sim.check() == []  # every request, every line, ends once
    plain, recalling = runs[False], runs[True]
    batch = recalling.report({})["batch"]
    assert batch["recalled"] > 20
    assert batch["completed"] == 1500  # every line once, recalled ones included
    assert batch["failed"] == 0
    assert plain.report({})["batch"]["recalled"] == 0
    assert _ttft_p99(recalling) < 0.8 * _ttft_p99(plain)
    # the recalls are the controller's: the recorded run replays to the same commands
    head, lines = read_recording(io.StringIO(recorded.getvalue()))
    replayed = list(replay(head, lines))
    assert sum(c["do"] == "recall" for line, _ in replayed for c in line.commands) > 20
    for line, commands in replayed:
        assert commands == line.commands, line


def test_the_ttft_guard_holds_the_interactive_tail_near_its_margin() -> None:
    """``spare.ttft_margin: 0.1``: the gate measures interactive TTFT without batch lines
    (its baseline), judges the requests beside them, cuts its limit when their P99 is over
    the margin and grows one step per verdict within it. The interactive tail ends far
    nearer the run without the batch than recall alone holds it; every line still ends
    once; the recorded run (its requests' TTFTs in ``Finished``) replays to the same
    decisions."""
    args = ["--max-num-seqs", "16"]

    def run(spare: dict[str, Any], lines: int) -> FleetSimulation:
        config = parse_fleet(
            {
                "models": [{"name": POOL, "replicas": 2, "routing": "least_request", "args": args}],
                "gateway": {"batch": {"spare": {"target": 0.95, **spare}}},
            },
            source="test",
        )
        job = BatchJob(lines=lines, at=0.0, model=POOL, window_s=3600.0) if lines else None
        sim = FleetSimulation(config, SimOptions(seed=1, batch=job))
        if spare:
            sim.control.record(recorded)
        sim.start(requests(1200, rate=10.0))
        sim.run()
        assert sim.check() == []
        return sim

    recorded = io.StringIO()
    alone = run({}, 0)
    ttfts = sorted(
        r.first_token_s - r.arrival_s for r in alone.harness.recorder.log if r.first_token_s
    )
    base = ttfts[int(0.99 * (len(ttfts) - 1))]
    recalling = _ttft_p99(run({}, 1500)) / base
    guarded_sim = run({"ttft_margin": 0.1}, 1500)
    guarded = _ttft_p99(guarded_sim) / base
    assert recalling > 1.6  # recall alone: ~2.05 in this run
    assert guarded < 0.75 * recalling  # ~1.34
    batch = guarded_sim.report({})["batch"]
    assert (batch["completed"], batch["failed"]) == (1500, 0)
    assert guarded_sim.control.times_first_tokens
    head, lines = read_recording(io.StringIO(recorded.getvalue()))
    replayed = list(replay(head, lines))
    timed = [e for line, _ in replayed if isinstance(e := line.event, Finished) and e.ttft]
    assert len(timed) > 1000
    for line, commands in replayed:
        assert commands == line.commands, line


def test_lines_reach_priority_engines_with_a_lower_priority_and_fcfs_ones_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the gateway sends them: a batch line reaches an engine started with
    ``--scheduling-policy priority`` with ``priority`` 1, an fcfs engine with none (the
    modelled engines are watched as they are sent requests)."""
    config = parse_fleet(
        {
            "models": [
                {"name": POOL, "replicas": 1, "args": ["--scheduling-policy", "priority"]},
                {"name": SPOT, "model": POOL, "replicas": 1},
            ]
        },
        source="test",
    )
    sent: dict[int, int] = {}
    submit = ReplicaDriver.submit

    def watched(self: ReplicaDriver, now: float, index: int, new: NewRequest, *rest: Any) -> Any:
        sent[index] = new.priority
        return submit(self, now, index, new, *rest)

    monkeypatch.setattr(ReplicaDriver, "submit", watched)
    for pool, lowered in ((POOL, 1), (SPOT, 0)):
        sent.clear()
        sim = FleetSimulation(config, SimOptions(seed=1, batch=BatchJob(40, 0.0, pool, 3600.0)))
        sim.start(requests(40))
        sim.run()
        assert sim.check() == []
        tenants, ids = sim.tenants.tenants(), sim.tenants.tenant_ids
        lines = {p for i, p in sent.items() if tenants[ids[i]] == BATCH_JOB}
        others = {p for i, p in sent.items() if tenants[ids[i]] != BATCH_JOB}
        assert (lines, others) == ({lowered}, {0})


def test_a_batch_input_file_runs_its_own_lines_in_prefix_order(tmp_path: Path) -> None:
    """``--batch nightly.jsonl``: the lines of an OpenAI batch input file, sized by their
    text and ``max_tokens``, run in prefix order: lines that share a long system prompt find
    it in the modelled caches, more than the same file in its own order does."""
    systems = [f"You are assistant {k}. " * 120 for k in range(6)]
    lines = [
        {
            "custom_id": f"r-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": POOL,
                "messages": [
                    {"role": "system", "content": systems[(i * 7) % 6]},
                    {"role": "user", "content": f"question {i}"},
                ],
                "max_tokens": 20 + i % 5,
            },
        }
        for i in range(300)
    ]
    path = tmp_path / "nightly.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = parse_batch_job(f"{path}:window=3600")
    assert (job.lines, job.file) == (300, path)
    first = job.requests(0)[0]
    text = prompt_text(lines[0]["body"])  # type: ignore[arg-type]
    assert first.input_tokens == len(text) // 4  # 4 characters a token, as the gateway
    assert len(first.hash_ids or ()) == len(text) // 512  # its 512-character blocks
    outputs = sorted(r.output_tokens for r in job.requests(0))
    assert outputs == sorted(20 + i % 5 for i in range(300))
    hits = {}
    for order in ("prefix", "input"):
        config = parse_fleet(
            {
                "models": [{"name": POOL, "replicas": 1,
                            "args": ["--max-num-seqs", "8", "--num-gpu-blocks-override", "160",
                                     "--max-model-len", "1024"]}],
                "gateway": {"batch": {"order": order}},
            },
            source="test",
        )  # fmt: skip
        sim = FleetSimulation(config, SimOptions(seed=1, batch=job))
        sim.start([])
        sim.run()
        assert sim.check() == []
        report = sim.report({})
        assert report["batch"]["completed"] == 300
        rows = sim.harness.recorder.log
        hits[order] = sum(r.cached_tokens for r in rows) / sum(r.input_tokens for r in rows)
    assert hits["prefix"] > hits["input"] + 0.1
    with pytest.raises(ValueError, match="neither a number of lines nor a batch file"):
        parse_batch_job("lots")
    (tmp_path / "bad.jsonl").write_text('{"custom_id": "a"}\n')
    with pytest.raises(ValueError, match="line 1"):
        parse_batch_job(f"{tmp_path / 'bad.jsonl'}")
