"""bench/sim_fidelity.py: its core on two references and two calibration rows, so the bench
(and the numbers docs/fidelity.md copies from it) cannot silently rot."""

from __future__ import annotations

import copy
import importlib.util
import sys
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "sim_fidelity", REPO / "bench" / "sim_fidelity.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sim_fidelity"] = module
    spec.loader.exec_module(module)
    return module


def references(*ids: str) -> list[dict[str, Any]]:
    text = resources.files("gpufleet.perf").joinpath("data", "references.yaml").read_text("utf-8")
    by_id = {ref["id"]: ref for ref in yaml.safe_load(text)["references"]}
    return [copy.deepcopy(by_id[i]) for i in ids]


def test_two_references_through_the_simulator(bench: ModuleType) -> None:
    """One prompt alone (TTFT) and one stream decoding (ITL): the replica runs exactly the
    steps perf_model_error prices, so the two predictions agree; the error is relative to the
    measurement, 0 when the measurement is the prediction."""
    refs = references("trtllm05-a100-llama2-7b-ttft-128", "vllm021-h100-llama8b-c1")
    ttft, itl = bench.published_points(refs)
    assert (ttft.metric, itl.metric) == ("ttft", "itl")
    assert ttft.simulated == pytest.approx(ttft.step_only, rel=1e-12)
    assert itl.simulated == pytest.approx(itl.step_only, rel=1e-9)
    assert ttft.error_pct == pytest.approx(100 * (ttft.simulated / 0.016 - 1))
    assert ttft.detail["requests"] == itl.detail["requests"] == 1

    refs[0]["measured"] = ttft.simulated
    refs[1]["measured"] = itl.simulated / 1.25
    exact, high = bench.published_points(refs)
    assert exact.error_pct == 0.0
    assert high.error_pct == pytest.approx(25.0)
    stats = bench.summarize([exact, high])["published"]
    assert stats["ttft"]["simulator"]["median_abs_error_pct"] == 0.0
    assert stats["itl"]["simulator"]["signed_median_error_pct"] == pytest.approx(25.0)
    assert stats["itl"]["scheduler_changed"] == 0


def test_a_closed_loop_measures_its_steady_state(bench: ModuleType) -> None:
    """Two clients, each sending its next request when the last ends: the window holds only
    requests that ran while both clients were busy, and their TPOT is a decode step's at least."""
    ref = {
        "id": "closed-loop",
        "model": "llama-3.1-8b",
        "gpu": "h100-sxm",
        "tp": 1,
        "scenario": "serving_tpot",
        "concurrency": 2,
        "input_tokens": 512,
        "output_tokens": 32,
    }
    tpot, detail = bench.simulate_reference(ref)
    assert detail["requests"] == 2 * bench.SERVING_ROUNDS
    assert 0 < detail["window_requests"] < detail["requests"]
    config = bench.reference_config(ref)
    from gpufleet.engine.model import ReplicaModel  # noqa: PLC0415

    single = ReplicaModel(config).step_time_model.decode_time(2, 512)
    assert single < tpot < 2 * single


def test_calibration_rows_run_the_batch_the_step_model_prices(bench: ModuleType) -> None:
    """A decode row (a batch decoding) and a prefill row on a cached prefix, through the
    replica: it builds the very batch perf_model_error prices (the prefix cache serves the
    cached tokens), and the GPU time is compared as perf_model_error compares it."""
    doc = {
        "meta": {"gpu_name": "NVIDIA H100 80GB HBM3"},
        "decode": [
            {"model": "llama3.1-8b", "batch": 4, "context": 512, "ms_p50": 6.0, "cuda_graph": True}
        ],
        "prefill": [
            {
                "model": "llama3.1-8b",
                "batch": 1,
                "new_tokens": 256,
                "cached_tokens": 2048,
                "ms_p50": 20.0,
            }
        ],
    }
    perf = bench.load_perf_bench()
    decode, prefill = bench.Calibration(doc, "h100-sxm", perf).points()
    assert decode.detail["same_batch_as_step_only"]
    assert prefill.detail["same_batch_as_step_only"]
    assert prefill.detail["cached_tokens"] == 2048
    for point, measured in ((decode, 6e-3), (prefill, 20e-3)):
        assert point.measured == measured
        assert point.simulated == pytest.approx(point.step_only, rel=1e-6)
        assert point.error_pct == pytest.approx(100 * (point.simulated - measured) / measured)


def test_error_statistics(bench: ModuleType) -> None:
    stats = bench.error_stats([-10.0, 20.0, 5.0])
    assert stats["points"] == 3
    assert stats["median_abs_error_pct"] == 10.0
    assert stats["p90_abs_error_pct"] == pytest.approx(18.0)  # 10 + 0.8 × (20 − 10)
    assert stats["signed_median_error_pct"] == 5.0
    assert bench.error_stats([]) == {"points": 0}
