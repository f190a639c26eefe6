"""Fleets to render: the packaged default, every example, and a GPU fleet written here."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.cli._deploy_cmd import cluster_fleet
from gpufleet.config import DEFAULT_FLEET, load_fleet
from gpufleet.runtime.kubernetes import ClusterFleet

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

GPU_FLEET = """\
# vLLM on real GPUs, one sim pool, and endpoints run elsewhere.
gateway:
  timeouts: {first_byte: 120}
models:
  - name: llama-3.1-70b
    model: meta-llama/Llama-3.1-70B-Instruct
    engine: vllm
    gpu: h100-sxm
    tp: 4
    replicas: 3
    args: ["--max-model-len", "8192", "--gpu-memory-utilization", "0.92"]
  - name: qwen2.5-7b
    model: Qwen/Qwen2.5-7B-Instruct
    engine: vllm
    gpu: l40s
    replicas: 2
  - name: llama-3.1-8b
    engine: sim
    replicas: 2
  - name: partner
    engine: external
    endpoints: ["http://10.0.0.5:8000"]
"""


def fleet_from(path: Path) -> ClusterFleet:
    return cluster_fleet(load_fleet(path), path.read_text())


@pytest.fixture
def gpu_fleet_file(tmp_path: Path) -> Path:
    path = tmp_path / "gpu-fleet.yaml"
    path.write_text(GPU_FLEET)
    return path


@pytest.fixture
def gpu_fleet(gpu_fleet_file: Path) -> ClusterFleet:
    return fleet_from(gpu_fleet_file)


FLEET_FILES = [DEFAULT_FLEET, *EXAMPLES]
