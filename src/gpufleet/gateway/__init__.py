"""The OpenAI-compatible HTTP edge: routing, retries, streaming, health, metrics.

``create_gateway(config, replica_source, registry)`` returns a pure ASGI app (docs/gateway.md).
The replicas come from a :class:`ReplicaSource` the shell feeds (``gpufleet up`` adapts the
local runtime); upstream requests go through one seam, :class:`ReplicaClient`. Models with
``autoscale`` are scaled as their pool controllers decide (``gpufleet.control``), through a
:class:`ScaleActuator` (``gpufleet up``: the local runtime). TLS: :class:`ServerTLS` for the
gateway's own port (``GatewayServer(app, tls=…)``), :class:`ReplicaTLS` for ``https://``
replicas (``Http11ReplicaClient(tls=…)``).
"""

from gpufleet.control import decision_record  # the autoscaler's log line (shared with the sim)
from gpufleet.gateway._app import SERVER_OPTIONS, Gateway, KvHasher, create_gateway
from gpufleet.gateway._autoscale import AutoscaleMetrics, ScaleActuator, ScaleExecutor
from gpufleet.gateway._control import LiveControl
from gpufleet.gateway._errors import (
    BadRequestError,
    GatewayError,
    LocalOriginError,
    ModelNotFoundError,
    NoReplicaError,
    ReplicaOriginError,
    UpstreamError,
)
from gpufleet.gateway._http11 import Http11ReplicaClient
from gpufleet.gateway._metrics import GatewayMetrics
from gpufleet.gateway._replicas import ReplicaSource, StaticReplicas, Upstream
from gpufleet.gateway._scrape import parse_engine_metrics
from gpufleet.gateway._server import GatewayServer
from gpufleet.gateway._tenancy import Tenancy, admin_key
from gpufleet.gateway._tls import ReplicaTLS, ServerTLS
from gpufleet.gateway._upstream import (
    ReplicaClient,
    UpstreamRequest,
    UpstreamResponse,
)
from gpufleet.gateway._views import no_spare_message, required_replicas

__all__ = [
    "SERVER_OPTIONS",
    "AutoscaleMetrics",
    "BadRequestError",
    "Gateway",
    "GatewayError",
    "GatewayMetrics",
    "GatewayServer",
    "Http11ReplicaClient",
    "KvHasher",
    "LiveControl",
    "LocalOriginError",
    "ModelNotFoundError",
    "NoReplicaError",
    "ReplicaClient",
    "ReplicaOriginError",
    "ReplicaSource",
    "ReplicaTLS",
    "ScaleActuator",
    "ScaleExecutor",
    "ServerTLS",
    "StaticReplicas",
    "Tenancy",
    "Upstream",
    "UpstreamError",
    "UpstreamRequest",
    "UpstreamResponse",
    "admin_key",
    "create_gateway",
    "decision_record",
    "no_spare_message",
    "parse_engine_metrics",
    "required_replicas",
]
