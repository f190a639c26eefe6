"""Reading the three gauges routing needs from an engine's ``/metrics`` page.

The names come from one table, ``gpufleet.fleet.ENGINE_METRICS``: vLLM's (old and new) and
SGLang's.
"""

from __future__ import annotations

from gpufleet.fleet import read_engine_metrics


def parse_engine_metrics(text: str) -> tuple[int, int, float] | None:
    """``(running, waiting, kv_cache_usage)`` summed over the page's series, or ``None``
    when the page has none of them (not an engine we know) or is malformed. A signal the
    engine does not export reads 0."""
    try:
        sample = read_engine_metrics(text)
    except ValueError:
        return None
    if sample is None or (
        sample.running is None and sample.waiting is None and sample.kv_cache_usage is None
    ):
        return None
    return sample.running or 0, sample.waiting or 0, sample.kv_cache_usage or 0.0
