"""``gpufleet trace synth``: the diurnal curve, its spikes, and a trace that a seed decides."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpufleet.cli import app
from gpufleet.sim import (
    DEFAULT_SPIKES,
    DiurnalCurve,
    Spike,
    TraceFormat,
    TraceRequest,
    load_trace,
    synth_requests,
    zipf_models,
    zipf_weights,
)

SIZES = [(100, 10), (2000, 300), (500, 50)]
runner = CliRunner()


def test_the_curve_peaks_at_peak_rps_and_bottoms_at_the_trough_hour() -> None:
    curve = DiurnalCurve(peak_rps=8.0)
    rates = [curve.rate(float(t)) for t in range(0, 86_400, 10)]
    assert max(rates) == pytest.approx(8.0, rel=1e-9)
    assert min(rates) == pytest.approx(curve.rate(4 * 3600.0), rel=1e-9)
    flat = DiurnalCurve(peak_rps=8.0, spikes=())
    assert flat.rate(16 * 3600.0) == pytest.approx(8.0)  # 12 h after the trough
    assert flat.rate(4 * 3600.0) == pytest.approx(8.0 * 0.2)


def test_a_spike_multiplies_the_rate_with_ramps() -> None:
    spike = Spike(at_h=1.0, minutes=10.0, factor=2.0, ramp_s=60.0)
    assert spike.multiplier(3599.0) == 1.0
    assert spike.multiplier(3600.0 + 30.0) == pytest.approx(1.5)
    assert spike.multiplier(3600.0 + 300.0) == 2.0
    assert spike.multiplier(3600.0 + 600.0) == 1.0
    curve = DiurnalCurve(peak_rps=8.0)
    evening = DEFAULT_SPIKES[-1]
    inside = evening.at_h * 3600 + evening.minutes * 30  # the spike's middle
    flat = DiurnalCurve(peak_rps=8.0, spikes=())
    ratio = curve.rate(inside) / curve.rate(inside - 3600)  # an hour before: no spike
    assert ratio == pytest.approx(
        evening.factor * flat.rate(inside) / flat.rate(inside - 3600), rel=1e-9
    )


def test_arrivals_follow_the_curve_and_sizes_come_from_the_table() -> None:
    curve = DiurnalCurve(peak_rps=4.0, hours=24.0, spikes=())
    requests = list(synth_requests(curve, SIZES, seed=3))
    times = [r.arrival_s for r in requests]
    assert times == sorted(times)
    assert times[-1] < 86_400
    assert {(r.input_tokens, r.output_tokens) for r in requests} <= set(SIZES)
    for hour in (4, 10, 16):  # counts per hour within 5 sigma of the curve's integral
        expected = sum(curve.rate(hour * 3600 + s + 0.5) for s in range(3600))
        seen = sum(1 for t in times if hour * 3600 <= t < (hour + 1) * 3600)
        assert abs(seen - expected) < 5 * math.sqrt(expected)


def test_a_seed_decides_the_trace() -> None:
    curve = DiurnalCurve(peak_rps=5.0, hours=0.5)
    first = list(synth_requests(curve, SIZES, seed=1))
    assert first == list(synth_requests(curve, SIZES, seed=1))
    assert first != list(synth_requests(curve, SIZES, seed=2))


def test_bad_curves_are_refused() -> None:
    with pytest.raises(ValueError, match="peak_rps"):
        DiurnalCurve(peak_rps=0.0)
    with pytest.raises(ValueError, match="trough"):
        DiurnalCurve(peak_rps=1.0, trough=0.0)
    with pytest.raises(ValueError, match="sizes"):
        list(synth_requests(DiurnalCurve(peak_rps=1.0), [], seed=0))


def azure_csv(path: Path) -> Path:
    rng = random.Random(0)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(50):
        lines.append(
            f"2023-11-16 18:15:{i:02d}.0000000,{rng.randrange(10, 3000)},{rng.randrange(1, 500)}"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_cli_writes_a_jsonl_trace_a_seed_repeats(tmp_path: Path) -> None:
    sizes = azure_csv(tmp_path / "azure.csv")
    args = ["trace", "synth", "--hours", "0.25", "--peak-rps", "3", "--sizes", str(sizes)]
    result = runner.invoke(app, [*args, "--seed", "7", "--out", str(tmp_path / "a.jsonl")])
    assert result.exit_code == 0, result.output
    assert "requests over 0.25 h" in result.output
    runner.invoke(app, [*args, "--seed", "7", "--out", str(tmp_path / "b.jsonl")])
    runner.invoke(app, [*args, "--seed", "8", "--out", str(tmp_path / "c.jsonl")])
    first = (tmp_path / "a.jsonl").read_bytes()
    assert first == (tmp_path / "b.jsonl").read_bytes()
    assert first != (tmp_path / "c.jsonl").read_bytes()
    reader = load_trace(tmp_path / "a.jsonl")
    assert reader.format is TraceFormat.JSONL
    requests = list(reader)
    assert len(requests) > 100
    assert set(json.loads(first.splitlines()[0])) == {"arrival_s", "input_tokens", "output_tokens"}


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["trace", "synth", "--out", str(tmp_path / "x.jsonl"), "--sizes", "missing.csv"]
    )
    assert result.exit_code == 2
    assert "missing.csv" in result.output
    result = runner.invoke(
        app,
        [
            "trace",
            "synth",
            "--out",
            str(tmp_path / "x.jsonl"),
            "--peak-rps",
            "-1",
            "--sizes",
            str(azure_csv(tmp_path / "a.csv")),
        ],
    )
    assert result.exit_code == 2
    assert "peak_rps" in result.output


def test_zipf_models_draws_each_rank_at_its_share_and_a_seed_gives_one_mix() -> None:
    names = [f"m{k:02d}" for k in range(1, 21)]
    requests = [TraceRequest(i * 0.1, 100, 10) for i in range(40_000)]
    mix = list(zipf_models(requests, names, s=1.1, seed=3))
    assert [r.arrival_s for r in mix] == [r.arrival_s for r in requests]  # only the model
    counts = Counter(r.model for r in mix)
    shares = zipf_weights(20, 1.1)
    assert shares[0] == pytest.approx(1 / sum(k**-1.1 for k in range(1, 21)))
    for name, share in zip(names, shares, strict=True):
        assert counts[name] / len(mix) == pytest.approx(share, abs=0.01)
    assert counts["m01"] > 8 * counts["m20"]  # 20**1.1 ≈ 27: a long tail
    assert mix == list(zipf_models(requests, names, s=1.1, seed=3))
    assert mix != list(zipf_models(requests, names, s=1.1, seed=4))
    uniform = Counter(r.model for r in zipf_models(requests, names, s=0.0, seed=3))
    assert max(uniform.values()) / min(uniform.values()) < 1.2
    with pytest.raises(ValueError, match="no models"):
        next(zipf_models(requests, [], seed=0))
