"""The gateway's book of per-tenant quotas: the pure
:class:`~gpufleet.gateway._tenant_quota.TenantQuota` of each tenant, kept in this process.

::

    lease = await quotas.acquire(tenant, request_id)   # a Lease, or a Denial (429)
    quotas.release(lease, tokens)                      # when the request ends (any way)

:class:`~gpufleet.gateway._quotas_redis.RedisQuotas` is the same book shared by every gateway
behind one Redis (``gateway.redis_url``); it keeps this local book up to date beside it and
falls back to it while Redis is away.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpufleet.gateway._tenant_quota import Denial, QuotaLimits, TenantQuota


@dataclass(slots=True)
class Lease:
    """A started request's hold on its tenant's quota (given back by ``release``)."""

    tenant: str
    member: str
    """Unique per request: its entry in the shared windows."""
    local: TenantQuota
    shared: bool = False
    """Whether the shared (Redis) book recorded it, so ``release`` must tell Redis too."""


class Quotas:
    """Per-tenant quotas held in this gateway alone."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._local: dict[str, TenantQuota] = {}

    def set_limits(self, tenant: str, limits: QuotaLimits) -> None:
        quota = self._local.get(tenant)
        if quota is None:
            self._local[tenant] = TenantQuota(limits)
        elif quota.limits != limits:
            quota.limits = limits

    def limits(self, tenant: str) -> QuotaLimits:
        quota = self._local.get(tenant)
        return QuotaLimits() if quota is None else quota.limits

    def local(self, tenant: str) -> TenantQuota:
        quota = self._local.get(tenant)
        if quota is None:
            quota = self._local[tenant] = TenantQuota(QuotaLimits())
        return quota

    async def acquire(self, tenant: str, member: str) -> Lease | Denial:
        """Start one request of ``tenant`` if its quotas allow it now."""
        return self.acquire_local(tenant, member)

    def acquire_local(self, tenant: str, member: str) -> Lease | Denial:
        quota = self.local(tenant)
        now = self._clock()
        denial = quota.check(now)
        if denial is not None:
            return denial
        quota.start(now)
        return Lease(tenant, member, quota)

    def release(self, lease: Lease, tokens: int) -> None:
        """The request ended; ``tokens`` (prompt + completion) are charged now."""
        lease.local.finish(self._clock(), tokens)

    async def run(self) -> None:
        """Background upkeep (none here)."""

    async def aclose(self) -> None:
        """Let go of what ``run`` and ``acquire`` hold (nothing here)."""
