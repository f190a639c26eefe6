"""Watching a namespace's EndpointSlices: list once, then follow a watch, for as long as it runs.

The standard list-then-watch protocol of a Kubernetes informer, kept small::

    LIST  ?labelSelector=…                      → every slice, and the list's resourceVersion
    WATCH ?resourceVersion=RV&allowWatchBookmarks=true
          ADDED / MODIFIED / DELETED   apply it; RV = its resourceVersion
          BOOKMARK                     RV = its resourceVersion (nothing changed)
          the server ends the stream   (timeoutSeconds) watch again from RV
          410 Gone (status or event)   RV is too old (etcd compacted it): LIST again
    any other error, refused, reset    keep the slices we have, retry with capped backoff

``on_change(slices)`` is called after every list and every applied event with the whole map;
an unreachable API server therefore leaves the last known slices, and the replicas they name,
in place (the gateway's own health checks see a pod that dies meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

from gpufleet.runtime.kubernetes._api import KubeApi, KubeApiError

logger = logging.getLogger("gpufleet.runtime.kubernetes")

Slices = Mapping[str, Mapping[str, Any]]
"""EndpointSlices by name."""

_BACKOFF_MAX_S: Final = 30.0


class SliceWatch:
    """Follows the EndpointSlices of one namespace that match ``label_selector``."""

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        label_selector: str,
        on_change: Callable[[Slices], None],
        *,
        retry_s: float = 1.0,
        watch_timeout_s: int = 300,
    ) -> None:
        self._api = api
        self._path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        self._selector = label_selector
        self._on_change = on_change
        self._retry_s = retry_s
        self._watch_timeout_s = watch_timeout_s
        self._slices: dict[str, Mapping[str, Any]] = {}
        self.resource_version: str | None = None
        self.lists = 0
        """How many times the slices were listed (1 + relists after 410 Gone or a restart)."""
        self.failures = 0
        """Consecutive failed calls (0: connected)."""
        self.synced = asyncio.Event()
        """Set once the first list has arrived."""

    @property
    def slices(self) -> Slices:
        return self._slices

    async def run(self) -> None:
        """List and watch until cancelled."""
        while True:
            try:
                if self.resource_version is None:
                    await self._list()
                await self._watch()
            except KubeApiError as error:
                if error.gone:
                    logger.info("endpointslices: %s; listing again", error)
                    self.resource_version = None
                    continue
                self.failures += 1
                delay = min(_BACKOFF_MAX_S, self._retry_s * 2 ** (self.failures - 1))
                logger.warning(
                    "endpointslices: %s; keeping the %d known slice(s), retrying in %.1f s",
                    error,
                    len(self._slices),
                    delay,
                )
                await asyncio.sleep(delay)

    async def _list(self) -> None:
        body = await self._api.get(self._path, {"labelSelector": self._selector})
        self._slices = {item["metadata"]["name"]: item for item in body.get("items") or []}
        self.resource_version = body.get("metadata", {}).get("resourceVersion") or None
        self.lists += 1
        self.failures = 0
        self.synced.set()
        self._on_change(self._slices)

    async def _watch(self) -> None:
        params = {"labelSelector": self._selector, "allowWatchBookmarks": "true"}
        if self.resource_version is not None:
            params["resourceVersion"] = self.resource_version
        events = self._api.watch(self._path, params, timeout_s=self._watch_timeout_s)
        async for event in events:
            self.failures = 0
            kind, obj = event.get("type"), event.get("object") or {}
            meta = obj.get("metadata") or {}
            if meta.get("resourceVersion"):
                self.resource_version = meta["resourceVersion"]
            if kind == "BOOKMARK" or "name" not in meta:
                continue
            if kind == "DELETED":
                self._slices.pop(meta["name"], None)
            elif kind in ("ADDED", "MODIFIED"):
                self._slices[meta["name"]] = obj
            else:
                continue
            self._on_change(self._slices)
