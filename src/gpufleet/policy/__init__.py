"""Pure, clock-injected policies: routing, admission, health, autoscaling.

Every policy is a small synchronous object: it takes ``now`` and a frozen
:class:`~gpufleet.fleet.FleetView`, returns a frozen decision, and keeps its memory in named
fields. The pool controller (``gpufleet.control``) owns and drives them, the same objects for
the gateway and the fleet simulator, which reach them only through it (``.importlinter``).

* Routing: :func:`make_router` builds a :class:`Router` from a fleet file's ``routing``
  entry (docs/design/routing.md); ``prefix_precise`` (:class:`PrecisePrefixRouter`) indexes
  the engines' KV events in a :class:`KvBlockIndex` (docs/kv-events.md).
* Health: :class:`HealthPolicy` (outlier detection, circuit breakers, active checks) and the
  N+1 check :func:`redundancy` (docs/design/health.md).
* Autoscaling: :class:`AutoscalePolicy` sizes one model pool (reactive windows, a demand
  forecast as a floor, prewarmed standbys, drains), on the shared :func:`saturation`
  (docs/design/autoscaling.md).
* Admission: :class:`PoolAdmission` and its :class:`FairQueue` (strict priority classes,
  weighted fair share on a virtual token counter) (docs/tenants.md). A tenant's quota (rpm,
  tpm, concurrency) is the gateway's, checked before a request reaches the controller.
* Rollouts: :class:`Rollout` steps a served name to a new variant (canary or blue-green),
  each step ending in an :func:`analyse` of new against old on the same window (TTFT and ITL
  P99 by Mann-Whitney U, the 5xx/timeout rate by a two-proportion test): promote, hold or
  roll back (docs/design/rollout.md).
* Residency: :class:`ResidencyPolicy` sleeps idle ``on_demand`` replicas, wakes one for a
  pool with held requests and evicts the least valuable resident of a shared GPU slot
  (docs/residency.md).
* Batch lines: :class:`SpareCapacity` gates the lowest class, batch, into the room the
  interactive load leaves (a target share of the slots, AIMD on engine queueing and KV
  pressure) (docs/batch.md).
* Variants: :func:`choose_variant` picks a served model's variant (pool) for a request's
  key, weighted and sticky (docs/fleet-file.md, "Served names, variants and fallbacks").
"""

from gpufleet.policy._admission import (
    BATCH,
    CLASSES,
    AdmissionConfig,
    FairQueue,
    PoolAdmission,
    PoolGauge,
    Ticket,
    pool_saturated,
)
from gpufleet.policy._autoscale import (
    AutoscalePolicy,
    PoolView,
    ScaleDecision,
    ScaleDirection,
    ScaleGuard,
    ScaleHistory,
    ScaleInputs,
    ScaleProposal,
    Standby,
    choose_drain,
    redundancy_floor,
)
from gpufleet.policy._autoscale_config import AutoscaleConfig, ForecastConfig
from gpufleet.policy._autoscale_forecast import DemandForecaster, Forecast
from gpufleet.policy._autoscale_record import decision_record
from gpufleet.policy._autoscale_saturation import pool_utilisation, saturation
from gpufleet.policy._breaker import BreakerPhase, BreakerState, EjectionCause, ejection_time
from gpufleet.policy._config import (
    ROUTER_POLICIES,
    ActiveCheckConfig,
    HealthConfig,
    KVAwareConfig,
    LeastRequestConfig,
    OutlierConfig,
    PrecisePrefixConfig,
    PrefixAwareConfig,
    PrefixSettings,
    RoundRobinConfig,
    RouterConfig,
    SessionConfig,
    parse_router_config,
)
from gpufleet.policy._health import (
    EjectionRecord,
    HealthDecision,
    HealthPolicy,
    ReplicaHealth,
)
from gpufleet.policy._kv_index import FeedSnapshot, KvBlockIndex
from gpufleet.policy._lora import AdapterConfig, LoraConfig, Placement, load_on, place_adapter
from gpufleet.policy._precise import PrecisePrefixRouter, PreciseSnapshot
from gpufleet.policy._prefix import PrefixAwareRouter, PrefixIndex
from gpufleet.policy._probe import ProbeState, ProbeStatus
from gpufleet.policy._ranking import (
    CandidateFilter,
    Candidates,
    Ranking,
    RoutableFilter,
    Router,
    in_panic,
    select_candidates,
)
from gpufleet.policy._redundancy import Redundancy, redundancy
from gpufleet.policy._registry import make_router
from gpufleet.policy._residency import (
    ASLEEP,
    AWAKE,
    DEMAND_HALF_LIFE,
    HOLDS_MEMORY,
    DemandMeter,
    PoolDemand,
    Residency,
    ResidencyConfig,
    ResidencyDecision,
    ResidencyMode,
    ResidencyPolicy,
    ResidencyView,
    Resident,
    SleepReason,
    asleep_at,
)
from gpufleet.policy._residency import (
    value as residency_value,
)
from gpufleet.policy._retry import retry_allowed
from gpufleet.policy._rollout import (
    ACTIVE_ROLLOUT,
    TERMINAL_ROLLOUT,
    CheckResult,
    Rollout,
    RolloutAction,
    RolloutAnalysis,
    RolloutCheck,
    RolloutDecision,
    RolloutPhase,
    RolloutVerdict,
    RolloutWindow,
    analyse,
)
from gpufleet.policy._rollout_config import AnalysisConfig, RolloutConfig, RolloutStrategy
from gpufleet.policy._rollout_stats import mann_whitney_greater, p99, two_proportion_greater
from gpufleet.policy._routers import (
    KVAwareRouter,
    LeastRequestRouter,
    RoundRobinRouter,
    kv_scores,
)
from gpufleet.policy._session import SessionRouter
from gpufleet.policy._spare import SpareCapacity, SpareConfig, SpareDecision, SpareView
from gpufleet.policy._variants import choose_variant, variant_point

__all__ = [
    "ACTIVE_ROLLOUT",
    "ASLEEP",
    "AWAKE",
    "BATCH",
    "CLASSES",
    "DEMAND_HALF_LIFE",
    "HOLDS_MEMORY",
    "ROUTER_POLICIES",
    "TERMINAL_ROLLOUT",
    "ActiveCheckConfig",
    "AdapterConfig",
    "AdmissionConfig",
    "AnalysisConfig",
    "AutoscaleConfig",
    "AutoscalePolicy",
    "BreakerPhase",
    "BreakerState",
    "CandidateFilter",
    "Candidates",
    "CheckResult",
    "DemandForecaster",
    "DemandMeter",
    "EjectionCause",
    "EjectionRecord",
    "FairQueue",
    "FeedSnapshot",
    "Forecast",
    "ForecastConfig",
    "HealthConfig",
    "HealthDecision",
    "HealthPolicy",
    "KVAwareConfig",
    "KVAwareRouter",
    "KvBlockIndex",
    "LeastRequestConfig",
    "LeastRequestRouter",
    "LoraConfig",
    "OutlierConfig",
    "Placement",
    "PoolAdmission",
    "PoolDemand",
    "PoolGauge",
    "PoolView",
    "PrecisePrefixConfig",
    "PrecisePrefixRouter",
    "PreciseSnapshot",
    "PrefixAwareConfig",
    "PrefixAwareRouter",
    "PrefixIndex",
    "PrefixSettings",
    "ProbeState",
    "ProbeStatus",
    "Ranking",
    "Redundancy",
    "ReplicaHealth",
    "Residency",
    "ResidencyConfig",
    "ResidencyDecision",
    "ResidencyMode",
    "ResidencyPolicy",
    "ResidencyView",
    "Resident",
    "Rollout",
    "RolloutAction",
    "RolloutAnalysis",
    "RolloutCheck",
    "RolloutConfig",
    "RolloutDecision",
    "RolloutPhase",
    "RolloutStrategy",
    "RolloutVerdict",
    "RolloutWindow",
    "RoundRobinConfig",
    "RoundRobinRouter",
    "RoutableFilter",
    "Router",
    "RouterConfig",
    "ScaleDecision",
    "ScaleDirection",
    "ScaleGuard",
    "ScaleHistory",
    "ScaleInputs",
    "ScaleProposal",
    "SessionConfig",
    "SessionRouter",
    "SleepReason",
    "SpareCapacity",
    "SpareConfig",
    "SpareDecision",
    "SpareView",
    "Standby",
    "Ticket",
    "analyse",
    "asleep_at",
    "choose_drain",
    "choose_variant",
    "decision_record",
    "ejection_time",
    "in_panic",
    "kv_scores",
    "load_on",
    "make_router",
    "mann_whitney_greater",
    "p99",
    "parse_router_config",
    "place_adapter",
    "pool_saturated",
    "pool_utilisation",
    "redundancy",
    "redundancy_floor",
    "residency_value",
    "retry_allowed",
    "saturation",
    "select_candidates",
    "two_proportion_greater",
    "variant_point",
]
