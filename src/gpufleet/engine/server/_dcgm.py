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

The loop records each step as it plans it (start, end, and the perf model's split of its
time: all known then), and a scrape sums what falls inside the last ``window`` of modelled
time::

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

import bisect
import math
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpufleet.catalog import GPUSpec
from gpufleet.engine.model import ReplicaModel
from gpufleet.perf import StepTime

DCGM_LABELS = ("gpu", "UUID", "device", "modelName", "Hostname")
WINDOW_S = 1.0
"""Modelled seconds the utilisation gauges look back over."""
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


class _Step(NamedTuple):  # a tuple: one is built per step, in the engine loop
    start: float
    end: float
    engine: float
    """Share of the step its kernels ran."""
    memory: float
    """Share of the step HBM streamed."""
    before: tuple[float, float, float]
    """Busy seconds (gpu, engine, memory) of every step recorded before this one."""


class GpuActivity:
    """The steps the modelled GPU ran within the last ``window_s`` modelled seconds.

    Each step keeps the busy seconds of all the steps before it, so a window's share is two
    lookups however many steps it holds (a scrape must not stall the engine loop)::

        busy(now) = (through(now) − through(now − window)) / window
        through(t) = step.before + the part of that step before t   (the last step begun by t)
    """

    def __init__(self, window_s: float = WINDOW_S) -> None:
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be a finite number > 0, got {window_s}")
        self.window_s = window_s
        self._steps: deque[_Step] = deque()
        self._total = (0.0, 0.0, 0.0)

    def record(self, start: float, end: float, timing: StepTime) -> None:
        """A step from ``start`` to ``end`` that ``timing`` splits; steps come in time order
        and do not overlap (the loop starts one where the last ended, or later)."""
        seconds = timing.seconds
        engine = memory = 0.0
        if seconds > 0.0:
            engine = max(0.0, seconds - timing.overhead - timing.pipeline_bubble) / seconds
            memory = min(1.0, timing.memory / seconds)
        steps, (gpu_s, engine_s, memory_s) = self._steps, self._total
        steps.append(_Step(start, end, engine, memory, self._total))
        length = end - start
        self._total = (gpu_s + length, engine_s + engine * length, memory_s + memory * length)
        horizon = start - 2 * self.window_s  # a window's start may trail the last step's
        while steps[0].end <= horizon:
            steps.popleft()

    def busy(self, now: float) -> Busy:
        """What the GPU did in ``[now − window_s, now]``."""
        window = self.window_s
        gpu0, engine0, memory0 = self._through(now - window)
        gpu1, engine1, memory1 = self._through(now)
        return Busy(
            min(1.0, (gpu1 - gpu0) / window),
            min(1.0, (engine1 - engine0) / window),
            min(1.0, (memory1 - memory0) / window),
        )

    def _through(self, t: float) -> tuple[float, float, float]:
        """Busy seconds from the first step up to ``t``."""
        steps = self._steps
        i = bisect.bisect_right(steps, t, key=itemgetter(0)) - 1
        if i < 0:  # before every step kept: all that came earlier has ended
            return steps[0].before if steps else self._total
        step = steps[i]
        ran = min(t, step.end) - step.start
        gpu, engine, memory = step.before
        return (gpu + ran, engine + step.engine * ran, memory + step.memory * ran)


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
        busy = self._activity.busy(self._now())
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
