"""Many fleets on one trace: each simulated in a process of its own, cheapest first, with
early stops that never drop the cheapest fleet that meets the SLO.

    slo = SLOTarget(ttft_p99_s=2.0, tpot_p50_s=0.05, ttft_s=2.0, tpot_s=0.05)
    run = SweepRun(TraceSpec(SAMPLE_TRACE), SimOptions(seed=0, ttft_slo_s=2.0, tpot_slo_s=0.05),
                   slo=slo, requests=19366, span_s=3501.7)
    results = run_sweep([SweepCandidate("2x h100", fleet, usd_per_hour=6.0), ...], run, jobs=2)
    best = cheapest_met(results)            # the cheapest MET, or None

``gpufleet plan --simulate`` and ``gpufleet simulate --sweep`` are its two front ends
(docs/planner.md, docs/simulator.md).

Two early stops, both exact (they drop a candidate only when the full run could not have
made it the pick):

* **Over: cost.** Candidates start in order of cost (``usd_per_hour``: exact for a static
  fleet, a lower bound for an autoscaled one). Once one meets the SLO at cost C, a candidate
  costing more than C is never started (``SKIPPED``), and one running is stopped at its next
  slice (``CUT``): it could only be a dearer pick. Ties are simulated.
* **Under: misses.** A percentile target allows a fixed number of misses over the whole
  trace: the lower-rank quantile ``v[⌊q·(n-1)⌋]`` of ``n`` values is within ``X`` exactly
  when at most ``n - 1 - ⌊q·(n-1)⌋`` values exceed ``X``, and that allowance only grows
  with ``n``, so the trace's request count bounds it from above. Attainment allows
  ``requests - good`` misses the same way. A run whose finished requests already miss more
  than a term allows is stopped (``STOPPED``): the finished rows are final, so the full run
  would miss that term too. A rejected or failed request stops it at once (the SLO asks for
  every request served). A fleet far from the SLO overruns its allowance in the first
  minutes of the trace, which is the point: most of a search's cost is its misses.

The planner's own pick may be marked ``keep`` so that it is simulated to the end whatever it
costs (how far the plan was off is then known).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from random import Random
from typing import Any, Final, Protocol

from gpufleet.catalog import get_gpu
from gpufleet.config import FleetConfig
from gpufleet.sim._arrivals import ArrivalProcess
from gpufleet.sim._recorder import RequestRecord
from gpufleet.sim._simulate import FleetSimulation, SimOptions
from gpufleet.sim._traces import TraceFormat, TraceReader, load_trace

SLICES: Final = 100
"""Slices of a run over the trace's span: progress reports and early-stop checks."""


@dataclass(frozen=True, slots=True)
class SLOTarget:
    """What a fleet must hold on the trace, judged on ``report.json``'s overall metrics.

    Percentile targets (seconds) bound the report's lower-rank quantiles; ``attainment`` is
    the least share of requests within both per-request thresholds ``ttft_s`` and
    ``tpot_s`` (the report's ``slo.attainment``, with the same thresholds in ``SimOptions``).
    Every request must also be served: a rejected or failed one misses.
    """

    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p99_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    attainment: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"SLO {name}: must be a positive number, got {value}")
        if self.attainment is not None:
            if not 0 < self.attainment <= 1:
                raise ValueError(f"SLO attainment: must be in (0, 1], got {self.attainment}")
            if self.ttft_s is None and self.tpot_s is None:
                raise ValueError("SLO attainment needs a per-request TTFT or TPOT threshold")
        if not self.terms() and self.attainment is None:
            raise ValueError("the SLO names no target")

    def terms(self) -> list[tuple[str, str, float, float]]:
        """The percentile targets: (label, metric, quantile, limit in seconds)."""
        out = []
        for label, metric, q, limit in (
            ("TTFT p50", "ttft", 0.5, self.ttft_p50_s),
            ("TTFT p99", "ttft", 0.99, self.ttft_p99_s),
            ("TPOT p50", "tpot", 0.5, self.tpot_p50_s),
            ("TPOT p99", "tpot", 0.99, self.tpot_p99_s),
        ):
            if limit is not None:
                out.append((label, metric, q, limit))
        return out

    def misses(self, overall: Mapping[str, Any]) -> list[str]:
        """Why a finished run's overall metrics miss the SLO (none: it meets it)."""
        reasons = []
        refused = overall["rejected"] + overall.get("failed", 0)
        if refused:
            reasons.append(f"{refused} requests rejected or failed")
        for label, metric, q, limit in self.terms():
            value = overall[f"{metric}_s"][f"p{round(q * 100)}"]
            if value is not None and value > limit:
                reasons.append(f"{label} {_ms(value)} > {_ms(limit)}")
        if self.attainment is not None:
            share = overall["slo"]["attainment"]
            if share is None or share < self.attainment:
                reasons.append(f"attainment {share:.2%} < {self.attainment:.2%}")
        return reasons


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms" if seconds < 1 else f"{seconds * 1000:,.0f} ms"


def allowance(q: float, n: int) -> int:
    """Values above the limit that the lower-rank ``q`` quantile of ``n`` values tolerates."""
    return n - 1 - math.floor(q * (n - 1)) if n > 0 else 0


class MissCounter:
    """Counts the finished requests that miss each term of an SLO, and says when a term is
    already lost for a trace of ``total`` requests (module docstring: "Under: misses")."""

    __slots__ = ("_bad", "_counts", "_refused", "_terms", "slo", "total")

    def __init__(self, slo: SLOTarget, total: int) -> None:
        self.slo = slo
        self.total = total
        self._terms = slo.terms()
        self._counts = [0] * len(self._terms)
        self._refused = 0
        self._bad = 0
        """Requests outside the per-request thresholds (attainment's misses)."""

    def add(self, record: RequestRecord) -> None:
        if record.rejected or record.failed:
            self._refused += 1
            self._bad += 1
            return
        ttft, tpot = record.ttft_s, record.tpot_s
        assert ttft is not None
        for k, (_, metric, _, limit) in enumerate(self._terms):
            value = ttft if metric == "ttft" else tpot
            # Rounded as the report rounds its quantiles, so both judge the same numbers.
            if value is not None and round(value, 6) > limit:
                self._counts[k] += 1
        slo = self.slo
        good = (slo.ttft_s is None or ttft <= slo.ttft_s) and (
            slo.tpot_s is None or tpot is None or tpot <= slo.tpot_s
        )
        self._bad += not good

    def lost(self) -> str | None:
        """The first term the run can no longer meet, as a sentence (None: none yet)."""
        if self._refused:
            return f"{self._refused} requests rejected or failed"
        for (label, _, q, limit), count in zip(self._terms, self._counts, strict=True):
            allowed = allowance(q, self.total)
            if count > allowed:
                return (
                    f"{label}: {count} requests over {_ms(limit)}, more than the {allowed} "
                    f"of {self.total} the target allows"
                )
        target = self.slo.attainment
        if target is not None and round((self.total - self._bad) / self.total, 4) < target:
            return (
                f"attainment: {self._bad} of {self.total} requests outside the SLO, "
                f"below {target:.2%} whatever the rest do"
            )
        return None


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """How to open the trace (each worker process opens its own)."""

    path: Path
    format: TraceFormat | None = None
    rate_scale: float = 1.0
    duration: float | None = None
    arrivals: ArrivalProcess | None = None
    seed: int = 0
    """Seed of drawn arrivals (as ``gpufleet simulate`` seeds them: the run's seed)."""

    def open(self) -> TraceReader:
        return load_trace(
            self.path,
            self.format,
            rate_scale=self.rate_scale,
            duration=self.duration,
            arrivals=self.arrivals,
            rng=Random(self.seed),
        )


@dataclass(frozen=True, slots=True)
class SweepCandidate:
    """One fleet to try."""

    name: str
    fleet: FleetConfig
    """What is simulated."""
    usd_per_hour: float
    """What it costs: exact when ``exact``, else a lower bound (an autoscaled pool's
    ``min_replicas``); the cost rule orders and prunes by it."""
    exact: bool = True
    keep: bool = False
    """Simulated to the end whatever it costs (the planner's own pick)."""


@dataclass(frozen=True, slots=True)
class SweepRun:
    """What every candidate shares: the trace, the options, the SLO, the rules."""

    trace: TraceSpec
    options: SimOptions
    slo: SLOTarget | None
    """None: no judging, no pruning (every candidate runs to the end)."""
    requests: int
    """Requests in the trace (the miss allowances are over these)."""
    span_s: float
    """The last arrival (the slices cover it)."""
    prune: bool = True
    prices: Mapping[str, float] = field(default_factory=dict)
    """USD per GPU-hour by GPU name, over the catalog's (an inexact candidate's cost)."""


class SweepStatus(StrEnum):
    MET = "met"
    MISSED = "missed"
    DONE = "done"
    """Ran to the end with no SLO to judge."""
    STOPPED = "stopped"
    """Stopped early: its misses exceeded what the SLO allows over the trace."""
    SKIPPED = "skipped"
    """Never started: it costs more than a candidate that met the SLO."""
    CUT = "cut"
    """Stopped early: a cheaper candidate met the SLO meanwhile."""


@dataclass(frozen=True, slots=True)
class SweepResult:
    name: str
    status: SweepStatus
    usd_per_hour: float
    """Exact, or (an autoscaled pool that ran to the end) what the run charged per hour."""
    reasons: tuple[str, ...] = ()
    overall: Mapping[str, Any] | None = None
    """``report["overall"]`` of a run that finished."""
    simulated_s: float | None = None
    stopped_at_s: float | None = None
    finished_requests: int = 0
    wall_s: float = 0.0
    digest: str | None = None

    @property
    def ran(self) -> bool:
        return self.overall is not None

    def quantile(self, metric: str, key: str) -> float | None:
        """``overall[metric][key]`` of a finished run (None otherwise)."""
        return None if self.overall is None else self.overall[metric][key]


def cheapest_met(results: Sequence[SweepResult]) -> SweepResult | None:
    """The cheapest candidate that met the SLO; ties to the lower TTFT p99, then the name."""
    met = [r for r in results if r.status is SweepStatus.MET]
    if not met:
        return None
    return min(met, key=lambda r: (r.usd_per_hour, r.quantile("ttft_s", "p99") or 0.0, r.name))


class _Best(Protocol):
    value: float


class _Outbox(Protocol):
    def put(self, item: tuple[int, float, int]) -> None: ...


@dataclass(slots=True)
class _LocalBest:
    value: float = math.inf


@dataclass(slots=True)
class _Callback:
    on_progress: Callable[[int, float, int], None] | None

    def put(self, item: tuple[int, float, int]) -> None:
        if self.on_progress is not None:
            self.on_progress(*item)


class SweepProgress(Protocol):
    """What a front end hears (in the parent process)."""

    def started(self, index: int) -> None: ...
    def advanced(self, index: int, now: float, finished: int) -> None: ...
    def ended(self, index: int, result: SweepResult) -> None: ...


def run_sweep(
    candidates: Sequence[SweepCandidate],
    run: SweepRun,
    *,
    jobs: int = 1,
    progress: SweepProgress | None = None,
) -> list[SweepResult]:
    """Simulate ``candidates`` (in ``jobs`` processes; 1: in this one), cheapest first,
    with the early stops of the module docstring when ``run.prune``. Results in the order
    of ``candidates``."""
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    sweep = _Sweep(candidates, run, progress)
    if jobs == 1 or len(candidates) <= 1:
        sweep.here()
    else:
        sweep.in_processes(jobs)
    return [sweep.results[i] for i in range(len(candidates))]


class _Sweep:
    """The schedule: candidates in order of cost, each started unless the cost rule skips it."""

    def __init__(
        self, candidates: Sequence[SweepCandidate], run: SweepRun, progress: SweepProgress | None
    ) -> None:
        self.candidates = candidates
        self.run = run
        self.progress = progress
        self.order = deque(sorted(range(len(candidates)), key=lambda i: candidates[i].usd_per_hour))
        self.results: dict[int, SweepResult] = {}

    def _next(self, best: float) -> int | None:
        """The next candidate to start (those the cost rule skips are settled on the way)."""
        while self.order:
            i = self.order.popleft()
            candidate = self.candidates[i]
            if self.run.prune and not candidate.keep and candidate.usd_per_hour > best:
                self._ended(i, _skipped(candidate, best))
                continue
            if self.progress is not None:
                self.progress.started(i)
            return i
        return None

    def _ended(self, i: int, result: SweepResult) -> None:
        self.results[i] = result
        if self.progress is not None:
            self.progress.ended(i, result)

    def here(self) -> None:
        best = _LocalBest()
        outbox = _Callback(self.progress.advanced if self.progress is not None else None)
        while (i := self._next(best.value)) is not None:
            result = simulate_candidate(i, self.candidates[i], self.run, best, outbox)
            _met(result, best)
            self._ended(i, result)

    def in_processes(self, jobs: int) -> None:
        import multiprocessing  # noqa: PLC0415 - only a parallel sweep needs it
        import queue  # noqa: PLC0415

        # Spawned, not forked: the parent may run threads (a progress bar's refresher).
        context = multiprocessing.get_context("spawn")
        with context.Manager() as manager, ProcessPoolExecutor(jobs, mp_context=context) as pool:
            best = manager.Value("d", math.inf)
            outbox = manager.Queue()
            running: dict[Future[SweepResult], int] = {}
            while True:
                while len(running) < jobs and (i := self._next(best.value)) is not None:
                    job = pool.submit(
                        simulate_candidate, i, self.candidates[i], self.run, best, outbox
                    )
                    running[job] = i
                if not running:
                    return
                done, _ = wait(running, timeout=0.1, return_when=FIRST_COMPLETED)
                while True:  # progress first: a run's last slice comes before its result
                    try:
                        index, now, finished = outbox.get_nowait()
                    except queue.Empty:
                        break
                    if self.progress is not None:
                        self.progress.advanced(index, now, finished)
                for job in done:
                    i = running.pop(job)
                    result = job.result()
                    _met(result, best)
                    self._ended(i, result)


def _skipped(candidate: SweepCandidate, best: float) -> SweepResult:
    return SweepResult(
        candidate.name,
        SweepStatus.SKIPPED,
        candidate.usd_per_hour,
        (f"dearer than ${best:,.2f}/h, which met the SLO",),
    )


def _met(result: SweepResult, best: _Best) -> None:
    if result.status is SweepStatus.MET and result.usd_per_hour < best.value:
        best.value = result.usd_per_hour


def simulate_candidate(
    index: int, candidate: SweepCandidate, run: SweepRun, best: _Best, outbox: _Outbox
) -> SweepResult:
    """One candidate on the trace, in slices; stopped early by the rules (worker side)."""
    wall = time.perf_counter()
    sim = FleetSimulation(candidate.fleet, run.options)
    sim.start(run.trace.open())
    judged = run.slo is not None and run.prune and not candidate.keep
    counter = MissCounter(run.slo, run.requests) if judged and run.slo is not None else None
    log = sim.harness.recorder.log
    seen = 0
    step = max(run.span_s, 1e-9) / SLICES
    k = 0

    def early(status: SweepStatus, why: str) -> SweepResult:
        return SweepResult(
            candidate.name,
            status,
            candidate.usd_per_hour,
            (why,),
            stopped_at_s=round(sim.now, 3),
            finished_requests=len(log),
            wall_s=time.perf_counter() - wall,
        )

    while sim.harness.active:
        k += 1
        sim.run(step * k)
        outbox.put((index, sim.now, len(log)))
        if counter is not None:
            for i in range(seen, len(log)):
                counter.add(log[i])
            seen = len(log)
            why = counter.lost()
            if why is not None:
                return early(SweepStatus.STOPPED, why)
        if run.prune and not candidate.keep and candidate.usd_per_hour > best.value:
            return early(
                SweepStatus.CUT,
                f"dearer than ${best.value:,.2f}/h, which met the SLO meanwhile",
            )
    sim.run()
    problems = sim.check()
    if problems:
        raise RuntimeError(f"{candidate.name}: global check failed: {'; '.join(problems)}")
    report = sim.report({})
    overall = report["overall"]
    cost = candidate.usd_per_hour if candidate.exact else _charged(report, run.prices)
    if run.slo is None:
        status, reasons = SweepStatus.DONE, []
    else:
        reasons = run.slo.misses(overall)
        status = SweepStatus.MISSED if reasons else SweepStatus.MET
    return SweepResult(
        candidate.name,
        status,
        cost,
        tuple(reasons),
        overall=overall,
        simulated_s=report["simulated_s"],
        finished_requests=len(log),
        wall_s=time.perf_counter() - wall,
        digest=report["digest"],
    )


def _charged(report: Mapping[str, Any], prices: Mapping[str, float]) -> float:
    """USD per hour the run charged (every replica from provisioned to gone, docs/simulator.md)."""
    hours = report["simulated_s"] / 3600.0
    usd = math.fsum(
        m["gpu_hours"] * prices.get(m["gpu"], get_gpu(m["gpu"]).price_per_hour_usd)
        for m in report["cost"]["models"].values()
    )
    return round(usd / hours, 4) if hours > 0 else 0.0


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower is better), by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front: list[int] = []
    lowest = math.inf
    for i in order:
        if points[i][1] < lowest:
            front.append(i)
            lowest = points[i][1]
    return front
