"""Injected faults: the current settings, the seeded error draw, and the crash timer.

``Faults`` is the one owner of the fault settings of a running sim engine::

    faults = Faults(FaultConfig(error_rate=0.1), random.Random(seed))
    faults.draw_error()                    # True for about one request in ten
    faults.update({"unhealthy": True})     # what POST /admin/faults does

The crash timer (``watch_for_crash``) is a task of the app's lifespan; it sleeps until the
crash deadline or until the settings change, and ends the process with ``os._exit`` so that
nothing (no lifespan shutdown, no graceful close) runs: a crash, not a stop.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from gpufleet.engine.server._config import FaultConfig

CRASH_EXIT_STATUS = 1


class Faults:
    """The fault settings in force, changed only through ``update``."""

    def __init__(self, config: FaultConfig, rng: random.Random) -> None:
        self._config = config
        self._rng = rng
        self._changed = asyncio.Event()
        self._crash_at = self._deadline(config)

    @property
    def config(self) -> FaultConfig:
        return self._config

    def update(self, patch: Mapping[str, Any]) -> FaultConfig:
        """Apply the given fields (validated; ``ValueError`` on bad ones) and return the result."""
        merged = {**self._config.model_dump(), **patch}
        self._config = FaultConfig.model_validate(merged)
        if "crash_after_s" in patch:
            self._crash_at = self._deadline(self._config)
        self._changed.set()
        return self._config

    def draw_error(self) -> bool:
        """Whether this request gets an injected 500."""
        rate = self._config.error_rate
        return rate > 0 and self._rng.random() < rate

    @staticmethod
    def _deadline(config: FaultConfig) -> float | None:
        if config.crash_after_s is None:
            return None
        return time.monotonic() + config.crash_after_s

    async def watch_for_crash(self, exit_: Callable[[int], object] = os._exit) -> None:
        """Call ``exit_`` when the crash deadline passes; re-arm whenever settings change."""
        while True:
            self._changed.clear()
            timeout = None if self._crash_at is None else self._crash_at - time.monotonic()
            if timeout is not None and timeout <= 0:
                exit_(CRASH_EXIT_STATUS)
                return
            try:
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
            except TimeoutError:
                continue
