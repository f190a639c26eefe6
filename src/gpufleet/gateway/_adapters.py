"""The gateway's side of LoRA adapters: loads and unloads carried out over HTTP, and metrics.

The controller decides where an adapter goes and what a load evicts (``gpufleet.control``,
docs/residency.md, "LoRA adapters"); this shell does::

    Route(load=adapter)            ─► POST {replica}/v1/load_lora_adapter at once (a task);
                                      its request goes once the load is done
    Route (its adapter loading)    ─► waits for that same load, then the request
    UnloadAdapter(model, r, name)  ─► POST {replica}/v1/unload_lora_adapter

A load starts when the controller decides it, not when its request's task runs next: a
request routed there meanwhile waits for it rather than reach an engine that has not got the
adapter yet. It runs as a task of its own, so a client that leaves does not cancel it for the
others. A load waits for the unloads sent to its replica before it (they free its slot).
vLLM answers a load of an adapter it already has with a 400 that says so: that counts as
loaded (an engine the controller thought empty kept it, say). A load that fails is the
attempt's failure (and that of every request that waited for it): the controller retries the
request elsewhere as for a 5xx, and no longer counts the adapter as held there.

Metrics (only for a fleet with adapters)::

    gpufleet:adapter_loads_total{model, outcome}     ok | failed
    gpufleet:adapter_load_seconds{model}             histogram: POST /v1/load_lora_adapter
    gpufleet:adapter_unloads_total{model, outcome}   ok | failed
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram

from gpufleet.control import FleetController
from gpufleet.fleet import ReplicaId
from gpufleet.gateway._errors import ReplicaOriginError, UpstreamError
from gpufleet.gateway._upstream import ReplicaClient, UpstreamRequest

logger = logging.getLogger("gpufleet.gateway")

_LOAD_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ALREADY: Final = "has already been loaded"
"""What vLLM's 400 says of an adapter it has (``InvalidUserInput``)."""


class AdapterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "gpufleet:"
        self.loads = Counter(
            p + "adapter_loads", "LoRA adapter loads the controller sent, by outcome.",
            ["model", "outcome"], registry=registry,
        )  # fmt: skip
        self.load_seconds = Histogram(
            p + "adapter_load_seconds", "Seconds a POST /v1/load_lora_adapter took.",
            ["model"], registry=registry, buckets=_LOAD_BUCKETS,
        )  # fmt: skip
        self.unloads = Counter(
            p + "adapter_unloads", "LoRA adapter unloads the controller sent, by outcome.",
            ["model", "outcome"], registry=registry,
        )  # fmt: skip


class AdapterShell:
    """Carries out adapter loads and unloads on the replicas' engines."""

    def __init__(self, control: FleetController, metrics: AdapterMetrics) -> None:
        self.metrics = metrics
        self._control = control
        """Which served names are adapters, their pools and paths: the controller's (the
        fleet file's and those registered at run time), read, never copied."""
        self._loads: dict[tuple[ReplicaId, str], asyncio.Task[None]] = {}
        self._unloads: dict[ReplicaId, set[asyncio.Task[None]]] = {}

    @staticmethod
    def of(control: FleetController, registry: CollectorRegistry) -> AdapterShell | None:
        """``None`` for a fleet with no pool that serves adapters (no ``lora`` block)."""
        if all(pool.adapters is None for pool in control.pools.values()):
            return None
        return AdapterShell(control, AdapterMetrics(registry))

    def is_adapter(self, name: str) -> bool:
        served = self._control.served.get(name)
        return served is not None and served.adapter

    def _where(self, adapter: str) -> tuple[str, str]:
        """``adapter``'s pool and the path its engines load it from."""
        ((pool, _),) = self._control.served[adapter].variants
        adapters = self._control.pools[pool].adapters
        assert adapters is not None
        return pool, adapters.registered[adapter]

    def begin(self, client: ReplicaClient, replica: ReplicaId, url: str, adapter: str) -> None:
        """Start the load a Route asks for, the moment the controller decides it: a request
        routed there next (maybe before that Route's own request runs again) finds it."""
        key = (replica, adapter)
        task = asyncio.ensure_future(self._load(client, replica, url, adapter))
        self._loads[key] = task  # kept once done: a failed one fails who waits for it too
        task.add_done_callback(_retrieved)

    async def ready(self, replica: ReplicaId, adapter: str) -> None:
        """Return once ``replica`` has ``adapter``: after the load under way there, if any
        (``UpstreamError``: it failed)."""
        task = self._loads.get((replica, adapter))
        if task is not None:
            await asyncio.shield(task)

    async def _load(
        self, client: ReplicaClient, replica: ReplicaId, url: str, adapter: str
    ) -> None:
        pending = self._unloads.get(replica)
        if pending:
            await asyncio.wait(list(pending))
        pool, path = self._where(adapter)
        body = json.dumps({"lora_name": adapter, "lora_path": path}).encode()
        started = time.monotonic()
        try:
            status, text = await _post(client, url, "/v1/load_lora_adapter", body)
        except (UpstreamError, TimeoutError, OSError) as error:
            self.metrics.loads.labels(pool, "failed").inc()
            logger.warning("adapters: loading %s on %s failed: %s", adapter, replica, error)
            raise
        if status != 200 and not (status == 400 and _ALREADY in text):
            self.metrics.loads.labels(pool, "failed").inc()
            logger.warning("adapters: loading %s on %s: %d %s", adapter, replica, status, text)
            raise ReplicaOriginError(f"loading adapter {adapter!r} answered {status}", status)
        self.metrics.loads.labels(pool, "ok").inc()
        self.metrics.load_seconds.labels(pool).observe(time.monotonic() - started)

    def unload(self, client: ReplicaClient, replica: ReplicaId, url: str, adapter: str) -> None:
        """Send the unload (a task; a later load on ``replica`` waits for it)."""
        task = asyncio.ensure_future(self._unload(client, replica, url, adapter))
        pending = self._unloads.setdefault(replica, set())
        pending.add(task)
        task.add_done_callback(pending.discard)
        self._loads.pop((replica, adapter), None)

    async def _unload(
        self, client: ReplicaClient, replica: ReplicaId, url: str, adapter: str
    ) -> None:
        pool, _ = self._where(adapter)
        body = json.dumps({"lora_name": adapter}).encode()
        try:
            status, text = await _post(client, url, "/v1/unload_lora_adapter", body)
        except (UpstreamError, TimeoutError, OSError) as error:
            self.metrics.unloads.labels(pool, "failed").inc()
            logger.warning("adapters: unloading %s on %s failed: %s", adapter, replica, error)
            return
        # 404: the engine had not got it (restarted since, say): it is unloaded all the same
        ok = status in (200, 404)
        self.metrics.unloads.labels(pool, "ok" if ok else "failed").inc()
        if not ok:
            logger.warning("adapters: unloading %s on %s: %d %s", adapter, replica, status, text)

    def forget(self, replica: ReplicaId) -> None:
        """``replica`` left: its loads are nobody's to wait for."""
        for key in [k for k in self._loads if k[0] == replica]:
            del self._loads[key]
        self._unloads.pop(replica, None)


def _retrieved(task: asyncio.Task[None]) -> None:
    """A load's failure is its waiters' (each sees it); none is left unretrieved."""
    if not task.cancelled():
        task.exception()


async def _post(client: ReplicaClient, url: str, path: str, body: bytes) -> tuple[int, str]:
    request = UpstreamRequest(url, path, body, (("content-type", "application/json"),))
    async with client.send(request) as answer:
        text = b"".join([chunk async for chunk in answer.chunks])
    return answer.status, text[:500].decode("utf-8", "replace")
