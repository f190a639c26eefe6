"""A batch job in a simulated run: many lines submitted at once, run on spare capacity.

    job = BatchJob(lines=200_000, at=0.0, model="llama-spot", window_s=8 * 3600)
    trace = job.merged(trace, seed=0)       # the lines join the trace at `at`
    SimOptions(batch=job)                   # their class, deadline and report section

Each line is a request of tenant ``BATCH_JOB`` in the ``batch`` class, for served name
``model`` (default: the first), with a prompt and output length drawn from a size table
(default: the packaged Azure 2023 conversation trace's). They all arrive at ``at`` and wait
at the pool controller's spare-capacity gate (``gateway.batch.spare``, docs/batch.md) until
room comes or their deadline, ``at + window_s``, passes: live, the batch runner keeps the
gate fed (``gateway.batch.lines_in_flight`` per gateway); the simulator assumes it keeps it
full. The report's ``batch`` section says when the job finished and whether in its window.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from random import Random
from typing import Any, Final

from gpufleet.sim._admission import SimTenant
from gpufleet.sim._recorder import RequestRecord
from gpufleet.sim._traces import SAMPLE_TRACE, TraceRequest, load_trace

BATCH_JOB: Final = "batch-job"
"""The tenant of a simulated batch job's lines."""


@dataclass(frozen=True, slots=True)
class BatchJob:
    """``lines`` requests submitted at ``at`` to served name ``model``, to finish within
    ``window_s`` seconds (the OpenAI Batch API's ``completion_window``: 24 h)."""

    lines: int
    at: float = 0.0
    model: str | None = None
    window_s: float = 86_400.0
    sizes: Path = SAMPLE_TRACE

    def __post_init__(self) -> None:
        if self.lines < 1:
            raise ValueError(f"a batch job has at least one line, got {self.lines}")
        if not self.at >= 0:
            raise ValueError(f"the batch job's submission time must be ≥ 0, got {self.at}")
        if not self.window_s > 0:
            raise ValueError(f"the batch job's window must be positive, got {self.window_s}")

    @property
    def deadline(self) -> float:
        return self.at + self.window_s

    @property
    def tenant(self) -> SimTenant:
        """The lines' tenant: the ``batch`` class, drawn for none of the trace's requests."""
        return SimTenant(BATCH_JOB, weight=1.0, priority="batch", share=0.0)

    def requests(self, seed: int) -> list[TraceRequest]:
        """The lines, in submission order: sizes drawn uniformly (with replacement) from the
        size table by ``Random("gpufleet-batch-<seed>")``."""
        pairs = [(r.input_tokens, r.output_tokens) for r in load_trace(self.sizes)]
        if not pairs:
            raise ValueError(f"{self.sizes}: no requests to draw sizes from")
        rng = Random(f"gpufleet-batch-{seed}")
        return [
            TraceRequest(self.at, *pairs[rng.randrange(len(pairs))], model=self.model,
                         tenant=BATCH_JOB)
            for _ in range(self.lines)
        ]  # fmt: skip

    def merged(self, trace: Sequence[TraceRequest], seed: int) -> list[TraceRequest]:
        """``trace`` with the lines inserted at ``at`` (after the requests of that instant)."""
        at = bisect.bisect_right([r.arrival_s for r in trace], self.at)
        return [*trace[:at], *self.requests(seed), *trace[at:]]


def parse_batch_job(spec: str) -> BatchJob:
    """``LINES[:at=S,model=NAME,window=S]``, the ``--batch`` option of ``simulate``:
    ``200000:at=0,model=llama-spot,window=28800``."""
    count, _, rest = spec.partition(":")
    try:
        lines = int(count.replace("_", ""))
    except ValueError:
        raise ValueError(f"--batch {spec!r}: {count!r} is not a number of lines") from None
    fields: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--batch {spec!r}: {item!r} is not key=value")
        if key == "model":
            fields["model"] = value
        elif key in {"at", "window"}:
            try:
                fields["window_s" if key == "window" else key] = float(value)
            except ValueError:
                raise ValueError(f"--batch {spec!r}: {key} {value!r} is not a number") from None
        else:
            raise ValueError(f"--batch {spec!r}: unknown key {key!r} (at, model, window)")
    try:
        return BatchJob(lines, **fields)
    except ValueError as error:
        raise ValueError(f"--batch {spec!r}: {error}") from None


def batch_report(job: BatchJob, rows: Iterable[RequestRecord], tenants: list[str],
                 tenant_ids: Sequence[int]) -> dict[str, Any]:  # fmt: skip
    """The ``batch`` section: the job's lines done and failed, when the last ended, and
    whether that was within its window."""
    mine = tenants.index(BATCH_JOB) if BATCH_JOB in tenants else -1
    done = failed = tokens = 0
    last = None
    for row in rows:
        if row.index >= len(tenant_ids) or tenant_ids[row.index] != mine:
            continue
        if row.failed:
            failed += 1
        else:
            done += 1
            tokens += row.output_tokens
        last = row.finish_s if last is None else max(last, row.finish_s)
    took = None if last is None else last - job.at
    return {
        "lines": job.lines,
        "model": job.model,
        "submitted_s": job.at,
        "window_s": job.window_s,
        "completed": done,
        "failed": failed,
        "output_tokens": tokens,
        "finished_s": None if last is None else round(last, 3),
        "took_s": None if took is None else round(took, 3),
        "within_window": failed == 0 and done == job.lines and took is not None
        and took <= job.window_s,
    }  # fmt: skip
