"""A fleet file on a trace: replicas from the catalog, the fleet's routers, samples, a report.

    sim = FleetSimulation(load_fleet("examples/azure-conv-8x-h100.yaml"), SimOptions(seed=0))
    sim.start(load_trace("AzureLLMInferenceTrace_conv.csv"))
    sim.run(until=600.0)          # slices, for a progress bar
    sim.run()                     # the rest: every request finishes
    report = sim.report()         # a plain dict: report.json (docs/simulator.md)

Everything in the report is a function of the inputs and the seed: no wall-clock time, and
floats rounded to a fixed number of digits, so equal inputs give byte-identical JSON.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from random import Random
from typing import Any, Final

from gpufleet.catalog import CatalogError, get_gpu, get_model
from gpufleet.config import Capacity, EngineKind, FleetConfig, ModelConfig
from gpufleet.control import FleetController
from gpufleet.engine.model import ReplicaConfig, ReplicaModel, prefill_seconds_per_token
from gpufleet.fleet import LORA_SETTINGS, ReplicaId, ReplicaState
from gpufleet.sim._admission import SimTenant, TenantBook, TenantMix
from gpufleet.sim._autoscale import Autoscaling
from gpufleet.sim._batch_job import BATCH_JOB, BatchJob, batch_report
from gpufleet.sim._control import SimControl
from gpufleet.sim._faults import FLEET_WIDE, Fault, FaultInjector, fault_spec
from gpufleet.sim._harness import FleetHarness
from gpufleet.sim._prompts import PromptBuilder
from gpufleet.sim._recorder import RequestRecord
from gpufleet.sim._stats import LogHistogram
from gpufleet.sim._traces import TraceRequest

QUANTILES: Final = (0.5, 0.9, 0.99)

_PACING: Final = frozenset({"--time-scale"})
"""Sim engine flags that pace real time: virtual time has nothing to pace (ignored here)."""
_SWITCHES: Final = frozenset({"--enable-sleep-mode"})
"""Engine flags without a value that the simulator models elsewhere (residency: its sleep
and wake times come from the performance model)."""


@dataclass(frozen=True, slots=True)
class SimOptions:
    """How to run: the seed, the sampling period and the SLOs (None: not judged)."""

    seed: int = 0
    sample_interval: float = 10.0
    """Simulated seconds between two samples of every replica (KV usage, load)."""
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    fast_forward: bool = True
    faults: tuple[Fault, ...] = ()
    """The scenario: crashes, MTBF, slow replicas, metric blackouts (``gpufleet.sim._faults``)."""
    autoscale_interval: float = 1.0
    """Simulated seconds between two decisions of each autoscaled pool (and at every
    decision's ``next_at``)."""
    admission: bool | None = None
    """The gateway's admission queue (``FairQueue``) in front of routing; None: on when the
    fleet file's ``tenants.auth`` is (the gateway queues only with auth on)."""
    tenants: tuple[SimTenant, ...] = ()
    """Tenants' weights and classes (live: the store's), and their shares of the trace's
    requests that name no tenant. With none, untagged requests are ``anonymous``."""
    batch: BatchJob | None = None
    """A batch job submitted during the run (its lines join the trace at ``batch.at``, in
    the ``batch`` class, for tenant ``batch-job``; ``gpufleet.sim._batch_job``)."""


def replica_config(model: ModelConfig, seed: int) -> ReplicaConfig:
    """The replica model a fleet file's entry describes: its profile (engine flags, ``args``
    included, and the engine seed of the run's ``seed``) on its catalog model and GPU."""
    try:
        spec, gpu = get_model(model.served_model), get_gpu(model.gpu)
    except CatalogError as error:
        raise ValueError(f"model {model.name!r}: {error}") from None
    profile = model.profile(seed)
    extra = list(profile.extra)
    while extra:  # what a live engine takes beyond the profile: only pacing means nothing here
        flag, eq, _ = extra.pop(0).partition("=")
        if flag in _SWITCHES:
            continue
        if flag not in _PACING:
            raise ValueError(f"model {model.name!r}: args: {flag} is not modelled by simulate")
        if not eq and extra:
            extra.pop(0)
    # adapters are the controller's and SimAdapters' (a pool's `lora`), not the replica model's
    settings = {k: v for k, v in profile.settings().items() if k not in LORA_SETTINGS}
    return ReplicaConfig(spec, gpu, **settings)


def prefill_speeds(fleet: FleetConfig, seed: int) -> dict[str, float]:
    """Per pool, the performance model's seconds per prompt token of a prefill on one of
    its replicas (the replica model above): what the controller places a request with a
    latency budget by, in ``gpufleet up`` and here alike. A pool the model cannot price (an
    external one, a model or flag it does not know) gets none, and no budget picks it."""
    speeds: dict[str, float] = {}
    for model in fleet.models:
        if model.engine is EngineKind.EXTERNAL:
            continue
        try:
            speeds[model.name] = prefill_seconds_per_token(replica_config(model, seed))
        except ValueError:
            continue
    return speeds


@dataclass(slots=True)
class Timeline:
    """Samples every ``interval`` simulated seconds, one row per sample."""

    interval: float
    t: list[float] = field(default_factory=list)
    arrivals: list[int] = field(default_factory=list)
    """Requests that arrived since the previous sample."""
    in_flight: list[int] = field(default_factory=list)
    replicas: list[int] = field(default_factory=list)
    """Replicas up: in the fleet (not drained away) and not crashed."""
    kv_usage: list[list[float | None]] = field(default_factory=list)
    """Per sample, per replica (driver order; ``None`` while a replica is not in the fleet)."""
    busy: list[list[float | None]] = field(default_factory=list)
    """Per sample, per replica: share of the interval before it spent in steps."""
    gpus: list[int] = field(default_factory=list)
    """GPUs charged: every replica provisioned and not yet gone, whatever its phase."""
    phases: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    """Per model, replicas serving / starting / standby / draining at each sample."""


class FleetSimulation:
    """One fleet file, one trace, one seed."""

    def __init__(self, fleet: FleetConfig, options: SimOptions = SimOptions()) -> None:
        job = options.batch
        if job is not None:
            names = [entry.name for entry in fleet.served_names()]
            if job.model is not None and job.model not in names:
                served = ", ".join(names)
                raise ValueError(f"batch job: no served model {job.model!r} (served: {served})")
            if all(t.name != BATCH_JOB for t in options.tenants):
                options = replace(options, tenants=(*options.tenants, job.tenant))
        self.fleet = fleet
        self.options = options
        models: list[ReplicaModel] = []
        counts: list[int] = []
        configs: list[ReplicaConfig] = []
        gpus: list[int] = []
        self._configs = {}
        admitting = fleet.tenants.auth if options.admission is None else options.admission
        control = FleetController.of(
            fleet,
            seed=options.seed,
            admission=admitting,
            autoscale_interval=options.autoscale_interval,
            prefill_s=prefill_speeds(fleet, options.seed),  # as `gpufleet up` gives them
        )
        for entry in fleet.models:
            config = replica_config(entry, options.seed)
            if control.pools[entry.name].settings.kv_events:  # its engines publish KV events
                config = replace(config, kv_events=True)
            self._configs[entry.name] = config
            count = entry.replica_count
            counts.append(count)
            models.extend(ReplicaModel(config) for _ in range(count))
            configs.extend([config] * count)
            gpus.extend([entry.tp] * count)
        self._replica_configs = configs
        self.tenants: TenantBook | None = None
        """Who sent each request (None: no tenants asked for and admission off)."""
        if admitting or options.tenants:
            self.tenants = TenantBook(TenantMix(options.tenants, options.seed))
        self.control = control
        self.routing = SimControl(
            self.control,
            counts,
            scrape_interval=fleet.gateway.scrape_interval,
            tenant_of=None if self.tenants is None else self.tenants.of,
            deadlines={} if job is None else {BATCH_JOB: job.deadline},
            whole=frozenset() if job is None else frozenset({BATCH_JOB}),
            on_refuse=None if self.tenants is None else self.tenants.refused,
            block_sizes={name: c.block_size for name, c in self._configs.items()},
        )
        vocab = min(m.config.model.vocab_size for m in models)  # ids valid for every model
        self.harness = FleetHarness(
            models,
            PromptBuilder(vocab, options.seed),
            # A queued request starts the instant another ends, on any replica: no replica
            # may run ahead of the fleet while admission is on (sim/_admission.py), or
            # while a batch gate holds a batch tenant's requests (docs/batch.md). Deferred
            # runs still hold: they apply nothing ahead of the instant someone looks.
            fast_forward=options.fast_forward,
            run_ahead=not admitting and not gated(fleet, options),
        )
        self.admitting = admitting
        known = set(self.replica_ids)
        for fault in options.faults:
            if not isinstance(fault, FLEET_WIDE) and fault.replica not in known:
                raise ValueError(
                    f"fault {fault.kind}: no replica {fault.replica!r} "
                    f"(replicas: {', '.join(self.replica_ids)})"
                )
        self.faults = FaultInjector(
            self.harness,
            self.routing,
            fresh=lambda i: ReplicaModel(configs[i]),
            gpus=gpus,
            rng=Random(f"gpufleet-faults-{options.seed}"),
            pools=[m.name for m, n in zip(fleet.models, counts, strict=True) for _ in range(n)],
            spot_pools=frozenset(m.name for m in fleet.models if m.spot_settings is not None),
        )
        self.replica_models = [
            m.name for m, n in zip(fleet.models, counts, strict=True) for _ in range(n)
        ]
        self.timeline = Timeline(options.sample_interval)
        self.timeline.phases = {
            m.name: {k: [] for k in ("serving", "starting", "standby", "draining")}
            for m in fleet.models
        }
        self._arrived_at_sample = 0
        self._busy_at_sample = [0.0] * len(models)
        self.autoscaling = Autoscaling(
            fleet.models,
            self.harness,
            self.routing,
            new_driver=self._new_driver,
            interval=options.autoscale_interval,
        )
        self.faults.billing = self.autoscaling

    def _new_driver(self, model: str, on_demand: bool = False) -> int:
        """A replica of ``model`` joins (an autoscaler's scale-out): its driver index."""
        config = self._configs[model]
        k = self.harness.add_replica(ReplicaModel(config))
        self._replica_configs.append(config)
        self.replica_models.append(model)
        self._busy_at_sample.append(0.0)
        entry = self.fleet.model(model)
        assert entry is not None
        self.faults.replica_added(self.now, k, entry.tp, model, on_demand)
        return k

    @property
    def replica_ids(self) -> list[ReplicaId]:
        """Every replica's name, in driver order (those that joined later too)."""
        return self.routing.replica_ids

    @property
    def now(self) -> float:
        return self.harness.kernel.now

    @property
    def events(self) -> int:
        return self.harness.kernel.events_processed

    def start(self, trace: Iterable[TraceRequest]) -> None:
        job = self.options.batch
        if job is not None:
            order = self.fleet.gateway.batch.order  # a batch file's lines, as live
            trace = job.merged(list(trace), self.options.seed, order)
        self.harness.start(trace)
        self.routing.attach(self.harness)
        self.harness.every(self.options.sample_interval, self._sample)
        self.faults.start(self.options.faults)

    @property
    def arrived(self) -> int:
        """Requests that reached the gateway so far (routed, or held by admission); one
        that fell back counts once (the pools count it in each)."""
        return self.routing.arrivals

    def check(self) -> list[str]:
        """The global checks of a finished run: every request that arrived ended exactly
        once, in a response or an error. Violations, as sentences (none: an empty list)."""
        arrived = self.arrived
        seen = bytearray(arrived)
        problems: list[str] = []
        for record in self.harness.recorder.log:
            i = record.index
            if not 0 <= i < arrived:
                problems.append(f"request {i} ended but never arrived")
            elif seen[i]:
                problems.append(f"request {i} ended twice")
            else:
                seen[i] = 1
        missing = arrived - sum(seen)
        if missing:
            problems.append(f"{missing} requests arrived and never ended")
        if self.harness.live:
            problems.append(f"{self.harness.live} requests still in flight")
        return problems[:20]

    def run(self, until: float | None = None) -> None:
        self.harness.run(until)

    def _sample(self, now: float) -> None:
        timeline, drivers = self.timeline, self.harness.drivers
        timeline.t.append(now)
        delivered = self.arrived
        timeline.arrivals.append(delivered - self._arrived_at_sample)
        self._arrived_at_sample = delivered
        timeline.in_flight.append(self.harness.live)
        routing = self.routing
        here = [routing.state(k) is not ReplicaState.STOPPED for k in range(len(drivers))]
        timeline.replicas.append(
            sum(1 for d, h in zip(drivers, here, strict=True) if h and not d.down)
        )
        timeline.kv_usage.append(
            [
                min(1.0, d.model.stats().kv_cache_usage) if h else None
                for d, h in zip(drivers, here, strict=True)
            ]
        )
        span = timeline.interval if len(timeline.t) > 1 else 0.0
        busy = [d.busy_s for d in drivers]
        timeline.busy.append(
            [
                (min(1.0, (b - a) / span) if span else 0.0) if h else None
                for a, b, h in zip(self._busy_at_sample, busy, here, strict=True)
            ]
        )
        self._busy_at_sample = busy
        scaling = self.autoscaling
        timeline.gpus.append(scaling.charged_gpus())
        for model, series in timeline.phases.items():
            for key, count in scaling.counts(model).items():
                series[key].append(count)

    # -- the report -----------------------------------------------------------------------

    def report(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Everything measured, as plain JSON values (see docs/simulator.md)."""
        return build_report(self, inputs)

    def latencies(self) -> dict[str, dict[str, list[float]]]:
        """Per model, the sorted TTFT and end-to-end latencies of the requests served."""
        models = self.replica_models
        out: dict[str, dict[str, list[float]]] = {
            m.name: {"ttft": [], "e2e": []} for m in self.fleet.models
        }
        for record in self.harness.recorder.log:
            if record.ttft_s is not None and not record.failed:
                mine = out[models[record.replica]]
                mine["ttft"].append(record.ttft_s)
                mine["e2e"].append(record.e2e_s)
        for values in out.values():
            values["ttft"].sort()
            values["e2e"].sort()
        return out


def _q(values: Sequence[float]) -> dict[str, float | None]:
    """Lower-rank quantiles of sorted ``values`` (the value at rank ⌊q·(n-1)⌋), and the mean."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    n = len(values)
    out: dict[str, float | None] = {
        f"p{round(q * 100)}": _r(values[math.floor(q * (n - 1))]) for q in QUANTILES
    }
    out["mean"] = _r(math.fsum(values) / n)
    return out


def _hq(hist: LogHistogram) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{round(q * 100)}": _r(hist.quantile(q)) for q in QUANTILES}
    out["mean"] = _r(hist.mean)
    return out


def _r(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


@dataclass(slots=True)
class _Group:
    """One model's (or the whole fleet's) requests."""

    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    requests: int = 0
    rejected: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    good: int = 0
    failed: int = 0

    def add(self, r: RequestRecord, ttft_slo: float | None, tpot_slo: float | None) -> None:
        self.requests += 1
        if r.rejected:
            self.rejected += 1
            return
        if r.failed:
            self.failed += 1
            return
        ttft, tpot = r.ttft_s, r.tpot_s
        assert ttft is not None
        self.ttft.append(ttft)
        self.e2e.append(r.e2e_s)
        if tpot is not None:
            self.tpot.append(tpot)
        self.input_tokens += r.input_tokens
        self.output_tokens += r.output_tokens
        self.cached_tokens += r.cached_tokens
        if (ttft_slo is None or ttft <= ttft_slo) and (
            tpot_slo is None or tpot is None or tpot <= tpot_slo
        ):
            self.good += 1


def build_report(sim: FleetSimulation, inputs: dict[str, Any]) -> dict[str, Any]:
    options = sim.options
    drivers = sim.harness.drivers
    models = sim.replica_models
    groups: dict[str, _Group] = {m.name: _Group() for m in sim.fleet.models}
    overall = _Group()
    served = [0] * len(drivers)
    makespan = 0.0
    """From 0 to the last request's end: what the fleet ran (and is paid) for."""
    refused_pool = sim.routing.refused_pool
    for record in sim.harness.recorder.log:
        makespan = max(makespan, record.finish_s)
        if record.replica < 0:  # failed before reaching any replica
            model = refused_pool[record.index]
        else:
            model = models[record.replica]
            served[record.replica] += 0 if record.failed else 1
        groups[model].add(record, options.ttft_slo_s, options.tpot_slo_s)
        overall.add(record, options.ttft_slo_s, options.tpot_slo_s)
    recorder = sim.harness.recorder
    itl: dict[str, LogHistogram] = {name: LogHistogram() for name in groups}
    for i, model in enumerate(models):
        itl[model].merge(recorder.replica_itl(i))
    stats = [d.model.stats() for d in drivers]
    preempted = [
        s.num_preemptions + d.retired_preemptions for s, d in zip(stats, drivers, strict=True)
    ]
    preemptions: dict[str, int] = dict.fromkeys(groups, 0)
    for model, count in zip(models, preempted, strict=True):
        preemptions[model] += count

    def metrics(group: _Group, hist: LogHistogram, preempted: int) -> dict[str, Any]:
        for values in (group.ttft, group.e2e, group.tpot):
            values.sort()
        span = makespan if makespan > 0 else math.nan
        out: dict[str, Any] = {
            "requests": group.requests,
            "rejected": group.rejected,
            "failed": group.failed,
            "ttft_s": _q(group.ttft),
            "itl_s": _hq(hist),
            "tpot_s": _q(group.tpot),
            "e2e_s": _q(group.e2e),
            "throughput": {
                "requests_per_s": _r(
                    _finite(group.requests - group.rejected - group.failed, span), 4
                ),
                "input_tokens_per_s": _r(_finite(group.input_tokens, span), 2),
                "output_tokens_per_s": _r(_finite(group.output_tokens, span), 2),
            },
            "prefix_hit_rate": _r(group.cached_tokens / group.input_tokens, 4)
            if group.input_tokens
            else None,
            "preemptions": preempted,
        }
        if options.ttft_slo_s is not None or options.tpot_slo_s is not None:
            out["slo"] = {
                "ttft_ms": None if options.ttft_slo_s is None else options.ttft_slo_s * 1000,
                "tpot_ms": None if options.tpot_slo_s is None else options.tpot_slo_s * 1000,
                "attainment": _r(group.good / group.requests, 4) if group.requests else None,
                "goodput_requests_per_s": _r(_finite(group.good, span), 4),
            }
        return out

    all_itl = recorder.itl
    per_model = {
        name: metrics(group, itl[name], preemptions[name]) for name, group in groups.items()
    }
    overall_metrics = metrics(overall, all_itl, sum(preemptions.values()))

    scaling = sim.autoscaling
    cost_models: dict[str, Any] = {}
    for entry in sim.fleet.models:
        bill = scaling.bill(entry.name, makespan)
        hours = {c: s / 3600.0 for c, s in scaling.bill_by_capacity(entry.name, makespan).items()}
        price = entry.usd_per_gpu_hour()
        prices = {entry.capacity.value: price, Capacity.ON_DEMAND.value: entry.on_demand_price()}
        cost_models[entry.name] = {
            "gpu": entry.gpu,
            "capacity": entry.capacity.value,
            "gpus": entry.tp * entry.replica_count,
            "usd_per_gpu_hour": price,
            "gpu_hours": _r(math.fsum(hours.values()), 4),
            "usd": _r(math.fsum(h * prices[c] for c, h in hours.items()), 2),
            "gpu_hours_by_phase": {k: _r(v / 3600.0, 4) for k, v in bill.items()},
            # a spot pool's on-demand stand-ins are billed at the on-demand price
            "by_capacity": {
                c: {"gpu_hours": _r(h, 4), "usd": _r(h * prices[c], 2)} for c, h in hours.items()
            },
        }
    timeline = sim.timeline
    n_replicas = len(drivers)
    replicas = []
    for i, (rid, driver, s) in enumerate(zip(sim.replica_ids, drivers, stats, strict=True)):
        kv = [v for row in timeline.kv_usage if i < len(row) and (v := row[i]) is not None]
        queries = s.prefix_cache_queries + driver.retired_prefix_queries
        hits = s.prefix_cache_hits + driver.retired_prefix_hits
        span = scaling.serving_s(rid, makespan)
        replicas.append(
            {
                "id": rid,
                "model": models[i],
                "utilisation": _r(driver.busy_s / span, 4) if span > 0 else None,
                "serving_s": _r(span, 3),
                "steps": driver.steps,
                "requests": served[i],
                "preemptions": preempted[i],
                "prefix_cache_hit_rate": _r(hits / queries, 4) if queries else None,
                "kv_usage_mean": _r(math.fsum(kv) / len(kv), 4) if kv else None,
                "kv_usage_max": _r(max(kv), 4) if kv else None,
                "crashes": driver.crashes,
                "downtime_s": _r(driver.downtime(makespan), 3),
            }
        )

    def column(rows: list[list[float | None]], i: int) -> list[float | None]:
        return [_r(row[i], 4) if i < len(row) else None for row in rows]

    autoscale = {
        m.name: section
        for m in sim.fleet.models
        if (section := scaling.report(m.name, makespan)) is not None
    }
    return {
        "inputs": inputs,
        "fleet": [
            {
                "model": m.name,
                "served_model": m.served_model,
                "gpu": m.gpu,
                "tp": m.tp,
                "replicas": m.replica_count,
                "routing": m.routing.policy,
                "autoscale": m.autoscale is not None,
            }
            for m in sim.fleet.models
        ],
        "simulated_s": _r(makespan),
        "overall": overall_metrics,
        "models": per_model,
        "cost": {
            "gpu_hours": _r(sum(c["gpu_hours"] for c in cost_models.values()), 4),
            "usd": _r(sum(c["usd"] for c in cost_models.values()), 2),
            "by_capacity": _by_capacity(cost_models),
            "models": cost_models,
        },
        "replicas": replicas,
        "autoscale": autoscale,
        "timeline": {
            "interval_s": timeline.interval,
            "t": [_r(t, 3) for t in timeline.t],
            "arrivals": timeline.arrivals,
            "in_flight": timeline.in_flight,
            "replicas": timeline.replicas,
            "gpus": timeline.gpus,
            "phases": timeline.phases,
            "kv_usage": {
                rid: column(timeline.kv_usage, i)
                for i, rid in zip(range(n_replicas), sim.replica_ids, strict=True)
            },
            "busy": {
                rid: column(timeline.busy, i)
                for i, rid in zip(range(n_replicas), sim.replica_ids, strict=True)
            },
        },
        "routing": {
            "scrapes": sim.routing.scrapes,
            "scrape_interval_s": sim.routing.scrape_interval,
            "routed": sum(p.counters.routed for p in sim.control.pools.values()),
            "matched_prefix_blocks": sum(
                p.counters.matched_blocks for p in sim.control.pools.values()
            ),
        },
        "faults": _faults_report(sim),
        **_served_report(sim),
        **_adapters_report(sim),
        **_rollouts_report(sim),
        **({} if sim.tenants is None else {"tenants": _tenants_report(sim)}),
        **_batch_section(sim),
        "digest": recorder.digest(),
    }


def _batch_section(sim: FleetSimulation) -> dict[str, Any]:
    job, book = sim.options.batch, sim.tenants
    if job is None or book is None:
        return {}
    report = batch_report(job, sim.harness.recorder.log, book.tenants(), book.tenant_ids)
    # lines stopped for an interactive request and run again (gateway.batch.spare.recall)
    report["recalled"] = sum(p.counters.recalled for p in sim.control.pools.values())
    return {"batch": report}


def _adapters_report(sim: FleetSimulation) -> dict[str, Any]:
    """LoRA adapters (docs/residency.md): per pool that serves some, the attempts for an
    adapter, the loads they cost (and per 1,000), unloads, loads over a full replica's cap;
    fleet-wide, the modelled load time and what attempts waited for loads. Nothing for a
    fleet without adapters."""
    modelled = sim.routing.adapters
    if modelled is None:
        return {}
    pools: dict[str, Any] = {}
    for name, pool in sim.control.pools.items():
        adapters = pool.adapters
        if adapters is None:
            continue
        c = adapters.counters
        pools[name] = {
            "adapters": len(adapters.config.adapters),
            "max_loras": adapters.config.max_loras,
            "affinity": adapters.config.affinity,
            "requests": c.requests,
            "loads": c.loads,
            "loads_per_1000": _r(1000 * c.loads / c.requests, 2) if c.requests else None,
            "unloads": c.unloads,
            "over_cap": c.over_cap,
        }
    stats = modelled.stats
    return {
        "adapters": {
            "pools": pools,
            "load_seconds": _r(stats.load_seconds, 3),
            "waited": stats.waited,
            "wait_seconds": _r(stats.wait_seconds, 3),
        }
    }


def _served_report(sim: FleetSimulation) -> dict[str, Any]:
    """The served names that are not plain (variants, aliases, fallbacks): the requests that
    named each, how those sent to its variants split over them (against the weights: a
    request none of them could hold went straight to a fallback) and the fallbacks taken.
    Nothing for a fleet without them (its report is as before)."""
    control = sim.control
    names = {name: s for name, s in control.served.items() if not s.plain}
    if not names:
        return {}
    served: dict[str, Any] = {}
    for name, s in names.items():
        total = sum(w for _, w in s.variants)
        split = sum(s.chosen.values())
        served[name] = {
            "requests": s.arrived,
            "variants": {
                pool: {
                    "weight": weight,
                    "weight_share": _r(weight / total, 4) if total else None,
                    "requests": s.chosen.get(pool, 0),
                    "share": _r(s.chosen.get(pool, 0) / split, 4) if split else None,
                }
                for pool, weight in s.variants
            },
            "fallbacks": list(s.fallbacks),
        }
    fallbacks = [
        {"from": source, "to": to, "reason": reason, "requests": n}
        for (source, to, reason), n in sorted(control.fallbacks.items())
    ]
    return {"served": served, "fallbacks": fallbacks}


def _rollouts_report(sim: FleetSimulation) -> dict[str, Any]:
    """Each rollout's decisions (steps, verdicts, their checks) and, per variant, the
    requests it served and its TTFT P99 over time (bins of half a step), what rollout.png
    draws. Nothing for a run without rollouts."""
    log = sim.routing.rollout_log
    if not log:
        return {}
    models = sim.replica_models
    out: dict[str, Any] = {}
    for name in dict.fromkeys(d.model for d in log):
        decisions = [d for d in log if d.model == name]
        pools = [pool for pool, _ in decisions[0].weights]
        config = sim.control.rollouts.by_name[name].config
        width = config.step_seconds / 2
        bins: dict[str, dict[int, list[float]]] = {p: {} for p in pools}
        served = dict.fromkeys(pools, 0)
        for record in sim.harness.recorder.log:
            pool = models[record.replica]
            if pool not in bins or record.failed or record.ttft_s is None:
                continue
            served[pool] += 1
            bins[pool].setdefault(int(record.arrival_s // width), []).append(record.ttft_s)
        last = max((max(b, default=0) for b in bins.values()), default=0)
        total = sum(served.values())
        out[name] = {
            "to": decisions[0].to,
            "strategy": decisions[0].strategy.value,
            "phase": sim.control.rollouts.by_name[name].phase.value,
            "decisions": [d.to_json() for d in decisions],
            "requests": served,
            "share": {p: _r(n / total, 4) if total else None for p, n in served.items()},
            "series": {
                "t": [_r(i * width) for i in range(last + 1)],
                "ttft_p99": {
                    p: [_r(_p99(b.get(i, []))) for i in range(last + 1)] for p, b in bins.items()
                },
                "requests": {
                    p: [len(b.get(i, [])) for i in range(last + 1)] for p, b in bins.items()
                },
            },
        }
    return {"rollouts": out}


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]


def _tenants_report(sim: FleetSimulation) -> dict[str, Any]:
    tenants = sim.tenants
    assert tenants is not None
    return tenants.report(
        sim.harness.recorder.log,
        sim.routing.waits,
        sim.control.queues(),
        sim.fleet.tenants,
        sim.admitting,
        _q,
        _r,
    )


def _by_capacity(cost_models: dict[str, Any]) -> dict[str, Any]:
    """GPU-hours and dollars split between on-demand and spot pools."""
    split: dict[str, Any] = {}
    for c in cost_models.values():
        for capacity, bill in c["by_capacity"].items():
            part = split.setdefault(capacity, {"gpu_hours": 0.0, "usd": 0.0})
            part["gpu_hours"] += bill["gpu_hours"]
            part["usd"] += bill["usd"]
    return {
        k: {"gpu_hours": _r(v["gpu_hours"], 4), "usd": _r(v["usd"], 2)} for k, v in split.items()
    }


def _faults_report(sim: FleetSimulation) -> dict[str, Any]:
    routing = sim.routing
    ejections = routing.ejections
    counters = [p.counters for p in sim.control.pools.values()]
    report: dict[str, Any] = {
        "scenario": [fault_spec(f) for f in sim.options.faults],
        "crashes": sim.faults.crashes,
        "preemptions": sim.faults.preemptions,
        "cut_by_preemption": sim.faults.cut_by_preemption,
        "on_demand_stand_ins": sim.faults.stand_ins,
        "moved_to_spot": sim.faults.moved_to_spot,
        "requests_failed": sim.harness.failed,
        "lost_mid_stream": sum(c.broken for c in counters),
        "resumed_streams": sum(c.resumes for c in counters),
        "resume_prefill_tokens": sim.harness.resume_prefill_tokens,
        "no_replica": sum(c.no_replica for c in counters),
        "retries": sum(c.retries for c in counters),
        "retries_refused": sum(c.retries_refused for c in counters),
        "free_retries": sum(c.free_retries for c in counters),
        "held": sum(c.held for c in counters),
        "hold_timeouts": sum(c.hold_timeouts for c in counters),
        "ejections": {
            "enforced": sum(1 for e in ejections if e.enforced),
            "not_enforced": sum(1 for e in ejections if not e.enforced),
            "log": [
                {
                    "at": _r(e.at, 6),
                    "replica": e.replica,
                    "cause": e.cause.value,
                    "enforced": e.enforced,
                    "overflow": e.overflow,
                    "ejections": e.ejections,
                    "duration_s": _r(e.duration, 6),
                }
                for e in ejections[:1000]
            ],
        },
        "downtime_s": _r(math.fsum(d.downtime(sim.now) for d in sim.harness.drivers), 3),
    }
    if any(f.kind == "errors" for f in sim.options.faults):
        report["error_answers"] = routing.refused_attempts  # attempts answered with a 5xx
    return report


def _finite(count: float, span: float) -> float | None:
    value = count / span
    return value if math.isfinite(value) else None


def gated(fleet: FleetConfig, options: SimOptions) -> bool:
    """Whether a pool's batch gate may hold requests: a tenant is in the batch class and
    the fleet gates that class (``gateway.batch.spare``)."""
    batch = any(t.priority == "batch" for t in options.tenants)
    return batch and fleet.gateway.batch.spare is not None
