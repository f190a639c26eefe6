"""``gpufleet simulate --sweep FIELD=V1,V2,…``: every combination of fleet-file fields on one
trace, through the machinery of ``plan --simulate`` (``gpufleet.sim.run_sweep``)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from gpufleet.catalog import get_gpu
from gpufleet.cli._sweep_view import SweepBar, dump, result_row, sweep_table
from gpufleet.config import FleetConfig, field_path, parse_fleet, set_field
from gpufleet.sim import (
    FleetSimulation,
    SimOptions,
    SLOTarget,
    SweepCandidate,
    SweepRun,
    SweepStatus,
    TraceSpec,
    cheapest_met,
    run_sweep,
    write_pareto_plot,
)

DEFAULT_ATTAINMENT = 0.99
"""The share of requests within ``--ttft-slo-ms`` and ``--tpot-slo-ms`` a combination needs
to meet the SLO, unless ``--attainment`` says otherwise."""


def parse_sweeps(specs: list[str]) -> list[tuple[str, list[Any]]]:
    """``["models[0].replicas=2,4"]`` → ``[("models[0].replicas", [2, 4])]``; each value
    read as YAML reads it (``2`` a number, ``true`` a boolean, ``h100-sxm`` text)."""
    out: list[tuple[str, list[Any]]] = []
    for spec in specs:
        path, sep, values = spec.partition("=")
        path = path.strip()
        if not sep or not path or not values.strip():
            raise ValueError(f"--sweep expects FIELD=V1,V2,…, got {spec!r}")
        field_path(path)
        if any(path == seen for seen, _ in out):
            raise ValueError(f"--sweep: {path} is swept twice")
        parsed = []
        for text in values.split(","):
            if not text.strip():
                raise ValueError(f"--sweep {spec!r}: an empty value")
            try:
                parsed.append(yaml.safe_load(text.strip()))
            except yaml.YAMLError:
                raise ValueError(f"--sweep {spec!r}: {text.strip()!r} is not a value") from None
        out.append((path, parsed))
    return out


@dataclass(frozen=True, slots=True)
class Combination:
    name: str
    values: dict[str, Any]
    data: dict[str, Any]
    fleet: FleetConfig


def combinations(data: Mapping[str, Any], sweeps: list[tuple[str, list[Any]]]) -> list[Combination]:
    """Every combination of the swept values, validated as a fleet file."""
    out = []
    for values in itertools.product(*(vals for _, vals in sweeps)):
        chosen = {path: value for (path, _), value in zip(sweeps, values, strict=True)}
        name = ", ".join(f"{path}={value}" for path, value in chosen.items())
        combo = dict(data)
        for path, value in chosen.items():
            combo = set_field(combo, path, value)
        out.append(Combination(name, chosen, combo, parse_fleet(combo, source=f"--sweep {name}")))
    return out


def fleet_cost(fleet: FleetConfig) -> tuple[float, bool]:
    """USD per hour at catalog prices, and whether it is exact: an autoscaled pool's is a
    lower bound (its ``min_replicas``)."""
    usd, exact = 0.0, True
    for model in fleet.models:
        count = model.replica_count
        if model.autoscale is not None:
            count, exact = model.autoscale.min_replicas, False
        usd += count * model.tp * get_gpu(model.gpu).price_per_hour_usd
    return round(usd, 4), exact


@dataclass(frozen=True, slots=True)
class SweepSetup:
    fleet: Path
    data: dict[str, Any]
    trace: TraceSpec
    trace_label: str
    options: SimOptions
    requests: int
    span_s: float
    jobs: int
    attainment: float | None
    prune: bool
    out: Path
    plots: bool


def sweep_slo(options: SimOptions, attainment: float | None) -> SLOTarget | None:
    if options.ttft_slo_s is None and options.tpot_slo_s is None:
        if attainment is not None:
            raise ValueError("--attainment needs --ttft-slo-ms or --tpot-slo-ms")
        return None
    return SLOTarget(
        ttft_s=options.ttft_slo_s,
        tpot_s=options.tpot_slo_s,
        attainment=DEFAULT_ATTAINMENT if attainment is None else attainment,
    )


def sweep_fleets(setup: SweepSetup, sweeps: list[tuple[str, list[Any]]], console: Console) -> None:
    """Run every combination, print the table, write sweep.json, pareto.png and the pick."""
    slo = sweep_slo(setup.options, setup.attainment)
    combos = combinations(setup.data, sweeps)
    for combo in combos:  # a combination that cannot be built fails before any runs
        try:
            FleetSimulation(combo.fleet, setup.options)
        except ValueError as error:
            raise ValueError(f"--sweep {combo.name}: {error}") from None
    candidates = []
    for combo in combos:
        usd, exact = fleet_cost(combo.fleet)
        candidates.append(SweepCandidate(combo.name, combo.fleet, usd, exact=exact))
    run = SweepRun(setup.trace, setup.options, slo, setup.requests, setup.span_s, prune=setup.prune)
    setup.out.mkdir(parents=True, exist_ok=True)
    wall = time.perf_counter()
    with SweepBar(console, candidates, setup.span_s) as bar:
        results = run_sweep(candidates, run, jobs=setup.jobs, progress=bar)
    wall = time.perf_counter() - wall
    best = cheapest_met(results)
    console.print(
        sweep_table(
            results,
            {path: [str(c.values[path]) for c in combos] for path, _ in sweeps},
            picked=None if best is None else best.name,
            title=f"{setup.fleet.name} on {setup.trace_label}",
        )
    )
    if slo is not None and best is None:
        console.print("[bold red]no combination met the SLO[/]")
    elif best is not None:
        combo = combos[[c.name for c in combos].index(best.name)]
        path = setup.out / "fleet.yaml"
        path.write_text(
            f"# The cheapest combination that met the SLO: {best.name} "
            f"(gpufleet simulate --sweep on {setup.trace_label}).\n"
            + yaml.safe_dump(combo.data, sort_keys=False)
        )
        console.print(f"pick: [bold]{best.name}[/], written to {path}", highlight=False)
    dump(
        setup.out / "sweep.json",
        {
            "inputs": {
                "fleet": str(setup.fleet),
                "trace": setup.trace_label,
                "seed": setup.options.seed,
                "requests": setup.requests,
                "sweep": dict(sweeps),
                "jobs": setup.jobs,
                "prune": setup.prune,
            },
            "slo": None
            if slo is None
            else {k: getattr(slo, k) for k in SLOTarget.__dataclass_fields__},
            "pick": None if best is None else best.name,
            "combinations": [
                {"values": c.values, **result_row(r)} for c, r in zip(combos, results, strict=True)
            ],
            "wall_s": round(wall, 3),
        },
    )
    if setup.plots:
        write_pareto_plot(
            setup.out / "pareto.png",
            results,
            slo,
            picked=None if best is None else best.name,
            title=f"{setup.fleet.name}: cost against P99 ({setup.trace_label})",
        )
    ran = sum(r.ran for r in results)
    skipped = sum(r.status is SweepStatus.SKIPPED for r in results)
    console.print(
        f"{len(results)} combinations, {ran} simulated to the end, {skipped} skipped; "
        f"{wall:.1f} s wall; wrote {setup.out}/",
        highlight=False,
    )
