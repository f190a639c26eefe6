"""Leader election on a ``coordination.k8s.io/v1`` Lease: one gateway replica scales, all route.

With Redis configured the gateway runs two (or more) replicas; each one's autoscaler decides,
but only the holder of the Lease acts on the cluster. The protocol is client-go's
``leaderelection`` with a Lease lock, kept small::

    every retry_period_s:
        GET lease                      404: CREATE it naming us  (409: someone else won)
        held by another, and its record unchanged for its leaseDurationSeconds on OUR clock?
            no:  not ours; wait        yes (or holderIdentity empty): take it
        PUT lease {holder: us, renewTime: now, ...} with metadata.resourceVersion
                                       409 Conflict: someone wrote first; not ours
    leading, and no renewal succeeded for renew_deadline_s  → step down (stop acting)
    the lease names another holder                          → step down at once
    shutdown while leading          → PUT holderIdentity "" (a successor takes over at once)

Expiry is judged on the local monotonic clock from when this candidate last saw the record
change (not on ``renewTime``), so clock skew between nodes cannot make two leaders; the
conditional update means two candidates that both see an expired lease cannot both win. The
leader steps down ``lease_duration_s - renew_deadline_s`` before any other candidate may take
over, so leadership never overlaps while the clocks tick at the same rate.

The leader can also share a short ``note`` on the Lease (an annotation, written with each
renewal): operator mode puts the pods it is draining there, so that the other gateway
replicas stop routing to them too (``peer_note``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from gpufleet.runtime.kubernetes._api import KubeApi, KubeApiError
from gpufleet.runtime.kubernetes._render import GATEWAY

logger = logging.getLogger("gpufleet.runtime.kubernetes")

NOTE_ANNOTATION: Final = "gpufleet/draining"
"""The leader's note on the Lease: the pods it drains, comma-separated."""
_RELEASE_TIMEOUT_S: Final = 2.0

Listener = Callable[[bool], None]


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    """client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry period."""

    name: str = GATEWAY
    """The Lease's name: the rendered Role grants get and update on this one only."""
    lease_duration_s: float = 15.0
    """How long a lease whose record has not changed stays another candidate's."""
    renew_deadline_s: float = 10.0
    """How long the leader keeps acting without a successful renewal."""
    retry_period_s: float = 2.0
    """Seconds between two attempts to acquire or renew."""

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "want 0 < retry_period_s < renew_deadline_s < lease_duration_s, got "
                f"{self.retry_period_s}, {self.renew_deadline_s}, {self.lease_duration_s}"
            )


def default_identity() -> str:
    """The pod's name (``HOSTNAME``) and a random suffix: a restarted container is a new
    candidate, so it waits for its predecessor's lease rather than inheriting it."""
    host = os.environ.get("HOSTNAME") or socket.gethostname()
    return f"{host}_{uuid.uuid4().hex[:8]}"


class LeaderElection:
    """One candidate for the Lease ``settings.name``; ``run()`` campaigns until cancelled."""

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        identity: str | None = None,
        settings: LeaseSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or LeaseSettings()
        self.identity = identity or default_identity()
        self._api = api
        self._ns = namespace
        self._clock = clock
        self._collection = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self._path = f"{self._collection}/{self.settings.name}"
        self._leading = False
        self._renewed_at = 0.0
        self._observed: tuple[object, ...] | None = None
        self._observed_at = 0.0
        self._listeners: list[Listener] = []
        self._shown: tuple[bool, str] = (False, "")
        self._poke = asyncio.Event()
        self.note = ""
        """What the leader writes on the lease with its next renewal (see ``set_note``)."""
        self.peer_note = ""
        """The note of the current (other) leader, as last read; empty when we lead."""
        self.holder: str | None = None
        """The holder as last seen (``None``: none, or never read)."""
        self.terms = 0
        """How many times this candidate became the leader."""

    @property
    def leading(self) -> bool:
        return self._leading

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(leading)`` on every change of leadership or of ``peer_note``."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def set_note(self, note: str) -> None:
        """Share ``note`` with the other candidates; the leader writes it at once."""
        if note != self.note:
            self.note = note
            if self._leading:
                self._poke.set()

    # -- the campaign -----------------------------------------------------------------------

    async def run(self) -> None:
        """Acquire, renew, step down, and release on cancellation (shutdown)."""
        try:
            while True:
                self._poke.clear()
                await self.try_once()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.settings.retry_period_s):
                        await self._poke.wait()
        finally:
            if self._leading:
                self._leading = False
                self._notify()
                # shielded: the release must be sent even though we are being cancelled
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.shield(self._release())

    async def try_once(self) -> bool:
        """One round: acquire or renew; whether we lead after it."""
        won = await self._acquire_or_renew()
        now = self._clock()
        if won:
            self._renewed_at = now
            if not self._leading:
                self.terms += 1
                logger.info("lease %s: %s leads", self.settings.name, self.identity)
                self._leading = True
        elif self._leading:
            other = self.holder not in (None, "", self.identity)
            if other or now - self._renewed_at >= self.settings.renew_deadline_s:
                why = (
                    f"{self.holder} holds it"
                    if other
                    else f"no renewal for {now - self._renewed_at:.1f} s"
                )
                name = self.settings.name
                logger.warning("lease %s: %s steps down: %s", name, self.identity, why)
                self._leading = False
        self._notify()
        return self._leading

    async def _acquire_or_renew(self) -> bool:
        now = self._clock()
        try:
            lease = await self._api.get(self._path)
        except KubeApiError as error:
            if error.status != 404:
                logger.debug("lease %s: cannot read it: %s", self.settings.name, error)
                return False
            return await self._create()
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        self.holder = holder or None
        self._observe(spec, now)
        duration = float(spec.get("leaseDurationSeconds") or self.settings.lease_duration_s)
        mine = holder == self.identity
        annotations = (lease.get("metadata") or {}).get("annotations") or {}
        self.peer_note = "" if mine or not holder else annotations.get(NOTE_ANNOTATION, "")
        if holder and not mine and now - self._observed_at < duration:
            return False  # another's, and alive as far as we can tell
        stamp = _micro_time()
        body = {
            **lease,
            "metadata": self._metadata(lease.get("metadata") or {}),
            "spec": {
                **spec,
                "holderIdentity": self.identity,
                "leaseDurationSeconds": _seconds(self.settings.lease_duration_s),
                "renewTime": stamp,
                "acquireTime": spec.get("acquireTime") if mine else stamp,
                "leaseTransitions": int(spec.get("leaseTransitions") or 0) + (0 if mine else 1),
            },
        }
        try:
            reply = await self._api.put(self._path, body)
        except KubeApiError as error:
            # 409: another candidate updated it since our read; anything else: try again later
            logger.debug("lease %s: update refused: %s", self.settings.name, error)
            return False
        self._accept(reply)
        return True

    async def _create(self) -> bool:
        stamp = _micro_time()
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": self._metadata({"name": self.settings.name, "namespace": self._ns}),
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": _seconds(self.settings.lease_duration_s),
                "acquireTime": stamp,
                "renewTime": stamp,
                "leaseTransitions": 0,
            },
        }
        try:
            reply = await self._api.post(self._collection, body)
        except KubeApiError as error:  # 409 AlreadyExists: another candidate created it
            logger.debug("lease %s: create refused: %s", self.settings.name, error)
            return False
        self._accept(reply)
        return True

    async def _release(self) -> None:
        """Give the lease up, so that a successor need not wait for it to expire. Read first:
        a renewal cut short by the shutdown may have been applied with its reply lost."""
        async with asyncio.timeout(_RELEASE_TIMEOUT_S):
            lease = await self._api.get(self._path)
            if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            await self._api.put(self._path, self._released(lease))
        logger.info("lease %s: %s released it", self.settings.name, self.identity)

    def _released(self, lease: dict[str, Any]) -> dict[str, Any]:
        metadata = self._metadata(lease.get("metadata") or {})
        metadata.get("annotations", {}).pop(NOTE_ANNOTATION, None)
        return {
            **lease,
            "metadata": metadata,
            "spec": {
                **lease["spec"],
                "holderIdentity": "",
                "leaseDurationSeconds": 1,
                "renewTime": _micro_time(),
            },
        }

    # -- helpers ----------------------------------------------------------------------------

    def _metadata(self, metadata: dict[str, Any]) -> dict[str, Any]:
        annotations = {
            k: v for k, v in (metadata.get("annotations") or {}).items() if k != NOTE_ANNOTATION
        }
        if self.note:
            annotations[NOTE_ANNOTATION] = self.note
        out = {k: v for k, v in metadata.items() if k != "annotations"}
        if annotations:
            out["annotations"] = annotations
        return out

    def _accept(self, lease: dict[str, Any]) -> None:
        self.holder = self.identity
        self.peer_note = ""
        self._observe(lease.get("spec") or {}, self._clock())

    def _observe(self, spec: dict[str, Any], now: float) -> None:
        """Restart the expiry clock whenever the record changes (client-go's rule)."""
        record = tuple(
            spec.get(k)
            for k in (
                "holderIdentity",
                "renewTime",
                "acquireTime",
                "leaseTransitions",
                "leaseDurationSeconds",
            )
        )
        if record != self._observed:
            self._observed, self._observed_at = record, now

    def _notify(self) -> None:
        """Tell the listeners when leadership or the leader's note changed."""
        shown = (self._leading, self.peer_note)
        if shown == self._shown:
            return
        self._shown = shown
        for listener in list(self._listeners):
            try:
                listener(self._leading)
            except Exception:
                logger.exception("leadership listener %r failed", listener)


def _micro_time() -> str:
    """``metav1.MicroTime``: RFC 3339 with microseconds, in UTC."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _seconds(value: float) -> int:
    """``leaseDurationSeconds`` is an integer: at least 1."""
    return max(1, round(value))
