"""The admission gate of one model pool: the pure :class:`~gpufleet.policy.FairQueue` driven
by the event loop.

A request starts at once while the pool is not saturated and nobody waits; otherwise it
joins the queue, and starts when :meth:`~gpufleet.policy.FairQueue.admit` lets it (at once
if its tenant is under its fair share and the pool below ``reserve_saturation``; else when
a running request ends or a scrape shows room), or its deadline passes (503), or a full
queue sheds it (503). "Saturated" is the shared definition: the
pool's :func:`~gpufleet.policy.pool_utilisation` over its routable replicas, or the gateway's
own count of requests it let in spread over them (a scrape lags; the count does not), read
through :func:`~gpufleet.policy.saturation`, at or above ``admission.saturation``. The
rules are :class:`~gpufleet.policy.PoolAdmission`'s, the simulator's too; this shell keeps
only the futures of queued requests and the timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from gpufleet.fleet import FleetView, ReplicaView
from gpufleet.gateway._tenancy_errors import AdmissionError
from gpufleet.policy import AdmissionConfig, FairQueue, PoolAdmission, Ticket


class AdmissionGate:
    """Lets one pool's requests in, in fair order, while it has room: the pure
    :class:`~gpufleet.policy.PoolAdmission` with a future per queued request and a timer
    every ``config.tick`` while the queue is non-empty."""

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
        self.pool = PoolAdmission(config, max_num_seqs)
        self._view = view
        self._clock = clock
        self._waiters: dict[str, asyncio.Future[None]] = {}
        self._timer: asyncio.TimerHandle | None = None

    @property
    def queue(self) -> FairQueue:
        return self.pool.queue

    @property
    def in_flight(self) -> int:
        """Requests this gate let in that have not left."""
        return self.pool.in_flight

    def _routable(self) -> Sequence[ReplicaView]:
        return self._view().routable(self.model)

    def saturated(self) -> bool:
        return self.pool.saturated(self._routable())

    def level(self) -> float:
        return self.pool.level(self._routable())

    async def enter(self, ticket: Ticket) -> None:
        """Return when ``ticket`` may start; raise :class:`AdmissionError` if it may not."""
        if self.pool.enter(ticket, self._routable()):
            return
        for shed in self.pool.offer(self._clock(), ticket):
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
                self.pool.discard(ticket)
            raise

    def leave(self, ticket: Ticket, work: tuple[int, int] | None) -> None:
        """A started ticket ended; ``work`` = (uncached prompt, output tokens) if known."""
        self.pool.leave(ticket, work)
        self.pump()

    def pump(self) -> None:
        while (ticket := self.pool.admit(self._clock(), self._routable())) is not None:
            waiter = self._waiters.pop(ticket.id, None)
            if waiter is None or waiter.done():
                self.pool.leave(ticket, None)  # its client left meanwhile: it never runs
                continue
            waiter.set_result(None)

    def _arm(self) -> None:
        if self._timer is None and self.queue:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.config.tick, self._tick)

    def _tick(self) -> None:
        self._timer = None
        for ticket in self.pool.expire(self._clock()):
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
