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
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from random import Random
from typing import Any, Final

from gpufleet.fleet import BatchRequest, parse_batch_input, prefix_ranks, prompt_text
from gpufleet.sim._admission import SimTenant
from gpufleet.sim._recorder import RequestRecord
from gpufleet.sim._traces import PREFIX_HASH_TOKENS, SAMPLE_TRACE, TraceRequest, load_trace

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
    file: Path | None = None
    """An OpenAI batch input file (JSONL) whose lines these are (:func:`parse_batch_job`
    counts them): each line's prompt is sized by its text (4 characters a token, the
    gateway's estimate) and named block by block (512 characters, as the gateway hashes
    prompts), so lines that share a prefix share it in the modelled caches; its output by its
    ``max_tokens`` (else drawn from ``sizes``); its model is the body's unless ``model``
    says. They join the gate in the run order live batches use (``batch.order``)."""

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

    def requests(self, seed: int, order: str = "prefix") -> list[TraceRequest]:
        """The lines, in submission order: sizes drawn uniformly (with replacement) from the
        size table by ``Random("gpufleet-batch-<seed>")``; a ``file``'s lines in its run
        ``order`` (``prefix`` or ``input``, as ``gateway.batch.order``)."""
        pairs = [(r.input_tokens, r.output_tokens) for r in load_trace(self.sizes)]
        if not pairs:
            raise ValueError(f"{self.sizes}: no requests to draw sizes from")
        rng = Random(f"gpufleet-batch-{seed}")
        if self.file is not None:
            return self._from_file(self.file, order, lambda: pairs[rng.randrange(len(pairs))])
        return [
            TraceRequest(self.at, *pairs[rng.randrange(len(pairs))], model=self.model,
                         tenant=BATCH_JOB)
            for _ in range(self.lines)
        ]  # fmt: skip

    def _from_file(
        self, path: Path, order: str, draw: Callable[[], tuple[int, int]]
    ) -> list[TraceRequest]:
        lines = read_batch_file(path)
        ranks = prefix_ranks(lines) if order == "prefix" else list(range(len(lines)))
        out: list[TraceRequest] = []
        for i in sorted(range(len(lines)), key=ranks.__getitem__):
            body = lines[i].body
            text = prompt_text(body)
            asked = body.get("max_completion_tokens", body.get("max_tokens"))
            output = asked if isinstance(asked, int) and asked > 0 else draw()[1]
            model = self.model or body.get("model")
            out.append(
                TraceRequest(
                    self.at,
                    max(1, len(text) // 4),
                    output,
                    hash_ids=_block_ids(text),
                    model=model if isinstance(model, str) else None,
                    tenant=BATCH_JOB,
                    block_tokens=PREFIX_HASH_TOKENS,
                )
            )
        return out

    def merged(
        self, trace: Sequence[TraceRequest], seed: int, order: str = "prefix"
    ) -> list[TraceRequest]:
        """``trace`` with the lines inserted at ``at`` (after the requests of that instant)."""
        at = bisect.bisect_right([r.arrival_s for r in trace], self.at)
        return [*trace[:at], *self.requests(seed, order), *trace[at:]]


def read_batch_file(path: Path) -> tuple[BatchRequest, ...]:
    """The lines of an OpenAI batch input file, checked as ``/v1/batches`` checks them
    (``ValueError`` naming the first bad line)."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror or error}") from None
    parsed = parse_batch_input(data)
    if not parsed.ok:
        first = parsed.errors[0]
        where = "" if first.line is None else f" line {first.line}:"
        raise ValueError(f"{path}:{where} {first.message}")
    return parsed.requests


def _block_ids(text: str) -> tuple[int, ...]:
    """Names of the prompt's 512-character blocks, each chained to those before it (equal
    prefixes, equal names; stable across processes, unlike ``hash``)."""
    ids: list[int] = []
    chained = 0
    for start in range(0, len(text) - _BLOCK_CHARS + 1, _BLOCK_CHARS):
        chained = zlib.crc32(text[start : start + _BLOCK_CHARS].encode(), chained)
        ids.append(chained)
    return tuple(ids)


_BLOCK_CHARS: Final = 512


def parse_batch_job(spec: str) -> BatchJob:
    """``LINES|FILE[:at=S,model=NAME,window=S]``, the ``--batch`` option of ``simulate``:
    ``200000:at=0,model=llama-spot,window=28800``, or ``nightly.jsonl:window=28800`` (an
    OpenAI batch input file, its lines sized by their text and ``max_tokens``)."""
    count, _, rest = spec.partition(":")
    fields: dict[str, Any] = {}
    try:
        lines = int(count.replace("_", ""))
    except ValueError:
        path = Path(count)
        if not (path.suffix == ".jsonl" or path.exists()):
            raise ValueError(
                f"--batch {spec!r}: {count!r} is neither a number of lines nor a batch file"
            ) from None
        try:
            lines = len(read_batch_file(path))
        except ValueError as error:
            raise ValueError(f"--batch {spec!r}: {error}") from None
        fields["file"] = path
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
