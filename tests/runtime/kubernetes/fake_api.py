"""A fake Kubernetes API server for operator-mode tests: no real cluster runs here.

It serves, over real HTTP on loopback (starlette under uvicorn, in the test's event loop), the
few paths operator mode calls, with the semantics that matter to it:

* ``GET  /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices`` — a list with a
  ``resourceVersion``, or with ``watch=1`` a stream of JSON-line events after the given
  ``resourceVersion``; a version older than the last compaction gets ``410 Gone`` (as an
  ``ERROR`` event, as the API server sends it, or as an HTTP status);
* ``GET  /api/v1/nodes`` — the same list and watch, of the cluster's nodes (their taints and
  cordon; versions from the same counter as the slices', as etcd's revision is one);
* ``GET/PATCH /apis/apps/v1/namespaces/NS/deployments/NAME/scale`` (merge patch);
* ``PATCH /api/v1/namespaces/NS/pods/NAME`` (merge patch of annotations);
* ``GET/PUT /apis/coordination.k8s.io/v1/namespaces/NS/leases/NAME`` and ``POST .../leases``:
  a Lease with its own ``resourceVersion``; a PUT naming another version gets ``409 Conflict``
  and a POST of a lease that exists ``409 AlreadyExists``, as optimistic concurrency does.

Tests change the cluster with ``set_pod``/``remove_pod`` (``node=``: the endpoint's
``nodeName``) and ``set_node``/``taint_node``/``cordon_node``, inject failures with ``fail``,
compact history with ``compact``, cut open watches with ``drop_watches``, and read every
request in ``calls``. kmock 0.8 was tried first: its emulator keeps no resource versions,
filters no label selectors and knows no scale subresource, so the watch protocol (the part
that needs testing) would have had to be written in its DSL anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

JSON = dict[str, Any]


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, str]
    body: JSON | None
    content_type: str | None


@dataclass
class Fault:
    method: str
    path_part: str
    status: int
    times: int


@dataclass
class FakeKubeApi:
    namespace: str = "gpufleet"
    rv: int = 100
    slices: dict[str, JSON] = field(default_factory=dict)
    nodes: dict[str, JSON] = field(default_factory=dict)
    history: list[tuple[int, str, JSON]] = field(default_factory=list)
    oldest: int = 0
    """Watches from a resourceVersion below this get 410 Gone."""
    gone_as_status: bool = False
    """Send 410 as an HTTP status instead of an ERROR event in a 200 stream."""
    scales: dict[str, int] = field(default_factory=dict)
    pod_annotations: dict[str, dict[str, str]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    leases: dict[str, JSON] = field(default_factory=dict)
    lease_rv: int = 1000
    conflicts: int = 0
    """Lease updates refused with 409 because another write came first."""
    """Lease versions: counted apart, so that slice versions stay what tests expect."""
    generation: int = 0
    closing: bool = False
    _pods: dict[str, dict[str, JSON]] = field(default_factory=dict)

    # -- what tests do to the cluster ---------------------------------------------------

    def set_pod(
        self,
        service: str,
        pod: str,
        port: int = 8000,
        *,
        ip: str = "127.0.0.1",
        ready: bool = True,
        terminating: bool = False,
        node: str | None = None,
    ) -> None:
        endpoint: JSON = {
            "addresses": [ip],
            "conditions": {"ready": ready, "serving": ready, "terminating": terminating},
            "targetRef": {"kind": "Pod", "namespace": self.namespace, "name": pod},
        }
        if node is not None:
            endpoint["nodeName"] = node
        self._pods.setdefault(service, {})[pod] = endpoint
        self._put_slice(service, port)

    def set_node(
        self, name: str, taints: list[JSON] | None = None, *, unschedulable: bool = False
    ) -> None:
        """Add or replace a node (with a status the operator must not need)."""
        spec: JSON = {"providerID": f"fake://{name}"}
        if taints:
            spec["taints"] = taints
        if unschedulable:
            spec["unschedulable"] = True
        self._put_node(name, spec)

    def taint_node(
        self,
        name: str,
        key: str,
        value: str | None = None,
        *,
        effect: str = "NoSchedule",
        time_added: str | None = None,
    ) -> None:
        """Add a taint to a node, as a termination handler does."""
        taint: JSON = {"key": key, "effect": effect}
        if value is not None:
            taint["value"] = value
        if time_added is not None:
            taint["timeAdded"] = time_added
        spec = dict(self.nodes[name]["spec"])
        spec["taints"] = [*spec.get("taints", []), taint]
        self._put_node(name, spec)

    def cordon_node(self, name: str, cordoned: bool = True) -> None:
        spec = {k: v for k, v in self.nodes[name]["spec"].items() if k != "unschedulable"}
        self._put_node(name, {**spec, "unschedulable": True} if cordoned else spec)

    def _put_node(self, name: str, spec: JSON) -> None:
        self.rv += 1
        kind = "MODIFIED" if name in self.nodes else "ADDED"
        obj = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "resourceVersion": str(self.rv), "labels": {}},
            "spec": spec,
            "status": {"images": [{"names": ["big/image:1"], "sizeBytes": 10**10}]},
        }
        self.nodes[name] = obj
        self.history.append((self.rv, kind, obj))

    def remove_pod(self, service: str, pod: str, port: int = 8000) -> None:
        self._pods.get(service, {}).pop(pod, None)
        self._put_slice(service, port)

    def delete_service(self, service: str) -> None:
        self._pods.pop(service, None)
        name = f"{service}-x1"
        if name in self.slices:
            self.rv += 1
            obj = self.slices.pop(name)
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
            self.history.append((self.rv, "DELETED", obj))

    def compact(self) -> None:
        """Forget history: every watch that resumes from an earlier version gets 410."""
        self.oldest = self.rv + 1
        self.history.clear()
        self.drop_watches()

    def drop_watches(self) -> None:
        self.generation += 1

    def fail(self, method: str, path_part: str, status: int, times: int = 1) -> None:
        self.faults.append(Fault(method, path_part, status, times))

    def calls_to(self, method: str, path_part: str) -> list[Call]:
        return [c for c in self.calls if c.method == method and path_part in c.path]

    def _put_slice(self, service: str, port: int) -> None:
        self.rv += 1
        name = f"{service}-x1"
        kind = "MODIFIED" if name in self.slices else "ADDED"
        obj = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "resourceVersion": str(self.rv),
                "labels": {"kubernetes.io/service-name": service},
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": list(self._pods.get(service, {}).values()),
        }
        self.slices[name] = obj
        self.history.append((self.rv, kind, obj))

    # -- the HTTP side ------------------------------------------------------------------

    def app(self) -> Starlette:
        ns = "/namespaces/{ns}"
        return Starlette(
            routes=[
                Route(f"/apis/discovery.k8s.io/v1{ns}/endpointslices", self._slices_route),
                Route("/api/v1/nodes", self._nodes_route),
                Route(
                    f"/apis/apps/v1{ns}/deployments/{{name}}/scale",
                    self._scale_route,
                    methods=["GET", "PATCH"],
                ),
                Route(f"/api/v1{ns}/pods/{{name}}", self._pod_route, methods=["PATCH"]),
                Route(f"{LEASES}{ns}/leases", self._leases_route, methods=["POST"]),
                Route(f"{LEASES}{ns}/leases/{{name}}", self._lease_route, methods=["GET", "PUT"]),
            ]
        )

    async def _record(self, request: Request) -> Response | None:
        raw = await request.body()
        self.calls.append(
            Call(
                request.method,
                request.url.path,
                dict(request.query_params),
                json.loads(raw) if raw else None,
                request.headers.get("content-type"),
            )
        )
        for fault in self.faults:
            hit = fault.method == request.method and fault.path_part in request.url.path
            if hit and fault.times > 0:
                fault.times -= 1
                return _status(fault.status, f"injected {fault.status}")
        return None

    async def _slices_route(self, request: Request) -> Response:
        if (failed := await self._record(request)) is not None:
            return failed
        services = _services(request.query_params.get("labelSelector", ""))

        def wanted(obj: JSON) -> bool:
            labels = obj["metadata"]["labels"]
            return obj["kind"] == "EndpointSlice" and labels["kubernetes.io/service-name"] in (
                services
            )

        return self._list_or_watch(request, "EndpointSliceList", self.slices, wanted)

    async def _nodes_route(self, request: Request) -> Response:
        if (failed := await self._record(request)) is not None:
            return failed
        assert "labelSelector" not in request.query_params  # every node: none is filtered out

        def wanted(obj: JSON) -> bool:
            return bool(obj["kind"] == "Node")

        return self._list_or_watch(request, "NodeList", self.nodes, wanted)

    def _list_or_watch(
        self, request: Request, kind: str, objects: dict[str, JSON], wanted: Any
    ) -> Response:
        if request.query_params.get("watch") not in ("1", "true"):
            items = [s for s in objects.values() if wanted(s)]
            return JSONResponse(
                {"kind": kind, "metadata": {"resourceVersion": str(self.rv)}, "items": items}
            )
        since = int(request.query_params.get("resourceVersion") or self.rv)
        if since < self.oldest - 1:
            if self.gone_as_status:
                return _status(410, "too old resource version")
            return StreamingResponse(
                _one(_line({"type": "ERROR", "object": _status_body(410, "too old")})),
                media_type="application/json",
            )
        timeout = float(request.query_params.get("timeoutSeconds", "300"))
        return StreamingResponse(
            self._events(since, wanted, timeout, self.generation), media_type="application/json"
        )

    def watching(self, path_part: str = "/endpointslices") -> int:
        """Watch requests received so far (of slices, by default)."""
        return sum(1 for c in self.calls if c.query.get("watch") == "1" and path_part in c.path)

    async def _events(
        self, since: int, wanted: Any, timeout: float, generation: int
    ) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        sent = since
        while not self.closing and self.generation == generation and loop.time() < end:
            for rv, kind, obj in list(self.history):
                if rv > sent:
                    sent = rv
                    if wanted(obj):
                        yield _line({"type": kind, "object": obj})
            await asyncio.sleep(0.01)

    async def _scale_route(self, request: Request) -> Response:
        if (failed := await self._record(request)) is not None:
            return failed
        name = request.path_params["name"]
        if name not in self.scales:
            return _status(404, f'deployments.apps "{name}" not found')
        if request.method == "PATCH":
            body = self.calls[-1].body or {}
            self.scales[name] = int(body["spec"]["replicas"])
        return JSONResponse(
            {
                "kind": "Scale",
                "apiVersion": "autoscaling/v1",
                "metadata": {"name": name, "namespace": self.namespace},
                "spec": {"replicas": self.scales[name]},
                "status": {"replicas": self.scales[name]},
            }
        )

    async def _pod_route(self, request: Request) -> Response:
        if (failed := await self._record(request)) is not None:
            return failed
        name = request.path_params["name"]
        if not any(name in pods for pods in self._pods.values()):
            return _status(404, f'pods "{name}" not found')
        body = self.calls[-1].body or {}
        annotations = body.get("metadata", {}).get("annotations", {})
        self.pod_annotations.setdefault(name, {}).update(annotations)
        return JSONResponse({"kind": "Pod", "metadata": {"name": name}})

    async def _leases_route(self, request: Request) -> Response:
        if (failed := await self._record(request)) is not None:
            return failed
        body = self.calls[-1].body or {}
        name = body["metadata"]["name"]
        if name in self.leases:
            return _status(409, f'leases.coordination.k8s.io "{name}" already exists')
        return JSONResponse(self._store_lease(name, body), status_code=201)

    async def _lease_route(self, request: Request) -> Response:
        if (failed := await self._record(request)) is not None:
            return failed
        name = request.path_params["name"]
        if name not in self.leases:
            return _status(404, f'leases.coordination.k8s.io "{name}" not found')
        if request.method == "GET":
            return JSONResponse(self.leases[name])
        body = self.calls[-1].body or {}
        sent = body.get("metadata", {}).get("resourceVersion")
        if sent != self.leases[name]["metadata"]["resourceVersion"]:
            self.conflicts += 1
            return _status(
                409,
                f'Operation cannot be fulfilled on leases.coordination.k8s.io "{name}": the '
                "object has been modified; please apply your changes to the latest version",
            )
        return JSONResponse(self._store_lease(name, body))

    def _store_lease(self, name: str, body: JSON) -> JSON:
        self.lease_rv += 1
        meta = {**body.get("metadata", {}), "name": name, "namespace": self.namespace}
        meta["resourceVersion"] = str(self.lease_rv)
        self.leases[name] = {**body, "metadata": meta}
        return self.leases[name]

    def holder(self, name: str = "gpufleet-gateway") -> str | None:
        """The lease's holder now (``None``: no lease, or released)."""
        lease = self.leases.get(name)
        return (lease["spec"].get("holderIdentity") or None) if lease else None


LEASES = "/apis/coordination.k8s.io/v1"


def _services(selector: str) -> set[str]:
    """``kubernetes.io/service-name in (a,b)`` → {a, b} (the only form the operator sends)."""
    key, _, values = selector.partition(" in ")
    assert key == "kubernetes.io/service-name", selector
    return {v.strip() for v in values.strip("()").split(",") if v.strip()}


def _line(obj: JSON) -> bytes:
    return (json.dumps(obj) + "\n").encode()


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _status_body(code: int, message: str) -> JSON:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "code": code,
    }


def _status(code: int, message: str) -> JSONResponse:
    return JSONResponse(_status_body(code, message), status_code=code)


@contextlib.asynccontextmanager
async def serving(fake: FakeKubeApi, port: int = 0) -> AsyncIterator[str]:
    """Serve ``fake`` on 127.0.0.1 (``port`` 0: a free one) in this event loop; yields the URL.
    Leaving the block closes the port: calls are then refused."""
    sock = socket.create_server(("127.0.0.1", port))
    port = sock.getsockname()[1]
    fake.closing = False
    server = uvicorn.Server(
        uvicorn.Config(fake.app(), log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        fake.closing = True
        server.should_exit = True
        await task
        sock.close()
