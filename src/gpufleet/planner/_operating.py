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


def _steady_prefill(tokens: int, prompt: int) -> BatchShape:
    """``tokens`` prompt tokens of ``prompt``-token prompts, as a steady step carries them.

    Several whole prompts when the step has room for them, else a chunk in the middle of one
    prompt (on average half of what precedes it is already cached).
    """
    if tokens <= 0:
        return BatchShape()
    whole, rest = divmod(tokens, prompt)
    batch = BatchShape()
    if whole:
        batch = BatchShape(
            prefill_tokens=whole * prompt,
            prefill_seqs=whole,
            prefill_attn_context=whole * (prompt * (prompt + 1) // 2),
            prefill_context=whole * prompt,
        )
    if rest:
        batch = batch + BatchShape.prefill(rest, cached=(prompt - rest) // 2)
    return batch


def _decodes(seqs: int, mean_context: float) -> BatchShape:
    return BatchShape(decode_seqs=seqs, decode_context=round(seqs * mean_context))


def _ttft(stm: StepTimeModel, decodes: BatchShape, prompt: int, room: int, wait: float) -> float:
    """Chunked prefill of one ``prompt`` at ``room`` tokens a step beside the running decodes."""
    total = 0.0
    step = 0.0
    for cached in range(0, prompt, room):
        chunk = min(room, prompt - cached)
        step = stm.step_time(decodes + BatchShape.prefill(chunk, cached=cached)).seconds
        total += step
    return total + wait * step


def evaluate(
    stm: StepTimeModel, workload: Workload, budget: int, concurrency: int
) -> OperatingPoint | None:
    """The replica at ``concurrency`` running sequences; ``None`` if the budget cannot carry it.

    With pipeline parallelism ``pp`` batches are in flight: a token still takes a whole pass
    (``seconds``), but a batch completes every ``interval``, so throughput gains that ratio.
    """
    mean_in, mean_out = workload.input_tokens, workload.output_tokens
    steady_prefill = math.ceil(concurrency * mean_in / mean_out)
    room = budget - concurrency
    if steady_prefill > room:
        return None
    decodes = _decodes(concurrency, mean_in + mean_out / 2)
    mean_step = stm.step_time(decodes + _steady_prefill(steady_prefill, mean_in))
    chunk99 = min(room, max(steady_prefill, workload.input_p99))
    worst = decodes + BatchShape.prefill(chunk99, cached=max(0, workload.input_p99 - chunk99))
    worst_step = stm.step_time(worst)
    ttft_p50 = _ttft(stm, decodes, mean_in, room, 0.5)
    ttft_p99 = _ttft(stm, decodes, workload.input_p99, room, 1.0)
    lifetime = ttft_p50 + (mean_out - 1) * mean_step.seconds
    in_flight = mean_step.seconds / mean_step.interval
    return OperatingPoint(
        concurrency=round(concurrency * in_flight),
        tpot_p50_s=mean_step.seconds,
        tpot_p99_s=worst_step.seconds,
        ttft_p50_s=ttft_p50,
        ttft_p99_s=ttft_p99,
        requests_per_s=concurrency * in_flight / lifetime,
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
        if point is None or point.concurrency > max_concurrency or not point.meets(slo):
            break
        if best is None or point.requests_per_s > best.requests_per_s:
            best = point
    return best, single
