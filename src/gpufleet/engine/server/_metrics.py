"""``/metrics`` in vLLM's Prometheus names, types and labels, from one app-owned registry.

Scheduler gauges and token counters are read from ``ReplicaModel.stats()`` when Prometheus
scrapes (a collector), so the engine loop pays nothing for them per step. The latency
histograms are observed by the loop in *modelled* seconds, as the step ends::

    vllm:num_requests_running            gauge      requests in the running batch
    vllm:num_requests_waiting            gauge      requests queued
    vllm:kv_cache_usage_perc             gauge      KV blocks in use, 0..1
    vllm:prefix_cache_queries_total      counter    prompt tokens looked up in the prefix cache
    vllm:prefix_cache_hits_total         counter    of those, tokens found
    vllm:num_preemptions_total           counter
    vllm:prompt_tokens_total             counter    prefill tokens computed
    vllm:generation_tokens_total         counter
    vllm:request_success_total           counter    label finished_reason: stop, length, abort
    vllm:time_to_first_token_seconds     histogram
    vllm:inter_token_latency_seconds     histogram
    vllm:e2e_request_latency_seconds     histogram
    vllm:cache_config_info               gauge = 1  labels: block_size, num_gpu_blocks, …
    gpufleet:sim_engine_lag_seconds_total counter   real time the loop fell behind the model

With ``--enable-lora``, ``LoraMetrics`` adds vLLM's ``vllm:lora_requests_info`` and the sim
engine's adapter load, unload and eviction counters (``_lora.py`` says what they count).

Every series has vLLM's labels ``model_name`` and ``engine`` ("0"). The loop also records each
step in ``activity``, from which ``_dcgm.py`` models dcgm-exporter's GPU gauges (``DCGM_FI_*``,
with dcgm-exporter's labels), registered by the engine in the same registry.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpufleet.engine.model import ReplicaStats
from gpufleet.engine.server._dcgm import GpuActivity

LABELS = ("model_name", "engine")
FINISHED_REASONS = ("stop", "length", "abort")

_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class ShellCounts:
    """What the HTTP shell knows and the model does not (read by the collector)."""

    def __init__(self) -> None:
        self.stop_string_finishes = 0
        """Requests the shell ended on a stop string: the model saw an abort, vLLM says stop."""
        self.lag_seconds = 0.0
        """Real seconds the loop started steps later than the modelled timeline allowed."""
        self.lora_held = 0
        """Requests for a LoRA adapter not yet submitted to the model (waiting for a slot or
        for its load): vLLM counts them in its waiting queue, so the gauge does too."""


class _StatsCollector(Collector):
    def __init__(
        self,
        stats: Callable[[], ReplicaStats],
        shell: ShellCounts,
        labels: tuple[str, str],
        cache_info: Mapping[str, str],
    ) -> None:
        self._stats = stats
        self._shell = shell
        self._labels = list(labels)
        self._cache_info = dict(cache_info)

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        labels = self._labels
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             stats.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             stats.num_waiting + self._shell.lora_held),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             stats.kv_cache_usage),
        ):  # fmt: skip
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            gauge.add_metric(labels, float(value))
            yield gauge
        for name, doc, value in (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.",
             stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             stats.prefix_cache_hits),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             stats.num_preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             stats.generation_tokens),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            counter.add_metric(labels, float(value))
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=(*LABELS, "finished_reason"),
        )
        for reason, count in self._finished(stats.finished).items():
            success.add_metric([*labels, reason], float(count))
        yield success
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=tuple(self._cache_info),
        )
        info.add_metric(list(self._cache_info.values()), 1.0)
        yield info
        lag = CounterMetricFamily(
            "gpufleet:sim_engine_lag_seconds",
            "Real seconds the sim engine loop fell behind its modelled timeline (CPU overload).",
            labels=LABELS,
        )
        lag.add_metric(labels, self._shell.lag_seconds)
        yield lag

    def _finished(self, finished: Mapping[str, int]) -> dict[str, int]:
        counts = dict.fromkeys(FINISHED_REASONS, 0)
        for reason, count in finished.items():
            counts[str(reason)] = counts.get(str(reason), 0) + count
        moved = min(self._shell.stop_string_finishes, counts["abort"])
        counts["abort"] -= moved
        counts["stop"] += moved
        return counts


class EngineMetrics:
    """The sim engine's metrics in a registry of its own (no process-global state)."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], ReplicaStats],
        cache_info: Mapping[str, str],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.shell = ShellCounts()
        self.activity = GpuActivity()
        """The steps the modelled GPU ran lately, recorded by the loop as it plans them."""
        labels = (model_name, "0")
        self.registry.register(
            _StatsCollector(stats, self.shell, labels, {**cache_info, "engine": "0"})
        )
        ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            registry=self.registry,
            buckets=_TTFT_BUCKETS,
        )
        itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            LABELS,
            registry=self.registry,
            buckets=_ITL_BUCKETS,
        )
        e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS,
            registry=self.registry,
            buckets=_E2E_BUCKETS,
        )
        self.observe_ttft = ttft.labels(*labels).observe
        self.observe_itl = itl.labels(*labels).observe
        self.observe_e2e = e2e.labels(*labels).observe


@dataclass(frozen=True, slots=True)
class LoraSnapshot:
    """The adapters' state a scrape reads (``LoraAdapters.snapshot``)."""

    running: tuple[str, ...]
    """Adapters with a request running in the model."""
    waiting: tuple[str, ...]
    """Adapters with a request waiting: in the model's queue, for a slot or for a load."""
    loads: int
    unloads: int
    evictions: int


LORA_INFO_SERIES = 256
"""The most ``vllm:lora_requests_info`` label sets kept (the least recently set go first)."""


class LoraMetrics(Collector):
    """vLLM's ``vllm:lora_requests_info`` and the sim engine's adapter counters.

    ``vllm:lora_requests_info`` is vLLM's: labels ``max_lora`` (``--max-loras``),
    ``running_lora_adapters`` and ``waiting_lora_adapters`` (adapter names joined by commas,
    here sorted), and no ``model_name`` or ``engine``; its value is the wall-clock time
    (``time.time()``) the label set was last current. vLLM sets it at every engine step, and
    a label set once seen stays on the page with the time it was last set, so a reader takes
    the series with the highest value; here it is set at every scrape, and at most
    ``LORA_INFO_SERIES`` label sets are kept.
    """

    def __init__(
        self,
        max_loras: int,
        snapshot: Callable[[], LoraSnapshot],
        labels: tuple[str, str],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._max_lora = str(max_loras)
        self._snapshot = snapshot
        self._labels = list(labels)
        self._wall = wall
        self._series: dict[tuple[str, str], float] = {}

    def collect(self) -> Iterator[Metric]:
        now = self._snapshot()
        current = (",".join(now.running), ",".join(now.waiting))
        self._series.pop(current, None)
        self._series[current] = self._wall()
        while len(self._series) > LORA_INFO_SERIES:
            del self._series[next(iter(self._series))]
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
        )
        for (running, waiting), at in self._series.items():
            info.add_metric([self._max_lora, waiting, running], at)
        yield info
        for name, doc, value in (
            ("gpufleet:sim_engine_lora_loads",
             "LoRA adapter loads that took modelled time (load route, or a request's).",
             now.loads),
            ("gpufleet:sim_engine_lora_unloads",
             "LoRA adapters unloaded by POST /v1/unload_lora_adapter.", now.unloads),
            ("gpufleet:sim_engine_lora_evictions",
             "Loaded LoRA adapters dropped to make room (least recently used first).",
             now.evictions),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            counter.add_metric(self._labels, float(value))
            yield counter
