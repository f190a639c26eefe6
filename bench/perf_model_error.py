"""Error of the step-time model against published measurements, and its speed.

    .venv/bin/python bench/perf_model_error.py     # table + bench/results/perf_model_error.json

Reference sets:

* ``published``: src/gpufleet/perf/data/references.yaml — vLLM, TensorRT-LLM and NIM numbers
  from their own benchmarks and public write-ups (see that file's header for the scenarios);
* ``hf-torch-<gpu>``, one per document under src/gpufleet/perf/data/measured/
  (``h100-sxm-forward.json`` → ``hf-torch-h100``, ``h200-forward.json`` → ``hf-torch-h200``):
  forward passes of a plain-PyTorch Llama on one GPU (bench/gpu_calibration/calibrate.py), the
  GPU taken from the document's ``meta.gpu_name`` (see ``DEVICE_GPUS``). Not vLLM: no scheduler,
  so they are compared with the model's GPU time (step time minus its calibrated CPU
  overhead); CUDA-graph rows where there are some;
* ``hf-torch-<gpu>-mixed``: a document's ``mixed`` rows where it has some (the H100's),
  chunked-prefill steps that run B decodes at context C and a prompt chunk of L tokens on P
  cached together (GPU time as above), and the batching saving of such a step against the
  decode-only plus the chunk-only step measured in the same run, predicted vs measured (ms).

Error is (predicted − measured) / measured. The headline is the median and maximum absolute
error of each set. The speed section times ``StepTimeModel.step_time`` on a mix of batches
against building those batches (a baseline from the same run: these machines are noisy).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from gpufleet.catalog import (
    GPUSpec,
    ModelSpec,
    UnknownGPUError,
    UnknownModelError,
    get_gpu,
    get_model,
)
from gpufleet.perf import BatchShape, Dtype, StepTimeModel, efficiency_for
from gpufleet.perf._step import smooth_roofline

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "perf_model_error.json"
MEASURED_DIR = REPO / "src" / "gpufleet" / "perf" / "data" / "measured"
DEVICE_GPUS = {  # nvidia-smi's name in a measured document's meta.gpu_name → catalog GPU
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H200": "h200",
}
DEFAULT_BUDGET = 8192  # tokens per step (vLLM's max_num_batched_tokens for online serving)


@dataclass
class Row:
    set: str
    id: str
    engine: str
    model: str
    gpu: str
    setup: str
    scenario: str
    unit: str
    measured: float
    predicted: float | None
    error_pct: float | None
    source: str = ""
    note: str = ""
    breakdown: dict[str, float] = field(default_factory=dict)


# --- scenarios: published workloads in terms of step times ------------------------------------


def prefill_batch(lengths: Iterable[tuple[int, int]]) -> BatchShape:
    """Sequences prefilling ``(new, cached)`` tokens in one step."""
    total = BatchShape()
    for new, cached in lengths:
        total = total + BatchShape.prefill(new, cached)
    return total


def prefill_steps(seqs: int, tokens: int, budget: int) -> list[BatchShape]:
    """The steps that prefill ``seqs`` prompts of ``tokens`` each, ``budget`` tokens a step."""
    remaining = [tokens] * seqs
    done = [0] * seqs
    steps = []
    index = 0
    while index < seqs:
        room = budget
        chunk: list[tuple[int, int]] = []
        while index < seqs and room > 0:
            take = min(room, remaining[index])
            chunk.append((take, done[index]))
            done[index] += take
            remaining[index] -= take
            room -= take
            if remaining[index] == 0:
                index += 1
        steps.append(prefill_batch(chunk))
    return steps


def latency_run(model: StepTimeModel, batch: int, inp: int, out: int, budget: int | None) -> float:
    """Seconds to prefill ``batch`` prompts and generate ``out`` tokens for each."""
    steps = prefill_steps(batch, inp, budget or batch * inp)
    total = sum(model.step_time(s).seconds for s in steps)  # the last one samples token 1
    for k in range(1, out):
        total += model.decode_time(batch, inp + k)
    return total


def decode_tpot(model: StepTimeModel, batch: int, inp: int, out: int) -> float:
    """Mean decode step while the context grows from ``inp`` to ``inp + out``."""
    steps = [model.decode_time(batch, inp + k) for k in range(1, out)]
    return sum(steps) / len(steps)


def serving_tpot(model: StepTimeModel, conc: int, inp: int, out: int, budget: int) -> float:
    """Mean step time seen by a decoding request when ``conc`` are kept in flight.

    While one request decodes its ``out`` tokens, each of the other ``conc - 1`` slots turns
    over once: its next prompt of ``inp`` tokens is prefilled, in chunks of at most ``budget``
    tokens, in steps shared with the decoding requests (arrivals assumed evenly spread). The
    other steps are pure decode of all ``conc`` requests at their mean context.
    """
    chunks = math.ceil(inp / budget)
    chunk = math.ceil(inp / chunks)
    mean_cached = chunk * (chunks - 1) // 2
    mean_context = inp + out // 2
    pure = model.step_time(BatchShape.uniform_decode(conc, mean_context)).seconds
    if conc == 1:
        return pure
    decoding = BatchShape.uniform_decode(conc - 1, mean_context)
    chunk_steps = (conc - 1) * chunks
    if chunk_steps <= out:
        mixed = model.step_time(decoding + BatchShape.prefill(chunk, mean_cached)).seconds
        return (chunk_steps * mixed + (out - chunk_steps) * pure) / out
    per_step = max(1, round(chunk_steps / out))
    mixed_batch = prefill_batch([(chunk, mean_cached)] * per_step)
    return model.step_time(decoding + mixed_batch).seconds


def evaluate(ref: dict[str, Any], model: StepTimeModel) -> float:
    scenario = ref["scenario"]
    inp = int(ref.get("input_tokens", 0))
    out = int(ref.get("output_tokens", 0))
    budget = ref.get("max_batched_tokens")
    if scenario == "latency_run":
        return latency_run(model, int(ref["batch"]), inp, out, budget)
    if scenario == "static_throughput":
        seconds = latency_run(model, int(ref["batch"]), inp, out, budget)
        tokens_per_s = int(ref["batch"]) * out / seconds
        return tokens_per_s / (model.tp * model.pp) if ref.get("per_gpu") else tokens_per_s
    if scenario == "ttft":
        return sum(model.step_time(s).seconds for s in prefill_steps(1, inp, budget or inp))
    if scenario == "decode_tpot":
        return decode_tpot(model, int(ref["batch"]), inp, out)
    if scenario == "serving_tpot":
        return serving_tpot(model, int(ref["concurrency"]), inp, out, budget or DEFAULT_BUDGET)
    raise ValueError(f"{ref['id']}: unknown scenario {scenario!r}")


def _catalog(model_name: str, gpu_name: str) -> tuple[ModelSpec, GPUSpec] | str:
    try:
        return get_model(model_name), get_gpu(gpu_name)
    except (UnknownModelError, UnknownGPUError) as exc:
        return f"not in catalog: {exc}"


def published_rows(refs: list[dict[str, Any]]) -> list[Row]:
    rows = []
    for ref in refs:
        weights = Dtype(ref.get("weights_dtype", "bf16"))
        kv = Dtype(ref.get("kv_dtype", "bf16"))
        tp, pp = int(ref.get("tp", 1)), int(ref.get("pp", 1))
        setup = f"tp{tp}" + (f" pp{pp}" if pp > 1 else "") + f" {weights}"
        row = Row(
            set="published",
            id=ref["id"],
            engine=ref["engine"],
            model=ref["model"],
            gpu=ref["gpu"],
            setup=setup,
            scenario=_describe(ref),
            unit=ref["unit"],
            measured=float(ref["measured"]),
            predicted=None,
            error_pct=None,
            source=ref.get("url", ""),
            note=ref.get("assumed", ""),
        )
        specs = _catalog(ref["model"], ref["gpu"])
        if isinstance(specs, str):
            row.note = specs
        else:
            step_model = StepTimeModel(*specs, tp=tp, pp=pp, weights_dtype=weights, kv_dtype=kv)
            row.predicted = evaluate(ref, step_model)
            row.error_pct = 100.0 * (row.predicted - row.measured) / row.measured
        rows.append(row)
    return rows


def _describe(ref: dict[str, Any]) -> str:
    s = ref["scenario"]
    io = f"{ref.get('input_tokens', '?')}/{ref.get('output_tokens', '-')}"
    if s in ("latency_run", "static_throughput", "decode_tpot"):
        return f"{s} b={ref['batch']} {io}"
    if s == "serving_tpot":
        return f"{s} c={ref['concurrency']} {io}"
    return f"{s} {ref.get('input_tokens')}"


# --- the HF/torch measurements (one set per GPU) ------------------------------------------------


@dataclass
class MeasuredSet:
    """One measured document: which catalog GPU it ran on and the name of its set."""

    path: Path
    doc: dict[str, Any]
    gpu: str
    device: str

    @property
    def name(self) -> str:
        return set_name(self.gpu)

    @property
    def mixed_name(self) -> str:
        return f"{self.name}-mixed"


def set_name(gpu: str) -> str:
    """``h100-sxm`` → ``hf-torch-h100``, ``h200`` → ``hf-torch-h200``."""
    return "hf-torch-" + re.sub(r"-sxm\d*$", "", gpu)


def document_gpu(doc: dict[str, Any]) -> str:
    """The catalog GPU a measured document ran on (from its ``meta.gpu_name``)."""
    device = str(doc.get("meta", {}).get("gpu_name", ""))
    if device not in DEVICE_GPUS:
        raise ValueError(
            f"measured document from {device or 'an unnamed GPU'!r}: add it to DEVICE_GPUS"
        )
    return DEVICE_GPUS[device]


def load_measured(paths: Iterable[Path]) -> list[MeasuredSet]:
    """The measured documents at ``paths``, one set each (a GPU may appear only once)."""
    sets: list[MeasuredSet] = []
    for path in paths:
        doc = json.loads(path.read_text("utf-8"))
        gpu = document_gpu(doc)
        if any(s.gpu == gpu for s in sets):
            raise ValueError(f"{path}: a second measured document for {gpu}")
        sets.append(MeasuredSet(path, doc, gpu, str(doc["meta"]["gpu_name"])))
    return sets


def _catalog_model_name(name: str) -> str:
    """calibrate.py's ``llama3.1-70b-8L`` → the catalog's ``llama-3.1-70b``.

    A ``-<n>L`` suffix marks a model cut to ``n`` layers to fit one GPU; the rows carry
    ``num_layers`` and the bench builds that cut of the catalog model.
    """
    name = re.sub(r"-\d+L$", "", name)
    if name.startswith("llama") and not name.startswith("llama-"):
        return "llama-" + name[len("llama") :]
    return name


def measured_rows(doc: dict[str, Any], gpu_name: str | None = None) -> list[Row]:
    """A measured document's decode, prefill, chain and GEMM rows (``gpu_name``: its GPU)."""
    gpu_name = gpu_name or document_gpu(doc)
    gpu = get_gpu(gpu_name)
    name = set_name(gpu_name)
    rows: list[Row] = []
    models: dict[tuple[str, int], StepTimeModel | str] = {}

    def step_model(name: str, layers: int | None) -> StepTimeModel | str:
        key = (name, layers or 0)
        if key not in models:
            try:
                spec = get_model(_catalog_model_name(name))
            except UnknownModelError as exc:
                models[key] = f"not in catalog: {exc}"
            else:
                if layers and layers != spec.num_layers:
                    spec = spec.model_copy(update={"num_layers": layers})
                models[key] = StepTimeModel(spec, gpu)
        return models[key]

    configs = doc.get("models", {})

    def add(
        kind: str, rec: dict[str, Any], scenario: str, predict: Callable[[StepTimeModel], float]
    ) -> None:
        layers = rec.get("num_layers") or configs.get(rec["model"], {}).get("num_layers")
        m = step_model(rec["model"], layers)
        row = Row(
            set=name,
            id=f"{kind}-{rec['model']}-{scenario.replace(' ', '-')}",
            engine="hf/torch (plain PyTorch Llama, not vLLM)",
            model=_catalog_model_name(rec["model"]),
            gpu=gpu_name,
            setup="tp1 bf16" + ("" if rec.get("cuda_graph", True) else " eager"),
            scenario=scenario,
            unit="s",
            measured=float(rec["ms_p50"]) / 1e3,
            predicted=None,
            error_pct=None,
            note="GPU time: model seconds minus calibrated CPU overhead",
        )
        if isinstance(m, str):
            row.note = m
        else:
            row.predicted = predict(m)
            row.error_pct = 100.0 * (row.predicted - row.measured) / row.measured
        rows.append(row)

    def gpu_time(m: StepTimeModel, batch: BatchShape) -> float:
        t = m.step_time(batch)
        return t.seconds - t.overhead

    for rec in _prefer_graph(doc.get("decode", []), ("model", "batch", "context")):
        b, c = int(rec["batch"]), int(rec["context"])
        add(
            "decode",
            rec,
            f"decode b={b} ctx={c}",
            lambda m, b=b, c=c: gpu_time(m, BatchShape.uniform_decode(b, c + 1)),
        )
    for rec in _prefer_graph(
        doc.get("prefill", []), ("model", "batch", "new_tokens", "cached_tokens")
    ):
        b, n, p = int(rec["batch"]), int(rec["new_tokens"]), int(rec["cached_tokens"])
        add(
            "prefill",
            rec,
            f"prefill b={b} new={n} cached={p}",
            lambda m, b=b, n=n, p=p: gpu_time(m, prefill_batch([(n, p)] * b)),
        )
    for rec in _prefer_graph(doc.get("chain", []), ("model", "m")):
        mm = int(rec["m"])
        add(
            "chain",
            rec,
            f"linear layers m={mm}",
            lambda m, mm=mm: m.step_time(BatchShape.uniform_decode(mm, 1)).linear,
        )
    eff = efficiency_for(gpu)
    for rec in doc.get("gemm", []):
        mm, k, n = int(rec["m"]), int(rec["k"]), int(rec["n"])
        compute = 2.0 * mm * k * n / (gpu.bf16_tflops * 1e12 * eff.gemm_flops_fraction)
        memory = 2.0 * k * n / (gpu.memory_bandwidth_gb_s * 1e9 * eff.memory_bandwidth_fraction)
        predicted = smooth_roofline(compute, memory, eff.roofline_exponent)
        measured = float(rec["ms_p50"]) / 1e3
        rows.append(
            Row(
                set=name,
                id=f"gemm-{rec.get('model')}-{rec.get('op')}-m{mm}",
                engine="torch F.linear (cuBLAS)",
                model=_catalog_model_name(str(rec.get("model", ""))),
                gpu=gpu_name,
                setup="bf16",
                scenario=f"gemm {rec.get('op')} m={mm} k={k} n={n}",
                unit="s",
                measured=measured,
                predicted=predicted,
                error_pct=100.0 * (predicted - measured) / measured,
                note="one GEMM: roofline of 2mkn FLOPs and k·n weight bytes",
            )
        )
    return rows


def mixed_rows(
    doc: dict[str, Any], gpu_name: str | None = None
) -> tuple[list[Row], list[dict[str, Any]]]:
    """Mixed steps (B decodes at context C + one chunk of L tokens on P cached) on one GPU.

    The rows come from the same plain-PyTorch model as the ``hf-torch-<gpu>`` set (split
    attention layout: one FlashAttention-2 call for the decode batch and one for the chunk per
    layer, GEMMs over all B + L tokens; CUDA graphs), so they are compared with the model's GPU
    time too. Rows with both B and L > 0 are the reference points; the decode-only (L = 0) and
    chunk-only (B = 0) rows of the same run give the measured batching saving,
    ``decode step + chunk step − mixed step``, which is set against the model's own.
    """
    gpu_name = gpu_name or document_gpu(doc)
    gpu = get_gpu(gpu_name)
    mixed_set = set_name(gpu_name) + "-mixed"
    models: dict[tuple[str, int], StepTimeModel | str] = {}
    configs = doc.get("models", {})

    def step_model(rec: dict[str, Any]) -> StepTimeModel | str:
        layers = rec.get("num_layers") or configs.get(rec["model"], {}).get("num_layers") or 0
        key = (rec["model"], layers)
        if key not in models:
            try:
                spec = get_model(_catalog_model_name(rec["model"]))
            except UnknownModelError as exc:
                models[key] = f"not in catalog: {exc}"
            else:
                if layers and layers != spec.num_layers:
                    spec = spec.model_copy(update={"num_layers": layers})
                models[key] = StepTimeModel(spec, gpu)
        return models[key]

    def gpu_time(m: StepTimeModel, batch: BatchShape) -> float:
        t = m.step_time(batch)
        return t.seconds - t.overhead

    def shape(b: int, c: int, n: int, p: int) -> BatchShape:
        decode = BatchShape.uniform_decode(b, c) if b else BatchShape()
        return decode + (BatchShape.prefill(n, cached=p) if n else BatchShape())

    split = [r for r in doc.get("mixed", []) if r.get("attn_layout", "split") == "split"]
    key = ("model", "decode_seqs", "decode_context", "chunk_tokens", "chunk_cached")
    points = {
        tuple(rec[f] for f in key): rec for rec in _prefer_graph(split, key)
    }  # (model, B, C, L, P) → record
    rows: list[Row] = []
    savings: list[dict[str, Any]] = []
    for (name, b, c, n, p), rec in sorted(points.items()):
        if not (b and n):
            continue
        m = step_model(rec)
        row = Row(
            set=mixed_set,
            id=f"mixed-{name}-b={b}-ctx={c}-new={n}-cached={p}",
            engine="hf/torch (plain PyTorch Llama, not vLLM)",
            model=_catalog_model_name(name),
            gpu=gpu_name,
            setup="tp1 bf16" + ("" if rec.get("cuda_graph", True) else " eager"),
            scenario=f"mixed b={b} ctx={c} + chunk new={n} cached={p}",
            unit="s",
            measured=float(rec["ms_p50"]) / 1e3,
            predicted=None,
            error_pct=None,
            note="GPU time: model seconds minus calibrated CPU overhead; "
            "uniform_decode(B, C) + prefill(L, cached=P)",
        )
        rows.append(row)
        if isinstance(m, str):
            row.note = m
            continue
        mixed = gpu_time(m, shape(b, c, n, p))
        row.predicted = mixed
        row.error_pct = 100.0 * (mixed - row.measured) / row.measured
        decode_rec = points.get((name, b, c, 0, 0))
        chunk_rec = points.get((name, 0, 0, n, p))
        if decode_rec is None or chunk_rec is None:
            continue  # the 8192 − B column has no chunk-only step of that length
        measured_decode = float(decode_rec["ms_p50"]) / 1e3
        measured_chunk = float(chunk_rec["ms_p50"]) / 1e3
        decode = gpu_time(m, shape(b, c, 0, 0))
        chunk = gpu_time(m, shape(0, 0, n, p))
        measured_saving = measured_decode + measured_chunk - row.measured
        predicted_saving = decode + chunk - mixed
        savings.append(
            {
                "model": row.model,
                "decode_seqs": b,
                "decode_context": c,
                "chunk_tokens": n,
                "chunk_cached": p,
                "measured_ms": {
                    "decode": round(measured_decode * 1e3, 3),
                    "chunk": round(measured_chunk * 1e3, 3),
                    "mixed": round(row.measured * 1e3, 3),
                    "saving": round(measured_saving * 1e3, 3),
                    "decode_added": round((row.measured - measured_chunk) * 1e3, 3),
                },
                "predicted_ms": {
                    "decode": round(decode * 1e3, 3),
                    "chunk": round(chunk * 1e3, 3),
                    "mixed": round(mixed * 1e3, 3),
                    "saving": round(predicted_saving * 1e3, 3),
                    "decode_added": round((mixed - chunk) * 1e3, 3),
                },
                "saving_error_ms": round((predicted_saving - measured_saving) * 1e3, 3),
                "saving_measured_pct_of_separate": round(
                    100.0 * measured_saving / (measured_decode + measured_chunk), 1
                ),
                "saving_predicted_pct_of_separate": round(
                    100.0 * predicted_saving / (decode + chunk), 1
                ),
            }
        )
    return rows, savings


def saving_summary(savings: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and maximum |predicted − measured| batching saving (ms), overall and by L."""
    if not savings:
        return {"points": 0}
    errs = [abs(s["saving_error_ms"]) for s in savings]
    by_chunk: dict[int, list[dict[str, Any]]] = {}
    for s in savings:
        by_chunk.setdefault(s["chunk_tokens"], []).append(s)

    def med(items: list[dict[str, Any]], side: str, what: str) -> float:
        return round(float(statistics.median(s[side][what] for s in items)), 2)

    return {
        "points": len(errs),
        "median_abs_error_ms": round(statistics.median(errs), 2),
        "max_abs_error_ms": round(max(errs), 2),
        "by_chunk_tokens": {
            str(n): {
                "points": len(items),
                "measured_saving_ms_median": med(items, "measured_ms", "saving"),
                "measured_saving_ms_range": [
                    round(min(s["measured_ms"]["saving"] for s in items), 2),
                    round(max(s["measured_ms"]["saving"] for s in items), 2),
                ],
                "predicted_saving_ms_median": med(items, "predicted_ms", "saving"),
                "predicted_saving_ms_range": [
                    round(min(s["predicted_ms"]["saving"] for s in items), 2),
                    round(max(s["predicted_ms"]["saving"] for s in items), 2),
                ],
                "median_abs_error_ms": round(
                    statistics.median(abs(s["saving_error_ms"]) for s in items), 2
                ),
            }
            for n, items in sorted(by_chunk.items())
        },
    }


def print_savings(console: Console, savings: list[dict[str, Any]]) -> None:
    """The batching saving by chunk length, and what a decode batch adds to a chunk step."""
    table = Table(
        title="Batching saving: decode step + chunk step − mixed step (GPU time, ms), "
        "median over B, C, P"
    )
    for col in ("L", "points", "measured", "measured range", "predicted", "predicted range",
                "median |err|"):  # fmt: skip
        table.add_column(col, justify="right")
    for n, s in saving_summary(savings).get("by_chunk_tokens", {}).items():
        lo, hi = s["measured_saving_ms_range"]
        plo, phi = s["predicted_saving_ms_range"]
        table.add_row(
            n,
            str(s["points"]),
            f"{s['measured_saving_ms_median']:.2f}",
            f"{lo:.2f} … {hi:.2f}",
            f"{s['predicted_saving_ms_median']:.2f}",
            f"{plo:.2f} … {phi:.2f}",
            f"{s['median_abs_error_ms']:.2f}",
        )
    console.print(table)
    added: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for s in savings:
        added.setdefault((s["decode_seqs"], s["decode_context"]), []).append(s)
    table = Table(
        title="What a decode batch adds to a chunk step (mixed − chunk-only, GPU time, ms), "
        "median over L, P"
    )
    for col in ("B", "C", "decode step alone (meas.)", "added (meas.)", "decode step alone "
                "(pred.)", "added (pred.)"):  # fmt: skip
        table.add_column(col, justify="right")
    for (b, c), items in sorted(added.items()):
        table.add_row(
            str(b),
            str(c),
            f"{items[0]['measured_ms']['decode']:.2f}",
            f"{statistics.median(s['measured_ms']['decode_added'] for s in items):.2f}",
            f"{items[0]['predicted_ms']['decode']:.2f}",
            f"{statistics.median(s['predicted_ms']['decode_added'] for s in items):.2f}",
        )
    console.print(table)


def _prefer_graph(records: list[dict[str, Any]], key: tuple[str, ...]) -> list[dict[str, Any]]:
    """One record per point: the CUDA-graph one when both were measured."""
    chosen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for rec in records:
        k = (*(rec.get(f) for f in key), rec.get("num_layers"))
        if k not in chosen or (rec.get("cuda_graph") and not chosen[k].get("cuda_graph")):
            chosen[k] = rec
    return list(chosen.values())


def bandwidth_checks(doc: dict[str, Any], gpu_name: str | None = None) -> list[dict[str, Any]]:
    gpu = get_gpu(gpu_name or document_gpu(doc))
    eff = efficiency_for(gpu)
    achievable = gpu.memory_bandwidth_gb_s * eff.memory_bandwidth_fraction
    return [
        {
            "test": rec.get("test"),
            "measured_gb_s": rec.get("gb_s_p50"),
            "measured_fraction_of_peak": round(
                float(rec["gb_s_p50"]) / gpu.memory_bandwidth_gb_s, 3
            )
            if rec.get("gb_s_p50")
            else None,
            "model_achievable_gb_s": round(achievable, 1),
            "model_fraction_of_peak": eff.memory_bandwidth_fraction,
            "peak_gb_s": gpu.memory_bandwidth_gb_s,
        }
        for rec in doc.get("bandwidth", [])
    ]


# --- speed --------------------------------------------------------------------------------------


def speed(calls: int) -> dict[str, float]:
    model = StepTimeModel(get_model("llama-3.1-8b"), get_gpu("h100-sxm"))
    moe = StepTimeModel(get_model("mixtral-8x7b"), get_gpu("h100-sxm"), tp=2)
    specs = [(b, c, p) for b in (1, 8, 64, 256) for c in (128, 2048) for p in (0, 512)]
    batches = [
        BatchShape.uniform_decode(b, c) + (BatchShape.prefill(p, c) if p else BatchShape())
        for b, c, p in specs
    ]
    rounds = max(1, calls // len(batches))

    def rate(fn: Callable[[], object]) -> float:
        best = math.inf
        for _ in range(3):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return rounds * len(batches) / best

    def run(m: StepTimeModel) -> Callable[[], None]:
        def go() -> None:
            step = m.step_time
            for _ in range(rounds):
                for batch in batches:
                    step(batch)

        return go

    def build() -> None:
        for _ in range(rounds):
            for b, c, _p in specs:
                BatchShape.uniform_decode(b, c)

    return {
        "step_time_calls_per_s": rate(run(model)),
        "step_time_moe_tp2_calls_per_s": rate(run(moe)),
        "baseline_build_batchshape_per_s": rate(build),
    }


# --- report -------------------------------------------------------------------------------------


def summary(rows: list[Row]) -> dict[str, Any]:
    errs = [abs(r.error_pct) for r in rows if r.error_pct is not None]
    if not errs:
        return {"points": 0}
    return {
        "points": len(errs),
        "median_abs_error_pct": round(statistics.median(errs), 1),
        "mean_abs_error_pct": round(statistics.fmean(errs), 1),
        "max_abs_error_pct": round(max(errs), 1),
        "within_25_pct": sum(e <= 25 for e in errs),
        "skipped": sum(r.error_pct is None for r in rows),
    }


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "s":
        return f"{value * 1e3:,.2f} ms" if value < 10 else f"{value:,.2f} s"
    return f"{value:,.0f} {unit}"


def print_table(console: Console, title: str, rows: list[Row]) -> None:
    table = Table(title=title, show_lines=False)
    for col in (
        "id",
        "engine",
        "gpu",
        "model",
        "setup",
        "scenario",
        "measured",
        "predicted",
        "error",
    ):
        table.add_column(
            col, justify="right" if col in ("measured", "predicted", "error") else "left"
        )
    for r in rows:
        err = "skipped" if r.error_pct is None else f"{r.error_pct:+.1f}%"
        style = "red" if r.error_pct is not None and abs(r.error_pct) > 30 else None
        table.add_row(
            r.id, r.engine, r.gpu, r.model, r.setup, r.scenario,
            _fmt(r.measured, r.unit), _fmt(r.predicted, r.unit), err, style=style,
        )  # fmt: skip
    console.print(table)


def by_kind(rows: list[Row]) -> list[dict[str, Any]]:
    """Signed error by kind of measurement and model: the bias, not just its size."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r.error_pct is not None:
            groups.setdefault((r.id.split("-")[0], r.model), []).append(r.error_pct)
    return [
        {
            "kind": kind,
            "model": model,
            "points": len(errs),
            "median_error_pct": round(statistics.median(errs), 1),
            "min_error_pct": round(min(errs), 1),
            "max_error_pct": round(max(errs), 1),
        }
        for (kind, model), errs in sorted(groups.items())
    ]


def print_groups(console: Console, name: str, rows: list[Row]) -> None:
    table = Table(title=f"{name} by kind: signed error (predicted − measured)")
    for col in ("kind", "model", "points", "median", "min", "max"):
        table.add_column(col)
    for g in by_kind(rows):
        table.add_row(
            g["kind"],
            g["model"],
            str(g["points"]),
            f"{g['median_error_pct']:+.1f}%",
            f"{g['min_error_pct']:+.1f}%",
            f"{g['max_error_pct']:+.1f}%",
        )
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report path")
    parser.add_argument(
        "--measured",
        type=Path,
        action="append",
        help="a measured HF/torch JSON document (repeatable; default: every *.json in "
        f"{MEASURED_DIR.relative_to(REPO)})",
    )
    parser.add_argument(
        "--calls", type=int, default=200_000, help="step_time calls timed (0: skip)"
    )
    parser.add_argument(
        "--worst", type=int, default=15, help="HF/torch rows to print (largest errors first)"
    )
    args = parser.parse_args(argv)
    console = Console(width=200)

    text = resources.files("gpufleet.perf").joinpath("data", "references.yaml").read_text("utf-8")
    published = published_rows(yaml.safe_load(text)["references"])
    print_table(console, "Step-time model vs published measurements", published)
    sets = {"published": published}
    groups = {
        "published: vllm": [r for r in published if r.engine.startswith("vllm")],
        "published: trt-llm / nim": [r for r in published if not r.engine.startswith("vllm")],
    }
    report: dict[str, Any] = {"command": "python bench/perf_model_error.py"}
    paths = args.measured or sorted(MEASURED_DIR.glob("*.json"))
    measured_sets = load_measured(p for p in paths if p.exists())
    for missing in (p for p in paths if not p.exists()):
        console.print(f"[dim]no HF/torch measurements at {missing} (skipped)[/dim]")
    report["measured_sets"] = {}
    for ms in measured_sets:
        gpu = get_gpu(ms.gpu)
        measured = measured_rows(ms.doc, ms.gpu)
        worst = sorted(measured, key=lambda r: -abs(r.error_pct or 0.0))[: args.worst]
        print_table(
            console,
            f"{ms.name}: step-time model vs HF/torch forward passes on one {gpu.display_name} "
            f"({ms.device}, not vLLM): the {len(worst)} largest errors of {len(measured)} "
            f"(all in the JSON)",
            worst,
        )
        print_groups(console, ms.name, measured)
        sets[ms.name] = measured
        groups[f"{ms.name}: decode+prefill"] = [
            r for r in measured if r.id.startswith(("decode", "prefill"))
        ]
        groups[f"{ms.name}: chain+gemm"] = [
            r for r in measured if r.id.startswith(("chain", "gemm"))
        ]
        info: dict[str, Any] = {
            "file": str(ms.path.relative_to(REPO) if ms.path.is_relative_to(REPO) else ms.path),
            "device": ms.device,
            "gpu": ms.gpu,
            "sets": [ms.name],
            "by_kind": by_kind(measured),
        }
        mixed, savings = mixed_rows(ms.doc, ms.gpu)
        if mixed:
            worst = sorted(mixed, key=lambda r: -abs(r.error_pct or 0.0))[: args.worst]
            print_table(
                console,
                f"{ms.mixed_name}: step-time model vs mixed prefill + decode steps on one "
                f"{gpu.display_name} (plain PyTorch, not vLLM): the {len(worst)} largest errors "
                f"of {len(mixed)}",
                worst,
            )
            print_savings(console, savings)
            sets[ms.mixed_name] = mixed
            info["sets"].append(ms.mixed_name)
            info["batching_saving"] = {"summary": saving_summary(savings), "points": savings}
        info["bandwidth_checks"] = bandwidth_checks(ms.doc, ms.gpu)
        for check in info["bandwidth_checks"]:
            console.print(f"{ms.name} bandwidth {check['test']}: measured "
                          f"{check['measured_gb_s']} GB/s ({check['measured_fraction_of_peak']} of "
                          f"{check['peak_gb_s']:,.0f}), model streams weights at "
                          f"{check['model_achievable_gb_s']} GB/s")  # fmt: skip
        report["measured_sets"][ms.name] = info

    summaries = {name: summary(rows) for name, rows in {**sets, **groups}.items()}
    sums = Table(title="Headline: absolute error of the model")
    for col in ("set", "points", "median |err|", "mean |err|", "max |err|", "within 25%"):
        sums.add_column(col)
    for name, s in summaries.items():
        if s["points"]:
            sums.add_row(
                name,
                str(s["points"]),
                f"{s['median_abs_error_pct']}%",
                f"{s['mean_abs_error_pct']}%",
                f"{s['max_abs_error_pct']}%",
                str(s["within_25_pct"]),
            )
    console.print(sums)
    for name, info in report["measured_sets"].items():
        if "batching_saving" in info:
            sav = info["batching_saving"]["summary"]
            console.print(
                f"{name}-mixed batching saving ({sav['points']} points): |predicted − measured| "
                f"median {sav['median_abs_error_ms']} ms, max {sav['max_abs_error_ms']} ms"
            )

    if args.calls:
        report["speed"] = speed(args.calls)
        for name, value in report["speed"].items():
            console.print(f"{name}: {value:,.0f}")
    report["summary"] = summaries
    report["rows"] = [asdict(r) for rows in sets.values() for r in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", "utf-8")
    console.print(
        f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
