"""Watching Kubernetes objects: list once, then follow a watch, for as long as it runs.

The standard list-then-watch protocol of a Kubernetes informer, kept small::

    LIST  ?labelSelector=…                      → every object, and the list's resourceVersion
    WATCH ?resourceVersion=RV&allowWatchBookmarks=true
          ADDED / MODIFIED / DELETED   apply it; RV = its resourceVersion
          BOOKMARK                     RV = its resourceVersion (nothing changed)
          the server ends the stream   (timeoutSeconds) watch again from RV
          410 Gone (status or event)   RV is too old (etcd compacted it): LIST again
    any other error, refused, reset    keep the objects we have, retry with capped backoff

``on_change(objects)`` is called after every list and every applied event with the whole map;
an unreachable API server therefore leaves the last known objects, and the replicas they
name, in place (the gateway's own health checks see a pod that dies meanwhile).

:class:`ListWatch` is the protocol for any path; :class:`SliceWatch` follows a namespace's
EndpointSlices (which pods serve), :class:`NodeWatch` the cluster's nodes (which are being
taken back, ``_nodes.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

from gpufleet.runtime.kubernetes._api import KubeApi, KubeApiError
from gpufleet.runtime.kubernetes._nodes import trim_node

logger = logging.getLogger("gpufleet.runtime.kubernetes")

Objects = Mapping[str, Mapping[str, Any]]
"""Watched objects by name."""
Slices = Objects
"""EndpointSlices by name."""
Nodes = Objects
"""Nodes by name."""

NODES_PATH: Final = "/api/v1/nodes"
_BACKOFF_MAX_S: Final = 30.0


class ListWatch:
    """Follows the objects at ``path`` (those matching ``label_selector``, if given).

    ``keep`` trims each object before it is stored (a node carries kilobytes of status that
    nothing here reads)."""

    def __init__(
        self,
        api: KubeApi,
        path: str,
        on_change: Callable[[Objects], None],
        *,
        label_selector: str | None = None,
        keep: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
        retry_s: float = 1.0,
        watch_timeout_s: int = 300,
    ) -> None:
        self._api = api
        self._path = path
        self._what = path.rsplit("/", 1)[-1]
        self._selector = label_selector
        self._on_change = on_change
        self._keep = keep or (lambda obj: obj)
        self._retry_s = retry_s
        self._watch_timeout_s = watch_timeout_s
        self._objects: dict[str, Mapping[str, Any]] = {}
        self.resource_version: str | None = None
        self.lists = 0
        """How many times the objects were listed (1 + relists after 410 Gone or a restart)."""
        self.failures = 0
        """Consecutive failed calls (0: connected)."""
        self.synced = asyncio.Event()
        """Set once the first list has arrived."""

    @property
    def objects(self) -> Objects:
        return self._objects

    async def run(self) -> None:
        """List and watch until cancelled."""
        while True:
            try:
                if self.resource_version is None:
                    await self._list()
                await self._watch()
            except KubeApiError as error:
                if error.gone:
                    logger.info("%s: %s; listing again", self._what, error)
                    self.resource_version = None
                    continue
                self.failures += 1
                delay = min(_BACKOFF_MAX_S, self._retry_s * 2 ** (self.failures - 1))
                logger.warning(
                    "%s: %s; keeping the %d known, retrying in %.1f s",
                    self._what,
                    error,
                    len(self._objects),
                    delay,
                )
                await asyncio.sleep(delay)

    def _params(self) -> dict[str, str]:
        return {} if self._selector is None else {"labelSelector": self._selector}

    async def _list(self) -> None:
        body = await self._api.get(self._path, self._params())
        items = body.get("items") or []
        self._objects = {
            item["metadata"]["name"]: self._keep(item)
            for item in items
            if isinstance((item.get("metadata") or {}).get("name"), str)
        }
        self.resource_version = body.get("metadata", {}).get("resourceVersion") or None
        self.lists += 1
        self.failures = 0
        self.synced.set()
        self._on_change(self._objects)

    async def _watch(self) -> None:
        params = {**self._params(), "allowWatchBookmarks": "true"}
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
                self._objects.pop(meta["name"], None)
            elif kind in ("ADDED", "MODIFIED"):
                self._objects[meta["name"]] = self._keep(obj)
            else:
                continue
            self._on_change(self._objects)


class SliceWatch(ListWatch):
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
        super().__init__(
            api,
            f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
            on_change,
            label_selector=label_selector,
            retry_s=retry_s,
            watch_timeout_s=watch_timeout_s,
        )

    @property
    def slices(self) -> Slices:
        return self.objects


class NodeWatch(ListWatch):
    """Follows the cluster's nodes (cluster-scoped: a ClusterRole allows it), each trimmed to
    its name, taints and cordon."""

    def __init__(
        self,
        api: KubeApi,
        on_change: Callable[[Nodes], None],
        *,
        retry_s: float = 1.0,
        watch_timeout_s: int = 300,
    ) -> None:
        super().__init__(
            api,
            NODES_PATH,
            on_change,
            keep=trim_node,
            retry_s=retry_s,
            watch_timeout_s=watch_timeout_s,
        )

    @property
    def nodes(self) -> Nodes:
        return self.objects
