"""Tenants in the simulator: who sent each request, and each tenant's numbers.

The admission queue itself is the pool controller's (``gpufleet.control``: one gate per
pool, the gateway's); the simulator only says who sent a request (the trace's ``tenant``,
or a draw from the ``--tenant`` mix) and counts what happened to each tenant::

    Arrival ─► TenantBook.of(index, request) ─► (tenant, class, weight) ─► Arrived
    Reject(shed | expired) ─► TenantBook.refused(index, reason)
    report ─► per tenant: latencies, queue waits, refusals; per pool: the queue's counters
              (read from the controller: ``FleetController.queues()``)

With admission on, the replicas do not fast-forward (``FleetSimulation`` turns it off): a
queued request starts the instant another ends, on any replica, so no replica may run
ahead of the fleet.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from random import Random
from typing import TYPE_CHECKING, Any

from gpufleet.config import TenantsConfig
from gpufleet.control import ANONYMOUS, CLASSES, QueueReport, RejectReason
from gpufleet.sim._traces import TraceRequest

if TYPE_CHECKING:
    from gpufleet.sim._recorder import RequestLog


@dataclass(frozen=True, slots=True)
class SimTenant:
    """A tenant as the simulator knows it: what the store holds live, plus its share of a
    trace whose requests name no tenant."""

    name: str
    share: float = 1.0
    """Relative share of the trace's requests that name no tenant (drawn per request)."""
    weight: float = 1.0
    """Fair-share weight (``gpufleet keys create --weight``)."""
    priority: str = "interactive"
    """Priority class (``--priority``): ``interactive`` or ``batch``."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tenant needs a name")
        if not (math.isfinite(self.share) and self.share >= 0):
            raise ValueError(f"tenant {self.name!r}: share must be >= 0, got {self.share}")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"tenant {self.name!r}: weight must be > 0, got {self.weight}")
        if self.priority not in CLASSES:
            raise ValueError(
                f"tenant {self.name!r}: priority must be one of {', '.join(CLASSES)}, "
                f"got {self.priority!r}"
            )


def parse_tenant(spec: str) -> SimTenant:
    """``NAME[:share=S,weight=W,priority=P]``, the ``--tenant`` option of ``simulate``.

    ``heavy:share=10`` draws ten times as many of a trace's untagged requests for ``heavy``
    as for a tenant of share 1; ``batch-team:priority=batch,weight=2``.
    """
    name, _, rest = spec.partition(":")
    fields: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--tenant {spec!r}: {item!r} is not key=value")
        if key in {"share", "weight"}:
            try:
                fields[key] = float(value)
            except ValueError:
                raise ValueError(f"--tenant {spec!r}: {key} {value!r} is not a number") from None
        elif key == "priority":
            fields[key] = value
        else:
            raise ValueError(f"--tenant {spec!r}: unknown key {key!r} (share, weight, priority)")
    return SimTenant(name.strip(), **fields)


class TenantMix:
    """Who sent each request: the trace's ``tenant`` field, else a draw by share.

    Draws come from ``Random("gpufleet-tenants-<seed>")``, one per untagged request in
    arrival order, so a seeded run assigns the same tenants every time.
    """

    __slots__ = ("_cumulative", "_names", "_rng", "tenants")

    def __init__(self, tenants: Sequence[SimTenant], seed: int) -> None:
        names = [t.name for t in tenants]
        if len(set(names)) < len(names):
            raise ValueError(f"tenant names repeat: {', '.join(names)}")
        self.tenants = {t.name: t for t in tenants}
        drawn = [t for t in tenants if t.share > 0]
        self._names = [t.name for t in drawn]
        total = math.fsum(t.share for t in drawn)
        running = 0.0
        self._cumulative: list[float] = []
        for t in drawn:
            running += t.share / total
            self._cumulative.append(running)
        self._rng = Random(f"gpufleet-tenants-{seed}")

    def tenant_of(self, request: TraceRequest) -> str:
        if request.tenant is not None:
            return request.tenant
        names = self._names
        if not names:
            return ANONYMOUS
        if len(names) == 1:
            return names[0]
        draw = self._rng.random()
        for name, edge in zip(names, self._cumulative, strict=True):
            if draw < edge:
                return name
        return names[-1]

    def settings(self, tenant: str) -> SimTenant:
        """A tenant's weight and class (a tenant the mix does not name: weight 1, interactive)."""
        known = self.tenants.get(tenant)
        return known if known is not None else SimTenant(tenant)


class TenantBook:
    """Each request's tenant (by arrival index) and each tenant's refusals."""

    __slots__ = ("_names", "expired", "mix", "shed", "tenant_ids")

    def __init__(self, mix: TenantMix) -> None:
        self.mix = mix
        self._names: dict[str, int] = {}
        self.tenant_ids = array("H")
        """Per arrived request (by index): its tenant, as an index into :meth:`tenants`."""
        self.shed: dict[str, int] = {}
        """Per tenant: requests a full queue shed (503)."""
        self.expired: dict[str, int] = {}
        """Per tenant: requests still queued at their deadline (503)."""

    def of(self, index: int, request: TraceRequest) -> tuple[str, int, float]:
        """Request ``index``'s tenant, priority class and weight (call once per arrival,
        in arrival order)."""
        tenant = self.mix.tenant_of(request)
        self.tenant_ids.append(self._names.setdefault(tenant, len(self._names)))
        settings = self.mix.settings(tenant)
        return tenant, CLASSES.index(settings.priority), settings.weight

    def refused(self, index: int, reason: str) -> None:
        counts = {RejectReason.SHED: self.shed, RejectReason.EXPIRED: self.expired}.get(reason)
        if counts is not None:
            tenant = self.tenants()[self.tenant_ids[index]]
            counts[tenant] = counts.get(tenant, 0) + 1

    def tenants(self) -> list[str]:
        """Tenant names, in order of first arrival (``tenant_ids`` index them)."""
        return list(self._names)

    # -- the report -----------------------------------------------------------------------

    def report(  # noqa: PLR0917 - the report's inputs
        self,
        log: RequestLog,
        waits: Mapping[int, float],
        queues: Mapping[str, QueueReport],
        tenancy: TenantsConfig,
        enabled: bool,
        quantiles: Callable[[Sequence[float]], dict[str, float | None]],
        rounded: Callable[[float | None], float | None],
    ) -> dict[str, Any]:
        """Each tenant's latencies, queue waits and refusals (report.json ``tenants``)."""
        config = tenancy.admission
        names = self.tenants()
        ids = self.tenant_ids
        ttft: list[list[float]] = [[] for _ in names]
        e2e: list[list[float]] = [[] for _ in names]
        requests = [0] * len(names)
        served = [0] * len(names)
        failed = [0] * len(names)
        rejected = [0] * len(names)
        output = [0] * len(names)
        for record in log:
            t = ids[record.index]
            requests[t] += 1
            if record.rejected:
                rejected[t] += 1
            elif record.failed:
                failed[t] += 1
            else:
                served[t] += 1
                ttft[t].append(record.ttft_s or 0.0)
                e2e[t].append(record.e2e_s)
                output[t] += record.output_tokens
        waited: list[list[float]] = [[] for _ in names]
        queued = [0] * len(names)
        for index, t in enumerate(ids):
            wait = waits.get(index)
            if wait is not None:
                waited[t].append(wait)
                queued[t] += wait > 0
        tenants: dict[str, Any] = {}
        for t, name in sorted(enumerate(names), key=lambda item: item[1]):
            settings = self.mix.settings(name)
            for values in (ttft[t], e2e[t], waited[t]):
                values.sort()
            tenants[name] = {
                "weight": settings.weight,
                "priority": settings.priority,
                "requests": requests[t],
                "served": served[t],
                "rejected": rejected[t],
                "failed": failed[t],
                "queued": queued[t],
                "shed": self.shed.get(name, 0),
                "expired": self.expired.get(name, 0),
                "output_tokens": output[t],
                "ttft_s": quantiles(ttft[t]),
                "e2e_s": quantiles(e2e[t]),
                "queue_wait_s": quantiles(waited[t]),
            }
        return {
            "admission": {
                "on": enabled,
                "saturation": config.saturation,
                "max_num_seqs": {pool: queue.max_num_seqs for pool, queue in queues.items()},
                "max_queue": config.max_queue,
                "max_wait_s": config.max_wait,
                "output_weight": config.output_weight,
                "reserve_saturation": config.reserve_saturation,
                "release_tick_s": config.tick,
                "queue_max": {pool: queue.queue_max for pool, queue in queues.items()},
                "counters": {
                    pool: {name: rounded(value) for name, value in sorted(queue.counters.items())}
                    for pool, queue in queues.items()
                },
            },
            "tenants": tenants,
        }
