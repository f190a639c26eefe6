"""What the console shows of each pool: its replicas now, and rates and latencies over a
recent window, sampled once a second from counters the gateway keeps anyway.

::

    watch = FleetWatch(config, control, metrics, clock)
    tg.create_task(watch.run(client))     # in the gateway's lifespan
    watch.fleet()                         # GET /admin/fleet

**Nothing on a request's path.** Every second the sampler copies the cumulative counters the
request path already bumps (``gateway_requests`` per model and status, the TTFT histogram's
buckets) into a ring of samples; a rate or a quantile over a window is the difference of two
samples (as Prometheus's ``rate`` and ``histogram_quantile`` compute them), so no request
pays for the console.

**Engines only while someone looks.** Inter-token latency is the engines' (the gateway relays
a stream's frames without reading their tokens), so the sampler reads each replica's
``/metrics`` (``vllm:inter_token_latency_seconds``, running, waiting and KV fill for pools
the controller does not scrape, and the GPUs' dcgm-exporter gauges where the page has them:
a sim engine's, or a vLLM pod's with dcgm-exporter's series joined), but only while a
console has asked within ``WATCHED_FOR`` seconds: an unwatched gateway does not scrape its
replicas for a page nobody reads.

::

    samples  s(t-60) ········ s(t-10) ········ s(t)     one a second, per pool
    table    └──────────── window (60 s) ──────────┘      P50/P99, req/s now
    chart    one point a second over the last 10 s: TTFT, req/s, KV fill, GPU util (5 min kept)
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from gpufleet.config import FleetConfig
from gpufleet.fleet import ReplicaLoad
from gpufleet.gateway._control import LiveControl
from gpufleet.gateway._errors import UpstreamError
from gpufleet.gateway._metrics import GatewayMetrics
from gpufleet.gateway._scrape import parse_engine_metrics
from gpufleet.gateway._upstream import ReplicaClient

SAMPLE_EVERY: Final = 1.0
WINDOW: Final = 60.0
"""Seconds the table's rates and quantiles cover."""
CHART_WINDOW: Final = 10.0
"""Seconds each chart point covers (shorter: a chart follows a change within seconds)."""
HISTORY: Final = 300
"""Chart points kept per pool (5 minutes)."""
WATCHED_FOR: Final = 30.0
"""Seconds after the last console request during which the engines are read."""
FRESH: Final = 5.0
"""An engine read older than this is not shown."""
ITL_NAMES: Final = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
_GPU_GAUGES: Final = {
    "DCGM_FI_DEV_GPU_UTIL": "util",
    "DCGM_FI_DEV_POWER_USAGE": "power",
    "DCGM_FI_DEV_FB_USED": "used",
    "DCGM_FI_DEV_FB_FREE": "free",
}
"""dcgm-exporter's gauges the console shows, one series per GPU."""
"""vLLM's inter-token latency histogram, new name then old (the sim engine writes the new)."""

Buckets = tuple[tuple[float, float], ...]
"""A cumulative histogram: ``(upper bound, count)`` by bound, ``inf`` last."""


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float
    wall: float
    requests: float
    errors: float
    ttft: Buckets
    itl: Buckets | None
    kv: float | None
    running: int | None
    gpu_util: float | None = None


@dataclass(frozen=True, slots=True)
class GpuRead:
    """A replica's GPUs, from its page's dcgm-exporter gauges."""

    count: int
    util: float
    """Mean ``DCGM_FI_DEV_GPU_UTIL`` over its GPUs, 0..1."""
    power_w: float
    """Summed ``DCGM_FI_DEV_POWER_USAGE``."""
    memory: float | None
    """Framebuffer used over used + free, summed over its GPUs (``None``: not reported)."""


@dataclass(slots=True)
class _EngineRead:
    at: float
    running: int
    waiting: int
    kv: float
    itl: Buckets | None
    gpus: GpuRead | None = None


@dataclass(slots=True)
class _Pool:
    samples: deque[_Sample] = field(default_factory=lambda: deque(maxlen=int(WINDOW) + 5))
    chart: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HISTORY))


class FleetWatch:
    """Samples each pool once a second; answers ``GET /admin/fleet``."""

    def __init__(
        self,
        config: FleetConfig,
        control: LiveControl,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.control = control
        self.metrics = metrics
        self._clock = clock
        self._wall = wall
        self._pools = {m.name: _Pool() for m in config.models}
        self._engines: dict[str, _EngineRead] = {}
        self._watched_at = -math.inf
        self._states: dict[str, str] = {}

    # -- the loop -------------------------------------------------------------------------

    async def run(self, client: ReplicaClient) -> None:
        while True:
            now = self._clock()
            if now - self._watched_at < WATCHED_FOR:
                await self._read_engines(client)
            self.sample(self._clock())
            await asyncio.sleep(SAMPLE_EVERY)

    def watched(self) -> None:
        """A console asked: read the engines for a while."""
        self._watched_at = self._clock()

    def sample(self, now: float) -> None:
        requests, errors = self._request_counts()
        ttft = self._ttft_buckets()
        self._note_states(now)
        for model, pool in self._pools.items():
            loads = [self._load(model, r.id, r.load) for r in self._view(model)]
            kvs = [load[2] for load in loads if load is not None]
            running = [load[0] for load in loads if load is not None]
            utils = [g.util for r in self._view(model) if (g := self._gpus(r.id, now))]
            sample = _Sample(
                now,
                self._wall(),
                requests.get(model, 0.0),
                errors.get(model, 0.0),
                ttft.get(model, ()),
                self._itl(model, now),
                sum(kvs) / len(kvs) if kvs else None,
                sum(running) if running else None,
                sum(utils) / len(utils) if utils else None,
            )
            pool.samples.append(sample)
            then = _at_or_before(pool.samples, now - CHART_WINDOW)
            pool.chart.append(_point(then, sample))

    # -- the answer -----------------------------------------------------------------------

    def fleet(self) -> dict[str, Any]:
        self.watched()
        now = self._clock()
        return {
            "time": round(self._wall(), 3),
            "window_s": WINDOW,
            "chart_window_s": CHART_WINDOW,
            "pools": [self._pool_json(model, now) for model in self._pools],
        }

    def _pool_json(self, model: str, now: float) -> dict[str, Any]:
        pool = self.control.pools[model]
        config = self.config.model(model)
        assert config is not None
        samples = self._pools[model].samples
        last = samples[-1] if samples else None
        then = _at_or_before(samples, now - WINDOW)
        window = _point(then, last) if last is not None else None
        residency = self.control.control.residency
        states = residency.replicas_of(model) if residency is not None else {}
        held = pool.adapters.held() if pool.adapters is not None else {}
        replicas = []
        for replica in self._view(model):
            load = self._load(model, replica.id, replica.load)
            gpus = self._gpus(replica.id, now)
            upstream = self.control.upstreams.get(replica.id)
            replicas.append(
                {
                    "name": replica.id,
                    "state": replica.state.value,
                    "url": None if upstream is None else upstream.url,
                    "in_flight": pool.attempts.get(replica.id, 0),
                    "running": None if load is None else load[0],
                    "waiting": None if load is None else load[1],
                    "kv": None if load is None else round(load[2], 4),
                    # where its model is (docs/residency.md): None for an always-resident pool
                    "residency": None if (at := states.get(replica.id)) is None else at.value,
                    # its LoRA adapters, least recently used first: None for a pool without
                    "adapters": None if pool.adapters is None else list(held.get(replica.id, ())),
                    "gpus": None
                    if gpus is None
                    else {
                        "count": gpus.count,
                        "util": round(gpus.util, 4),
                        "power_w": round(gpus.power_w, 1),
                        "memory": None if gpus.memory is None else round(gpus.memory, 4),
                    },
                }
            )
        decision = pool.last_scale
        chart = self._pools[model].chart
        return {
            "model": model,
            "engine": config.engine.value,
            "router": config.routing.policy,
            "autoscaled": config.autoscale is not None,
            "desired": None if decision is None else decision.desired,
            "replicas": replicas,
            "routable": len(pool.routable()),
            "queued": pool.queued,
            "held": pool.held,
            "in_flight": pool.in_flight,
            "window": window,
            "series": {key: [p[key] for p in chart] for key in _SERIES},
        }

    # -- reading ----------------------------------------------------------------------------

    def _view(self, model: str) -> Sequence[Any]:
        return self.control.pools[model].view.pool(model)

    def _request_counts(self) -> tuple[dict[str, float], dict[str, float]]:
        requests: dict[str, float] = {}
        errors: dict[str, float] = {}
        for (model, status), child in self.metrics.requests.children():
            requests[model] = requests.get(model, 0.0) + child.value
            if status.isdigit() and int(status) >= 500:
                errors[model] = errors.get(model, 0.0) + child.value
        return requests, errors

    def _ttft_buckets(self) -> dict[str, Buckets]:
        out = {}
        for (model,), child in self.metrics.ttft.children():
            bounds = [*child.bounds, math.inf]
            running, cumulative = 0, []
            for bound, count in zip(bounds, list(child.counts), strict=True):
                running += count
                cumulative.append((bound, float(running)))
            out[model] = tuple(cumulative)
        return out

    def _load(
        self, model: str, replica: str, scraped: ReplicaLoad
    ) -> tuple[int, int, float] | None:
        """``(running, waiting, kv)``: the sampler's own read if fresh, else the
        controller's last scrape, else unknown."""
        read = self._engines.get(replica)
        if read is not None and self._clock() - read.at < FRESH:
            return read.running, read.waiting, read.kv
        if scraped.observed_at is not None:
            return scraped.running, scraped.waiting, scraped.kv_cache_usage
        return None

    def _gpus(self, replica: str, now: float) -> GpuRead | None:
        """The replica's GPUs from the sampler's fresh read (``None``: none, or no gauges)."""
        read = self._engines.get(replica)
        if read is None or now - read.at >= FRESH:
            return None
        return read.gpus

    def _itl(self, model: str, now: float) -> Buckets | None:
        """The pool's ITL histogram: its replicas' fresh reads summed bucket by bucket."""
        total: dict[float, float] = {}
        found = False
        for replica in self._view(model):
            read = self._engines.get(replica.id)
            if read is None or read.itl is None or now - read.at >= FRESH:
                continue
            found = True
            for bound, count in read.itl:
                total[bound] = total.get(bound, 0.0) + count
        return tuple(sorted(total.items())) if found else None

    async def _read_engines(self, client: ReplicaClient) -> None:
        targets = [(name, u.url) for name, u in self.control.upstreams.items() if u.url]
        pages = await asyncio.gather(*(_get_metrics(client, url) for _, url in targets))
        now = self._clock()
        for (name, _), page in zip(targets, pages, strict=True):
            if page is None:
                continue
            load = parse_engine_metrics(page)
            running, waiting, kv = load if load is not None else (0, 0, 0.0)
            self._engines[name] = _EngineRead(
                now, running, waiting, kv, read_histogram(page), read_gpus(page)
            )
        for gone in self._engines.keys() - self.control.upstreams.keys():
            del self._engines[gone]

    def _note_states(self, now: float) -> None:
        """Replica state changes go on the timeline (ejections come from the controller's
        own records, with their cause, so entering ``ejected`` is not repeated here)."""
        timeline = self.control.timeline
        seen: dict[str, str] = {}
        for model in self._pools:
            for replica in self._view(model):
                state = replica.state.value
                seen[replica.id] = state
                before = self._states.get(replica.id)
                if state not in (before, "ejected"):
                    text = f"{replica.id}: {before or 'new'} → {state}"
                    timeline.add(now, "replica", model, text, replica=replica.id)
        for gone in self._states.keys() - seen.keys():
            timeline.add(now, "replica", None, f"{gone}: gone", replica=gone)
        self._states = seen


_SERIES: Final = (
    "t", "rps", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "kv", "running", "gpu_util",
)  # fmt: skip


def _at_or_before(samples: deque[_Sample], when: float) -> _Sample | None:
    """The newest sample taken at or before ``when`` (the oldest one if none is that old)."""
    found = samples[0] if samples else None
    for sample in samples:
        if sample.at > when:
            break
        found = sample
    return found


def _point(then: _Sample | None, now: _Sample) -> dict[str, Any]:
    """Rates and quantiles between two samples (``then`` ``None`` or the same: no rate)."""
    span = 0.0 if then is None else now.at - then.at
    rps = errors = None
    ttft: tuple[float | None, float | None] = (None, None)
    itl: tuple[float | None, float | None] = (None, None)
    if then is not None and span > 0:
        rps = max(now.requests - then.requests, 0.0) / span
        errors = max(now.errors - then.errors, 0.0) / span
        ttft = _quantiles(then.ttft, now.ttft)
        if now.itl is not None:
            itl = _quantiles(then.itl or (), now.itl)
    return {
        "t": round(now.wall, 3),
        "span_s": round(span, 3),
        "rps": _round(rps),
        "errors_per_s": _round(errors),
        "ttft_p50": _round(ttft[0]),
        "ttft_p99": _round(ttft[1]),
        "itl_p50": _round(itl[0]),
        "itl_p99": _round(itl[1]),
        "kv": _round(now.kv),
        "running": now.running,
        "gpu_util": _round(now.gpu_util),
    }


def _quantiles(then: Buckets, now: Buckets) -> tuple[float | None, float | None]:
    before = dict(then)
    deltas = [(bound, max(count - before.get(bound, 0.0), 0.0)) for bound, count in now]
    return quantile(deltas, 0.5), quantile(deltas, 0.99)


def quantile(cumulative: Sequence[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of a cumulative histogram, interpolated linearly within its
    bucket as Prometheus's ``histogram_quantile`` does (the last finite bound when it falls
    in ``+Inf``); ``None`` for an empty one."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank and count > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = (bound if not math.isinf(bound) else lower), max(count, below)
    return lower


def read_histogram(page: str, names: Sequence[str] = ITL_NAMES) -> Buckets | None:
    """The first of ``names`` found on a Prometheus page, as one cumulative histogram (its
    series summed bucket by bucket); ``None`` when the page has none of them."""
    for name in names:
        prefix = name + "_bucket{"
        total: dict[float, float] = {}
        for line in page.splitlines():
            if not line.startswith(prefix):
                continue
            labels, _, value = line[len(prefix) :].rpartition("} ")
            bound = _label(labels, "le")
            if bound is None:
                continue
            with contextlib.suppress(ValueError):
                total[float(bound)] = total.get(float(bound), 0.0) + float(value.split()[0])
        if total:
            return tuple(sorted(total.items()))
    return None


def read_gpus(page: str) -> GpuRead | None:
    """A page's dcgm-exporter gauges, one series per GPU (``gpu`` label): utilisation
    averaged, power and memory summed; ``None`` when it has no ``DCGM_FI_DEV_GPU_UTIL``."""
    values: dict[str, dict[str, float]] = {}
    for line in page.splitlines():
        if not line.startswith("DCGM_FI_DEV_"):
            continue
        name, _, rest = line.partition("{")
        key = _GPU_GAUGES.get(name)
        if key is None or "}" not in rest:
            continue
        labels, _, value = rest.rpartition("}")
        try:
            number = float(value.split()[0])
        except (ValueError, IndexError):
            continue
        gpu = _label(labels, "gpu") or _label(labels, "UUID") or ""
        values.setdefault(key, {})[gpu] = number
    util = values.get("util")
    if not util:
        return None
    used, free = values.get("used", {}), values.get("free", {})
    total = sum(used.values()) + sum(free.values())
    return GpuRead(
        count=len(util),
        util=min(1.0, max(0.0, sum(util.values()) / len(util) / 100.0)),
        power_w=sum(values.get("power", {}).values()),
        memory=sum(used.values()) / total if used and total > 0 else None,
    )


def _label(labels: str, name: str) -> str | None:
    key = f'{name}="'
    start = labels.find(key)
    if start < 0:
        return None
    start += len(key)
    end = labels.find('"', start)
    return None if end < 0 else labels[start:end]


async def _get_metrics(client: ReplicaClient, url: str) -> str | None:
    try:
        async with asyncio.timeout(2.0):
            status, body = await client.get(url + "/metrics", 2.0)
    except (TimeoutError, UpstreamError):
        return None
    return body.decode("utf-8", "replace") if status == 200 else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 5)
