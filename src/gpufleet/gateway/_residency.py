"""The gateway's side of residency: Sleep and Wake carried out over HTTP, and the metrics.

The controller decides (``gpufleet.control``, docs/residency.md); this shell does::

    Sleep(model, replica, level) ─► POST {replica}/sleep?level=N ─► Resident(sleeping_N)
    Wake(model, replica)         ─► POST {replica}/wake_up        ─► Resident(serving)

vLLM's (and the sim engine's) routes answer once the engine has fallen asleep or woken up.
A call that fails (a refused connection, a 4xx/5xx, a timeout) reports the state the engine
says it is in (``GET /is_sleeping``), so the controller decides again on what is true.

Metrics (only for pools that are not always resident: nothing is added otherwise)::

    gpufleet:replica_residency{model, replica, state}     1 for each replica's residency
    gpufleet:residency_sleeps_total{model, reason}        idle | evicted | overcommit
    gpufleet:residency_wakes_total{model}
    gpufleet:residency_wake_seconds{model}                histogram: POST /wake_up's time
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gpufleet.control import Residency, Resident, Sleep, Wake, asleep_at
from gpufleet.fleet import ReplicaId
from gpufleet.gateway._errors import UpstreamError
from gpufleet.gateway._upstream import ReplicaClient, UpstreamRequest

logger = logging.getLogger("gpufleet.gateway")

_WAKE_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_STATES: Final = tuple(Residency)
CALL_TIMEOUT: Final = 300.0
"""Longest wait for ``/sleep`` or ``/wake_up`` (a level-2 wake of a large model reads the
checkpoint: tens of seconds)."""


class ResidencyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "gpufleet:"
        self.state = Gauge(
            p + "replica_residency", "1 for each replica's residency state.",
            ["model", "replica", "state"], registry=registry,
        )  # fmt: skip
        self.sleeps = Counter(
            p + "residency_sleeps", "Replicas put to sleep, by why.",
            ["model", "reason"], registry=registry,
        )  # fmt: skip
        self.wakes = Counter(
            p + "residency_wakes", "Replicas woken up.", ["model"], registry=registry
        )  # fmt: skip
        self.wake_seconds = Histogram(
            p + "residency_wake_seconds", "Seconds a POST /wake_up took.",
            ["model"], registry=registry, buckets=_WAKE_BUCKETS,
        )  # fmt: skip

    def show(self, model: str, states: Mapping[ReplicaId, Residency]) -> None:
        for replica, now in states.items():
            for state in _STATES:
                self.state.labels(model, replica, state.value).set(1.0 if state is now else 0.0)


class ResidencyShell:
    """Carries out Sleep and Wake; reports each outcome as a :class:`Resident` event."""

    def __init__(
        self,
        metrics: ResidencyMetrics,
        url_of: Callable[[ReplicaId], str | None],
        report: Callable[[Resident], None],
    ) -> None:
        self.metrics = metrics
        self._url_of = url_of
        self._report = report

    async def sleep(self, client: ReplicaClient, command: Sleep) -> None:
        self.metrics.sleeps.labels(command.model, command.reason).inc()
        ok = await self._post(client, command.replica, f"/sleep?level={command.level}")
        state = asleep_at(command.level) if ok else await self._state(client, command.replica)
        if state is not None:
            self._report(Resident(command.model, command.replica, state))

    async def wake(self, client: ReplicaClient, command: Wake) -> None:
        started = time.monotonic()
        ok = await self._post(client, command.replica, "/wake_up")
        if ok:
            self.metrics.wakes.labels(command.model).inc()
            self.metrics.wake_seconds.labels(command.model).observe(time.monotonic() - started)
            state: Residency | None = Residency.SERVING
        else:
            state = await self._state(client, command.replica)
        if state is not None:
            self._report(Resident(command.model, command.replica, state))

    async def _post(self, client: ReplicaClient, replica: ReplicaId, path: str) -> bool:
        url = self._url_of(replica)
        if url is None:
            return False
        try:
            async with client.send(UpstreamRequest(url, path, b"")) as answer:
                async for _ in answer.chunks:
                    pass
                ok = answer.status == 200
        except (UpstreamError, TimeoutError, OSError) as error:
            logger.warning("residency: %s%s failed: %s", replica, path, error)
            return False
        if not ok:
            logger.warning("residency: %s%s answered %d", replica, path, answer.status)
        return ok

    async def _state(self, client: ReplicaClient, replica: ReplicaId) -> Residency | None:
        """What the engine says after a failed call (``None``: it does not answer)."""
        url = self._url_of(replica)
        if url is None:
            return None
        try:
            status, body = await client.get(url + "/is_sleeping", 5.0)
            if status != 200:
                return None
            sleeping = bool(json.loads(body)["is_sleeping"])
        except (UpstreamError, TimeoutError, OSError, ValueError, KeyError, TypeError):
            return None
        # the level of a sleep that failed half-way is not told: level 1 is the safe guess
        return asleep_at(1) if sleeping else Residency.SERVING
