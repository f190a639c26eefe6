"""The cost-vs-P99 Pareto plot of a sweep: every candidate that ran to the end, the front of
those no other beats on both cost and P99, the SLO's limits, the pick and a marked one.

matplotlib is imported here only, when the plot is asked for (Agg, no timestamp).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpufleet.sim._sweep import SLOTarget, SweepResult, SweepStatus, pareto_front

_METADATA: dict[str, str | None] = {"Software": None}


def write_pareto_plot(
    path: Path,
    results: Sequence[SweepResult],
    slo: SLOTarget | None,
    *,
    picked: str | None = None,
    marked: tuple[str, str] | None = None,
    title: str = "Cost against P99 latency",
) -> Path:
    """Two panels, TTFT P99 and TPOT P99 against USD per hour; ``marked`` is (name, label)."""
    import matplotlib  # noqa: PLC0415 - slow to import; only when plots are drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    ran = [r for r in results if r.ran]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), layout="constrained")
    panels = (
        ("ttft_s", "TTFT P99", None if slo is None else slo.ttft_p99_s or slo.ttft_s),
        ("tpot_s", "TPOT P99", None if slo is None else slo.tpot_p99_s or slo.tpot_s),
    )
    for ax, (metric, label, limit) in zip(axes, panels, strict=True):
        points = [
            (r.usd_per_hour, value * 1000)
            for r in ran
            if (value := r.quantile(metric, "p99")) is not None
        ]
        named = [r for r in ran if r.quantile(metric, "p99") is not None]
        _scatter(ax, named, points)
        front = pareto_front(points)
        if front:
            ax.step(
                [points[i][0] for i in front],
                [points[i][1] for i in front],
                where="post",
                color="0.45",
                linewidth=1.0,
                label="Pareto front",
                zorder=1,
            )
        for r, (x, y) in zip(named, points, strict=True):
            if r.name == picked:
                ax.scatter([x], [y], s=180, facecolors="none", edgecolors="black", zorder=3)
                ax.annotate("pick", (x, y), textcoords="offset points", xytext=(8, 6))
            if marked is not None and r.name == marked[0]:
                ax.scatter([x], [y], s=120, marker="x", color="tab:purple", zorder=3)
                ax.annotate(marked[1], (x, y), textcoords="offset points", xytext=(8, -12))
        if limit is not None:
            ax.axhline(limit * 1000, color="tab:red", linestyle="--", linewidth=0.9, label="SLO")
        ax.set_yscale("log")
        ax.set_xlabel("USD per hour")
        ax.set_ylabel(f"{label} (ms, log scale)")
        ax.set_title(label)
        ax.grid(True, color="0.92")
        ax.legend(loc="upper right", fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=110, metadata=_METADATA)
    plt.close(fig)
    return path


def _scatter(
    ax: Any, results: Sequence[SweepResult], points: Sequence[tuple[float, float]]
) -> None:
    for status, colour in ((SweepStatus.MET, "tab:green"), (SweepStatus.MISSED, "tab:orange")):
        mine = [p for r, p in zip(results, points, strict=True) if r.status is status]
        if mine:
            ax.scatter(*zip(*mine, strict=True), color=colour, label=status.value, zorder=2)
    other = [
        p
        for r, p in zip(results, points, strict=True)
        if r.status not in (SweepStatus.MET, SweepStatus.MISSED)
    ]
    if other:
        ax.scatter(*zip(*other, strict=True), color="tab:blue", label="ran", zorder=2)
