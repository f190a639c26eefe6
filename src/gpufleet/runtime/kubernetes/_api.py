"""A small async client of the Kubernetes API: the calls operator mode makes, over httpx.

Why httpx and not a generated client: the operator needs list and watch of EndpointSlices,
get and patch of ``deployments/scale``, a patch of a pod's annotations, and get, create and
conditional update of its leader-election Lease. httpx is already
the gateway's and the runtime's HTTP client, so this adds no dependency (the official
``kubernetes`` client is synchronous and would need threads in the gateway's event loop;
``kubernetes_asyncio`` brings aiohttp and thousands of generated models; ``kr8s`` and
``lightkube`` would each add a dependency for a handful of calls). And the watch protocol (resource
versions, bookmarks, ``410 Gone``) is the part that must be right and tested, so it is spelled
out in ``_discovery.py`` (``ListWatch``) rather than hidden in a helper.

Authentication is what a pod has: the service account's token (re-read from its file, since
the kubelet rotates bound tokens) and the cluster CA. ``ApiConfig(server=...)`` without a token
reaches a cluster through ``kubectl proxy`` (or a test's fake API server)::

    async with KubeApi(ApiConfig.in_cluster()) as api:
        scale = await api.get("/apis/apps/v1/namespaces/ns/deployments/x/scale")
        async for event in api.watch(path, {"resourceVersion": rv}): ...
"""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import time
from collections.abc import AsyncIterator, Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

import httpx

SERVICE_ACCOUNT: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where the kubelet mounts a pod's service-account token, CA and namespace."""
MERGE_PATCH: Final = "application/merge-patch+json"
_TOKEN_TTL_S: Final = 60.0
"""Re-read the token file this often (the kubelet refreshes it well before it expires)."""

JSON = dict[str, Any]


class KubeApiError(Exception):
    """A call that failed: ``status`` is the HTTP status, ``None`` when the API server could
    not be reached at all (refused, reset, timed out)."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"{status or 'unreachable'}: {message}")
        self.status = status
        self.message = message

    @property
    def gone(self) -> bool:
        """``410 Gone``: a resource version too old to watch from; list again."""
        return self.status == 410


@dataclass(frozen=True, slots=True)
class ApiConfig:
    """Where the API server is and how to prove who we are."""

    server: str
    """Base URL, e.g. ``https://10.96.0.1:443`` or ``http://127.0.0.1:8001`` (kubectl proxy)."""
    token_file: Path | None = None
    ca_file: Path | None = None

    @classmethod
    def in_cluster(cls, root: Path = SERVICE_ACCOUNT) -> ApiConfig:
        """The API server as a pod sees it; ``ValueError`` outside a pod."""
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host or not (root / "token").exists():
            raise ValueError(
                "not running in a Kubernetes pod (no KUBERNETES_SERVICE_HOST or service-account "
                "token): set runtime.api_server in the fleet file (e.g. kubectl proxy's URL)"
            )
        shown = f"[{host}]" if ":" in host else host
        return cls(f"https://{shown}:{port}", root / "token", root / "ca.crt")


def in_cluster_namespace(root: Path = SERVICE_ACCOUNT) -> str | None:
    """The namespace of the pod we run in, or ``None`` outside a pod."""
    try:
        return (root / "namespace").read_text().strip() or None
    except OSError:
        return None


class _TokenAuth(httpx.Auth):
    """``Authorization: Bearer`` from a token file that the kubelet rotates."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._token = ""
        self._read_at = -_TOKEN_TTL_S

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        now = time.monotonic()
        if now - self._read_at >= _TOKEN_TTL_S:
            self._token = self._path.read_text().strip()
            self._read_at = now
        request.headers["Authorization"] = f"Bearer {self._token}"
        yield request


class KubeApi:
    """Get, patch and watch Kubernetes API paths; every failure is a :class:`KubeApiError`."""

    def __init__(self, config: ApiConfig, *, timeout_s: float = 10.0) -> None:
        verify: ssl.SSLContext | bool = True
        if config.ca_file is not None:
            verify = ssl.create_default_context(cafile=str(config.ca_file))
        self._timeout = httpx.Timeout(timeout_s)
        self._client = httpx.AsyncClient(
            base_url=config.server.rstrip("/"),
            auth=_TokenAuth(config.token_file) if config.token_file is not None else None,
            verify=verify,
            timeout=self._timeout,
            headers={"Accept": "application/json", "User-Agent": "gpufleet-operator"},
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def get(self, path: str, params: Mapping[str, str] | None = None) -> JSON:
        return await self._call("GET", path, params=params)

    async def post(self, path: str, body: JSON) -> JSON:
        """Create an object (``409`` if one of that name exists)."""
        return await self._call("POST", path, json=body)

    async def put(self, path: str, body: JSON) -> JSON:
        """Replace an object; with ``metadata.resourceVersion`` set, only if it is still that
        version (``409 Conflict`` otherwise: someone else wrote it first)."""
        return await self._call("PUT", path, json=body)

    async def patch(self, path: str, body: JSON, *, content_type: str = MERGE_PATCH) -> JSON:
        return await self._call(
            "PATCH", path, content=json.dumps(body), headers={"Content-Type": content_type}
        )

    async def watch(
        self, path: str, params: Mapping[str, str], *, timeout_s: int = 300
    ) -> AsyncIterator[JSON]:
        """The events of a watch (``{"type": ..., "object": ...}``) until the server ends it
        (after about ``timeout_s``). An ``ERROR`` event raises (``gone`` for ``410``)."""
        query = {**params, "watch": "1", "timeoutSeconds": str(timeout_s)}
        # the server holds the stream open up to timeout_s between events: read a little longer
        timeout = httpx.Timeout(self._timeout.connect, read=timeout_s + 30.0)
        try:
            async with self._client.stream("GET", path, params=query, timeout=timeout) as reply:
                if reply.status_code >= 300:
                    await reply.aread()
                    raise _error(reply)
                async for line in reply.aiter_lines():
                    if not line.strip():
                        continue
                    event: JSON = json.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object") or {}
                        raise KubeApiError(status.get("code"), status.get("message", "watch"))
                    yield event
        except httpx.HTTPError as error:
            raise KubeApiError(None, f"{path}: {error!r}") from error
        except json.JSONDecodeError as error:
            raise KubeApiError(None, f"{path}: a watch event is not JSON: {error}") from error

    async def _call(self, method: str, path: str, **kwargs: Any) -> JSON:
        try:
            reply = await self._client.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise KubeApiError(None, f"{method} {path}: {error!r}") from error
        if reply.status_code >= 300:
            raise _error(reply)
        try:
            body: JSON = reply.json()
        except ValueError as error:
            raise KubeApiError(reply.status_code, f"{path}: the reply is not JSON") from error
        return body


def _error(reply: httpx.Response) -> KubeApiError:
    """The API server's ``Status`` message when it sent one (``pods "x" is forbidden: …``)."""
    message = reply.reason_phrase
    with contextlib.suppress(ValueError):
        message = reply.json().get("message", message)
    return KubeApiError(
        reply.status_code, f"{reply.request.method} {reply.request.url.path}: {message}"
    )
