"""The admission gate of one model pool: the pure :class:`~gpufleet.policy.FairQueue` driven
by the event loop.

A request starts at once while the pool is not saturated and nobody waits; otherwise it
joins the queue, and starts when :meth:`~gpufleet.policy.FairQueue.admit` lets it (at once
if its tenant is under its fair share and the pool below ``reserve_saturation``; else when
a running request ends or a scrape shows room), or its deadline passes (503), or a full
queue sheds it (503). "Saturated" is the shared definition: the
pool's :func:`~gpufleet.policy.pool_utilisation` over its routable replicas, or the gateway's
own count of requests it let in spread over them (a scrape lags; the count does not), read
through :func:`~gpufleet.policy.saturation`, at or above ``admission.saturation``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gpufleet.fleet import FleetView
from gpufleet.gateway._tenancy_errors import AdmissionError
from gpufleet.policy import AdmissionConfig, FairQueue, PoolGauge, Ticket

_TICK = 0.05
"""Seconds between two looks at a non-empty queue (deadlines, and room a scrape shows)."""


class AdmissionGate:
    """Lets one pool's requests in, in fair order, while it has room."""

    def __init__(
        self,
        model: str,
        config: AdmissionConfig,
        max_num_seqs: int,
        view: Callable[[], FleetView],
        clock: Callable[[], float],
    ) -> None:
        self.model = model
        self.config = config
        self.queue = FairQueue(config)
        self._gauge = PoolGauge(config, max_num_seqs)
        self.in_flight = 0
        self._view = view
        self._clock = clock
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def saturated(self) -> bool:
        # No routable replica: not saturated (nothing to wait for: the router answers 503).
        return self._gauge.saturated(self._view().routable(self.model), self.in_flight)

    def level(self) -> float:
        return self._gauge.level(self._view().routable(self.model), self.in_flight)

    async def enter(self, ticket: Ticket) -> None:
        """Return when ``ticket`` may start; raise :class:`AdmissionError` if it may not."""
        if not self.queue and not self.saturated():
            self.queue.start(ticket)
            self.in_flight += 1
            return
        for shed in self.queue.offer(self._clock(), ticket):
            error = AdmissionError(
                f"the gateway's queue for `{self.model}` is full (lower-priority work is shed "
                "first)",
                1,
            )
            if shed is ticket:
                raise error
            waiter = self._waiters.pop(shed.id, None)
            if waiter is not None and not waiter.done():
                waiter.set_exception(error)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[ticket.id] = waiter
        self.pump()
        self._arm()
        try:
            await waiter
        except asyncio.CancelledError:
            self._waiters.pop(ticket.id, None)
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.leave(ticket, None)  # started as its client left
            else:
                self.queue.discard(ticket)
            raise

    def leave(self, ticket: Ticket, work: tuple[int, int] | None) -> None:
        """A started ticket ended; ``work`` = (uncached prompt, output tokens) if known."""
        self.in_flight -= 1
        self.queue.end(ticket, work)
        self.pump()

    def pump(self) -> None:
        while self.queue:
            ticket = self.queue.admit(self._clock(), self.level())
            if ticket is None:
                break
            waiter = self._waiters.pop(ticket.id, None)
            if waiter is None or waiter.done():
                self.queue.end(ticket)  # its client left meanwhile: it never runs
                continue
            self.in_flight += 1
            waiter.set_result(None)

    def _arm(self) -> None:
        if self._timer is None and self.queue:
            self._timer = asyncio.get_running_loop().call_later(_TICK, self._tick)

    def _tick(self) -> None:
        self._timer = None
        for ticket in self.queue.expire(self._clock()):
            waiter = self._waiters.pop(ticket.id, None)
            if waiter is not None and not waiter.done():
                waiter.set_exception(
                    AdmissionError(
                        f"`{self.model}` is saturated and the request could not start before "
                        "its deadline",
                        1,
                    )
                )
        self.pump()
        self._arm()
