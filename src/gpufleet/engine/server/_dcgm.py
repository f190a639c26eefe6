"""The NVIDIA DCGM exporter's GPU gauges, modelled from the replica's steps and memory.

A vLLM pod's GPUs are watched by dcgm-exporter. The sim engine has no GPU, so its ``/metrics``
page carries the same names itself, computed when Prometheus scrapes, one series per GPU of
the replica (``tp × pp``)::

    DCGM_FI_DEV_GPU_UTIL           %     share of the window the GPU ran steps
    DCGM_FI_PROF_GR_ENGINE_ACTIVE  0..1  the same, less each step's CPU part (scheduling and
                                         sampling, perf's ``overhead``) and pipeline bubble
    DCGM_FI_DEV_MEM_COPY_UTIL      %     share of the window HBM was streaming: each step's
                                         memory roof over its duration
    DCGM_FI_DEV_FB_USED            MiB   weights + workspace + overhead + KV blocks in use
    DCGM_FI_DEV_FB_FREE            MiB   the GPU's memory less FB_USED
    DCGM_FI_DEV_POWER_USAGE        W     idle + (TDP − idle) × GPU_UTIL / 100

Labels, in dcgm-exporter's names: ``gpu`` (the GPU's index in the replica), ``UUID``
(``GPU-`` and a random UUID per process: the replicas of a fleet share a seed, never a GPU),
``device`` (``nvidia0``, …), ``modelName`` (the catalog GPU's display name) and ``Hostname``.

The loop records each step as it plans it (start, end, batch: its end is known then), and a
scrape sums what falls inside the last ``window`` of modelled time::

      now − window                                               now
          │   ┌─step─┐┌──step──┐       idle       ┌───step in flight───┐
          │   │██████││████████│                  │██████████████│     │
          └───┴──────┴┴────────┴──────────────────┴──────────────┘─ ─ ─┘
              busy = Σ overlap / window; a step in flight counts up to now

Tensor-parallel GPUs run every step together, so every GPU of a replica reports the
replica's activity and the memory of its most loaded GPU (``ReplicaModel.memory_plan``).
docs/sim-engine.md says what the model leaves out.
"""

from __future__ import annotations

import math
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpufleet.catalog import GPUSpec
from gpufleet.engine.model import ReplicaModel
from gpufleet.perf import BatchShape, StepTime

DCGM_LABELS = ("gpu", "UUID", "device", "modelName", "Hostname")
WINDOW_S = 1.0
"""Modelled seconds a utilisation gauge looks back over (the driver samples about as often)."""
IDLE_SHARE_OF_TDP = 120.0 / 700.0
"""Idle draw as a share of TDP, for GPUs the catalog has no idle figure for: the ratio
measured on H100 SXM and H200 (120 W of 700 W; docs/catalog.md)."""
_MIB = 2**20


def idle_watts(gpu: GPUSpec) -> float:
    """The catalog's measured idle draw, else ``IDLE_SHARE_OF_TDP`` of the TDP."""
    return gpu.idle_watts if gpu.idle_watts is not None else IDLE_SHARE_OF_TDP * gpu.tdp_watts


@dataclass(frozen=True, slots=True)
class Busy:
    """Shares of the window (0..1) in which the modelled GPU was busy, by kind of work."""

    gpu: float
    """A step ran."""
    engine: float
    """Kernels ran: the steps less their CPU part and pipeline bubble."""
    memory: float
    """HBM was streaming."""


class GpuActivity:
    """The steps the modelled GPU ran within the last ``window_s`` modelled seconds."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be a finite number > 0, got {window_s}")
        self.window_s = window_s
        self._steps: deque[tuple[float, float, BatchShape]] = deque()

    def record(self, start: float, end: float, batch: BatchShape) -> None:
        """A step that runs ``batch`` from ``start`` to ``end``; steps come in time order."""
        steps = self._steps
        steps.append((start, end, batch))
        horizon = start - self.window_s
        while steps[0][1] <= horizon:
            steps.popleft()

    def busy(self, now: float, step_time: Callable[[BatchShape], StepTime]) -> Busy:
        """What the GPU did in ``[now − window_s, now]``; ``step_time`` splits each step."""
        since = now - self.window_s
        gpu = engine = memory = 0.0
        for start, end, batch in self._steps:
            overlap = min(end, now) - max(start, since)
            if overlap <= 0.0:
                continue
            gpu += overlap
            timed = step_time(batch)
            if timed.seconds > 0.0:
                kernels = timed.seconds - timed.overhead - timed.pipeline_bubble
                engine += overlap * max(0.0, kernels) / timed.seconds
                memory += overlap * min(1.0, timed.memory / timed.seconds)
        window = self.window_s
        return Busy(min(1.0, gpu / window), min(1.0, engine / window), min(1.0, memory / window))


class DcgmCollector(Collector):
    """dcgm-exporter's gauges for the GPUs of one modelled replica, read at scrape time."""

    def __init__(
        self,
        model: ReplicaModel,
        activity: GpuActivity,
        now: Callable[[], float],
        hostname: str,
    ) -> None:
        config = model.config
        plan = model.memory_plan()
        gpu = config.gpu
        self._model = model
        self._activity = activity
        self._now = now
        self._step_time = model.step_time_model.step_time
        self.total_mib = round(gpu.memory_gib * 1024)
        """The device's memory as the driver reports it (the catalog's ``memory_gib``)."""
        self.resident_bytes = plan.weights + plan.activation + plan.overhead
        """Held whatever runs: weights, activation workspace, CUDA context and graphs."""
        self._kv_bytes = model.num_gpu_blocks * config.block_size * plan.kv_bytes_per_token_per_gpu
        self.idle_watts = idle_watts(gpu)
        self.tdp_watts = gpu.tdp_watts
        self.labels = [
            [str(i), f"GPU-{uuid.uuid4()}", f"nvidia{i}", gpu.display_name, hostname]
            for i in range(config.tp * config.pp)
        ]

    def fb_used_mib(self) -> int:
        """What one GPU holds now: resident bytes and the KV blocks requests reference."""
        used = self.resident_bytes + self._model.stats().kv_cache_usage * self._kv_bytes
        return min(self.total_mib, int(used // _MIB))

    def collect(self) -> Iterator[Metric]:
        busy = self._activity.busy(self._now(), self._step_time)
        used = self.fb_used_mib()
        power = self.idle_watts + (self.tdp_watts - self.idle_watts) * busy.gpu
        for name, doc, value in (
            ("DCGM_FI_DEV_GPU_UTIL",
             "GPU utilization in percent (modelled: share of the last second it ran steps).",
             100.0 * busy.gpu),
            ("DCGM_FI_DEV_MEM_COPY_UTIL",
             "Memory bandwidth utilization in percent (modelled: share of the last second HBM "
             "was streaming).",
             100.0 * busy.memory),
            ("DCGM_FI_DEV_FB_USED",
             "Framebuffer memory used in MiB (modelled: weights, workspace, KV blocks in use).",
             float(used)),
            ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free in MiB (modelled).",
             float(self.total_mib - used)),
            ("DCGM_FI_DEV_POWER_USAGE",
             "Power draw in watts (modelled: idle + (TDP - idle) x utilization).", power),
            ("DCGM_FI_PROF_GR_ENGINE_ACTIVE",
             "Ratio of time the graphics engine was active (modelled: kernels of the steps).",
             busy.engine),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, doc, labels=DCGM_LABELS)
            for labels in self.labels:
                gauge.add_metric(labels, value)
            yield gauge
