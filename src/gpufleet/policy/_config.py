"""Router settings as the fleet file writes them: one validated model per policy.

Every default is here. A fleet file names a policy and overrides what it needs::

    routing: {policy: prefix_aware, balance_rel: 1.3}

``parse_router_config`` turns that mapping (or a bare policy name) into one of the models
below; an unknown policy or field is a ``ValueError`` (pydantic's ``ValidationError``) that
names it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator


class _RouterSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    panic_threshold: float = Field(0.5, ge=0.0, le=1.0)
    """Below this share of routable in-service replicas the pool routes over all of them
    (Envoy's healthy panic threshold; 0 turns panic off)."""


class RoundRobinConfig(_RouterSettings):
    """Each candidate in turn."""

    policy: Literal["round_robin"] = "round_robin"


class LeastRequestConfig(_RouterSettings):
    """The candidate with the fewest gateway-side requests in flight."""

    policy: Literal["least_request"] = "least_request"


class _ScrapeSettings(_RouterSettings):
    max_scrape_age: float = Field(1.0, gt=0.0)
    """Seconds after which a replica's ``/metrics`` scrape is ignored (scrapes come every
    0.1–0.25 s; a replica whose scrapes stop is judged by the gateway's own count)."""


class KVAwareConfig(_ScrapeSettings):
    """The candidate with the lowest KV-and-queue score (docs/design/routing.md)."""

    policy: Literal["kv_aware"] = "kv_aware"
    waiting_weight: float = Field(1.0, ge=0.0)
    """Extra cost of each request the replica has queued (it is saturated)."""
    kv_weight: float = Field(4.0, ge=0.0)
    """Cost of a full KV cache, in requests: a replica at 100 % usage must preempt or queue."""


class PrefixSettings(_ScrapeSettings):
    """What the two prefix routers share: the approximate index and the load guard."""

    index_blocks: int = Field(4096, ge=1)
    """Prefix blocks remembered per replica (an LRU, about 160 bytes each). Best near the
    replica's KV cache size in the same unit: 4096 blocks of 512 characters (~128 tokens)
    is ~512k tokens, an 8B model on one 80 GB GPU. Larger, and the index remembers what the
    replica has evicted; smaller, and it forgets what the replica still holds."""
    balance_abs: float = Field(4.0, ge=0.0)
    """A replica is overloaded when it holds more than ``balance_abs`` requests more …"""
    balance_rel: float = Field(1.5, ge=1.0)
    """… and more than ``balance_rel`` times the requests of the least-loaded candidate."""
    min_match_blocks: int = Field(1, ge=1)
    """Fewer matched blocks than this count as no match (route by load alone)."""


class PrefixAwareConfig(PrefixSettings):
    """The candidate holding the longest cached prefix, unless it is overloaded."""

    policy: Literal["prefix_aware"] = "prefix_aware"


class PrecisePrefixConfig(PrefixSettings):
    """``prefix_aware`` on what the engines report cached (their KV events), matched on the
    engines' own block hashes; replicas without a live event feed fall back to the
    approximate index (docs/kv-events.md)."""

    policy: Literal["prefix_precise"] = "prefix_precise"
    index_blocks: int = Field(32768, ge=1)
    """The approximate fallback's blocks per replica, in engine blocks (16 tokens by
    default: 32,768 is ~512k tokens, as ``prefix_aware``'s 4,096 blocks of ~128)."""
    kv_index_blocks: int = Field(262144, ge=1)
    """The most blocks indexed per replica from its events (the memory bound, about 150
    bytes each); above it the oldest stored are dropped. Set it at or above the engines'
    KV cache in blocks (an 8B model on one 80 GB GPU: ~32k blocks of 16)."""
    stale_after: float = Field(10.0, gt=0.0)
    """Seconds a replica may take requests without publishing a batch before its feed
    counts as stale (the approximate index answers for it until its next batch)."""


class SessionConfig(_RouterSettings):
    """Consistent hashing with bounded load on the request's session key."""

    policy: Literal["session"] = "session"
    load_factor: float = Field(1.25, gt=1.0)
    """No replica takes more than ``load_factor`` × the mean in-flight load (+1)."""
    vnodes: int = Field(64, ge=1)
    """Points per replica on the hash ring: more points, more even key spread."""


RouterConfig = Annotated[
    RoundRobinConfig
    | LeastRequestConfig
    | KVAwareConfig
    | PrefixAwareConfig
    | PrecisePrefixConfig
    | SessionConfig,
    Field(discriminator="policy"),
]
"""Any router's settings, told apart by ``policy``."""

_ADAPTER: Final[TypeAdapter[RouterConfig]] = TypeAdapter(RouterConfig)

ROUTER_POLICIES: Final = (
    "kv_aware",
    "least_request",
    "prefix_aware",
    "prefix_precise",
    "round_robin",
    "session",
)


def parse_router_config(data: Mapping[str, object] | str) -> RouterConfig:
    """Validate a fleet file's ``routing`` entry: a mapping with ``policy``, or just a name."""
    if isinstance(data, str):
        data = {"policy": data}
    return _ADAPTER.validate_python(data)


# -- health -----------------------------------------------------------------------------------


class _HealthSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class OutlierConfig(_HealthSettings):
    """Passive outlier detection and the circuit breaker it opens (Envoy's names)."""

    consecutive_5xx: int = Field(5, ge=1)
    """Replica-origin failures (5xx) in a row that eject a replica."""
    consecutive_local_origin_failure: int = Field(5, ge=1)
    """Local-origin failures (connect failure, timeout) in a row that eject a replica."""
    base_ejection_time: float = Field(5.0, gt=0.0)
    """Seconds of the first ejection; the n-th lasts n × this. The ejection count drops by
    one for each ``base_ejection_time`` the replica then stays in service."""
    max_ejection_time: float = Field(300.0, gt=0.0)
    """Cap on one ejection's length."""
    max_ejection_percent: float = Field(50.0, ge=0.0, le=100.0)
    """At most this share of a pool's in-service replicas is ejected at once (floor)."""
    enforcing: float = Field(1.0, ge=0.0, le=1.0)
    """Share of ejections carried out; the rest are only logged (``enforced=False``), so
    0 is a dry run."""

    @model_validator(mode="after")
    def _times_ordered(self) -> OutlierConfig:
        if self.max_ejection_time < self.base_ejection_time:
            raise ValueError(
                f"max_ejection_time ({self.max_ejection_time}) must be at least "
                f"base_ejection_time ({self.base_ejection_time})"
            )
        return self


class ActiveCheckConfig(_HealthSettings):
    """Active checks: ``GET /health`` on every ready replica every ``interval`` seconds."""

    enabled: bool = True
    """Off: no periodic probes, and replicas are routable without one (recovery probes of
    ejected replicas still run)."""
    interval: float = Field(1.0, gt=0.0)
    timeout: float = Field(1.0, gt=0.0)
    """A probe not answered within this is a failure (the shell enforces it); one not
    reported within twice this is sent again."""
    healthy_threshold: int = Field(2, ge=1)
    """Successes in a row that bring an unhealthy replica back (a new one needs one)."""
    unhealthy_threshold: int = Field(2, ge=1)
    """Failures in a row that make a healthy replica unhealthy."""
    abandon: bool = True
    """When a replica fails its checks, end the attempts in flight on it at once (retried,
    or resumed, elsewhere) rather than leave them to their timeouts: a process that answers
    no probe (hung, its host gone) answers none of them (Envoy's
    ``close_connections_on_host_health_failure``; docs/design/retries.md)."""


class HealthConfig(_HealthSettings):
    """A fleet file's ``health`` entry."""

    outlier: OutlierConfig = OutlierConfig()
    active: ActiveCheckConfig = ActiveCheckConfig()
