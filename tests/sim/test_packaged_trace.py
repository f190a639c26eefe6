"""What a first user needs ships in the package: a new directory, no checkout beside it,
and ``gpufleet trace synth`` and ``gpufleet simulate`` still work (the packaged Azure 2023
conversation hour is their default size table and trace)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.sim import SAMPLE_TRACE, TraceFormat, detect_format, load_trace

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"


def test_the_packaged_trace_is_the_azure_conversation_hour_with_its_licence() -> None:
    assert SAMPLE_TRACE.is_file()
    assert (SAMPLE_TRACE.parent / "LICENSE-CC-BY-4.0.txt").is_file()
    assert "Attribution" in (SAMPLE_TRACE.parent / "README.md").read_text()
    assert detect_format(SAMPLE_TRACE) is TraceFormat.AZURE
    requests = list(load_trace(SAMPLE_TRACE))
    assert len(requests) == 19_366
    assert requests[0].arrival_s == 0.0
    assert 3500 < requests[-1].arrival_s < 3600  # one hour
    if SHARED.is_file():  # unchanged but for gzip
        assert gzip.decompress(SAMPLE_TRACE.read_bytes()) == SHARED.read_bytes()


def test_any_format_reads_gzipped(tmp_path: Path) -> None:
    rows = [{"arrival_s": 0.5 * i, "input_tokens": 100 + i, "output_tokens": 10} for i in range(5)]
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    reader = load_trace(path)
    assert reader.format is TraceFormat.JSONL
    assert [r.input_tokens for r in reader] == [100, 101, 102, 103, 104]


def test_a_broken_gzip_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress(b"TIMESTAMP,ContextTokens,GeneratedTokens\n" * 50)[:40])
    with pytest.raises(ValueError, match="not a whole gzip file"):
        list(load_trace(path, TraceFormat.AZURE))
    path.write_bytes(b"plain bytes, not gzip")
    with pytest.raises(ValueError, match="not a whole gzip file"):
        detect_format(path)


def test_a_first_user_needs_nothing_beside_the_package(tmp_path: Path) -> None:
    """Run from a fresh directory, as an installed command would be (no ../shared)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    cli = [sys.executable, "-m", "gpufleet"]
    synth = subprocess.run(
        [*cli, "trace", "synth", "--out", "t.jsonl", "--hours", "0.05", "--peak-rps", "2"],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert synth.returncode == 0, synth.stderr
    assert "packaged Azure 2023" in synth.stdout
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    sizes = {(r["input_tokens"], r["output_tokens"]) for r in map(json.loads, lines)}
    azure = {(r.input_tokens, r.output_tokens) for r in load_trace(SAMPLE_TRACE)}
    assert sizes
    assert sizes <= azure  # every size drawn from the packaged table
    simulate = subprocess.run(
        [*cli, "simulate", "--out", "run", "--duration", "30", "--no-plots"],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert simulate.returncode == 0, simulate.stderr
    assert "packaged Azure 2023" in simulate.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["inputs"]["trace"] == str(SAMPLE_TRACE)
    assert report["overall"]["requests"] > 50, report["overall"]  # ~5.5 req/s for 30 s
