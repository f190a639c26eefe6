"""The fleet file: models, their engines, routing and health, and the gateway's settings.

``load_fleet(path)`` returns a validated :class:`FleetConfig` (docs/fleet-file.md); with no
path it loads the packaged default fleet, a small local sim fleet.
"""

from gpufleet.config._fleet import (
    DEFAULT_FLEET,
    SPOT_DISCOUNT,
    STARTUP_TIMEOUTS,
    AutoscalerConfig,
    BatchConfig,
    Capacity,
    EngineKind,
    FleetConfig,
    FleetFileError,
    GatewayConfig,
    ModelConfig,
    RetryConfig,
    RuntimeConfig,
    RuntimeKind,
    ServedConfig,
    SpotConfig,
    SpotFallback,
    StartupConfig,
    TenantsConfig,
    Timeouts,
    TLSConfig,
    TracingConfig,
    VariantConfig,
    is_loopback,
    load_fleet,
    parse_fleet,
)
from gpufleet.config._override import field_path, set_field
from gpufleet.config._reclaim import (
    DEFAULT_RECLAIM_TAINTS,
    ReclaimConfig,
    ReclaimTaintConfig,
)

__all__ = [
    "DEFAULT_FLEET",
    "DEFAULT_RECLAIM_TAINTS",
    "SPOT_DISCOUNT",
    "STARTUP_TIMEOUTS",
    "AutoscalerConfig",
    "BatchConfig",
    "Capacity",
    "EngineKind",
    "FleetConfig",
    "FleetFileError",
    "GatewayConfig",
    "ModelConfig",
    "ReclaimConfig",
    "ReclaimTaintConfig",
    "RetryConfig",
    "RuntimeConfig",
    "RuntimeKind",
    "ServedConfig",
    "SpotConfig",
    "SpotFallback",
    "StartupConfig",
    "TLSConfig",
    "TenantsConfig",
    "Timeouts",
    "TracingConfig",
    "VariantConfig",
    "field_path",
    "is_loopback",
    "load_fleet",
    "parse_fleet",
    "set_field",
]
