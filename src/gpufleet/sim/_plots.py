"""PNG plots of a simulation report: latency CDFs, load over time, a KV-usage heat map.

Everything is drawn from the report (``report.json``) and the sorted latencies, with the
Agg backend and no timestamp in the files' metadata, so equal inputs draw equal pictures.
matplotlib is imported here only, when plots are asked for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PLOTS = ("latency_cdf.png", "load.png", "kv_heatmap.png", "replicas.png")
"""Always drawn; a run with a rollout adds ``rollout.png`` (one per served name if several)."""
_METADATA: dict[str, str | None] = {"Software": None}


def write_plots(
    out: Path, report: Mapping[str, Any], latencies: Mapping[str, Mapping[str, Sequence[float]]]
) -> list[Path]:
    """Draw the plots into ``out``; ``latencies[model]["ttft"|"e2e"]`` sorted seconds."""
    import matplotlib  # noqa: PLC0415 - slow to import; only when plots are drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    paths = [out / name for name in PLOTS]
    _latency_cdfs(plt, paths[0], latencies)
    _load(plt, paths[1], report["timeline"])
    _kv_heatmap(plt, paths[2], report["timeline"])
    _replicas(plt, paths[3], report["timeline"])
    for name, rollout in (report.get("rollouts") or {}).items():
        path = out / ("rollout.png" if len(report["rollouts"]) == 1 else f"rollout-{name}.png")
        _rollout(plt, path, name, rollout)
        paths.append(path)
    return paths


def _latency_cdfs(
    plt: Any, path: Path, latencies: Mapping[str, Mapping[str, Sequence[float]]]
) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    for ax, key, title in zip(
        axes, ("ttft", "e2e"), ("Time to first token", "End to end"), strict=True
    ):
        for model, values in latencies.items():
            series = values[key]
            if not series:
                continue
            n = len(series)
            ax.plot(series, [(i + 1) / n for i in range(n)], label=model, linewidth=1.4)
        ax.set_xscale("log")
        ax.set_xlabel("seconds (log scale)")
        ax.set_ylabel("share of requests")
        ax.set_ylim(0, 1.01)
        ax.set_title(title)
        for q in (0.5, 0.9, 0.99):
            ax.axhline(q, color="0.8", linewidth=0.7, zorder=0)
        ax.grid(True, which="major", axis="x", color="0.9")
        ax.legend(loc="lower right", fontsize="small")
    fig.suptitle("Latency CDFs")
    fig.savefig(path, dpi=110, metadata=_METADATA)
    plt.close(fig)


def _load(plt: Any, path: Path, timeline: Mapping[str, Any]) -> None:
    t = timeline["t"]
    interval = timeline["interval_s"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True, layout="constrained")
    top.plot(t, [a / interval for a in timeline["arrivals"]], label="arrivals / s", color="C0")
    top.set_ylabel("requests / s")
    twin = top.twinx()
    twin.plot(t, timeline["in_flight"], label="in flight", color="C1", linewidth=1.0)
    twin.set_ylabel("requests in flight")
    top.legend(handles=[*top.get_lines(), *twin.get_lines()], loc="upper left", fontsize="small")
    top.set_title("Load")
    busy = timeline["busy"]
    if busy and t:
        mean_busy = [_mean(col) for col in zip(*busy.values(), strict=True)]
        bottom.plot(t, mean_busy, label="mean replica utilisation", color="C2")
    bottom.set_ylabel("utilisation")
    bottom.set_ylim(0, 1.05)
    twin2 = bottom.twinx()
    twin2.step(t, timeline["replicas"], where="post", label="replicas", color="C3")
    twin2.set_ylabel("replicas")
    twin2.set_ylim(0, max(timeline["replicas"], default=1) * 1.25 + 0.5)
    bottom.legend(
        handles=[*bottom.get_lines(), *twin2.get_lines()], loc="upper left", fontsize="small"
    )
    bottom.set_xlabel("simulated seconds")
    bottom.set_title("Replicas and utilisation")
    fig.savefig(path, dpi=110, metadata=_METADATA)
    plt.close(fig)


def _rollout(plt: Any, path: Path, name: str, rollout: Mapping[str, Any]) -> None:
    """Each variant's weight (a step at each decision) over its TTFT P99 per half step, the
    decisions marked with their verdicts."""
    decisions = rollout["decisions"]
    series = rollout["series"]
    pools = list(series["ttft_p99"])
    end = max(series["t"][-1] if series["t"] else 0.0, decisions[-1]["at"]) * 1.05 + 1
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True, layout="constrained")
    for i, pool in enumerate(pools):
        times = [d["at"] for d in decisions] + [end]
        weights = [d["weights"][pool] for d in decisions]
        weights.append(weights[-1])
        top.step(times, weights, where="post", label=pool, color=f"C{i}", linewidth=1.6)
        bottom.plot(
            series["t"],
            series["ttft_p99"][pool],
            "o-",
            label=pool,
            color=f"C{i}",
            markersize=3,
            linewidth=1.0,
        )
    for d in decisions:
        for ax in (top, bottom):
            ax.axvline(d["at"], color="0.75", linewidth=0.7, zorder=0)
        top.annotate(
            d["verdict"], (d["at"], 102), fontsize="x-small", rotation=90, va="bottom", ha="right"
        )
    top.set_ylabel("weight (%)")
    top.set_ylim(0, 125)
    top.legend(loc="center right", fontsize="small")
    top.set_title(f"{name}: {rollout['strategy']} to {rollout['to']} ({rollout['phase']})")
    bottom.set_ylabel("TTFT P99 (s)")
    bottom.set_xlabel("simulated seconds")
    bottom.legend(loc="upper right", fontsize="small")
    fig.savefig(path, dpi=110, metadata=_METADATA)
    plt.close(fig)


def _kv_heatmap(plt: Any, path: Path, timeline: Mapping[str, Any]) -> None:
    t, interval = timeline["t"], timeline["interval_s"]
    kv = timeline["kv_usage"]
    names = list(kv)
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.32 * max(len(names), 2)), layout="constrained")
    if names and t:
        end = t[-1] + interval
        peak = max((v for row in kv.values() for v in row if v is not None), default=0.0)
        top = 1.0 if peak > 0.5 else max(0.05, math.ceil(peak * 20) / 20)  # readable when low
        image = ax.imshow(
            [[math.nan if v is None else v for v in kv[name]] for name in names],
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
            vmin=0.0,
            vmax=top,
            extent=(t[0], end, len(names) - 0.5, -0.5),
        )
        label = "KV-cache usage" if top == 1.0 else f"KV-cache usage (scale to {top:.0%})"
        fig.colorbar(image, ax=ax, label=label, pad=0.01)
    ax.set_yticks(range(len(names)), names, fontsize="small")
    ax.set_xlabel("simulated seconds")
    ax.set_title("KV-cache usage per replica")
    fig.savefig(path, dpi=110, metadata=_METADATA)
    plt.close(fig)


def _replicas(plt: Any, path: Path, timeline: Mapping[str, Any]) -> None:
    """Replicas over time per model, stacked by phase, over the arrival rate; GPUs charged."""
    t, interval = timeline["t"], timeline["interval_s"]
    phases: Mapping[str, Mapping[str, Sequence[int]]] = timeline["phases"]
    fig, axes = plt.subplots(
        len(phases) + 1, 1, figsize=(11, 2.6 * (len(phases) + 1)), sharex=True, layout="constrained"
    )
    colors = {"serving": "C2", "starting": "C1", "standby": "C0", "draining": "C7"}
    for ax, (model, series) in zip(axes, phases.items(), strict=False):
        if t:
            ax.stackplot(
                t,
                *(series[k] for k in colors),
                labels=list(colors),
                colors=list(colors.values()),
                step="post",
                alpha=0.85,
            )
        ax.set_ylabel("replicas")
        ax.set_title(f"{model}: replicas by phase")
        ax.legend(loc="upper left", fontsize="small")
        twin = ax.twinx()
        twin.plot(t, [a / interval for a in timeline["arrivals"]], color="k", linewidth=0.6)
        twin.set_ylabel("arrivals / s (all models)")
    last = axes[-1]
    last.step(t, timeline["gpus"], where="post", color="C3")
    last.set_ylabel("GPUs charged")
    last.set_xlabel("simulated seconds")
    last.set_title("GPUs charged (provisioned, whatever the phase)")
    fig.savefig(path, dpi=110, metadata=_METADATA)
    plt.close(fig)


def _mean(values: Sequence[float | None]) -> float:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else math.nan
