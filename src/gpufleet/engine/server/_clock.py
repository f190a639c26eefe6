"""The engine loop's clock: modelled seconds, mapped onto the event loop's time.

The sim engine reports every latency in *modelled* time: the time the modelled GPU would
take. ``--time-scale K`` makes modelled time run K times faster than real time::

    clock = ScaledClock(time_scale=10.0)   # a 50 ms modelled step sleeps 5 ms
    t = clock.now()                        # modelled seconds since the clock started
    await clock.sleep_until(t + 0.050)

``VirtualClock`` jumps straight to every deadline (trio's ``MockClock`` with autojump), so a
test drives the real loop in virtual time and asserts exact durations.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    """Modelled time for the engine loop (STYLE 8: time is a parameter)."""

    @property
    def time_scale(self) -> float:
        """Modelled seconds per real second (1 is real time)."""
        ...

    def now(self) -> float:
        """Modelled seconds since an arbitrary origin; never decreases."""
        ...

    async def sleep_until(self, deadline: float) -> None:
        """Return once ``now() >= deadline``."""
        ...


class ScaledClock:
    """The system's monotonic clock, ``time_scale`` times faster."""

    def __init__(self, time_scale: float = 1.0) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self._scale = time_scale
        self._origin = time.monotonic()

    @property
    def time_scale(self) -> float:
        return self._scale

    def now(self) -> float:
        return (time.monotonic() - self._origin) * self._scale

    async def sleep_until(self, deadline: float) -> None:
        # Timers fire on whole milliseconds (libuv) or a little late (selectors): wake again
        # for the remainder rather than returning early.
        while (left := deadline - self.now()) > 0:
            await asyncio.sleep(left / self._scale)


class VirtualClock:
    """A test clock: sleeping jumps time to the deadline at once."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    @property
    def time_scale(self) -> float:
        return float("inf")

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot move a clock back ({seconds} s)")
        self._now += seconds

    async def sleep_until(self, deadline: float) -> None:
        self._now = max(self._now, deadline)
        await asyncio.sleep(0)
