"""Fidelity of the simulator's replica against published measurements and GPU calibration data.

    .venv/bin/python bench/sim_fidelity.py   # tables, bench/results/sim_fidelity.json and .png

``bench/perf_model_error.py`` prices each published workload with step times directly. This
bench runs the same workloads through the simulator's replica instead: the fleet simulator's
event kernel, its replica driver (fast-forward included) and ``ReplicaModel`` (scheduler,
chunked prefill, paged KV blocks, prefix cache), each reference's arrival pattern replayed in
virtual time, and reads the latencies off the simulator's request records:

=================  ===========================================================  ==========
scenario           arrival pattern                                              metric
=================  ===========================================================  ==========
latency_run        ``batch`` prompts arrive together; time until the last ends   E2E
static_throughput  the same run; ``batch × output / E2E`` (per GPU if the source)  throughput
ttft               one prompt alone                                             TTFT
decode_tpot        ``batch`` prompts arrive together; mean per-request TPOT       ITL
serving_tpot       ``concurrency`` closed-loop clients (a client sends its next    ITL
                   request when its last token arrives); mean TPOT of the
                   requests in the steady-state window (after every client's
                   first two requests, before the first client stops)
=================  ===========================================================  ==========

Each replica is the one ``gpufleet simulate`` builds for a fleet-file entry with the
reference's model, GPU and TP (``gpufleet.sim.replica_config``), plus the engine flags the
reference implies (``--max-num-seqs`` when it ran more sequences together than vLLM's default
256, ``--max-num-batched-tokens`` when it names one) and its weight and KV-cache dtypes (a
fleet file has no dtype field yet: they are set on the ``ReplicaConfig``).

The GPU calibration documents (``src/gpufleet/perf/data/measured/*.json``, plain PyTorch, no
scheduler) are replayed through ``ReplicaModel`` step by step: a decode row is a batch of B
prompts prefilled together and then decoding 5 steps around the row's context (the mean of
their GPU times); a prefill row is the TTFT of its prompts (a prefix of the row's cached
tokens warmed first, so the prefix cache serves it); a mixed row is B requests decoding when
one prompt chunk arrives. As in ``perf_model_error.py`` these are compared with GPU time: the
step time minus the model's calibrated CPU overhead (``StepTime.overhead``). Their engine
flags let the batch run as the calibration ran it (one prefill step, a KV pool that holds it,
context limits lifted for the random-weight models).

Error is (predicted − measured) / measured. Reported per set and metric as BLIS reports its
own: points, median |error|, P90 |error| (linear between ranks), signed median (bias), for
the simulator and, beside it, for the step-time-only prediction of ``perf_model_error.py``:
where the two differ, the scheduler added or removed time.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from gpufleet.catalog import get_gpu, get_model
from gpufleet.config import ModelConfig
from gpufleet.engine.model import NewRequest, ReplicaConfig, ReplicaModel, StepPlan
from gpufleet.fleet import DEFAULT_MAX_NUM_SEQS
from gpufleet.perf import BatchShape, Dtype
from gpufleet.sim import (
    URGENT,
    Kernel,
    PromptBuilder,
    Recorder,
    ReplicaDriver,
    RequestRecord,
    ScheduledEvent,
    TraceRequest,
    replica_config,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "sim_fidelity.json"
TARGETS = {"ttft": 10.0, "itl": 5.0}
"""Median |error| targets (%), issue 20: on the published measurements."""
METRICS = ("ttft", "itl", "e2e", "throughput")
METRIC_OF = {
    "latency_run": "e2e",
    "static_throughput": "throughput",
    "ttft": "ttft",
    "decode_tpot": "itl",
    "serving_tpot": "itl",
}
SERVING_ROUNDS = 10
"""Requests each closed-loop client sends (serving_tpot)."""
SERVING_WARMUP = 2
"""Requests per client before the steady-state window opens."""
CHAIN_STEPS = 5
"""Decode steps a calibration decode row runs (centred on its context)."""


def load_perf_bench() -> ModuleType:
    """``bench/perf_model_error.py`` as a module (the step-time-only predictions)."""
    if "perf_model_error" in sys.modules:
        return sys.modules["perf_model_error"]
    spec = importlib.util.spec_from_file_location(
        "perf_model_error", Path(__file__).resolve().parent / "perf_model_error.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["perf_model_error"] = module
    spec.loader.exec_module(module)
    return module


def error_pct(predicted: float, measured: float) -> float:
    """(predicted − measured) / measured, in per cent."""
    return 100.0 * (predicted - measured) / measured


@dataclass
class Point:
    """One measured value, the simulator's prediction and the step-time-only one."""

    set: str
    id: str
    engine: str
    model: str
    gpu: str
    setup: str
    scenario: str
    metric: str
    unit: str
    measured: float
    simulated: float
    step_only: float | None
    source: str = ""
    note: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def error_pct(self) -> float:
        return error_pct(self.simulated, self.measured)

    @property
    def step_only_error_pct(self) -> float | None:
        return None if self.step_only is None else error_pct(self.step_only, self.measured)

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in ("measured", "simulated", "step_only"):
            if out[name] is not None:
                out[name] = float(f"{out[name]:.9g}")
        out["error_pct"] = round(self.error_pct, 2)
        step = self.step_only_error_pct
        out["step_only_error_pct"] = None if step is None else round(step, 2)
        return out


# --- the simulator: one replica, clients, virtual time ------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Client ``client`` sends its next request (a shared event: an arrival)."""

    target: Clients
    client: int


class Clients:
    """``clients`` clients sending fixed-length requests to one simulated replica.

    Each sends ``rounds`` requests, the next one when the last token of the one before comes
    out (a closed loop); client ``i`` sends its first at ``i × spacing`` (0: all together, as
    a benchmark client starts them). The replica is the fleet simulator's: a ``ReplicaDriver``
    on a ``Kernel``, recording into a ``Recorder``. With one round (no loop) the driver
    fast-forwards its decode runs as in ``gpufleet simulate``; a closed loop schedules
    arrivals from inside the replica's step events, which a fast-forwarding driver may already
    have run past, so it steps one event at a time (the same results: the harness's
    ``fast_forward=False``, docs/design/sim-kernel.md).
    """

    def __init__(
        self,
        model: ReplicaModel,
        *,
        clients: int,
        input_tokens: int,
        output_tokens: int,
        rounds: int = 1,
        spacing: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.kernel = Kernel()
        self.recorder = Recorder()
        self.model = model
        fast = rounds == 1
        self.driver = ReplicaDriver(
            0,
            model,
            self.recorder,
            horizon=self.kernel.next_shared if fast else None,
            on_end=self._ended,
            kernel=self.kernel,
        )
        self.prompts = PromptBuilder(model.config.model.vocab_size, seed)
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.rounds = rounds
        self.sent = [0] * clients
        self.owner: dict[int, tuple[int, int]] = {}
        """Request index → (client, its round)."""
        for client in range(clients):
            self.kernel.schedule(client * spacing, URGENT, Send(self, client))

    def on_event(self, now: float, event: Send) -> list[ScheduledEvent]:
        index = len(self.owner)
        self.owner[index] = (event.client, self.sent[event.client])
        self.sent[event.client] += 1
        trace = TraceRequest(now, self.input_tokens, self.output_tokens)
        prompt = self.prompts.prompt(index, trace)
        request = NewRequest(str(index), prompt, self.output_tokens, ignore_eos=True)
        return self.driver.submit(now, index, request)

    def _ended(self, now: float, index: int, replica: int, rejected: bool) -> None:
        if rejected:
            raise RuntimeError(f"the replica refused request {index} (too long?)")
        client, _ = self.owner[index]
        if self.sent[client] < self.rounds:
            self.kernel.schedule(now, URGENT, Send(self, client))

    def run(self) -> list[RequestRecord]:
        self.kernel.run()
        return list(self.recorder.log)

    def detail(self) -> dict[str, Any]:
        stats = self.driver.model.stats()
        return {
            "requests": len(self.recorder.log),
            "steps": self.driver.steps,
            "fast_forwarded_steps": self.driver.fast_steps,
            "preemptions": stats.num_preemptions,
            "max_num_seqs": self.model.config.max_num_seqs,
            "max_num_batched_tokens": self.model.config.max_num_batched_tokens,
            "num_gpu_blocks": self.model.num_gpu_blocks,
        }


def fleet_entry(ref: dict[str, Any]) -> ModelConfig:
    """The fleet-file entry a user would write for a reference's setup."""
    args: list[str] = []
    together = int(ref.get("batch") or ref.get("concurrency") or 1)
    if together > DEFAULT_MAX_NUM_SEQS:  # the source ran them together: the engine's cap allowed
        args += ["--max-num-seqs", str(together)]
    if ref.get("max_batched_tokens"):
        args += ["--max-num-batched-tokens", str(ref["max_batched_tokens"])]
    return ModelConfig(
        name="reference",
        model=ref["model"],
        gpu=ref["gpu"],
        tp=int(ref.get("tp", 1)),
        replicas=1,
        args=tuple(args),
    )


def reference_config(ref: dict[str, Any], seed: int = 0) -> ReplicaConfig:
    """The replica ``gpufleet simulate`` builds for :func:`fleet_entry`, with the reference's
    pipeline depth and dtypes (fields a fleet file does not have)."""
    return dataclasses.replace(
        replica_config(fleet_entry(ref), seed),
        pp=int(ref.get("pp", 1)),
        weights_dtype=Dtype(ref.get("weights_dtype", "bf16")),
        kv_dtype=Dtype(ref.get("kv_dtype", "bf16")),
    )


def steady_window(
    records: list[RequestRecord], owner: dict[int, tuple[int, int]], warmup: int = SERVING_WARMUP
) -> tuple[float, float]:
    """``[open, close]``: from when every client has finished its warm-up requests to when
    the first client finishes its last (after that fewer than ``concurrency`` are in flight)."""
    warm: dict[int, float] = {}
    last: dict[int, float] = {}
    for r in records:
        client, round_ = owner[r.index]
        if round_ == warmup - 1:
            warm[client] = r.finish_s
        last[client] = max(last.get(client, 0.0), r.finish_s)
    return max(warm.values()), min(last.values())


def simulate_reference(
    ref: dict[str, Any],
    rounds: int = SERVING_ROUNDS,
    warmup: int = SERVING_WARMUP,
    spacing: float = 0.0,
) -> tuple[float, dict[str, Any]]:
    """The simulator's value of a reference's measured quantity, and what the run did
    (``rounds``, ``warmup``: requests per closed-loop client, and before its window opens;
    ``spacing``: seconds between the closed-loop clients' first requests)."""
    scenario = ref["scenario"]
    inp = int(ref["input_tokens"])
    out = int(ref.get("output_tokens", 1))
    model = ReplicaModel(reference_config(ref))
    if scenario == "serving_tpot":
        clients = Clients(
            model,
            clients=int(ref["concurrency"]),
            input_tokens=inp,
            output_tokens=out,
            rounds=rounds,
            spacing=spacing,
        )
        records = clients.run()
        start, end = steady_window(records, clients.owner, warmup)
        window = [r for r in records if r.arrival_s >= start and r.finish_s <= end]
        if not window:
            raise RuntimeError(f"{ref['id']}: no request in the steady-state window")
        tpots = [r.tpot_s for r in window if r.tpot_s is not None]
        detail = clients.detail() | {
            "window_s": [round(start, 4), round(end, 4)],
            "window_requests": len(tpots),
            "e2e_mean_s_in_window": round(statistics.fmean(r.e2e_s for r in window), 6),
            "ttft_mean_s_in_window": round(
                statistics.fmean(r.ttft_s for r in window if r.ttft_s is not None), 6
            ),
        }
        return statistics.fmean(tpots), detail
    batch = 1 if scenario == "ttft" else int(ref["batch"])
    clients = Clients(model, clients=batch, input_tokens=inp, output_tokens=out)
    records = clients.run()
    detail = clients.detail()
    if len(records) != batch or any(r.rejected for r in records):
        raise RuntimeError(f"{ref['id']}: {len(records)} of {batch} requests finished")
    if scenario == "ttft":
        ttft = records[0].ttft_s
        assert ttft is not None
        return ttft, detail
    if scenario == "decode_tpot":
        return statistics.fmean(r.tpot_s for r in records if r.tpot_s is not None), detail
    e2e = max(r.finish_s for r in records)  # all arrived at 0
    detail["ttft_max_s"] = round(max(r.ttft_s or 0.0 for r in records), 6)
    if scenario == "latency_run":
        return e2e, detail
    if scenario == "static_throughput":
        tokens_per_s = batch * out / e2e
        gpus = int(ref.get("tp", 1)) * int(ref.get("pp", 1))
        return (tokens_per_s / gpus if ref.get("per_gpu") else tokens_per_s), detail
    raise ValueError(f"{ref['id']}: unknown scenario {scenario!r}")


def published_points(
    refs: list[dict[str, Any]],
    bench: ModuleType | None = None,
    rounds: int = SERVING_ROUNDS,
    warmup: int = SERVING_WARMUP,
) -> list[Point]:
    """Every reference through the simulator, beside ``perf_model_error``'s step-only value."""
    bench = bench or load_perf_bench()
    step_only = {row.id: row for row in bench.published_rows(refs)}
    points = []
    for ref in refs:
        row = step_only[ref["id"]]
        simulated, detail = simulate_reference(ref, rounds, warmup)
        points.append(
            Point(
                set="published",
                id=ref["id"],
                engine=ref["engine"],
                model=ref["model"],
                gpu=ref["gpu"],
                setup=row.setup + (f" kv {ref['kv_dtype']}" if "kv_dtype" in ref else ""),
                scenario=row.scenario,
                metric=METRIC_OF[ref["scenario"]],
                unit=ref["unit"],
                measured=float(ref["measured"]),
                simulated=simulated,
                step_only=row.predicted,
                source=ref.get("url", ""),
                note=ref.get("assumed", ""),
                detail=detail,
            )
        )
    return points


def what_ifs(
    refs: list[dict[str, Any]],
    points: list[Point],
    rounds: int = SERVING_ROUNDS,
    warmup: int = SERVING_WARMUP,
) -> list[dict[str, Any]]:
    """The ITL references rerun with what their sources leave open, beside the headline
    (``points``, which keeps references.yaml as it is):

    * ``kv fp8``: an fp8 KV cache, for fp8-weight references that name no KV dtype (the
      headline takes bf16, as perf_model_error does);
    * ``spread start``: closed-loop clients whose first requests are spread evenly over one
      request's duration (the headline's mean E2E) instead of sent together, as
      perf_model_error's ``serving_tpot`` assumes arrivals to be.
    """
    base = {p.id: p for p in points if p.set == "published"}
    out = []
    for ref in refs:
        if METRIC_OF[ref["scenario"]] != "itl":
            continue
        point = base[ref["id"]]
        variants: list[tuple[str, dict[str, Any], float]] = []
        if ref.get("weights_dtype") == "fp8" and "kv_dtype" not in ref:
            variants.append(("kv fp8", dict(ref, kv_dtype="fp8"), 0.0))
        if ref["scenario"] == "serving_tpot":
            spacing = point.detail["e2e_mean_s_in_window"] / int(ref["concurrency"])
            variants.append(("spread start", ref, spacing))
        for name, variant, spacing in variants:
            value, detail = simulate_reference(variant, rounds, warmup, spacing)
            out.append(
                {
                    "id": ref["id"],
                    "variant": name,
                    "measured": float(ref["measured"]),
                    "simulated": value,
                    "error_pct": round(error_pct(value, float(ref["measured"])), 2),
                    "headline_error_pct": round(point.error_pct, 2),
                    "step_only_error_pct": round(point.step_only_error_pct or 0.0, 2),
                    "preemptions": detail["preemptions"],
                    "headline_preemptions": point.detail["preemptions"],
                }
            )
    return out


# --- the GPU calibration data through ReplicaModel ----------------------------------------------


def run_steps(model: ReplicaModel, now: float = 0.0) -> tuple[list[StepPlan], float]:
    """Step ``model`` until it is idle: the plans, and the time it ends."""
    plans = []
    while (plan := model.plan_step(now)) is not None:
        now += plan.duration
        model.finish_step(plan, now)
        plans.append(plan)
    return plans, now


def gpu_seconds(plan: StepPlan) -> float:
    """A step's GPU time: its seconds minus the calibrated CPU overhead (perf_model_error's)."""
    return plan.timing.seconds - plan.timing.overhead


class Calibration:
    """Replays one measured document's rows through fresh ``ReplicaModel``s."""

    def __init__(self, doc: dict[str, Any], gpu_name: str, bench: ModuleType) -> None:
        self.doc = doc
        self.gpu = get_gpu(gpu_name)
        self.gpu_name = gpu_name
        self.bench = bench
        self.configs = doc.get("models", {})
        self.prompts = PromptBuilder(32_000, 0)  # ids below every calibrated model's vocab

    def spec_for(self, rec: dict[str, Any], context: int) -> Any:
        """The catalog model cut to the row's layers, its context limit lifted to ``context``
        (the random-weight runs went past Llama-2's 4096)."""
        spec = get_model(self.bench._catalog_model_name(rec["model"]))
        layers = rec.get("num_layers") or self.configs.get(rec["model"], {}).get("num_layers")
        update: dict[str, int] = {"max_context": max(spec.max_context, context)}
        if layers and layers != spec.num_layers:
            update["num_layers"] = int(layers)
        return spec.model_copy(update=update)

    def replica(
        self, rec: dict[str, Any], *, seqs: int, tokens: int, budget: int, caching: bool
    ) -> ReplicaModel:
        """A replica that runs ``seqs`` sequences of up to ``tokens`` tokens together and
        prefills ``budget`` tokens in one step, with a KV pool that holds them."""
        blocks = seqs * (tokens // 16 + 2) + 64
        config = ReplicaConfig(
            self.spec_for(rec, tokens + 16),
            self.gpu,
            max_num_batched_tokens=max(8192, budget),
            max_num_seqs=max(DEFAULT_MAX_NUM_SEQS, seqs),
            num_gpu_blocks_override=blocks,
            enable_prefix_caching=caching,
        )
        return ReplicaModel(config)

    def request(self, index: int, length: int, max_tokens: int, prefix: int = 0) -> NewRequest:
        """Request ``index``: ``length`` prompt tokens, the first ``prefix`` shared by all."""
        trace = TraceRequest(
            0.0, length, max_tokens, hash_ids=(0,) if prefix else None, block_tokens=prefix or 1
        )
        return NewRequest(
            str(index), self.prompts.prompt(index, trace), max_tokens, ignore_eos=True
        )

    def warm(self, model: ReplicaModel, prefix: int) -> float:
        """Run one request whose prompt is the shared ``prefix`` (and 16 tokens of its own),
        so that the prefix is in the cache; the time it ends."""
        model.add_request(self.request(10**6, prefix + 16, 1, prefix), 0.0)
        return run_steps(model)[1]

    def decode(self, rec: dict[str, Any]) -> tuple[float, BatchShape, dict[str, Any]]:
        """B prompts prefilled together, then ``CHAIN_STEPS`` decode steps centred on the
        row's context C (the first decode step of a C-token prompt has C + 1 tokens of context,
        perf_model_error's convention): the mean GPU time of those steps."""
        b, c = int(rec["batch"]), int(rec["context"])
        prompt = c + 1 - (CHAIN_STEPS + 1) // 2
        model = self.replica(
            rec, seqs=b, tokens=prompt + CHAIN_STEPS + 1, budget=b * prompt, caching=False
        )
        for i in range(b):
            model.add_request(self.request(i, prompt, CHAIN_STEPS + 1), 0.0)
        plans, _ = run_steps(model)
        chain = [p for p in plans if p.batch.decode_seqs == b and not p.batch.prefill_tokens]
        detail = {"steps": len(plans), "decode_steps": len(chain)}
        middle = chain[len(chain) // 2].batch
        return statistics.fmean(gpu_seconds(p) for p in chain), middle, detail

    def prefill(self, rec: dict[str, Any]) -> tuple[float, BatchShape, dict[str, Any]]:
        """The TTFT (GPU time) of B prompts of L new tokens arriving together, the first P
        tokens (the row's cached ones) in the prefix cache from a request before."""
        b, n, p = int(rec["batch"]), int(rec["new_tokens"]), int(rec["cached_tokens"])
        model = self.replica(rec, seqs=b, tokens=p + n + 16, budget=b * n, caching=bool(p))
        start = self.warm(model, p) if p else 0.0
        for i in range(b):
            model.add_request(self.request(i, p + n, 1, p), start)
        plans, _ = run_steps(model, start)
        batch = plans[0].batch
        for plan in plans[1:]:
            batch = batch + plan.batch
        detail = {"steps": len(plans), "cached_tokens": model.stats().prefix_cache_hits}
        return sum(gpu_seconds(plan) for plan in plans), batch, detail

    def mixed(self, rec: dict[str, Any]) -> tuple[float, BatchShape, dict[str, Any]]:
        """B requests decoding at context C when a prompt of P cached + L new tokens arrives:
        the GPU time of the step that runs them together."""
        b, c = int(rec["decode_seqs"]), int(rec["decode_context"])
        n, p = int(rec["chunk_tokens"]), int(rec["chunk_cached"])
        model = self.replica(
            rec, seqs=b + 1, tokens=max(c, p + n) + 16, budget=b * c + n, caching=bool(p)
        )
        now = self.warm(model, p) if p else 0.0
        for i in range(b):  # a (C − 1)-token prompt decodes its first step at context C
            model.add_request(self.request(i, c - 1, 2), now)
        first = model.plan_step(now)
        assert first is not None
        now += first.duration
        model.finish_step(first, now)
        model.add_request(self.request(b, p + n, 1, p), now)
        step = model.plan_step(now)
        assert step is not None
        return gpu_seconds(step), step.batch, {"cached_tokens": model.stats().prefix_cache_hits}

    def points(self) -> list[Point]:
        bench = self.bench
        name = bench.set_name(self.gpu_name)
        step_only = {row.id: row for row in bench.measured_rows(self.doc, self.gpu_name)}
        mixed_rows, _ = bench.mixed_rows(self.doc, self.gpu_name)
        step_only |= {row.id: row for row in mixed_rows}
        points: list[Point] = []

        def add(
            set_name: str,
            row_id: str,
            rec: dict[str, Any],
            *,
            metric: str,
            run: Callable[[dict[str, Any]], tuple[float, BatchShape, dict[str, Any]]],
            priced: BatchShape,
        ) -> None:
            row = step_only[row_id]
            simulated, batch, detail = run(rec)
            detail["same_batch_as_step_only"] = batch == priced
            points.append(
                Point(
                    set=set_name,
                    id=row_id,
                    engine=row.engine,
                    model=row.model,
                    gpu=self.gpu_name,
                    setup=row.setup,
                    scenario=row.scenario,
                    metric=metric,
                    unit="s",
                    measured=row.measured,
                    simulated=simulated,
                    step_only=row.predicted,
                    note="GPU time: step seconds minus calibrated CPU overhead",
                    detail=detail,
                )
            )

        for rec in bench._prefer_graph(self.doc.get("decode", []), ("model", "batch", "context")):
            b, c = int(rec["batch"]), int(rec["context"])
            row_id = f"decode-{rec['model']}-decode-b={b}-ctx={c}"
            add(
                name,
                row_id,
                rec,
                metric="itl",
                run=self.decode,
                priced=BatchShape.uniform_decode(b, c + 1),
            )
        key = ("model", "batch", "new_tokens", "cached_tokens")
        for rec in bench._prefer_graph(self.doc.get("prefill", []), key):
            b, n, p = int(rec["batch"]), int(rec["new_tokens"]), int(rec["cached_tokens"])
            row_id = f"prefill-{rec['model']}-prefill-b={b}-new={n}-cached={p}"
            priced = bench.prefill_batch([(n, p)] * b)
            add(name, row_id, rec, metric="ttft", run=self.prefill, priced=priced)
        split = [r for r in self.doc.get("mixed", []) if r.get("attn_layout", "split") == "split"]
        key = ("model", "decode_seqs", "decode_context", "chunk_tokens", "chunk_cached")
        for rec in bench._prefer_graph(split, key):
            b, c = int(rec["decode_seqs"]), int(rec["decode_context"])
            n, p = int(rec["chunk_tokens"]), int(rec["chunk_cached"])
            if not (b and n):
                continue
            row_id = f"mixed-{rec['model']}-b={b}-ctx={c}-new={n}-cached={p}"
            priced = BatchShape.uniform_decode(b, c) + BatchShape.prefill(n, cached=p)
            add(f"{name}-mixed", row_id, rec, metric="itl", run=self.mixed, priced=priced)
        return points


def calibration_points(bench: ModuleType | None = None) -> list[Point]:
    bench = bench or load_perf_bench()
    points: list[Point] = []
    for measured in bench.load_measured(sorted(bench.MEASURED_DIR.glob("*.json"))):
        points += Calibration(measured.doc, measured.gpu, bench).points()
    return points


# --- summaries ----------------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-quantile (0..1), linear between ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    rank = q * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def error_stats(errors: list[float]) -> dict[str, Any]:
    """Points, median and P90 |error|, signed median (the bias), max |error|, in per cent."""
    if not errors:
        return {"points": 0}
    absolute = [abs(e) for e in errors]
    return {
        "points": len(errors),
        "median_abs_error_pct": round(statistics.median(absolute), 2),
        "p90_abs_error_pct": round(percentile(absolute, 0.9), 2),
        "signed_median_error_pct": round(statistics.median(errors), 2),
        "max_abs_error_pct": round(max(absolute), 2),
    }


def groups(points: list[Point]) -> dict[str, list[Point]]:
    """The sets the headline is over: published (all, vLLM, TensorRT-LLM/NIM), then each
    calibration set."""
    out: dict[str, list[Point]] = {}
    for p in points:
        out.setdefault(p.set, []).append(p)
        if p.set == "published":
            family = "vllm" if p.engine.startswith("vllm") else "trt-llm / nim"
            out.setdefault(f"published: {family}", []).append(p)
    return out


def summarize(points: list[Point]) -> dict[str, dict[str, Any]]:
    """Per set and metric: the simulator's error statistics and the step-only ones."""
    summary: dict[str, dict[str, Any]] = {}
    for name, members in groups(points).items():
        for metric in METRICS:
            chosen = [p for p in members if p.metric == metric]
            if not chosen:
                continue
            step = [e for p in chosen if (e := p.step_only_error_pct) is not None]
            summary.setdefault(name, {})[metric] = {
                "simulator": error_stats([p.error_pct for p in chosen]),
                "step_only": error_stats(step),
                "scheduler_changed": sum(
                    p.step_only is not None
                    and abs(p.simulated - p.step_only) > 1e-3 * abs(p.step_only)
                    for p in chosen
                ),
            }
    return summary


def targets(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Whether the median |error| targets hold on the published measurements."""
    out = {}
    for metric, bar in TARGETS.items():
        stats = summary.get("published", {}).get(metric, {}).get("simulator", {"points": 0})
        median = stats.get("median_abs_error_pct")
        out[metric] = {
            "target_median_abs_error_pct": bar,
            "median_abs_error_pct": median,
            "points": stats["points"],
            "holds": median is not None and median <= bar,
        }
    return out


# --- output -------------------------------------------------------------------------------------


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "s":
        return f"{value * 1e3:,.2f} ms" if value < 10 else f"{value:,.2f} s"
    return f"{value:,.0f} {unit}"


def _err(value: float | None) -> str:
    return "—" if value is None else f"{value:+.1f}%"


def print_points(console: Console, title: str, points: list[Point]) -> None:
    table = Table(title=title)
    for col in ("id", "engine", "gpu", "setup", "workload", "metric", "measured", "step-only",
                "simulator", "err step-only", "err simulator", "sched. Δ"):  # fmt: skip
        table.add_column(col, justify="right" if col[0] in "mse" and col != "setup" else "left")
    for p in points:
        delta = (
            "—"
            if p.step_only is None
            else f"{100.0 * (p.simulated - p.step_only) / p.step_only:+.1f}%"
        )
        style = "red" if abs(p.error_pct) > 30 else None
        table.add_row(
            p.id, p.engine, p.gpu, p.setup, p.scenario, p.metric,
            _fmt(p.measured, p.unit), _fmt(p.step_only, p.unit), _fmt(p.simulated, p.unit),
            _err(p.step_only_error_pct), _err(p.error_pct), delta, style=style,
        )  # fmt: skip
    console.print(table)


def print_summary(console: Console, summary: dict[str, dict[str, Any]]) -> None:
    table = Table(title="Headline (BLIS-style): |error| of the simulator, and of step times alone")
    for col in ("set", "metric", "points", "median", "P90", "signed median", "step-only median",
                "step-only P90", "step-only signed", "changed by scheduler"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("set", "metric") else "right")
    for name, metrics in summary.items():
        for metric, s in metrics.items():
            sim, step = s["simulator"], s["step_only"]
            table.add_row(
                name,
                metric,
                str(sim["points"]),
                f"{sim['median_abs_error_pct']:.1f}%",
                f"{sim['p90_abs_error_pct']:.1f}%",
                f"{sim['signed_median_error_pct']:+.1f}%",
                f"{step['median_abs_error_pct']:.1f}%" if step["points"] else "—",
                f"{step['p90_abs_error_pct']:.1f}%" if step["points"] else "—",
                f"{step['signed_median_error_pct']:+.1f}%" if step["points"] else "—",
                f"{s['scheduler_changed']} of {sim['points']}",
            )
    console.print(table)


def write_plot(points: list[Point], path: Path) -> None:
    """Predicted vs measured, log-log, y = x: published metrics on top, calibration below."""
    import matplotlib  # noqa: PLC0415 - only when plotting

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: PLC0415

    panels: list[tuple[str, str, list[Point]]] = []
    published = [p for p in points if p.set == "published"]
    for metric in METRICS:
        chosen = [p for p in published if p.metric == metric]
        if chosen:
            panels.append(("published", metric, chosen))
    calibration = [p for p in points if p.set != "published"]
    for label, metric, kind in (
        ("calibration decode", "itl", "decode"),
        ("calibration prefill", "ttft", "prefill"),
        ("calibration mixed", "itl", "mixed"),
    ):
        chosen = [p for p in calibration if p.id.startswith(kind)]
        if chosen:
            panels.append((label, metric, chosen))
    columns = 4
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 4.2 * rows), squeeze=False)
    colours = {"vllm": "tab:blue", "trt-llm / nim": "tab:orange"}
    for ax, (label, metric, chosen) in zip(axes.flat, panels, strict=False):
        scale = 1e3 if chosen[0].unit == "s" else 1.0
        unit = "ms" if chosen[0].unit == "s" else chosen[0].unit
        for p in chosen:
            if p.set == "published":
                colour = colours["vllm" if p.engine.startswith("vllm") else "trt-llm / nim"]
            else:
                colour = "tab:green" if "h200" in p.set else "tab:purple"
            if p.step_only is not None:
                ax.scatter(p.measured * scale, p.step_only * scale, s=28, facecolors="none",
                           edgecolors="grey", linewidths=0.8)  # fmt: skip
            ax.scatter(p.measured * scale, p.simulated * scale, s=16, color=colour, alpha=0.8)
        values = [v * scale for p in chosen for v in (p.measured, p.simulated)]
        low, high = min(values) / 1.3, max(values) * 1.3
        ax.plot([low, high], [low, high], color="black", linewidth=0.8)
        for factor in (0.9, 1.1):
            ax.plot([low, high], [low * factor, high * factor], color="black", linewidth=0.5,
                    linestyle=":")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
        errors = [abs(p.error_pct) for p in chosen]
        ax.set_title(
            f"{label}: {metric.upper()} ({len(chosen)} pts)\n"
            f"median |err| {statistics.median(errors):.1f}%, P90 {percentile(errors, 0.9):.1f}%",
            fontsize=9,
        )
        ax.set_xlabel(f"measured ({unit})", fontsize=8)
        ax.set_ylabel(f"predicted ({unit})", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles = [
        plt.Line2D([], [], marker="o", linestyle="", color=c, label=f"simulator ({name})")
        for name, c in (
            *colours.items(),
            ("hf-torch H100", "tab:purple"),
            ("hf-torch H200", "tab:green"),
        )
    ]
    handles.append(
        plt.Line2D(
            [],
            [],
            marker="o",
            linestyle="",
            markerfacecolor="none",
            color="grey",
            label="step-time only (perf_model_error)",
        )
    )
    handles.append(plt.Line2D([], [], color="black", linestyle=":", label="±10 %"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report path")
    parser.add_argument("--no-calibration", action="store_true", help="published points only")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--serving-rounds",
        type=int,
        default=SERVING_ROUNDS,
        help="requests per closed-loop client (serving_tpot)",
    )
    parser.add_argument(
        "--serving-warmup",
        type=int,
        default=SERVING_WARMUP,
        help="requests per client before the steady-state window opens",
    )
    parser.add_argument(
        "--worst", type=int, default=12, help="calibration rows to print (largest errors first)"
    )
    args = parser.parse_args(argv)
    console = Console(width=220)
    started = time.perf_counter()
    bench = load_perf_bench()
    text = resources.files("gpufleet.perf").joinpath("data", "references.yaml").read_text("utf-8")
    refs = yaml.safe_load(text)["references"]
    rounds, warmup = args.serving_rounds, args.serving_warmup
    if not 1 <= warmup < rounds:
        parser.error("need 1 <= --serving-warmup < --serving-rounds")
    points = published_points(refs, bench, rounds, warmup)
    print_points(console, "Simulator vs published measurements", points)
    if not args.no_calibration:
        calibration = calibration_points(bench)
        for name, members in groups(calibration).items():
            worst = sorted(members, key=lambda p: -abs(p.error_pct))[: args.worst]
            print_points(
                console,
                f"{name}: the {len(worst)} largest errors of {len(members)} (GPU time; all in "
                "the JSON)",
                worst,
            )
        points += calibration
    summary = summarize(points)
    print_summary(console, summary)
    verdict = targets(summary)
    for metric, t in verdict.items():
        console.print(
            f"target {metric.upper()} median |error| ≤ {t['target_median_abs_error_pct']:.0f} % "
            f"on the published points: {t['median_abs_error_pct']} % over {t['points']} points "
            f"→ {'holds' if t['holds'] else 'DOES NOT HOLD'}"
        )
    what_if = what_ifs(refs, points, rounds, warmup)
    for w in what_if:
        console.print(
            f"what-if {w['id']}, {w['variant']}: {w['error_pct']:+.1f} % (headline "
            f"{w['headline_error_pct']:+.1f} %, step-only {w['step_only_error_pct']:+.1f} %; "
            f"preemptions {w['headline_preemptions']} → {w['preemptions']})"
        )
    same = [p.detail["same_batch_as_step_only"] for p in points if p.set != "published"]
    if same:
        console.print(
            f"calibration rows whose replica step is the batch perf_model_error prices: "
            f"{sum(same)} of {len(same)}"
        )
    wall = time.perf_counter() - started
    report = {
        "command": "python bench/sim_fidelity.py" + (" " + " ".join(argv) if argv else ""),
        "targets": verdict,
        "summary": summary,
        "what_if": what_if,
        "wall_s": round(wall, 1),
        "points": [p.as_dict() for p in points],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", "utf-8")
    shown = args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out
    console.print(f"wrote {shown} ({wall:.1f} s)")
    if not args.no_plot:
        png = args.out.with_suffix(".png")
        write_plot(points, png)
        console.print(f"wrote {png.relative_to(REPO) if png.is_relative_to(REPO) else png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
