"""When a drain is over: the one rule both runtimes (local processes, Kubernetes pods) follow.

A draining replica gets no new request, but one the gateway sent just before it saw the
replica draining may still be on its way. So a drain ends after ``IDLE_READS`` consecutive
reads of the engine's ``/metrics`` (one probe interval apart) that find nothing running or
waiting; a read that fails or finds no such metric (``None``) proves nothing and starts the
count over, like a busy one::

    idle = await wait_idle(read, interval, draining=lambda: replica.is_draining)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from gpufleet.fleet import read_engine_metrics

IDLE_READS: Final = 2
"""Consecutive idle reads that end a drain (the second covers a request in transit)."""

Read = Callable[[], Awaitable[int | None]]
"""One in-flight read: requests running or waiting; ``None`` when unknown."""


@dataclass(slots=True)
class IdleCounter:
    """Consecutive idle reads; :meth:`saw` says whether the drain is over."""

    reads: int = 0

    def saw(self, busy: int | None) -> bool:
        self.reads = self.reads + 1 if busy == 0 else 0
        return self.reads >= IDLE_READS


def _always() -> bool:
    return True


async def wait_idle(read: Read, interval: float, *, draining: Callable[[], bool] = _always) -> bool:
    """Read until the drain is over (``True``) or ``draining()`` turns false (``False``).
    No deadline of its own: wrap it in ``asyncio.timeout`` for one."""
    counter = IdleCounter()
    while draining():
        if counter.saw(await read()):
            return True
        await asyncio.sleep(interval)
    return False


def in_flight(metrics_text: str) -> int | None:
    """Running + waiting requests from an engine's Prometheus text (the names of
    ``gpufleet.fleet.ENGINE_METRICS``: vLLM's, SGLang's); ``None`` when the engine exports
    neither. A malformed sample line raises ``ValueError``."""
    sample = read_engine_metrics(metrics_text)
    return None if sample is None else sample.in_flight
