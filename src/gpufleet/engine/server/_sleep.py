"""vLLM's sleep mode on the sim engine: ``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping``.

As vLLM (``--enable-sleep-mode``, and the routes only with ``VLLM_SERVER_DEV_MODE=1``)::

    POST /sleep?level=1     abort every request, drop the KV cache, offload the weights to
                            host memory; answers 200 (empty) once asleep
    POST /sleep?level=2     … and drop the weights too
    POST /wake_up           load the weights back; answers 200 (empty) once awake
    GET  /is_sleeping       {"is_sleeping": true | false}

The time each takes is the performance model's (``gpufleet.perf.residency_times``: level 1
copies the weights over PCIe, level 2 reads the checkpoint from storage first), slept on the
engine's clock, so ``--time-scale`` shortens it as it shortens steps. ``tags`` on
``/wake_up`` (``weights``, ``kv_cache``) are accepted and wake everything: the sim engine
has no half-awake state. While asleep (and until a wake finishes) the routes that run the
model answer 503 ``ServiceUnavailableError``; ``/health``, ``/v1/models``, ``/tokenize``
and ``/metrics`` keep answering. ``vllm:engine_sleep_state`` shows the state, in vLLM's
labels (``sleep_state``: ``awake``, ``weights_offloaded``, ``discard_all``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpufleet.engine.server._clock import Clock
from gpufleet.engine.server._loop import EngineLoop
from gpufleet.perf import ResidencyTimes

logger = logging.getLogger("gpufleet.engine.sim")

SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
"""``vllm:engine_sleep_state``'s ``sleep_state`` label values: awake, level 1, level 2."""


class SleepMode:
    """The engine's sleep level (0: awake) and its transitions, one at a time."""

    def __init__(self, times: ResidencyTimes, clock: Clock, loop: EngineLoop) -> None:
        self.times = times
        self.level = 0
        """0: awake; 1 or 2: asleep at that level (until a wake has finished)."""
        self.sleeps = 0
        self.wakes = 0
        self._clock = clock
        self._loop = loop
        self._lock = asyncio.Lock()

    @property
    def sleeping(self) -> bool:
        return self.level != 0

    async def sleep(self, level: int) -> None:
        """Abort every request, drop the KV cache (and the weights at level 2): asleep."""
        async with self._lock:
            if self.level >= level:
                return  # asleep already, as deep or deeper
            self.level = level  # from now on no request is taken
            aborted = self._loop.abort_all()
            self._loop.model.reset_prefix_cache()
            await self._wait(self.times.sleep(level))
            self.sleeps += 1
            logger.info("asleep at level %d (%d request(s) aborted)", level, aborted)

    async def wake(self) -> float:
        """Load the weights back; the modelled seconds it took (0: awake already)."""
        async with self._lock:
            if self.level == 0:
                return 0.0
            seconds = self.times.wake(self.level)
            await self._wait(seconds)
            self.level = 0
            self.wakes += 1
            logger.info("awake after %.3f modelled seconds", seconds)
            return seconds

    async def _wait(self, seconds: float) -> None:
        clock = self._clock
        await clock.sleep_until(clock.now() + seconds)


class SleepMetrics(Collector):
    """``vllm:engine_sleep_state`` (vLLM's), and the sim engine's sleep and wake counts."""

    def __init__(self, mode: SleepMode, labels: tuple[str, str]) -> None:
        self._mode = mode
        self._labels = list(labels)

    def collect(self) -> Iterator[Metric]:
        mode = self._mode
        state = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
            "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep "
            "level 2.",
            labels=("model_name", "engine", "sleep_state"),
        )
        for level, name in enumerate(SLEEP_STATES):
            state.add_metric([*self._labels, name], 1.0 if mode.level == level else 0.0)
        yield state
        for name, doc, value in (
            ("gpufleet:sim_engine_sleeps", "Times the engine fell asleep.", mode.sleeps),
            ("gpufleet:sim_engine_wakes", "Times the engine woke up.", mode.wakes),
        ):
            counter = CounterMetricFamily(name, doc, labels=("model_name", "engine"))
            counter.add_metric(self._labels, float(value))
            yield counter
