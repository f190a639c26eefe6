"""What an engine's Prometheus ``/metrics`` page says about its load: one table of names.

vLLM renamed its metrics across versions, and SGLang has its own; every consumer (the
gateway's scraper, the runtime's drain poll) reads them through ``ENGINE_METRICS`` below, so a
new engine version is one line here. For each signal the names are tried in the table's order
and the first one the page has wins (an engine that exposes a deprecated name beside the new
one is read by the new one)::

    sample = read_engine_metrics(page)      # None: not an engine page we know
    sample.running, sample.waiting, sample.kv_cache_usage, sample.prefix_hits

Gauges and counters are summed over their series (one per engine core, DP rank or label
set), except KV-cache usage, which is the fullest series. Histograms give ``_sum`` and
``_count``. Counters are matched with or without prometheus_client's ``_total`` suffix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Final


class EngineSignal(StrEnum):
    """One thing the control plane reads off an engine, whatever the engine calls it."""

    RUNNING = "running"
    """Requests in the running batch (gauge)."""
    WAITING = "waiting"
    """Requests queued, not yet scheduled (gauge)."""
    KV_CACHE_USAGE = "kv_cache_usage"
    """KV cache in use, 0..1 (gauge)."""
    PREFIX_HITS = "prefix_hits"
    """Prompt tokens found in the prefix cache (counter)."""
    PREFIX_QUERIES = "prefix_queries"
    """Prompt tokens looked up in the prefix cache (counter)."""
    PROMPT_TOKENS = "prompt_tokens"
    """Prefill tokens processed (counter)."""
    GENERATION_TOKENS = "generation_tokens"
    """Tokens generated (counter)."""
    TTFT = "ttft"
    """Time to first token, seconds (histogram)."""
    ITL = "itl"
    """Time between two output tokens of a request, seconds (histogram)."""


ENGINE_METRICS: Final[Mapping[EngineSignal, tuple[str, ...]]] = MappingProxyType(
    {
        EngineSignal.RUNNING: ("vllm:num_requests_running", "sglang:num_running_reqs"),
        EngineSignal.WAITING: ("vllm:num_requests_waiting", "sglang:num_queue_reqs"),
        EngineSignal.KV_CACHE_USAGE: (
            "vllm:kv_cache_usage_perc",  # vLLM V1 (0.10 on)
            "vllm:gpu_cache_usage_perc",  # vLLM V0 and early V1
            "sglang:token_usage",
        ),
        EngineSignal.PREFIX_HITS: (
            "vllm:prefix_cache_hits",  # vLLM 0.10 on
            "vllm:gpu_prefix_cache_hits",  # vLLM V1 0.8-0.9
        ),
        EngineSignal.PREFIX_QUERIES: ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
        EngineSignal.PROMPT_TOKENS: ("vllm:prompt_tokens", "sglang:prompt_tokens"),
        EngineSignal.GENERATION_TOKENS: ("vllm:generation_tokens", "sglang:generation_tokens"),
        EngineSignal.TTFT: (
            "vllm:time_to_first_token_seconds",
            "sglang:time_to_first_token_seconds",
        ),
        EngineSignal.ITL: (
            "vllm:inter_token_latency_seconds",  # vLLM 0.11 on
            "vllm:time_per_output_token_seconds",  # vLLM before (same meaning)
            "sglang:inter_token_latency_seconds",
            "sglang:time_per_output_token_seconds",
        ),
    }
)
"""Per signal, the metric names (without ``_total``, ``_sum`` or ``_count``) that carry it, the
preferred first."""

_HISTOGRAMS: Final = frozenset({EngineSignal.TTFT, EngineSignal.ITL})


class _Part(StrEnum):
    VALUE = "value"
    SUM = "sum"
    COUNT = "count"


def _lookup() -> dict[str, tuple[EngineSignal, int, _Part]]:
    table: dict[str, tuple[EngineSignal, int, _Part]] = {}
    for signal, names in ENGINE_METRICS.items():
        for rank, name in enumerate(names):
            if signal in _HISTOGRAMS:
                table[name + "_sum"] = (signal, rank, _Part.SUM)
                table[name + "_count"] = (signal, rank, _Part.COUNT)
            else:
                table[name] = (signal, rank, _Part.VALUE)
                table[name + "_total"] = (signal, rank, _Part.VALUE)
    return table


_SAMPLES: Final = _lookup()
"""Exposed sample name -> (signal, rank in the table, which part)."""


@dataclass(frozen=True, slots=True)
class Histogram:
    """A histogram's running totals (``_sum`` and ``_count``)."""

    sum: float
    count: float

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One page's reading; a signal the page does not carry is ``None`` (not zero)."""

    running: int | None = None
    waiting: int | None = None
    kv_cache_usage: float | None = None
    prefix_hits: float | None = None
    prefix_queries: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    ttft: Histogram | None = None
    itl: Histogram | None = None
    names: frozenset[str] = frozenset()
    """The table's names the page was read by (which version's names the engine speaks)."""

    @property
    def in_flight(self) -> int | None:
        """Running + waiting; ``None`` when the page has neither."""
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0) + (self.waiting or 0)


def read_engine_metrics(text: str) -> EngineMetrics | None:
    """Read an engine's Prometheus text page through ``ENGINE_METRICS``; ``None`` when it
    carries none of the table's names. A sample of a known name whose value is not a number
    raises ``ValueError``; NaN and infinite values are skipped."""
    best: dict[EngineSignal, int] = {}
    values: dict[tuple[EngineSignal, _Part], float] = {}
    used: dict[EngineSignal, str] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        end = brace if brace != -1 and (space == -1 or brace < space) else space
        if end == -1:
            continue
        found = _SAMPLES.get(line[:end])
        if found is None:
            continue
        signal, rank, part = found
        rest = line[line.rindex("}") + 1 :] if end == brace else line[end:]
        fields = rest.split()  # the value, then an optional timestamp
        if not fields:
            raise ValueError(f"no value in metrics line {line!r}")
        value = float(fields[0])
        known = best.get(signal)
        if known is not None and known < rank:
            continue  # a preferred name of this signal is already on the page
        if known is None or rank < known:
            best[signal] = rank
            used[signal] = ENGINE_METRICS[signal][rank]
            for stale in _Part:
                values.pop((signal, stale), None)
        if not math.isfinite(value):
            continue  # the engine speaks this name but has no number for it now
        key = (signal, part)
        if signal is EngineSignal.KV_CACHE_USAGE:
            values[key] = max(values.get(key, 0.0), value)
        else:
            values[key] = values.get(key, 0.0) + value
    if not best:
        return None

    def scalar(signal: EngineSignal) -> float | None:
        return values.get((signal, _Part.VALUE))

    def histogram(signal: EngineSignal) -> Histogram | None:
        total, count = values.get((signal, _Part.SUM)), values.get((signal, _Part.COUNT))
        return None if total is None or count is None else Histogram(total, count)

    running, waiting = scalar(EngineSignal.RUNNING), scalar(EngineSignal.WAITING)
    kv = scalar(EngineSignal.KV_CACHE_USAGE)
    return EngineMetrics(
        running=None if running is None else round(running),
        waiting=None if waiting is None else round(waiting),
        kv_cache_usage=None if kv is None else min(max(kv, 0.0), 1.0),
        prefix_hits=scalar(EngineSignal.PREFIX_HITS),
        prefix_queries=scalar(EngineSignal.PREFIX_QUERIES),
        prompt_tokens=scalar(EngineSignal.PROMPT_TOKENS),
        generation_tokens=scalar(EngineSignal.GENERATION_TOKENS),
        ttft=histogram(EngineSignal.TTFT),
        itl=histogram(EngineSignal.ITL),
        names=frozenset(used.values()),
    )
