"""Tenancy in the gateway: who is calling (API keys), what they may do (models, quotas), in
what order they start (the admission gate), and what they used (the ledger).

::

    request ─► authenticate (401) ─► model allowed? (403) ─► quota (429, Retry-After)
            ─► the pool controller's admission (waits while saturated; 503 when shed or
               past its deadline: the tenant's priority, weight and deadline go with it)
            ─► proxied … usage read on the way ─► ledger row journaled before the last byte

Keys are checked against an in-memory snapshot of the store, reloaded every
``refresh_interval`` (at once after an admin action through this gateway), so a request never
waits for the database. Ledger rows and audit entries go through the store's journal.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from gpufleet.config import FleetConfig, TenantsConfig
from gpufleet.control import CLASSES
from gpufleet.gateway._errors import BadRequestError
from gpufleet.gateway._quotas import Lease, Quotas
from gpufleet.gateway._quotas_redis import RedisQuotas
from gpufleet.gateway._tenancy_errors import (
    ForbiddenError,
    RateLimitedError,
    UnauthorizedError,
)
from gpufleet.gateway._tenant_quota import QuotaLimits
from gpufleet.gateway._usage import COMPLETIONS, Meter, Metering, ask_for_usage
from gpufleet.store import (
    ADMIN_PREFIX,
    Journal,
    Role,
    Snapshot,
    Store,
    TenantSettings,
    audit_row,
    secret_matches,
    split_key,
)

logger = logging.getLogger("gpufleet.gateway")

OPEN_PATHS: Final = frozenset({"/health", "/ready"})
PRINCIPAL: Final = "gpufleet.principal"
"""The scope key under which an authenticated request carries its :class:`Principal`."""
BATCH_LINE: Final = "gpufleet.batch_line"
"""The scope key of a batch line the runner sends in-process (``_inprocess.call_app``): the
line's ``batch_req_…`` id. Its :data:`PRINCIPAL` (the batch's owner, in the ``batch`` class)
comes in the scope too, so the app does not authenticate it; no client can set a scope key."""
RUN_AGAIN: Final = frozenset({429, 499, 500, 503})
"""The statuses of a batch line that did not get a replica's answer (a quota, no room,
cancelled, or an error in the gateway): the runner runs the line again later, so this try
writes no ledger row. A line's one row is that of the try whose answer it keeps."""


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    key_id: str
    settings: TenantSettings


@dataclass(frozen=True, slots=True)
class AdminPrincipal:
    """Who calls the admin API: ``actor`` names them in the audit log."""

    actor: str
    """``admin:env`` (the ``$GPUFLEET_ADMIN_KEY`` credential) or ``admin:<key id>``."""
    role: Role


ENV_ADMIN: Final = AdminPrincipal("admin:env", Role.ADMIN)
"""The credential of ``$GPUFLEET_ADMIN_KEY`` (or ``admin_key_file``): always ``admin``."""


@dataclass(slots=True)
class Admitted:
    """One request let in: what the ledger row and the charges need at its end."""

    principal: Principal
    request_id: str
    model: str
    arrived: float
    wall: float
    admission: tuple[int, float, float]
    """Its priority (an index of ``CLASSES``), fair-share weight and queue deadline."""
    lease: Lease | None
    meter: Meter
    queued: float = 0.0
    first_at: float | None = None
    status: int = 200
    replica: str | None = None
    """The replica it was last sent to (``None``: never started)."""
    recorded: bool = False
    ledger_id: str = field(default_factory=lambda: os.urandom(12).hex())
    batch_line: bool = False
    """A batch line's try: ``ledger_id`` is the line's ``batch_req_…`` id (every try of the
    line has it, so the ledger keeps one row), and a status in :data:`RUN_AGAIN` writes none."""


def admin_key(config: TenantsConfig) -> str | None:
    """The admin credential: ``$<admin_key_env>``, else the ``admin_key_file``'s first line."""
    value = os.environ.get(config.admin_key_env)
    if value:
        return value.strip()
    if config.admin_key_file:
        return Path(config.admin_key_file).read_text().strip() or None
    return None


class Tenancy:
    """Auth, quotas, admission and the ledger for one gateway."""

    def __init__(
        self,
        fleet: FleetConfig,
        store: Store,
        *,
        journal: Journal | None = None,
        admin_key: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = fleet.tenants
        self.store = store
        self.journal = journal or store.journal()
        self.admin_key = admin_key
        self._clock = clock
        self.snapshot = Snapshot()
        redis_url = fleet.gateway.redis_url
        self.quotas = Quotas(clock) if redis_url is None else RedisQuotas(redis_url, clock)
        """rpm, tpm and concurrency per tenant: this gateway's own, or shared through Redis."""
        self._taken = 0
        self._applied = 0
        self._denials: dict[tuple[str | None, int], _Denials] = {}
        """Failed authentications per (client address, minute) not yet audited."""

    # -- life -------------------------------------------------------------------------------

    def open(self) -> None:
        """Replay a dead gateway's journal, load keys."""
        replayed = self.journal.start()
        if replayed:
            logger.warning("replayed %d ledger/audit records a stopped gateway left", replayed)
        self.reload()

    def close(self) -> None:
        self.flush_denials()
        self.journal.close()

    async def aclose(self) -> None:
        await self.quotas.aclose()

    def reload(self) -> None:
        """Load keys and tenants now (on the event loop's thread, or before it runs)."""
        self._apply_newer(self._take(), self.store.snapshot())

    async def reload_async(self) -> None:
        """Load keys and tenants: the database read in a worker thread, the snapshot applied
        here on the loop (``Quotas`` is the loop's: a thread must not replace a tenant's
        entry under a request, nor reset its rpm window)."""
        ticket = self._take()
        snapshot = await asyncio.to_thread(self.store.snapshot)
        self._apply_newer(ticket, snapshot)

    def _take(self) -> int:
        self._taken += 1
        return self._taken

    def _apply_newer(self, ticket: int, snapshot: Snapshot) -> None:
        """Snapshots apply in the order they were started, so a slow periodic reload cannot
        undo a revocation applied after it began."""
        if ticket > self._applied:
            self._applied = ticket
            self._apply(snapshot)

    def _apply(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        for name, settings in snapshot.tenants.items():
            limits = QuotaLimits(settings.rpm, settings.tpm, settings.concurrency)
            self.quotas.set_limits(name, limits)

    async def refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_interval)
            self._flush_denials(self._clock())
            try:
                await self.reload_async()
            except Exception:
                logger.exception("could not reload keys and tenants; keeping the last ones")

    # -- requests ---------------------------------------------------------------------------

    def authenticate(self, scope: dict[str, Any] | Any, path: str) -> Principal:
        key = _bearer(scope)
        if key is None:
            self._deny(scope, path, None, "missing key")
            raise UnauthorizedError("Missing API key: send `Authorization: Bearer <key>`.")
        parts = split_key(key)
        entry = None if parts is None else self.snapshot.keys.get(parts[0])
        if parts is None or entry is None or not secret_matches(parts[1], entry[0]):
            key_id = None if parts is None else parts[0]
            self._deny(scope, path, key_id, "invalid key")
            raise UnauthorizedError("Incorrect API key provided.")
        settings = self.snapshot.tenants.get(entry[1])
        if settings is None:
            raise UnauthorizedError("Incorrect API key provided.")
        principal = Principal(entry[1], parts[0], settings)
        scope[PRINCIPAL] = principal
        return principal

    def _deny(self, scope: Any, path: str, key_id: str | None, why: str) -> None:
        """Audit a failed authentication: the first per client address and minute at once,
        the rest of that minute's as one row with their ``count`` when it ends, so clients
        without a key cannot grow the audit table per request (docs/tenants.md)."""
        now = self._clock()
        self._flush_denials(now)
        client = scope.get("client")
        address = client[0] if client else None
        minute = int(now // 60)
        if len(self._denials) >= _MAX_DENIAL_WINDOWS and (address, minute) not in self._denials:
            address = "*"  # too many addresses this minute: the rest count together
        denials = self._denials.get((address, minute))
        if denials is not None:
            denials.count += 1
            denials.last = (key_id, path, why)
            return
        self._denials[(address, minute)] = _Denials((key_id, path, why))
        self._audit_denial(address, key_id, path, why, 1)

    def flush_denials(self) -> None:
        """Audit every repeated denial counted so far (at close; tests)."""
        self._flush_denials(None)

    def _flush_denials(self, now: float | None) -> None:
        """Audit the repeated denials of the minutes that ended (every one if ``now`` is
        ``None``)."""
        if not self._denials:
            return
        current = None if now is None else int(now // 60)
        for window in [w for w in self._denials if current is None or w[1] < current]:
            denials = self._denials.pop(window)
            if denials.count:
                key_id, path, why = denials.last
                self._audit_denial(window[0], key_id, path, why, denials.count)

    def _audit_denial(
        self, address: str | None, key_id: str | None, path: str, why: str, count: int
    ) -> None:
        self.audit(
            key_id or "anonymous",
            "access.denied",
            path,
            "denied",
            {"why": why, "client": address, "count": count},
        )

    def audit(
        self,
        actor: str,
        action: str,
        target: str | None,
        outcome: str = "ok",
        detail: dict[str, Any] | None = None,
    ) -> None:
        self.journal.append("audit", audit_row(actor, action, target, outcome, detail))

    async def admit(
        self,
        scope: Any,
        model: str,
        payload: dict[str, Any],
        body: bytes,
        *,
        request_id: str,
        arrived: float,
        prompt_estimate: int,
        metering: Metering = COMPLETIONS,
    ) -> tuple[Admitted, bytes]:
        """Check one request (model allowed, quotas); the admitted request, with what the
        pool controller's admission reads, and the body to send upstream. ``metering``: how
        its route's answers carry their usage (``_usage``)."""
        principal: Principal = scope[PRINCIPAL]
        settings = principal.settings
        wall = time.time()
        allowed = settings.models
        admission = (
            CLASSES.index(settings.priority),
            settings.weight,
            arrived + self._max_wait(scope),
        )
        admitted = Admitted(
            principal,
            request_id,
            model,
            arrived,
            wall,
            admission,
            None,
            Meter(prompt_estimate, False, _no),  # replaced once the request may run
        )
        line = scope.get(BATCH_LINE)
        if line is not None:
            admitted.ledger_id, admitted.batch_line = line, True
        if allowed is not None and model not in allowed:
            self.audit(principal.key_id, "access.denied", model, "denied", {"why": "model"})
            self._record(admitted, 403, started=False)
            raise ForbiddenError(f"This key may not use the model `{model}`.")
        lease = await self.quotas.acquire(principal.tenant, admitted.ledger_id)
        if not isinstance(lease, Lease):
            denial = lease
            self._record(admitted, 429, started=False)
            raise RateLimitedError(
                f"Rate limit reached for tenant `{principal.tenant}`: {denial.limit} "
                f"(retry after {denial.retry_after} s).",
                denial.retry_after,
            )
        admitted.lease = lease
        # the body is re-serialised (usage asked for) only for a request that got this far
        injected = False
        if metering.ask:
            body, injected = ask_for_usage(payload, body)
        admitted.meter = metering.meter(
            prompt_estimate, injected, lambda: self._record(admitted), metering.read
        )
        return admitted, body

    def _max_wait(self, scope: Any) -> float:
        wait = self.config.admission.max_wait
        for key, value in scope["headers"]:
            if key == b"x-gpufleet-deadline-ms":
                try:
                    asked = float(value) / 1000.0
                except ValueError:
                    raise BadRequestError("x-gpufleet-deadline-ms must be a number") from None
                return max(min(wait, asked), 0.0)
        return wait

    def finish(self, admitted: Admitted, status: int) -> None:
        """The request ended (any way): ledger row if none yet, then charge the quota (one
        that never reached a replica, shed or gone while queued, charges no tokens)."""
        started = admitted.replica is not None
        if not admitted.recorded:
            self._record(admitted, status, started=started)
        usage = admitted.meter.usage
        if admitted.lease is not None:
            spent = usage.total if usage.known else usage.prompt_tokens
            spent += usage.resumed_prompt_tokens
            self.quotas.release(admitted.lease, spent if started else 0)
            admitted.lease = None

    def _record(
        self, admitted: Admitted, status: int | None = None, *, started: bool = True
    ) -> None:
        if admitted.recorded:
            return
        admitted.recorded = True
        if admitted.batch_line and (admitted.status if status is None else status) in RUN_AGAIN:
            return  # the runner runs the line again: that try is ledgered
        now = self._clock()
        usage = admitted.meter.usage
        first = admitted.first_at
        self.journal.append(
            "usage",
            {
                "id": admitted.ledger_id,
                "request_id": admitted.request_id,
                "time": admitted.wall,
                "tenant": admitted.principal.tenant,
                "key_id": admitted.principal.key_id,
                "model": admitted.model,
                "replica": admitted.replica,
                "status": admitted.status if status is None else status,
                "prompt_tokens": usage.prompt_tokens if started else 0,
                "cached_tokens": usage.cached_tokens,
                "completion_tokens": usage.completion_tokens,
                "queue_s": admitted.queued,
                "ttft_s": None if first is None else first - admitted.arrived,
                "e2e_s": now - admitted.arrived,
            },
        )

    # -- admin ------------------------------------------------------------------------------

    @property
    def admin_enabled(self) -> bool:
        """Whether any admin credential exists (the variable's, or one in the store)."""
        return self.admin_key is not None or bool(self.snapshot.admins)

    def admin_principal(self, scope: Any) -> AdminPrincipal | None:
        """The admin credential the request carries (checked against the snapshot, like
        tenants' keys), or ``None``: missing, unknown, revoked, or a tenant's key."""
        key = _bearer(scope)
        if key is None:
            return None
        if self.admin_key is not None and hmac.compare_digest(
            key.encode(), self.admin_key.encode()
        ):
            return ENV_ADMIN
        parts = split_key(key, ADMIN_PREFIX)
        entry = None if parts is None else self.snapshot.admins.get(parts[0])
        if parts is None or entry is None or not secret_matches(parts[1], entry[0]):
            return None
        return AdminPrincipal(f"admin:{parts[0]}", entry[1])

    def deny(self, scope: Any, path: str, why: str) -> None:
        """Audit a refused credential (throttled per client address and minute, like a
        tenant's; the key id when the key is well formed, never the key)."""
        key = _bearer(scope)
        parts = None if key is None else (split_key(key) or split_key(key, ADMIN_PREFIX))
        self._deny(scope, path, None if parts is None else parts[0], why)


async def metered(
    admitted: Admitted, chunks: AsyncIterator[bytes], clock: Callable[[], float]
) -> AsyncIterator[bytes]:
    """A stream's chunks through its meter (usage read, the ledger row journaled at
    ``[DONE]``, before those bytes are sent)."""
    meter = admitted.meter
    async for chunk in chunks:
        if admitted.first_at is None:
            admitted.first_at = clock()
        yield meter.chunk(chunk)
    rest = meter.rest()
    if rest:
        yield rest


_MAX_DENIAL_WINDOWS: Final = 10_000
"""Client addresses whose failed authentications are counted apart in one minute; past it,
the rest count under ``*`` (memory stays bounded under a flood of addresses)."""


@dataclass(slots=True)
class _Denials:
    """Failed authentications of one client address in one minute, after the first."""

    last: tuple[str | None, str, str]
    count: int = 0


def _no() -> None:
    return None


def _bearer(scope: Any) -> str | None:
    for key, value in scope["headers"]:
        if key == b"authorization":
            text = str(value.decode("latin-1"))
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None
