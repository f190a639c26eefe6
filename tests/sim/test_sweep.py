"""``run_sweep``: the early stops are exact (a pruned run never hides the cheapest fleet that
meets the SLO), in one process and in several."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.config import parse_fleet
from gpufleet.sim import (
    SimOptions,
    SLOTarget,
    SweepCandidate,
    SweepResult,
    SweepRun,
    SweepStatus,
    TraceSpec,
    cheapest_met,
    pareto_front,
    run_sweep,
)
from gpufleet.sim._recorder import RequestRecord
from gpufleet.sim._sweep import MissCounter, allowance

PRICES = {"l40s": 1.8, "a100-80gb-sxm": 1.8, "h100-sxm": 3.0}


def write_trace(path: Path, rows: int, rate: float, seed: int = 1) -> tuple[int, float]:
    rng = random.Random(seed)
    t = 0.0
    with path.open("w") as file:
        for _ in range(rows):
            t += rng.expovariate(rate)
            row = {
                "arrival_s": round(t, 4),
                "input_tokens": rng.randrange(100, 3000),
                "output_tokens": rng.randrange(10, 200),
            }
            file.write(json.dumps(row) + "\n")
    return rows, round(t, 4)


def candidates(gpus: tuple[str, ...], counts: tuple[int, ...]) -> list[SweepCandidate]:
    out = []
    for gpu in gpus:
        for n in counts:
            fleet = parse_fleet(
                {"models": [{"name": "llama-3.1-8b", "gpu": gpu, "replicas": n,
                             "routing": "least_request"}]}
            )  # fmt: skip
            out.append(SweepCandidate(f"{gpu} x{n}", fleet, n * PRICES[gpu]))
    return out


SCENARIOS = {
    # name: (SLO, rows, rate)
    "TTFT p99 and TPOT p50": (SLOTarget(ttft_p99_s=0.5, tpot_p50_s=0.03), 100, 20.0),
    "attainment": (SLOTarget(ttft_s=0.3, tpot_s=0.04, attainment=0.95), 100, 15.0),
}


def sweep(
    tmp_path: Path, slo: SLOTarget, rows: int, rate: float, *, prune: bool, jobs: int = 1
) -> tuple[list[SweepCandidate], list[SweepResult]]:
    trace = tmp_path / "trace.jsonl"
    requests, span = write_trace(trace, rows, rate)
    options = SimOptions(seed=0, ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s)
    run = SweepRun(TraceSpec(trace), options, slo, requests, span, prune=prune)
    found = candidates(("l40s", "h100-sxm"), (1, 2, 3))
    return found, run_sweep(found, run, jobs=jobs)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_pruning_never_drops_the_cheapest_that_meets(tmp_path: Path, scenario: str) -> None:
    slo, rows, rate = SCENARIOS[scenario]
    _, pruned = sweep(tmp_path, slo, rows, rate, prune=True)
    _, full = sweep(tmp_path, slo, rows, rate, prune=False)
    assert all(r.status in (SweepStatus.MET, SweepStatus.MISSED) for r in full)
    best = cheapest_met(full)
    assert best is not None, "a scenario whose answer is 'none' tests nothing"
    assert any(r.status is SweepStatus.MISSED for r in full), "nor one where all meet"
    chosen = cheapest_met(pruned)
    assert chosen is not None
    assert chosen.name == best.name
    for p, f in zip(pruned, full, strict=True):
        if p.status is SweepStatus.STOPPED:  # stopped for misses: the full run missed
            assert f.status is SweepStatus.MISSED, p.name
        elif p.status in (SweepStatus.SKIPPED, SweepStatus.CUT):  # for cost: it was dearer
            assert p.usd_per_hour > best.usd_per_hour
        else:  # ran to the end: the same run
            assert (p.status, p.digest) == (f.status, f.digest)
    assert sum(p.ran for p in pruned) < len(pruned), "the rules saved nothing here"


def test_processes_find_the_same_pick(tmp_path: Path) -> None:
    slo, rows, rate = SCENARIOS["TTFT p99 and TPOT p50"]
    _, here = sweep(tmp_path, slo, rows, rate, prune=True)
    _, there = sweep(tmp_path, slo, rows, rate, prune=True, jobs=2)
    a, b = cheapest_met(here), cheapest_met(there)
    assert a is not None
    assert b is not None
    assert (a.name, a.digest) == (b.name, b.digest)


def test_without_an_slo_every_candidate_runs_to_the_end(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    requests, span = write_trace(trace, 40, 20.0)
    run = SweepRun(TraceSpec(trace), SimOptions(seed=0), None, requests, span)
    results = run_sweep(candidates(("h100-sxm",), (1, 2)), run)
    assert [r.status for r in results] == [SweepStatus.DONE, SweepStatus.DONE]
    assert cheapest_met(results) is None


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=60),
    q=st.sampled_from([0.5, 0.9, 0.99]),
    limit=st.floats(0.0, 10.0, allow_nan=False),
)
def test_allowance_is_exact_for_lower_rank_quantiles(
    values: list[float], q: float, limit: float
) -> None:
    ordered = sorted(values)
    quantile = ordered[math.floor(q * (len(values) - 1))]
    over = sum(v > limit for v in values)
    assert (over <= allowance(q, len(values))) == (quantile <= limit)


def _overall(records: list[RequestRecord], slo: SLOTarget) -> dict[str, object]:
    """The report's overall metrics, as docs/simulator.md defines them (an oracle)."""
    served = [r for r in records if not (r.rejected or r.failed)]
    ttft = sorted(r.ttft_s for r in served if r.ttft_s is not None)
    tpot = sorted(t for r in served if (t := r.tpot_s) is not None)

    def q(values: list[float]) -> dict[str, float | None]:
        n = len(values)
        return {
            f"p{round(p * 100)}": round(values[math.floor(p * (n - 1))], 6) if n else None
            for p in (0.5, 0.99)
        }

    good = sum(
        1
        for r in served
        if (slo.ttft_s is None or (r.ttft_s or 0.0) <= slo.ttft_s)
        and (slo.tpot_s is None or r.tpot_s is None or r.tpot_s <= slo.tpot_s)
    )
    return {
        "rejected": sum(r.rejected for r in records),
        "failed": sum(r.failed for r in records),
        "ttft_s": q(ttft),
        "tpot_s": q(tpot),
        "slo": {"attainment": round(good / len(records), 4)},
    }


_RECORD = st.tuples(st.floats(0.001, 3.0), st.floats(0.001, 0.2), st.integers(1, 5), st.booleans())


@settings(max_examples=120, deadline=None)
@given(
    rows=st.lists(_RECORD, min_size=1, max_size=80),
    rejected=st.lists(st.booleans(), max_size=80),
    slo=st.sampled_from(
        [
            SLOTarget(ttft_p99_s=1.0, tpot_p50_s=0.1),
            SLOTarget(ttft_p50_s=0.5, tpot_p99_s=0.15),
            SLOTarget(ttft_s=1.5, tpot_s=0.1, attainment=0.9),
            SLOTarget(ttft_p99_s=2.0, ttft_s=2.0, tpot_s=0.05, attainment=0.8),
        ]
    ),
)
def test_a_stopped_run_would_have_missed(
    rows: list[tuple[float, float, int, bool]], rejected: list[bool], slo: SLOTarget
) -> None:
    records = []
    for i, (ttft, tpot, out, _) in enumerate(rows):
        refused = i < len(rejected) and rejected[i] and i % 7 == 0
        records.append(
            RequestRecord(
                index=i,
                replica=0,
                arrival_s=float(i),
                first_token_s=None if refused else i + ttft,
                finish_s=i + ttft + tpot * (out - 1),
                input_tokens=10,
                output_tokens=out,
                cached_tokens=0,
                rejected=refused,
            )
        )
    counter = MissCounter(slo, len(records))
    lost_at = None
    for k, record in enumerate(records):
        counter.add(record)
        if lost_at is None and counter.lost() is not None:
            lost_at = k
    misses = slo.misses(_overall(records, slo))
    if lost_at is not None:
        assert misses, f"stopped after {lost_at + 1} rows, but the whole trace meets the SLO"


def test_slo_target_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="names no target"):
        SLOTarget()
    with pytest.raises(ValueError, match="positive"):
        SLOTarget(ttft_p99_s=-1.0)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        SLOTarget(ttft_s=1.0, attainment=1.5)
    with pytest.raises(ValueError, match="per-request"):
        SLOTarget(ttft_p99_s=1.0, attainment=0.9)


def test_pareto_front_keeps_what_nothing_beats() -> None:
    points = [(1.0, 5.0), (2.0, 3.0), (2.5, 4.0), (3.0, 1.0), (1.0, 6.0), (4.0, 1.0)]
    assert pareto_front(points) == [0, 1, 3]
