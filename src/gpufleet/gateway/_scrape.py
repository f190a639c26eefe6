"""Reading the three gauges routing needs from a vLLM ``/metrics`` page, cheaply."""

from __future__ import annotations

from typing import Final

_RUNNING: Final = "vllm:num_requests_running"
_WAITING: Final = "vllm:num_requests_waiting"
_KV: Final = "vllm:kv_cache_usage_perc"


def parse_engine_metrics(text: str) -> tuple[int, int, float] | None:
    """``(running, waiting, kv_cache_usage)`` summed over the page's series, or ``None``
    when the page has none of them (not a vLLM-compatible engine)."""
    running = waiting = 0.0
    kv = 0.0
    seen = False
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        if not rest:
            name, _, rest = line.partition(" ")
        value = rest.rsplit(" ", 1)[-1]
        if name == _RUNNING:
            running += float(value)
        elif name == _WAITING:
            waiting += float(value)
        elif name == _KV:
            kv = max(kv, float(value))
        else:
            continue
        seen = True
    if not seen:
        return None
    return int(running), int(waiting), min(max(kv, 0.0), 1.0)
