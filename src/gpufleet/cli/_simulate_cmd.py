"""``gpufleet simulate``: replay a trace against one fleet file (or several, side by side)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from gpufleet.cli._errors import user_errors
from gpufleet.cli._sweep_cmd import SweepSetup, parse_sweeps, sweep_fleets
from gpufleet.config import DEFAULT_FLEET, FleetConfig, load_fleet
from gpufleet.sim import (
    SAMPLE_TRACE,
    ArrivalProcess,
    Fault,
    FleetSimulation,
    SimOptions,
    TraceFormat,
    TraceReader,
    TraceSpec,
    load_faults,
    load_trace,
    parse_batch_job,
    parse_fault,
    parse_tenant,
    write_plots,
)

_console = Console(highlight=False)
_SLICES = 200
"""Progress-bar updates over a run (each a ``run(until)`` slice; results do not change)."""


def _reader(
    trace: Path,
    fmt: str | None,
    *,
    rate_scale: float,
    duration: float | None,
    seed: int,
    arrival_rate: float | None,
    arrival_cv: float,
) -> TraceReader:
    if not trace.exists():
        raise ValueError(f"{trace}: no such trace file")
    arrivals = None if arrival_rate is None else ArrivalProcess(arrival_rate, arrival_cv)
    if fmt == "lengths" and arrivals is None:
        raise ValueError("--format lengths needs --arrival-rate (a length table has no times)")
    try:
        return load_trace(
            trace,
            TraceFormat(fmt) if fmt is not None else None,
            rate_scale=rate_scale,
            duration=duration,
            arrivals=arrivals,
            rng=random.Random(seed),
        )
    except FileNotFoundError:
        raise ValueError(f"{trace}: no such trace file") from None


def _scan(make: Any) -> tuple[int, float]:
    """Requests and last arrival time of the trace (one cheap pass, for the progress bar)."""
    count, last = 0, 0.0
    for request in make():
        count += 1
        last = request.arrival_s
    return count, last


def _print_notes(reader: TraceReader) -> None:
    """What the reader says about how it read the trace (a recording's gaps)."""
    for note in reader.notes:
        _console.print(f"note: {note}", markup=False)


def _run_one(
    fleet: FleetConfig,
    options: SimOptions,
    make: Any,
    *,
    label: str,
    total: tuple[int, float],
    record: Path | None = None,
) -> tuple[FleetSimulation, float]:
    sim = FleetSimulation(fleet, options)
    with contextlib.ExitStack() as files:
        if record is not None:
            sim.control.record(files.enter_context(record.open("w", encoding="utf-8")))
        return _run(sim, make, label=label, total=total)


def _run(
    sim: FleetSimulation, make: Any, *, label: str, total: tuple[int, float]
) -> tuple[FleetSimulation, float]:
    sim.start(make())
    requests, last = total
    wall = time.perf_counter()
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[now]:>9.1f} / {task.total:.1f} simulated s"),
        TextColumn("{task.fields[done]:>8} / " + f"{requests} requests"),
        TimeElapsedColumn(),
        console=_console,
        transient=False,
    ) as progress:
        task = progress.add_task(label, total=max(last, 1e-9), now=0.0, done=0)
        step = max(last, 1e-9) / _SLICES
        for k in range(1, _SLICES + 1):
            sim.run(step * k)
            done = len(sim.harness.recorder.log)
            progress.update(task, completed=step * k, now=sim.now, done=done)
        sim.run()
        progress.update(task, completed=max(last, 1e-9), now=sim.now, done=requests)
    return sim, time.perf_counter() - wall


def _dump(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False, allow_nan=False) + "\n")


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:,.0f}" if value >= 1 else f"{value * 1000:.1f}"


def _adapter_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """One row per pool that serves LoRA adapters: the loads they cost."""
    adapters = report.get("adapters")
    if adapters is None:
        return []
    rows = []
    for pool, a in adapters["pools"].items():
        per = "—" if a["loads_per_1000"] is None else f"{a['loads_per_1000']:,.1f}"
        loads = f"{a['loads']:,} loads for {a['requests']:,} requests ({per} per 1,000)"
        rows.append((f"LoRA adapters ({pool})", f"{loads}, {a['unloads']:,} unloads"))
    return rows


def _rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    o = report["overall"]
    rows = [
        ("requests", f"{o['requests']:,} ({o['rejected']} rejected)"),
        ("simulated", f"{report['simulated_s']:,.1f} s"),
    ]
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        q = o[key]
        rows.append(
            (f"{name} p50 / p90 / p99 (ms)", " / ".join(_ms(q[p]) for p in ("p50", "p90", "p99")))
        )
    t = o["throughput"]
    rows.append(("throughput", f"{t['requests_per_s']} req/s, {t['output_tokens_per_s']:,} tok/s"))
    hit = o["prefix_hit_rate"]
    rows.append(("prefix hit rate", "—" if hit is None else f"{hit:.1%}"))
    rows.append(("preemptions", f"{o['preemptions']:,}"))
    for name, t in report.get("tenants", {}).get("tenants", {}).items():
        q = t["ttft_s"]
        rows.append(
            (
                f"tenant {name}: TTFT p50 / p99 (ms), shed",
                " / ".join(_ms(q[p]) for p in ("p50", "p99"))
                + f", {t['shed'] + t['expired']:,} of {t['requests']:,}",
            )
        )
    for name, served in report.get("served", {}).items():
        split = ", ".join(
            f"{pool} {v['share']:.1%} (weight {v['weight_share']:.0%})"
            for pool, v in served["variants"].items()
            if v["share"] is not None
        )
        rows.append((f"served {name}: split", split or "—"))
    if report.get("fallbacks"):
        rows.append(
            (
                "fallbacks",
                ", ".join(
                    f"{f['from']} → {f['to']} ({f['reason']}) {f['requests']:,}"
                    for f in report["fallbacks"]
                ),
            )
        )
    faults = report["faults"]
    if faults["scenario"]:
        rows.append(
            (
                "failed / retried",
                f"{o['failed']:,} failed ({faults['lost_mid_stream']:,} mid-stream), "
                f"{faults['retries']:,} retries",
            )
        )
        rows.append(
            (
                "resumed streams",
                f"{faults['resumed_streams']:,} "
                f"(+{faults['resume_prefill_tokens']:,} prompt tokens re-prefilled)",
            )
        )
        ejections = faults["ejections"]
        if faults["preemptions"]:
            rows.append(("spot preemptions", f"{faults['preemptions']:,}"))
        if faults["on_demand_stand_ins"]:  # spot.fallback: on_demand, in a shortage
            rows.append(
                (
                    "on-demand stand-ins / back to spot",
                    f"{faults['on_demand_stand_ins']:,} / {faults['moved_to_spot']:,}",
                )
            )
        rows.append(
            (
                "crashes / ejections",
                f"{faults['crashes']} / {ejections['enforced']} "
                f"(+{ejections['not_enforced']} not enforced), "
                f"{faults['downtime_s']:,.0f} s down",
            )
        )
    util = [r["utilisation"] for r in report["replicas"] if r["utilisation"] is not None]
    if util:
        rows.append(
            ("replica utilisation", f"mean {sum(util) / len(util):.0%}, max {max(util):.0%}")
        )
    kv = [r["kv_usage_max"] for r in report["replicas"] if r["kv_usage_max"] is not None]
    if kv:
        rows.append(("KV usage (max sampled)", f"{max(kv):.0%}"))
    if "slo" in o:
        slo = o["slo"]
        rows.append(("SLO attainment", f"{slo['attainment']:.1%}"))
        rows.append(("goodput", f"{slo['goodput_requests_per_s']} req/s"))
    batch = report.get("batch")
    if batch is not None:
        took = "—" if batch["took_s"] is None else f"{batch['took_s'] / 3600:,.2f} h"
        within = "within" if batch["within_window"] else "NOT within"
        rows.append(
            (
                "batch job",
                f"{batch['completed']:,} of {batch['lines']:,} lines in {took} "
                f"({within} {batch['window_s'] / 3600:g} h), {batch['failed']:,} failed",
            )
        )
    rows += _adapter_rows(report)
    cost = report["cost"]
    rows.append(("GPU-hours / cost", f"{cost['gpu_hours']:,.2f} h / ${cost['usd']:,.2f}"))
    split = cost["by_capacity"]
    if "spot" in split:
        od = split.get("on_demand", {"gpu_hours": 0.0, "usd": 0.0})
        rows.append(
            (
                "on-demand / spot",
                f"{od['gpu_hours']:,.2f} h ${od['usd']:,.2f} / "
                f"{split['spot']['gpu_hours']:,.2f} h ${split['spot']['usd']:,.2f}",
            )
        )
    rows.extend(_scaling_rows(report))
    return rows


def _scaling_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """Replicas over the run and, for autoscaled pools, scale events and lags."""
    serving = [
        sum(column)
        for column in zip(
            *(p["serving"] for p in report["timeline"]["phases"].values()), strict=True
        )
    ]
    rows = []
    if serving:
        mean = sum(serving) / len(serving)
        rows.append(
            ("replicas serving min / mean / max", f"{min(serving)} / {mean:.1f} / {max(serving)}")
        )
    scaled = report["autoscale"].values()
    if not scaled:
        return rows
    ups = sum(a["scale_ups"] for a in scaled)
    downs = sum(a["scale_downs"] for a in scaled)
    promoted = sum(a["promoted"] for a in scaled)
    cold = sum(a["cold_starts"] for a in scaled)
    rows.append(("scale ups / downs", f"{ups} / {downs} ({promoted} promoted, {cold} cold)"))
    lag = [a["lag"]["decision_to_serving_s"] for a in scaled]
    over = [a["lag"]["over_target"] for a in scaled]
    rows.append(
        (
            "scale-up lag p50 / max (s)",
            " / ".join(
                _s(max((x[k] for x in lag if x[k] is not None), default=None))
                for k in ("p50", "max")
            ),
        )
    )
    rows.append(
        (
            "over target: episodes, p50 / max (s)",
            f"{sum(o['episodes'] for o in over)}, "
            + " / ".join(
                _s(max((o[k] for o in over if o[k] is not None), default=None))
                for k in ("p50", "max")
            ),
        )
    )
    return rows


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def _table(reports: dict[str, dict[str, Any]]) -> Table:
    table = Table(show_header=True, header_style="bold")
    table.add_column("")
    for name in reports:
        table.add_column(name, justify="right")
    per = [dict(_rows(r)) for r in reports.values()]
    keys = list(dict.fromkeys(key for rows in per for key in rows))  # static fleets lack some
    for key in keys:
        table.add_row(key, *(rows.get(key, "—") for rows in per))
    return table


def _fleet_paths(fleets: list[Path] | None, fleet: Path | None, *, compare: bool) -> list[Path]:
    if compare:
        if fleet is not None or not fleets or len(fleets) < 2:
            raise ValueError("--compare takes two or more fleet files as arguments")
        if len({p.stem for p in fleets}) < len(fleets):
            raise ValueError("--compare: fleet files need distinct names (they name the runs)")
        return list(fleets)
    if fleets:
        raise ValueError("fleet files as arguments need --compare (else use --fleet)")
    return [fleet if fleet is not None else DEFAULT_FLEET]


def _scenario(
    faults: Path | None, fault: list[str] | None, mtbf_hours: float | None
) -> tuple[Fault, ...]:
    """The faults of a run: a scenario file's, then --fault's, then --mtbf-hours'."""
    scenario: list[Fault] = load_faults(faults) if faults is not None else []
    scenario += [parse_fault(spec) for spec in fault or []]
    if mtbf_hours is not None:
        scenario.append(parse_fault({"mtbf": {"hours": mtbf_hours}}))
    return tuple(scenario)


def _sweep(
    sweep: list[str],
    fleet: Path,
    trace_path: Path,
    fmt: str | None,
    rate_scale: float,
    duration: float | None,
    arrival_rate: float | None,
    arrival_cv: float,
    options: SimOptions,
    total: tuple[int, float],
    jobs: int | None,
    attainment: float | None,
    prune: bool,
    out: Path,
    plots: bool,
    one_fleet_only: bool,
) -> None:
    """``--sweep``: every combination of the swept fields (cli/_sweep_cmd.py)."""
    if one_fleet_only:
        raise ValueError("--sweep varies one fleet file: not with --compare or --record")
    trace = TraceSpec(
        trace_path,
        TraceFormat(fmt) if fmt is not None else None,
        rate_scale=rate_scale,
        duration=duration,
        arrivals=None if arrival_rate is None else ArrivalProcess(arrival_rate, arrival_cv),
        seed=options.seed,
    )
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}")
    for name, value in (
        ("--ttft-slo-ms", options.ttft_slo_s),
        ("--tpot-slo-ms", options.tpot_slo_s),
    ):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value * 1000:g}")
    setup = SweepSetup(
        fleet=fleet,
        data=yaml.safe_load(fleet.read_text()),
        trace=trace,
        trace_label=str(trace.path),
        options=options,
        requests=total[0],
        span_s=total[1],
        jobs=jobs if jobs is not None else os.cpu_count() or 1,
        attainment=attainment,
        prune=prune,
        out=out,
        plots=plots,
    )
    console = Console(highlight=False)
    if not console.is_terminal:  # piped or captured: wide enough for the table
        console.width = max(console.width, 160)
    sweep_fleets(setup, parse_sweeps(sweep), console)


def simulate(
    fleets: Annotated[
        list[Path] | None,
        typer.Argument(help="With --compare: the fleet files to compare.", show_default=False),
    ] = None,
    fleet: Annotated[
        Path | None, typer.Option(help="Fleet file (default: the packaged default fleet).")
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            help="Request trace to replay (default: the packaged Azure 2023 conversation hour)."
        ),
    ] = None,
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            help="azure, mooncake, burstgpt, jsonl, lengths or recording (detected).",
        ),
    ] = None,
    rate_scale: Annotated[float, typer.Option(help="Replay this many times faster.")] = 1.0,
    duration: Annotated[
        float | None, typer.Option(help="Only requests arriving in the first S (scaled) s.")
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Seed of every draw (default: the fleet's gateway.seed).")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Directory for report.json and plots.")] = None,
    compare: Annotated[
        bool, typer.Option("--compare", help="Run every FLEETS file on the same trace and seed.")
    ] = False,
    ttft_slo_ms: Annotated[float | None, typer.Option(help="TTFT SLO per request (ms).")] = None,
    tpot_slo_ms: Annotated[
        float | None, typer.Option(help="Time-per-output-token SLO per request (ms).")
    ] = None,
    arrival_rate: Annotated[
        float | None, typer.Option(help="Draw arrivals at this rate (req/s) instead.")
    ] = None,
    arrival_cv: Annotated[float, typer.Option(help="Gap CV of drawn arrivals (1: Poisson).")] = (
        1.0
    ),
    sample_every: Annotated[float, typer.Option(help="Seconds between samples.")] = 10.0,
    plots: Annotated[bool, typer.Option(help="Draw PNG plots.")] = True,
    fault: Annotated[
        list[str] | None,
        typer.Option(help="A fault, e.g. crash:replica=llama-3.1-8b-2,at=300 (repeatable)."),
    ] = None,
    faults: Annotated[
        Path | None, typer.Option(help="A scenario file: `faults:` and a list of faults.")
    ] = None,
    mtbf_hours: Annotated[
        float | None,
        typer.Option(help="Crash replicas at random, MTBF per GPU in simulated hours."),
    ] = None,
    tenant: Annotated[
        list[str] | None,
        typer.Option(
            help="A tenant: NAME[:share=S,weight=W,priority=P]; untagged requests are drawn "
            "by share (repeatable)."
        ),
    ] = None,
    batch: Annotated[
        str | None,
        typer.Option(
            help="A batch job: LINES|FILE[:at=S,model=NAME,window=S], its lines submitted at "
            "`at` to served model NAME in the batch class (sizes from the packaged table, or "
            "an OpenAI batch input FILE's lines, sized by their text and max_tokens).",
            rich_help_panel="Batch",
        ),
    ] = None,
    admission: Annotated[
        bool | None,
        typer.Option(
            "--admission/--no-admission",
            help="The gateway's admission queue (default: on with the fleet's tenants.auth).",
        ),
    ] = None,
    record: Annotated[
        bool,
        typer.Option(
            "--record",
            help="Write the pool controller's events and decisions to recording.jsonl "
            "(gpufleet replay reads it).",
        ),
    ] = False,
    sweep: Annotated[
        list[str] | None,
        typer.Option(
            help="FIELD=V1,V2,…: simulate every combination of fleet-file fields "
            "(repeatable; e.g. models[0].replicas=2,4,8).",
            rich_help_panel="Sweep",
        ),
    ] = None,
    jobs: Annotated[
        int | None,
        typer.Option(
            help="Processes of a sweep (default: the CPU count).", rich_help_panel="Sweep"
        ),
    ] = None,
    attainment: Annotated[
        float | None,
        typer.Option(
            help="A sweep's least share of requests within the SLOs (default: 0.99).",
            rich_help_panel="Sweep",
        ),
    ] = None,
    prune: Annotated[
        bool,
        typer.Option(
            help="Stop a sweep's combinations early (exact rules).", rich_help_panel="Sweep"
        ),
    ] = True,
) -> None:
    """Replay a trace against a modelled fleet: latencies, throughput, KV usage, cost.

    Example: gpufleet simulate --fleet examples/azure-conv-8x-h100.yaml
    --trace AzureLLMInferenceTrace_conv.csv --out runs/azure
    """
    with user_errors():
        if trace is None:  # a first run needs nothing beside the package
            trace = SAMPLE_TRACE
            typer.echo("no --trace: replaying the packaged Azure 2023 conversation hour", err=True)
        if out is None:
            raise ValueError("--out is required")
        paths = _fleet_paths(fleets, fleet, compare=compare)
        configs = {path: load_fleet(path) for path in paths}
        for name, value in (("--rate-scale", rate_scale), ("--sample-every", sample_every)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        run_seed = seed if seed is not None else next(iter(configs.values())).gateway.seed
        options = SimOptions(
            tenants=tuple(parse_tenant(spec) for spec in tenant or []),
            batch=None if batch is None else parse_batch_job(batch),
            admission=admission,
            faults=_scenario(faults, fault, mtbf_hours),
            seed=run_seed,
            sample_interval=sample_every,
            ttft_slo_s=None if ttft_slo_ms is None else ttft_slo_ms / 1000,
            tpot_slo_s=None if tpot_slo_ms is None else tpot_slo_ms / 1000,
        )

        def make() -> TraceReader:
            return _reader(
                trace,
                fmt,
                rate_scale=rate_scale,
                duration=duration,
                seed=run_seed,
                arrival_rate=arrival_rate,
                arrival_cv=arrival_cv,
            )

        first = make()
        total = _scan(lambda: first)
        if total[0] == 0:
            raise ValueError(f"{trace}: no requests to replay")
        if sweep:
            _sweep(
                sweep, paths[0], trace, fmt, rate_scale, duration, arrival_rate, arrival_cv,
                options, total, jobs, attainment, prune, out, plots, compare or record,
            )  # fmt: skip
            return
        out.mkdir(parents=True, exist_ok=True)
        # Checked up front: a bad fleet entry fails before minutes of simulation.
        for config in configs.values():
            FleetSimulation(config, options)
    inputs = {
        "trace": str(trace),
        "format": first.format.value,
        "rate_scale": rate_scale,
        "duration": duration,
        "arrival_rate": arrival_rate,
        "arrival_cv": arrival_cv if arrival_rate is not None else None,
        "seed": run_seed,
        "requests": total[0],
        "skipped": first.skipped,
        "estimated_outputs": first.estimated,
    }
    _print_notes(first)
    reports: dict[str, dict[str, Any]] = {}
    speeds: dict[str, Any] = {}
    for path, config in configs.items():
        where = out / path.stem if compare else out
        where.mkdir(parents=True, exist_ok=True)
        recording = where / "recording.jsonl" if record else None
        sim, wall = _run_one(config, options, make, label=path.stem, total=total, record=recording)
        problems = sim.check()
        if problems:
            raise RuntimeError(
                f"{path.stem}: global check failed: {'; '.join(problems)}; rerun with "
                f"gpufleet simulate --fleet {path} --trace {trace} --seed {run_seed} (+ faults)"
            )
        shown = "(packaged default)" if path == DEFAULT_FLEET else str(path)
        report = sim.report({**inputs, "fleet": shown})
        _dump(where / "report.json", report)
        speeds[path.stem] = {
            "wall_s": round(wall, 3),
            "simulated_s_per_wall_s": round(sim.now / wall, 1) if wall > 0 else None,
            "events": sim.events,
            "events_per_s": round(sim.events / wall) if wall > 0 else None,
        }
        _dump(where / "run.json", speeds[path.stem])
        if plots:
            write_plots(where, report, sim.latencies())
        reports[path.stem] = report
    if compare:
        _dump(
            out / "compare.json",
            {
                "inputs": inputs,
                "fleets": {
                    name: {k: r[k] for k in ("fleet", "simulated_s", "overall", "cost")}
                    for name, r in reports.items()
                },
            },
        )
    _console.print(_table(reports))
    for name, speed in speeds.items():
        _console.print(
            f"{name}: {speed['wall_s']:.1f} s wall, {speed['simulated_s_per_wall_s']} simulated "
            f"s per wall s, {speed['events']:,} events ({speed['events_per_s']:,}/s)"
        )
    _console.print(f"wrote {out}/" + ("compare.json and one folder per fleet" if compare else ""))
