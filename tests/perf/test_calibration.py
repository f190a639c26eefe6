"""The calibration file (efficiency constants) and the references the model is checked against."""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from gpufleet.catalog import LinkKind, get_gpu, get_model, load_gpus
from gpufleet.perf import CalibrationError, Dtype, efficiency_for, load_calibration
from gpufleet.perf._calibration import parse_calibration

REPO = Path(__file__).resolve().parents[2]


def packaged(name: str) -> Any:
    return yaml.safe_load(
        resources.files("gpufleet.perf").joinpath("data", name).read_text("utf-8")
    )


# --- calibration.yaml --------------------------------------------------------------------------


def test_packaged_calibration_parses_and_gives_every_constant_a_reason() -> None:
    cal = load_calibration()
    doc = packaged("calibration.yaml")
    values = _count_values(doc["defaults"]) + sum(_count_values(g) for g in doc["gpus"].values())
    assert len(cal.reasons) == values
    assert all(len(why) > 20 for why in cal.reasons.values())


def _count_values(entry: dict[str, Any]) -> int:
    return sum(_count_values(v) if "value" not in v else 1 for v in entry.values())


def test_overrides_name_catalog_gpus() -> None:
    assert set(load_calibration().overrides) <= set(load_gpus())


def test_gpu_overrides_apply_on_top_of_defaults() -> None:
    cal = load_calibration()
    h100 = efficiency_for(get_gpu("h100-sxm"))
    assert h100 == cal.for_gpu("h100-sxm") == efficiency_for("h100-sxm")
    assert h100.attention_flops_fraction == cal.overrides["h100-sxm"]["attention_flops_fraction"]
    assert h100.attention_flops_fraction != cal.defaults.attention_flops_fraction
    assert h100.step_overhead_s == cal.defaults.step_overhead_s
    assert efficiency_for("some-future-gpu") == cal.defaults


def test_links_have_their_own_efficiency() -> None:
    eff = load_calibration().defaults
    assert eff.link(LinkKind.NVLINK) is eff.nvlink
    assert eff.link(LinkKind.INFINITY_FABRIC) is eff.infinity_fabric
    assert eff.link(LinkKind.PCIE) is eff.pcie
    assert eff.pcie.allreduce_latency_s > eff.nvlink.allreduce_latency_s


def test_replace_validates() -> None:
    eff = load_calibration().defaults
    assert eff.replace(step_overhead_s=0.0).step_overhead_s == 0.0
    assert eff.replace(roofline_exponent=math.inf).roofline_exponent == math.inf
    with pytest.raises(CalibrationError, match=r"memory_bandwidth_fraction must be in \(0, 1\]"):
        eff.replace(memory_bandwidth_fraction=1.2)
    with pytest.raises(CalibrationError, match="roofline_exponent must be at least 1"):
        eff.replace(roofline_exponent=0.5)
    with pytest.raises(CalibrationError, match="step_overhead_s must be a finite number"):
        eff.replace(step_overhead_s=-1e-3)


def _bad(mutate: Any) -> dict[str, Any]:
    doc = copy.deepcopy(packaged("calibration.yaml"))
    mutate(doc)
    return doc


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["defaults"].pop("gemm_flops_fraction"), "defaults lack gemm_flops_fraction"),
        (lambda d: d["defaults"].update(typo={"value": 1, "why": "x"}), "unknown constant 'typo'"),
        (lambda d: d["defaults"]["gemm_flops_fraction"].update(why=" "), "needs a non-empty 'why'"),
        (lambda d: d["defaults"]["gemm_flops_fraction"].pop("why"), "expected {value"),
        (lambda d: d["defaults"]["gemm_flops_fraction"].update(value="high"), "must be a number"),
        (
            lambda d: d["gpus"]["h100-sxm"]["attention_flops_fraction"].update(value=3),
            "gpus.h100-sxm",
        ),
        (lambda d: d["defaults"]["links"].update(ethernet={}), "'links' must map"),
        (
            lambda d: d["defaults"]["links"]["pcie"].update(speed={"value": 1, "why": "x"}),
            "unknown constant",
        ),
        (lambda d: d.update(extra=1), "expected a mapping with 'defaults'"),
    ],
)
def test_malformed_calibration_is_rejected_with_a_clear_message(mutate: Any, message: str) -> None:
    with pytest.raises(CalibrationError, match=message):
        parse_calibration(_bad(mutate), source="test")


# --- references.yaml ---------------------------------------------------------------------------

SCENARIOS = {
    "latency_run": {"batch", "input_tokens", "output_tokens"},
    "static_throughput": {"batch", "input_tokens", "output_tokens"},
    "ttft": {"input_tokens"},
    "decode_tpot": {"batch", "input_tokens", "output_tokens"},
    "serving_tpot": {"concurrency", "input_tokens", "output_tokens"},
}


def test_every_reference_is_complete_and_names_catalog_specs() -> None:
    refs = packaged("references.yaml")["references"]
    ids = [r["id"] for r in refs]
    assert len(ids) == len(set(ids))
    for ref in refs:
        assert {"source", "url", "engine", "model", "gpu", "scenario", "measured", "unit"} <= set(
            ref
        )
        assert SCENARIOS[ref["scenario"]] <= set(ref), ref["id"]
        assert ref["url"].startswith("https://")
        get_model(ref["model"])
        get_gpu(ref["gpu"])
        Dtype(ref.get("weights_dtype", "bf16"))
        assert ref["measured"] > 0


def _load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "perf_model_error", REPO / "bench" / "perf_model_error.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["perf_model_error"] = module
    spec.loader.exec_module(module)
    return module


def test_model_stays_within_its_documented_error_of_every_reference() -> None:
    """A regression guard for the constants: docs/perf-model.md reports the errors in full."""
    bench = _load_bench()
    rows = bench.published_rows(packaged("references.yaml")["references"])
    errors = {r.id: r.error_pct for r in rows}
    assert None not in errors.values()
    assert max(abs(e) for e in errors.values()) < 50, errors
    vllm = sorted(abs(r.error_pct) for r in rows if r.engine.startswith("vllm"))
    assert vllm[len(vllm) // 2] < 20


def test_model_stays_within_its_documented_error_of_every_measured_set() -> None:
    """Every document under perf/data/measured/ is a set (docs/perf-model.md has the numbers)."""
    bench = _load_bench()
    sets = bench.load_measured(sorted(bench.MEASURED_DIR.glob("*.json")))
    assert {s.name for s in sets} >= {"hf-torch-h100", "hf-torch-h200"}
    for measured in sets:
        rows = bench.measured_rows(measured.doc, measured.gpu)
        errors = sorted(abs(r.error_pct) for r in rows if r.error_pct is not None)
        assert len(errors) == len(rows) > 200, measured.name
        assert errors[len(errors) // 2] < 10, measured.name
        assert errors[-1] < 40, measured.name


def test_h200_streams_weights_and_kv_at_its_measured_rates() -> None:
    """The H200 overrides are the hf-torch-h200 rates: 8B linears at M=1, KV at 64+ sequences."""
    bench = _load_bench()
    h200 = bench.load_measured([bench.MEASURED_DIR / "h200-forward.json"])[0]
    gpu = get_gpu("h200")
    eff = efficiency_for(gpu)
    chain = next(r for r in h200.doc["chain"] if r["model"] == "llama3.1-8b" and r["m"] == 1)
    weights = gpu.memory_bandwidth_gb_s * eff.memory_bandwidth_fraction
    assert weights == pytest.approx(chain["weight_gb_s_p50"], rel=0.03)
    decode = {
        (r["batch"], r["context"]): r["ms_p50"]
        for r in h200.doc["decode"]
        if r["model"] == "llama3.1-8b" and r.get("cuda_graph")
    }
    kv_bytes = h200.doc["models"]["llama3.1-8b"]["kv_bytes_per_token"]
    kv = gpu.memory_bandwidth_gb_s * eff.kv_bandwidth_fraction
    for b, c in ((64, 2048), (128, 1024)):
        added_s = (decode[(b, 2 * c)] - decode[(b, c)]) / 1e3
        assert kv == pytest.approx(b * c * kv_bytes / added_s / 1e9, rel=0.06), (b, c)
