"""Quotas shared by every gateway behind one Redis (``gateway.redis_url``).

Without it each gateway holds its tenants to the full limits alone, so N gateways let a
tenant through N times its ``rpm``. Here the windows live in Redis and one Lua script checks
and records a start atomically, so the limits hold across instances. It is the same
arithmetic as the pure :class:`~gpufleet.gateway._tenant_quota.TenantQuota` (exact
60-second sliding windows; ``tpm`` charged at completion), kept in Redis, with Redis's clock
(``TIME``), so the gateways' clocks need not agree. Per tenant, under one hash tag (one Redis
Cluster slot):

* ``…:req``  sorted set of requests started (score: start time, ms);
* ``…:tok``  sorted set of token charges (member ``<tokens>:<id>``) and ``…:tot`` their sum;
* ``…:run``  sorted set of running requests (score: lease expiry). A gateway renews its
  running requests' leases every few seconds, so a gateway that dies frees its slots
  within ``LEASE`` seconds instead of holding them forever.

**Redis away: fail open, to per-gateway limits.** A request that cannot reach Redis within
``TIMEOUT`` is checked against this gateway's own
:class:`~gpufleet.gateway._tenant_quota.TenantQuota` (kept up to date beside Redis all
along), a warning is logged, and Redis is tried again after ``RETRY``. Failing closed would
turn a Redis outage into a full outage of every tenant's service; failing open to local
limits keeps every tenant served and still bounded (by N × the limit, as without Redis)
until it is back. What an outage costs: token charges of
requests that end meanwhile, and slots of requests that started before it (until their
leases expire).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Final

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gpufleet.gateway._quotas import Lease, Quotas
from gpufleet.gateway._tenant_quota import Denial, QuotaLimits

logger = logging.getLogger("gpufleet.gateway")

WINDOW_MS: Final = 60_000
LEASE: Final = 20.0
"""Seconds a running request holds a concurrency slot without its gateway renewing it."""
RENEW: Final = 5.0
TIMEOUT: Final = 0.5
"""Seconds a request waits for Redis before its gateway decides alone."""
RETRY: Final = 1.0
"""Seconds between two tries while Redis is away (requests meanwhile do not wait for it)."""

_EXPIRE_TOKENS: Final = """
local function expire_tokens(tok, tot, horizon)
  local gone = redis.call('ZRANGEBYSCORE', tok, '-inf', horizon)
  if #gone > 0 then
    local sum = 0
    for _, m in ipairs(gone) do sum = sum + tonumber(string.match(m, '^(%d+):')) end
    redis.call('ZREMRANGEBYSCORE', tok, '-inf', horizon)
    redis.call('DECRBY', tot, sum)
  end
  if redis.call('ZCARD', tok) == 0 then redis.call('DEL', tot) return 0 end
  return tonumber(redis.call('GET', tot) or '0')
end
"""
_NOW: Final = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

_ACQUIRE: Final = (
    _EXPIRE_TOKENS
    + _NOW
    + """
-- KEYS: req, tok, tot, run; ARGV: rpm, tpm, concurrency (-1: none), window ms, member, lease ms
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local window, member, lease = tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6])
local horizon = now - window
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
if conc >= 0 and redis.call('ZCARD', KEYS[4]) >= conc then return {1, 1000} end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', horizon)
if rpm >= 0 then
  local n = redis.call('ZCARD', KEYS[1])
  if n >= rpm then
    local at = redis.call('ZRANGE', KEYS[1], n - rpm, n - rpm, 'WITHSCORES')
    return {2, tonumber(at[2]) + window - now}
  end
end
local used = expire_tokens(KEYS[2], KEYS[3], horizon)
if tpm >= 0 and used >= tpm then
  local excess = used - tpm + 1
  local all = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  for i = 1, #all, 2 do
    excess = excess - tonumber(string.match(all[i], '^(%d+):'))
    if excess <= 0 then return {3, tonumber(all[i + 1]) + window - now} end
  end
  return {3, window}
end
redis.call('ZADD', KEYS[1], now, member)
redis.call('ZADD', KEYS[4], now + lease, member)
redis.call('PEXPIRE', KEYS[1], window + lease)
redis.call('PEXPIRE', KEYS[4], window + lease)
return {0, 0}
"""
)

_RELEASE: Final = (
    _EXPIRE_TOKENS
    + _NOW
    + """
-- KEYS: tok, tot, run; ARGV: member, tokens, window ms
redis.call('ZREM', KEYS[3], ARGV[1])
local tokens, window = tonumber(ARGV[2]), tonumber(ARGV[3])
if tokens > 0 then
  expire_tokens(KEYS[1], KEYS[2], now - window)
  redis.call('ZADD', KEYS[1], now, ARGV[2] .. ':' .. ARGV[1])
  redis.call('INCRBY', KEYS[2], tokens)
  redis.call('PEXPIRE', KEYS[1], window)
  redis.call('PEXPIRE', KEYS[2], window)
end
return 0
"""
)

_RENEW: Final = (
    _NOW  # (expire_tokens is not used here)
    + """
-- KEYS: run; ARGV: lease ms, members…
local expiry = now + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[1]))
return 0
"""
)

_LIMITS: Final = ("concurrency", "rpm", "tpm")


def _keys(tenant: str) -> tuple[str, str, str, str]:
    """The tenant's keys: one hash tag (a Redis Cluster slot), whatever its name holds."""
    tag = hashlib.sha256(tenant.encode()).hexdigest()[:16]
    base = f"gpufleet:quota:{{{tag}}}"
    return f"{base}:req", f"{base}:tok", f"{base}:tot", f"{base}:run"


def _arg(limit: int | None) -> int:
    return -1 if limit is None else limit


class RedisQuotas(Quotas):
    """Per-tenant quotas shared through Redis; this gateway's own book while it is away."""

    def __init__(
        self,
        url: str,
        clock: Callable[[], float],
        *,
        timeout: float = TIMEOUT,
        retry: float = RETRY,
        lease: float = LEASE,
        renew: float = RENEW,
    ) -> None:
        super().__init__(clock)
        self.url = url
        self._timeout = timeout
        self._retry = retry
        self._lease_ms = int(lease * 1000)
        self._renew = renew
        self._redis: Redis | None = None
        self._scripts: dict[str, Any] = {}
        self._down_until: float | None = None
        """While Redis is away: when to try it again (``None``: it is up)."""
        self._running: defaultdict[str, set[str]] = defaultdict(set)
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def shared(self) -> bool:
        """Whether requests are checked in Redis now (not fallen back to local limits)."""
        return self._down_until is None

    def _client(self) -> Redis:
        """The client, made in the serving event loop on first use (its connections are)."""
        if self._redis is None:
            self._redis = Redis.from_url(
                self.url,
                socket_timeout=self._timeout,
                socket_connect_timeout=self._timeout,
                retry=Retry(NoBackoff(), 0),  # a failed call falls back at once, not retried
            )
            for name, text in (("acquire", _ACQUIRE), ("release", _RELEASE), ("renew", _RENEW)):
                self._scripts[name] = self._redis.register_script(text)
        return self._redis

    def _usable(self) -> bool:
        down = self._down_until
        return down is None or self._clock() >= down

    def _failed(self, error: BaseException) -> None:
        if self._down_until is None:
            logger.warning(
                "Redis at %s unreachable (%s): quotas fall back to this gateway's own limits "
                "until it is back",
                self.url,
                str(error) or type(error).__name__,  # a timeout's message is empty
            )
        self._down_until = self._clock() + self._retry

    def _recovered(self) -> None:
        if self._down_until is not None:
            self._down_until = None
            logger.warning("Redis at %s is back: quotas are shared again", self.url)

    async def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        self._client()
        async with asyncio.timeout(self._timeout):
            return await self._scripts[name](keys=keys, args=args)

    async def acquire(self, tenant: str, member: str) -> Lease | Denial:
        limits = self.limits(tenant)
        if limits == QuotaLimits() or not self._usable():
            return self.acquire_local(tenant, member)
        req, tok, tot, run = _keys(tenant)
        args = [
            _arg(limits.rpm),
            _arg(limits.tpm),
            _arg(limits.concurrency),
            WINDOW_MS,
            member,
            self._lease_ms,
        ]
        try:
            code, wait_ms = await self._call("acquire", [req, tok, tot, run], args)
        except (RedisError, OSError, TimeoutError) as error:
            self._failed(error)
            return self.acquire_local(tenant, member)
        self._recovered()
        if code:
            return Denial(_LIMITS[int(code) - 1], max(1, math.ceil(int(wait_ms) / 1000)))
        quota = self.local(tenant)
        quota.start(self._clock())  # kept warm for a fallback
        self._running[tenant].add(member)
        return Lease(tenant, member, quota, shared=True)

    def release(self, lease: Lease, tokens: int) -> None:
        super().release(lease, tokens)
        if not lease.shared:
            return
        running = self._running.get(lease.tenant)
        if running is not None:
            running.discard(lease.member)
            if not running:
                del self._running[lease.tenant]
        # off the request's path (it may be ending by cancellation): a task of its own
        task = asyncio.get_running_loop().create_task(self._release(lease, tokens))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, lease: Lease, tokens: int) -> None:
        _, tok, tot, run = _keys(lease.tenant)
        try:
            await self._call("release", [tok, tot, run], [lease.member, max(tokens, 0), WINDOW_MS])
        except (RedisError, OSError, TimeoutError) as error:
            self._failed(error)  # the slot frees itself when its lease expires

    async def run(self) -> None:
        """Renew the leases of this gateway's running requests, every ``renew`` seconds."""
        while True:
            await asyncio.sleep(self._renew)
            for tenant, members in list(self._running.items()):
                if not members or not self._usable():
                    continue
                try:
                    await self._call(
                        "renew", [_keys(tenant)[3]], [self._lease_ms, *sorted(members)]
                    )
                except (RedisError, OSError, TimeoutError) as error:
                    self._failed(error)

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self._timeout * 2)
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
