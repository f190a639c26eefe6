"""What ``plan --simulate`` and ``simulate --sweep`` share on screen and on disk: a progress
bar over the candidates, the table of every candidate, and each candidate's JSON row."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpufleet.sim import SweepCandidate, SweepResult, SweepStatus

_STYLE = {
    SweepStatus.MET: "green",
    SweepStatus.MISSED: "yellow",
    SweepStatus.DONE: "",
    SweepStatus.STOPPED: "yellow",
    SweepStatus.SKIPPED: "dim",
    SweepStatus.CUT: "dim",
}


class SweepBar:
    """A rich progress bar: one row for the sweep, one per candidate running."""

    def __init__(
        self, console: Console, candidates: Sequence[SweepCandidate], span_s: float
    ) -> None:
        self.console = console
        self.candidates = candidates
        self.span = max(span_s, 1e-9)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[text]}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.total: TaskID | None = None
        self.rows: dict[int, TaskID] = {}
        self.counts: dict[SweepStatus, int] = {}

    def __enter__(self) -> SweepBar:
        self.progress.__enter__()
        self.total = self.progress.add_task(
            "candidates", total=len(self.candidates), text=self._summary()
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(None, None, None)

    def _summary(self) -> str:
        done = sum(self.counts.values())
        parts = [f"{done} / {len(self.candidates)}"]
        parts += [f"{n} {status.value}" for status, n in sorted(self.counts.items())]
        return ", ".join(parts)

    def started(self, index: int) -> None:
        name = self.candidates[index].name
        self.rows[index] = self.progress.add_task(
            f"  {name}", total=self.span, text="0 simulated s"
        )

    def advanced(self, index: int, now: float, finished: int) -> None:
        row = self.rows.get(index)
        if row is not None:
            text = f"{now:,.0f} simulated s, {finished:,} requests"
            self.progress.update(row, completed=min(now, self.span), text=text)

    def ended(self, index: int, result: SweepResult) -> None:
        row = self.rows.pop(index, None)
        if row is not None:
            self.progress.remove_task(row)
        self.counts[result.status] = self.counts.get(result.status, 0) + 1
        assert self.total is not None
        self.progress.update(self.total, advance=1, text=self._summary())
        if result.status is not SweepStatus.SKIPPED:
            self.progress.console.print(
                f"  {result.name}: [{_STYLE[result.status]}]{result.status.value}[/] "
                f"(${result.usd_per_hour:,.2f}/h{_brief(result)}, {result.wall_s:.1f} s)",
                highlight=False,
            )


def _brief(result: SweepResult) -> str:
    p99 = result.quantile("ttft_s", "p99")
    if p99 is not None:
        return f", TTFT p99 {_ms(p99)}"
    if result.stopped_at_s is not None:
        return f", at {result.stopped_at_s:,.0f} simulated s"
    return ""


def _ms(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value * 1000:,.0f} ms" if value >= 1 else f"{value * 1000:.1f} ms"


def _pair(result: SweepResult, metric: str) -> str:
    if not result.ran:
        return "—"
    return f"{_ms(result.quantile(metric, 'p50'))} / {_ms(result.quantile(metric, 'p99'))}"


def attainment(result: SweepResult) -> float | None:
    if result.overall is None or "slo" not in result.overall:
        return None
    value = result.overall["slo"]["attainment"]
    return None if value is None else float(value)


def status_text(result: SweepResult) -> str:
    text = result.status.value
    if result.status is SweepStatus.STOPPED and result.stopped_at_s is not None:
        text += f" at {result.stopped_at_s:,.0f} s"
    if result.reasons:
        text += ": " + "; ".join(result.reasons)
    return text


def sweep_table(
    results: Sequence[SweepResult],
    columns: Mapping[str, Sequence[str]],
    *,
    picked: str | None,
    marks: Mapping[str, str] | None = None,
    title: str | None = None,
) -> Table:
    """Every candidate, cheapest first; ``columns``: extra leading columns (name → values in
    the order of ``results``); ``marks``: a note after a candidate's status."""
    table = Table(title=title, show_header=True, header_style="bold")
    for name in columns:
        table.add_column(name, justify="left")
    for name in ("$/hour", "TTFT p50 / p99", "TPOT p50 / p99", "attain.", "status"):
        table.add_column(name, justify="left" if name == "status" else "right")
    order = sorted(range(len(results)), key=lambda i: (results[i].usd_per_hour, i))
    for i in order:
        r = results[i]
        share = attainment(r)
        status = f"[{_STYLE[r.status]}]{status_text(r)}[/]" if _STYLE[r.status] else status_text(r)
        if r.name == picked:
            status = "[bold green]← pick[/] " + status
        if marks and r.name in marks:
            status += f" [bold]({marks[r.name]})[/]"
        table.add_row(
            *(values[i] for values in columns.values()),
            f"{r.usd_per_hour:,.2f}",
            _pair(r, "ttft_s"),
            _pair(r, "tpot_s"),
            "—" if share is None else f"{share:.1%}",
            status,
        )
    return table


def result_row(result: SweepResult) -> dict[str, Any]:
    """One candidate's JSON (the wall time aside, a function of the inputs: pruning's
    statuses depend on which runs finished first when jobs > 1)."""
    o = result.overall
    return {
        "name": result.name,
        "status": result.status.value,
        "reasons": list(result.reasons),
        "usd_per_hour": result.usd_per_hour,
        "ttft_s": None if o is None else o["ttft_s"],
        "tpot_s": None if o is None else o["tpot_s"],
        "itl_s": None if o is None else o["itl_s"],
        "attainment": attainment(result),
        "requests": None if o is None else o["requests"],
        "simulated_s": result.simulated_s,
        "stopped_at_s": result.stopped_at_s,
        "finished_requests": result.finished_requests,
        "digest": result.digest,
        "wall_s": round(result.wall_s, 3),
    }


def dump(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n")
