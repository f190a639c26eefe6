"""The batch runner: one per gateway, it runs the store's batches line by line through the
gateway's own request path (docs/batch.md).

::

    every poll_interval (at once when this gateway's API created or cancelled a batch):
        store.batches.unfinished() ─► a driver per batch not driven here yet
    a driver, for one batch:
        advance ─► in_progress? claim up to lines_in_flight lines (a lease each)
                   each line: call_app(POST endpoint, body) as the batch's owner, class `batch`
                       answered (any status but RUN_AGAIN) ─► record it, once
                       429 / 503 / 500 / cancelled       ─► wait (Retry-After, doubling), again
                   renew the leases every lease/3; claim more as lines end
               ─► cancelling: lines waiting stop (released), lines running finish and count
               ─► terminal (completed, expired, cancelled): stop; output files are the store's

What makes it survive ``kill -9``: a line is claimed with a lease in the store, and its
result recorded once (``UPDATE … WHERE state != 'done'``); a killed gateway's lines are
claimable again when their leases run out, by any gateway. A line can therefore *run* twice
(killed after the answer, before the record) but is *recorded* once, and its ledger row has
the line's fixed ``batch_req_…`` id, so the ledger keeps one row however often it ran.
Two gateways on one PostgreSQL store drive the same batches: their claims never overlap
(``FOR UPDATE SKIP LOCKED``) and each move of a batch is a compare-and-set, made once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter, Gauge

from gpufleet.config import BatchConfig
from gpufleet.fleet import BATCH_TERMINAL, BatchStatus
from gpufleet.gateway._batches_api import BatchApi
from gpufleet.gateway._inprocess import Answer, App, call_app
from gpufleet.gateway._tenancy import BATCH_LINE, PRINCIPAL, RUN_AGAIN, Principal, Tenancy
from gpufleet.store import Batch, LineClaim, LineResult, Store

logger = logging.getLogger("gpufleet.batch")

FIRST_BACKOFF: Final = 0.5
"""Seconds before a line refused for now is tried again the first time (then doubling)."""


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "gpufleet:gateway_batch_"
        self.lines = Counter(
            p + "lines",
            "Batch lines this gateway ran to an end, by outcome: completed (a 2xx recorded), "
            "failed (another answer recorded), late (answered, but the line was already done "
            "or its batch had ended), deferred (refused for now, to be tried again).",
            ["outcome"],
            registry=registry,
        )
        self.running = Gauge(
            p + "lines_running", "Batch lines this gateway holds now.", registry=registry
        )
        self.batches = Gauge(p + "driven", "Batches this gateway drives now.", registry=registry)


class BatchService:
    """The Batch API's routes and its runner, over one store, for one gateway."""

    def __init__(
        self,
        config: BatchConfig,
        store: Store,
        app: App,
        registry: CollectorRegistry,
        *,
        tenancy: Tenancy | None,
        body_timeout: float,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.runner = BatchRunner(config, store, app, BatchMetrics(registry), tenancy, wall=wall)
        self.api = BatchApi(store, wake=self.runner.wake, body_timeout=body_timeout, wall=wall)


class BatchRunner:
    """Drives every unfinished batch of the store from this gateway (run it in the app's
    lifespan TaskGroup: :meth:`run` returns only when cancelled)."""

    def __init__(
        self,
        config: BatchConfig,
        store: Store,
        app: App,
        metrics: BatchMetrics,
        tenancy: Tenancy | None,
        *,
        wall: Callable[[], float] = time.time,
        worker: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.app = app
        self.metrics = metrics
        self.tenancy = tenancy
        self.wall = wall
        """Unix seconds: the store's batch times (leases included) are wall-clock times."""
        self.worker = worker or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        """This runner's name on its claims (a restarted gateway is a new worker)."""
        self.rng = rng or random.Random()
        self._woken = asyncio.Event()
        self._drivers: dict[str, _Driver] = {}

    def wake(self) -> None:
        """Look at the batches now (one was created or cancelled through this gateway)."""
        self._woken.set()
        for driver in self._drivers.values():
            driver.woken = True
            driver.changed.set()

    @property
    def driving(self) -> frozenset[str]:
        """The batches this runner drives now."""
        return frozenset(self._drivers)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            while True:
                self._woken.clear()
                try:
                    batches = await asyncio.to_thread(self.store.batches.unfinished)
                except Exception:
                    logger.exception("could not list the unfinished batches; trying again")
                    batches = []
                for batch in batches:
                    if batch.id not in self._drivers:
                        driver = self._drivers[batch.id] = _Driver(self, batch)
                        tg.create_task(self._drive(driver), name=f"batch {batch.id}")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.config.poll_interval):
                        await self._woken.wait()

    async def _drive(self, driver: _Driver) -> None:
        self.metrics.batches.inc()
        try:
            await driver.run()
        except Exception:  # the database went away, a bug: the next poll starts it again
            logger.exception("batch %s: the runner stopped driving it", driver.batch_id)
        finally:
            self.metrics.batches.dec()
            del self._drivers[driver.batch_id]

    def backoff(self, tries: int, retry_after: float | None) -> float:
        """Seconds before a refused line's next try: doubling from ``Retry-After`` (or
        :data:`FIRST_BACKOFF`) up to ``max_backoff``, with jitter (half to all of it)."""
        base = max(retry_after or 0.0, FIRST_BACKOFF) * 2.0 ** min(tries, 30)
        return min(base, self.config.max_backoff) * self.rng.uniform(0.5, 1.0)

    def scope(self, batch: Batch, claim: LineClaim) -> dict[str, Any] | None:
        """What the line's request carries in its scope: the batch's owner as a principal in
        the ``batch`` class (auth on), and the line's id. ``None``: the owner is not (yet)
        known to this gateway's snapshot of tenants; the line waits."""
        scope: dict[str, Any] = {BATCH_LINE: claim.request_id}
        if self.tenancy is not None:
            settings = self.tenancy.snapshot.tenants.get(batch.owner)
            if settings is None:
                return None
            # the batch's id stands where a request names its API key (ledger `key_id`)
            principal = Principal(batch.owner, batch.id, replace(settings, priority="batch"))
            scope[PRINCIPAL] = principal
        return scope


@dataclass(slots=True)
class _Line:
    claim: LineClaim
    task: asyncio.Task[None] | None = None
    waiting: bool = False
    """Between two tries: a cancel or the window's end stops it at once."""


class _Driver:
    """One batch, driven by one runner until the batch ends (or the runner stops)."""

    def __init__(self, runner: BatchRunner, batch: Batch) -> None:
        self.runner = runner
        self.batch = batch
        self.batch_id = batch.id
        self.lines: dict[int, _Line] = {}
        self.changed = asyncio.Event()
        """Set when a line ended or the runner was woken: the loop looks again."""
        self.woken = False
        self.dirty = False
        """A line ended since the last advance (the batch may be done)."""
        self._claiming = threading.Lock()
        """Held by a claim's worker thread while it runs: a driver that stops waits for it."""
        self._unseen: list[LineClaim] = []
        """What the last claim took, until the driver holds it (a claim's thread runs on
        when its driver is cancelled: those lines are given back too)."""
        self._stopped = False
        """The driver stopped: a claim whose thread starts only now takes nothing."""

    async def run(self) -> None:
        r = self.runner
        config = r.config
        loop = asyncio.get_running_loop()
        status = await self._advance()
        poll_at = loop.time() + config.poll_interval
        renew_at = loop.time() + config.lease / 3
        exhausted = False  # the last claim found nothing more to take
        try:
            async with asyncio.TaskGroup() as tg:
                while status not in BATCH_TERMINAL:
                    if status is BatchStatus.IN_PROGRESS:
                        if not exhausted and self._room():
                            exhausted = await self._claim(tg)
                    else:  # cancelling: lines not running stop; running ones finish
                        await self._stop_waiting()
                    now = loop.time()
                    if renew_at <= now:
                        await self._renew()
                        renew_at = now + config.lease / 3
                    end = self.dirty and not self.lines and (exhausted or status is not _RUNNING)
                    if end or self.woken or poll_at <= now:
                        self.dirty = self.woken = exhausted = False
                        status = await self._advance()
                        poll_at = loop.time() + config.poll_interval
                        continue
                    self.changed.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(max(min(poll_at, renew_at) - now, 0.0)):
                            await self.changed.wait()
                for line in self.lines.values():  # ended here (expired, cancelled): stop
                    if line.task is not None:
                        line.task.cancel()
        finally:
            with self._claiming:  # a claim still in its thread ends first: its lines too
                self._stopped = True
                held = [*self.lines, *(c.line for c in self._unseen)]
            if held:  # the runner stops (or failed): give the lines back at once
                with contextlib.suppress(Exception):
                    r.store.batch_lines.release(self.batch_id, held, worker=r.worker)
                r.metrics.running.dec(len(held))
                self.lines.clear()

    def _room(self) -> bool:
        """Whether to claim now: a quarter of the window is free (or nothing runs)."""
        window = self.runner.config.lines_in_flight
        free = window - len(self.lines)
        return free > 0 and (not self.lines or free * 4 >= window)

    async def _advance(self) -> BatchStatus:
        r = self.runner
        advance = r.store.batches.advance
        batch = await asyncio.to_thread(advance, self.batch_id, now=r.wall(), order=r.config.order)
        if batch is None:
            return BatchStatus.CANCELLED  # gone: nothing to drive
        self.batch = batch
        return batch.status

    async def _claim(self, tg: asyncio.TaskGroup) -> bool:
        """Claim what fits; whether the batch had fewer lines to give than asked for."""
        r = self.runner
        free = r.config.lines_in_flight - len(self.lines)
        claims = await asyncio.to_thread(self._claim_now, free)
        self._unseen = []  # held from here on (no await until they are in self.lines)
        for claim in claims:
            line = self.lines[claim.line] = _Line(claim)
            line.task = tg.create_task(self._run_line(line))
        r.metrics.running.inc(len(claims))
        return len(claims) < free

    def _claim_now(self, limit: int) -> list[LineClaim]:
        """The claim, in a worker thread."""
        r = self.runner
        with self._claiming:
            if self._stopped:  # queued for a thread until after its driver stopped
                return []
            self._unseen = r.store.batch_lines.claim(
                self.batch_id, worker=r.worker, now=r.wall(), limit=limit, lease_s=r.config.lease
            )
            return self._unseen

    async def _stop_waiting(self) -> None:
        """Stop the lines waiting between two tries and give them back (a cancel)."""
        waiting = [n for n, line in self.lines.items() if line.waiting]
        for n in waiting:
            task = self.lines.pop(n).task
            if task is not None:
                task.cancel()
        if waiting:
            r = self.runner
            r.metrics.running.dec(len(waiting))
            self.dirty = True
            release = r.store.batch_lines.release
            await asyncio.to_thread(release, self.batch_id, waiting, worker=r.worker)

    async def _renew(self) -> None:
        r = self.runner
        held = list(self.lines)
        if not held:
            return
        kept = await asyncio.to_thread(
            r.store.batch_lines.renew,
            self.batch_id,
            held,
            worker=r.worker,
            now=r.wall(),
            lease_s=r.config.lease,
        )
        if kept < len(held):  # a lease ran out first (a stalled loop): the first record wins
            logger.warning(
                "batch %s: %d of %d leases lost", self.batch_id, len(held) - kept, len(held)
            )

    async def _run_line(self, line: _Line) -> None:
        """Run the line to an answer and record it. Cancelled before the record returned,
        the line stays in :attr:`lines` and the driver gives it back: a release after the
        record (its thread runs on) changes nothing, a record after the release still
        records (the first result stays)."""
        r = self.runner
        claim = line.claim
        result = _result(await self._answer(line))
        recorded = await asyncio.to_thread(
            r.store.batch_lines.record, self.batch_id, claim.line, result, now=r.wall()
        )
        if self.lines.pop(claim.line, None) is not None:
            r.metrics.running.dec()
        self.dirty = True
        self.changed.set()
        outcome = ("completed" if result.ok else "failed") if recorded else "late"
        r.metrics.lines.labels(outcome).inc()

    async def _answer(self, line: _Line) -> Answer:
        """The line's answer, trying again (after a wait) while it is refused for now."""
        r = self.runner
        claim = line.claim
        body = json.dumps(claim.body).encode()
        headers = [(b"x-request-id", claim.request_id.encode())]
        tries = 0
        while True:
            retry_after = None
            scope = r.scope(self.batch, claim)
            if scope is not None:
                try:
                    answer = await call_app(
                        r.app, "POST", self.batch.endpoint, body, headers=headers, scope=scope
                    )
                except Exception:
                    logger.exception("batch %s, line %d: the gateway failed", *self._at(claim))
                else:
                    if answer.status not in RUN_AGAIN:
                        return answer
                    retry_after = _seconds(answer.header(b"retry-after"))
            r.metrics.lines.labels("deferred").inc()
            line.waiting = True
            try:
                await asyncio.sleep(r.backoff(tries, retry_after))
            finally:
                line.waiting = False
            tries += 1

    def _at(self, claim: LineClaim) -> tuple[str, int]:
        return self.batch_id, claim.line


_RUNNING: Final = BatchStatus.IN_PROGRESS


def _result(answer: Answer) -> LineResult:
    """The line's result from the gateway's answer (its body kept as the output's body)."""
    try:
        body = answer.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return LineResult.error("invalid_response", f"the answer ({answer.status}) is not JSON")
    return LineResult.response(answer.status, body, answer.header(b"x-request-id"))


def _seconds(value: str | None) -> float | None:
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        return None
    return min(seconds, 3600.0) if seconds >= 0.0 else None  # NaN is not >= 0
