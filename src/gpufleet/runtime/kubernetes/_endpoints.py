"""Replica pods as EndpointSlices show them: a pure function from slices to endpoints.

The EndpointSlice controller writes one or more slices per Service, labelled
``kubernetes.io/service-name``; each endpoint is one pod (``targetRef``) with its addresses and
three conditions::

    ready        the pod passes its readiness probe and is not terminating  → routable
    serving      the same, but also true while terminating                  (not used)
    terminating  the pod is shutting down (a scale-down, a rollout, a node drain)

Each endpoint also names the node its pod runs on (``nodeName``): the node watch
(``_nodes.py``) says which nodes the cloud is taking back.

A pod can sit in two slices for a moment while the controller rebalances them; it is listed
once, ready if either slice says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

SERVICE_NAME_LABEL: Final = "kubernetes.io/service-name"
"""The label the EndpointSlice controller puts on every slice of a Service."""
PORT_NAME: Final = "http"


class PodState(StrEnum):
    STARTING = "starting"
    """Not (yet) ready: loading the model, or failing its readiness probe."""
    READY = "ready"
    TERMINATING = "terminating"


@dataclass(frozen=True, slots=True)
class PodEndpoint:
    """One replica pod of a pool: its name, base URL, state and node."""

    pool: str
    name: str
    url: str
    state: PodState
    node: str | None = None
    """The node it runs on (``None``: the slice does not say)."""


def pod_endpoints(
    slices: Iterable[Mapping[str, Any]], pools_by_service: Mapping[str, str]
) -> tuple[PodEndpoint, ...]:
    """Every pod of the given Services (``service name → pool``), sorted by pool and name.

    Endpoints without an address or a port are skipped (a slice being filled in)."""
    found: dict[str, PodEndpoint] = {}
    for piece in slices:
        labels = piece.get("metadata", {}).get("labels") or {}
        pool = pools_by_service.get(labels.get(SERVICE_NAME_LABEL, ""))
        port = _port(piece.get("ports") or [])
        if pool is None or port is None:
            continue
        for endpoint in piece.get("endpoints") or []:
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            address = addresses[0]
            host = f"[{address}]" if ":" in address else address
            ref = endpoint.get("targetRef") or {}
            name = ref.get("name") or endpoint.get("hostname") or address
            node = endpoint.get("nodeName")
            node = node if isinstance(node, str) and node else None
            pod = PodEndpoint(pool, name, f"http://{host}:{port}", _state(endpoint), node)
            seen = found.get(name)
            if seen is None or (pod.state is PodState.READY and seen.state is not PodState.READY):
                found[name] = pod
    return tuple(sorted(found.values(), key=lambda p: (p.pool, p.name)))


def _port(ports: list[Mapping[str, Any]]) -> int | None:
    for port in ports:
        if port.get("name") == PORT_NAME and port.get("port"):
            return int(port["port"])
    return int(ports[0]["port"]) if len(ports) == 1 and ports[0].get("port") else None


def _state(endpoint: Mapping[str, Any]) -> PodState:
    conditions = endpoint.get("conditions") or {}
    if conditions.get("terminating"):
        return PodState.TERMINATING
    # the API says: a nil `ready` is to be read as ready
    return PodState.STARTING if conditions.get("ready") is False else PodState.READY
