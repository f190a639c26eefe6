"""Spare capacity: how many batch lines a pool may run beside its interactive load.

Pure and clock-injected; the pool controller asks it whenever a batch line waits at its
gate and something changed (a line arrived, a request ended, a scrape, its wake-up)::

    gate = SpareCapacity(config)
    decision = gate.decide(now, SpareView(replicas, max_num_seqs, in_flight, batch_in_flight,
                                          batch_waiting, gateway_waiting, loads))
    start decision.room of the waiting lines; ask again at decision.next_at (if lines wait)

Batch lines are the lowest class: they start only into room the interactive load leaves.
The rule, a core and three guards (``room`` is what may start now)::

    pressure   (the TTFT guard, when configured: interactive TTFT P99 beside batch lines over
               its margin or bound; policy/_spare_ttft.py)
               any routable replica's scrape shows requests queueing in the engine (more
               waiting than free slots: waiting > max_num_seqs - running), or KV usage at or
               above kv_threshold; or requests wait at the gateway (admission queue, holds)
    limit      AIMD on the batch lines in flight: + increase × replicas at most once per
               `interval` while lines wait and no pressure (the first at once), doubled
               instead until the first pressure (a slow start, as TCP's: an idle pool
               of 256-slot engines fills in seconds, not minutes); on pressure × decrease
               of what runs (at most once per `interval`: the last cut is given time to
               show in a scrape)
    headroom   the pool is filled to `target` of its slots, no further:
               target × replicas × max_num_seqs − max(own in flight, scraped running+waiting)
    cap        at most `per_replica` × replicas batch lines (``None``: max_num_seqs each)

    room = 0 under pressure, else min(limit, cap) − batch in flight, and ≤ headroom

The limit only stops new lines, so on its own the pool backs off within the lines' own run
time, and at once for new lines (the next event after the scrape that shows queueing). With
``recall`` (the default) the pool controller also takes a slot back the instant it is
needed: when an interactive attempt would wait for a slot on a replica that runs batch
lines, the newest of them is stopped and waits here again (it runs from its start later;
``control/_pool.py``, ``_recall``). The conserved quantity is the controller's: every batch
line released here is counted in ``batch_in_flight`` until it ends or is recalled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from pydantic import BaseModel, ConfigDict, Field

from gpufleet.fleet import ReplicaLoad
from gpufleet.policy._spare_ttft import GUARD_LOOK, GuardSettings, TtftGuard

_EPS: Final = 1e-9
"""Slack for float time: a look at ``grown_at + interval`` must grow the limit (the
controller wakes exactly then; a miss would wake it at that same time again)."""


class SpareConfig(BaseModel):
    """Batch lines on spare capacity (fleet file ``gateway.batch.spare``; docs/batch.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target: float = Field(0.8, gt=0.0, le=1.0)
    """Batch lines fill a pool up to this share of its slots (routable replicas ×
    ``max_num_seqs``), counting every request in flight, interactive ones included."""
    per_replica: int | None = Field(None, ge=1)
    """At most this many batch lines in flight per routable replica (``None``: the engines'
    ``max_num_seqs``)."""
    kv_threshold: float = Field(0.9, gt=0.0, le=1.0)
    """A replica whose scraped KV-cache usage is at or above this is under pressure."""
    interval: float = Field(0.2, gt=0.0)
    """Seconds between two additive increases of the limit, and at least between two cuts."""
    increase: float = Field(1.0, gt=0.0)
    """Lines per routable replica the limit grows by every ``interval`` without pressure."""
    decrease: float = Field(0.5, ge=0.0, lt=1.0)
    """On pressure the limit becomes this share of the batch lines running then."""
    recall: bool = True
    """Stop a running batch line when an interactive request would otherwise wait for its
    slot (the line's work so far is lost; it runs again later). Batch lines that stream are
    never recalled."""
    max_wait: float = Field(60.0, gt=0.0)
    """Seconds a batch line waits for room when its request names no deadline; then it is
    refused (503) and the batch runner offers it again."""
    ttft_margin: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    """How much batch lines may push interactive TTFT P99 up: the P99 of requests that
    arrived beside batch lines may exceed that of requests without them by this share
    (0.1: 10 %); beyond it the gate cuts its limit (``None``: no such guard)."""
    ttft_p99: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    """A bound in seconds on the TTFT P99 of interactive requests beside batch lines; above
    it the gate cuts its limit (``None``: none)."""
    ttft_window: float = Field(60.0, gt=0.0, allow_inf_nan=False)
    """Seconds of TTFT samples the guard reads."""
    ttft_samples: int = Field(50, ge=5)
    """Samples the guard needs on a side before it judges (or measures its baseline)."""
    ttft_refresh: float = Field(600.0, gt=0.0, allow_inf_nan=False)
    """Seconds after which the baseline (TTFT P99 without batch lines) is measured again:
    new lines wait meanwhile, ``ttft_hold`` seconds at most (``ttft_margin`` only)."""
    ttft_hold: float = Field(10.0, gt=0.0, allow_inf_nan=False)
    """Seconds at most new lines wait for the baseline to be measured; with too few
    interactive requests to measure it by, the last one stays."""

    @property
    def guarded(self) -> bool:
        """Whether the gate reads interactive TTFTs (``ttft_margin`` or ``ttft_p99``)."""
        return self.ttft_margin is not None or self.ttft_p99 is not None


@dataclass(frozen=True, slots=True)
class SpareView:
    """One pool as the gate reads it, at one moment."""

    replicas: int
    """Routable replicas."""
    max_num_seqs: int
    in_flight: int
    """Requests this controller let into the pool and that have not ended (batch included)."""
    batch_in_flight: int
    """Batch lines released by the gate that have not ended."""
    batch_waiting: int
    """Batch lines waiting at the gate."""
    gateway_waiting: int
    """Other requests waiting at the gateway (the admission queue, holds)."""
    loads: Sequence[ReplicaLoad] = ()
    """The routable replicas' last scraped loads (``observed_at`` ``None``: never scraped)."""


@dataclass(frozen=True, slots=True)
class SpareDecision:
    room: int
    """Batch lines that may start now."""
    limit: float
    """The AIMD limit on batch lines in flight after this decision."""
    pressure: str | None
    """Why nothing may start (``queueing``, ``kv``, ``gateway``, ``ttft``; ``baseline``:
    the TTFT guard measures interactive TTFT without batch lines), or ``None``."""
    next_at: float | None
    """When the limit may grow next (ask again then, if lines still wait), always after
    ``now``; ``None``: not by time alone (under pressure, an event ends it)."""


def pressure(view: SpareView, kv_threshold: float) -> str | None:
    """Why the pool has no spare capacity now, or ``None``."""
    if view.gateway_waiting > 0:
        return "gateway"
    seqs = view.max_num_seqs
    for load in view.loads:
        if load.observed_at is None:
            continue
        if load.waiting > max(seqs - load.running, 0):
            return "queueing"
        if load.kv_cache_usage >= kv_threshold:
            return "kv"
    return None


def headroom(view: SpareView, target: float) -> int:
    """Requests that fit below ``target`` of the pool's slots, by the larger of the own count
    and the scrape (which sees other gateways' requests too, a scrape late)."""
    scraped = sum(x.running + x.waiting for x in view.loads if x.observed_at is not None)
    used = max(view.in_flight, scraped)
    # a hair under the float product: 0.8 × 10 must give 8, not 7
    return math.floor(target * view.replicas * view.max_num_seqs + 1e-9) - used


class SpareCapacity:
    """One pool's gate for batch lines: the AIMD limit and when it last moved."""

    __slots__ = ("config", "cut_at", "governed", "grown_at", "guard", "last", "limit")

    def __init__(self, config: SpareConfig) -> None:
        self.config = config
        self.guard = None
        if config.guarded:
            self.guard = TtftGuard(
                GuardSettings(
                    config.ttft_margin,
                    config.ttft_p99,
                    config.ttft_window,
                    config.ttft_samples,
                    config.ttft_refresh,
                    config.ttft_hold,
                )
            )
        """Interactive TTFT beside batch lines against its margin (``None``: not asked)."""
        self.governed: float | None = None
        """When the guard last held the limit's growth back (its next verdict is awaited)."""
        self.limit = 0.0
        """Batch lines the pool may run at once, by AIMD (grows from 0 while lines wait)."""
        self.grown_at: float | None = None
        self.cut_at: float | None = None
        self.last: SpareDecision | None = None
        """The latest decision (what metrics and tests read)."""

    def decide(self, now: float, view: SpareView) -> SpareDecision:
        """How many batch lines may start now (the limit moved first, by ``now``)."""
        self.last = decision = self._decide(now, view)
        return decision

    def _decide(self, now: float, view: SpareView) -> SpareDecision:
        config = self.config
        if view.replicas == 0:
            return SpareDecision(0, self.limit, None, None)  # nothing to run on: wait
        why = pressure(view, config.kv_threshold)
        guard = self.guard
        if guard is not None and why is None:
            hold = guard.holding(now)
            if hold is not None:  # the baseline is measured without batch lines: wait
                return SpareDecision(0, self.limit, "baseline", hold)
            if guard.over(now):
                why = "ttft"
        cap = (config.per_replica or view.max_num_seqs) * view.replicas
        self._adapt(now, view, why, cap)
        if why == "ttft":
            assert guard is not None
            guard.cut(now)  # the next verdict is on the cut limit's own samples
        if why is not None:
            return SpareDecision(0, self.limit, why, None)  # what ends it is an event
        room = min(
            math.floor(min(self.limit, cap) + 1e-9) - view.batch_in_flight,
            headroom(view, config.target),
        )
        return SpareDecision(max(room, 0), self.limit, None, self._next(view))

    def _adapt(self, now: float, view: SpareView, why: str | None, cap: int) -> None:
        """The AIMD step: cut on pressure (once per interval), grow while lines wait."""
        config = self.config
        if why is not None:
            if self.cut_at is None or now - self.cut_at >= config.interval - _EPS:
                self.limit = min(self.limit, view.batch_in_flight) * config.decrease
                self.cut_at = self.grown_at = now
            return
        if view.batch_waiting == 0:
            return  # nothing is held back: the limit is not what binds
        if self.grown_at is None or now - self.grown_at >= config.interval - _EPS:
            if self.guard is not None and not self.guard.may_grow(now):
                self.governed = now  # the TTFT guard has not judged the limit as it is yet
                return
            self.governed = None
            # one step per look at most: after a spell with no line waiting (no looks), the
            # limit resumes its climb from where it was, not by the time that went by
            step = self.limit + config.increase * view.replicas
            if self.cut_at is None:  # no pressure seen yet: the slow start doubles
                step = max(step, 2 * self.limit)
            self.limit = min(step, float(cap))
            self.grown_at = now

    def _next(self, view: SpareView) -> float | None:
        if view.batch_waiting == 0 or self.grown_at is None:
            return None
        if self.governed is not None:  # a verdict comes with the samples: look again then
            return self.governed + GUARD_LOOK
        return self.grown_at + self.config.interval

    def snapshot(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {
            "limit": self.limit,
            "grown_at": self.grown_at,
            "cut_at": self.cut_at,
        }
        if self.guard is not None:
            out |= {f"ttft_{k}": v for k, v in self.guard.snapshot().items()}
        return out
