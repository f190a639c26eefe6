"""The operating point of one replica: how many sequences it runs at once, and what follows.

The replica runs vLLM-style iterations with chunked prefill: every step decodes one token for
each running sequence and spends what is left of the token budget on prompt chunks. In steady
state at concurrency ``B`` (sequences in the running batch), with mean input ``I`` and output
``O`` tokens::

    a sequence lives ≈ TTFT + (O − 1) steps  →  throughput X = B / (TTFT + (O − 1)·step)
    prompt tokens arrive at X·I per second    →  B·I/O prompt tokens ride along in each step

so a mean step carries ``B`` decodes of mean context ``I + O/2`` plus ``B·I/O`` prefill tokens,
which must fit the token budget (``max_num_batched_tokens``). Latencies follow from the step
time model:

* TPOT p50: the mean step above;
* TPOT p99: a step that also carries a full prompt chunk (``budget − B`` tokens, or the p99
  prompt if that is smaller): decodes stall behind prefill chunks, which is what chunked
  prefill bounds;
* TTFT: the steps a prompt needs at ``budget − B`` tokens each, plus the wait for the step
  under way (half a step at p50, a whole one at p99).

Queueing delay in front of the replica is not modelled here: the fleet is sized at a target
utilisation (65 % by default) precisely to keep queues short, and ``gpufleet simulate``
measures what remains on a real trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpufleet.perf import BatchShape, MemoryPlan, StepTimeModel
from gpufleet.planner._inputs import SLO, Workload


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    concurrency: int
    tpot_p50_s: float
    tpot_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    requests_per_s: float
    bound: str

    def meets(self, slo: SLO) -> bool:
        checks = (
            (slo.ttft_p99_ms, self.ttft_p99_s),
            (slo.ttft_p50_ms, self.ttft_p50_s),
            (slo.tpot_p50_ms, self.tpot_p50_s),
            (slo.tpot_p99_ms, self.tpot_p99_s),
        )
        return all(target is None or seconds * 1000.0 <= target for target, seconds in checks)

    def misses(self, slo: SLO) -> list[str]:
        """The SLO terms this point breaks, e.g. ``["TPOT p50 61 ms > 50 ms"]``."""
        terms = (
            ("TTFT p99", slo.ttft_p99_ms, self.ttft_p99_s),
            ("TTFT p50", slo.ttft_p50_ms, self.ttft_p50_s),
            ("TPOT p50", slo.tpot_p50_ms, self.tpot_p50_s),
            ("TPOT p99", slo.tpot_p99_ms, self.tpot_p99_s),
        )
        return [
            f"{label} {seconds * 1000:.0f} ms > {target:.0f} ms"
            for label, target, seconds in terms
            if target is not None and seconds * 1000.0 > target
        ]


def _prefill_chunk(tokens: int, context: float) -> BatchShape:
    """``tokens`` prompt tokens whose attention reaches ``context`` earlier tokens on average."""
    if tokens <= 0:
        return BatchShape()
    return BatchShape(
        prefill_tokens=tokens,
        prefill_seqs=1,
        prefill_attn_context=round(tokens * context),
    )


def _decodes(seqs: int, mean_context: float) -> BatchShape:
    return BatchShape(decode_seqs=seqs, decode_context=round(seqs * mean_context))


def evaluate(
    stm: StepTimeModel, workload: Workload, budget: int, concurrency: int
) -> OperatingPoint | None:
    """The replica at ``concurrency`` running sequences; ``None`` if the budget cannot carry it."""
    mean_in, mean_out = workload.input_tokens, workload.output_tokens
    steady_prefill = math.ceil(concurrency * mean_in / mean_out)
    room = budget - concurrency
    if steady_prefill > room:
        return None
    decodes = _decodes(concurrency, mean_in + mean_out / 2)
    mean_step = stm.step_time(decodes + _prefill_chunk(steady_prefill, mean_in / 2))
    chunk99 = min(room, max(steady_prefill, workload.input_p99))
    worst_step = stm.step_time(decodes + _prefill_chunk(chunk99, workload.input_p99 / 2))

    def ttft(prompt: int, wait_steps: float) -> float:
        chunk = min(room, prompt)
        step = stm.step_time(decodes + _prefill_chunk(chunk, prompt / 2))
        return (math.ceil(prompt / room) + wait_steps) * step.seconds

    ttft_p50 = ttft(mean_in, 0.5)
    ttft_p99 = ttft(workload.input_p99, 1.0)
    lifetime = ttft_p50 + (mean_out - 1) * mean_step.seconds
    return OperatingPoint(
        concurrency=concurrency,
        tpot_p50_s=mean_step.seconds,
        tpot_p99_s=worst_step.seconds,
        ttft_p50_s=ttft_p50,
        ttft_p99_s=ttft_p99,
        requests_per_s=concurrency / lifetime,
        bound=mean_step.bound,
    )


def kv_concurrency_limit(memory: MemoryPlan, workload: Workload) -> int:
    """Sequences whose mean context (prompt plus half the output) fits the KV cache at once."""
    mean_context = workload.input_tokens + math.ceil(workload.output_tokens / 2)
    return memory.max_concurrency(mean_context)


def best_operating_point(
    stm: StepTimeModel, workload: Workload, slo: SLO, budget: int, max_concurrency: int
) -> tuple[OperatingPoint | None, OperatingPoint | None]:
    """(the highest-throughput point that meets the SLO, the point at concurrency 1).

    Every latency term grows with the batch (longer steps, less room for prompt chunks), so
    the search walks concurrency up from 1 and stops at the first point that misses the SLO.
    """
    best: OperatingPoint | None = None
    single = evaluate(stm, workload, budget, 1)
    for concurrency in range(1, max_concurrency + 1):
        point = evaluate(stm, workload, budget, concurrency)
        if point is None or not point.meets(slo):
            break
        if best is None or point.requests_per_s > best.requests_per_s:
            best = point
    return best, single
