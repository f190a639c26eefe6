"""The control loop, written once: a sans-I/O pool controller per model pool.

The gateway (HTTP and asyncio timers) and the fleet simulator (a virtual clock) turn what
happens into :mod:`events <gpufleet.control._events>` and carry out the commands that come
back; every rule between them and the policies (``gpufleet.policy``) lives here
(docs/architecture.md). ``gpufleet up --record`` writes the events, ``gpufleet replay``
feeds them to a fresh controller.

The shells reach the policies only through this package (an import contract in
``.importlinter``): the controller owns every router, health policy, admission gate and
autoscaler, and re-exports just the values that cross to the shells in its events and
commands, its vocabulary: a :class:`Standby` the runtime reports, a :class:`ScaleDecision`
(its :class:`ScaleDirection`) and the :class:`PoolView` it was made on, an
:class:`EjectionRecord`, a decision's log line (:func:`decision_record`), the N+1 check on
a routing view (:func:`redundancy`, :class:`Redundancy`), the priority classes
(:data:`CLASSES`), a rollout's settings and decisions (:class:`RolloutConfig`,
:class:`RolloutDecision` and their enums) and a replica's :class:`Residency`
(:func:`asleep_at`), and a LoRA adapter's :class:`AdapterConfig`.

Residency (:class:`ResidencyControl`, docs/residency.md) is decided above the pools: a GPU
slot may be shared by several pools' replicas; its commands are :class:`Sleep` and
:class:`Wake`, and the shells report an engine's new state with :class:`Resident`.

Spot capacity is the pool controller's: a replica the provider took (:class:`Reclaimed`)
gets a node of spot or on-demand GPUs (:class:`Replace`), as the pool's ``spot.fallback``
and the market (:class:`SpotMarket`) say (docs/spot.md).

Served names are the controller's too: an ``Arrived`` names what the client sent, and the
:class:`FleetController` chooses the variant (pool) and the fallbacks (a :class:`Fallback`
command), so a weighted split or a fallback is decided once, live and simulated alike.
"""

from gpufleet.control._events import (
    Abandon,
    AdapterAdded,
    Arrived,
    AttemptFailed,
    ClientGone,
    Command,
    Ejected,
    Event,
    Fallback,
    FallbackReason,
    Finished,
    KvEvents,
    KvResync,
    Latencies,
    Preempting,
    Probe,
    ProbeAnswered,
    Recall,
    Reject,
    RejectReason,
    Replicas,
    ReplicaSeen,
    RolloutAct,
    RolloutStart,
    RolloutStep,
    Route,
    Scale,
    Scraped,
    ScrapedLoad,
    Standbys,
    Tick,
    UnloadAdapter,
    Weights,
    command_to_json,
    event_from_json,
    event_to_json,
)
from gpufleet.control._fleet import (
    DecisionLog,
    FleetController,
    QueueReport,
    Recorded,
    read_recording,
    replay,
)
from gpufleet.control._pool import ANONYMOUS, PoolController, PoolCounters
from gpufleet.control._residency import ResidencyControl, ResidencyCounters
from gpufleet.control._residency_events import Resident, Sleep, Wake
from gpufleet.control._rollouts import Rollouts
from gpufleet.control._served import ServedModel
from gpufleet.control._settings import PoolSettings
from gpufleet.control._spot import NO_BUY
from gpufleet.control._spot_events import Reclaimed, Replace, SpotMarket

# The controller's vocabulary (see above): policy values the shells pass around.
from gpufleet.policy import (
    BATCH,
    CLASSES,
    AdapterConfig,
    AnalysisConfig,
    EjectionRecord,
    PoolView,
    Redundancy,
    Residency,
    RolloutAction,
    RolloutConfig,
    RolloutDecision,
    RolloutPhase,
    RolloutStrategy,
    RolloutVerdict,
    ScaleDecision,
    ScaleDirection,
    SpareConfig,
    SpareDecision,
    Standby,
    asleep_at,
    decision_record,
    redundancy,
)

__all__ = [
    "ANONYMOUS",
    "BATCH",
    "CLASSES",
    "NO_BUY",
    "Abandon",
    "AdapterAdded",
    "AdapterConfig",
    "AnalysisConfig",
    "Arrived",
    "AttemptFailed",
    "ClientGone",
    "Command",
    "DecisionLog",
    "Ejected",
    "EjectionRecord",
    "Event",
    "Fallback",
    "FallbackReason",
    "Finished",
    "FleetController",
    "KvEvents",
    "KvResync",
    "Latencies",
    "PoolController",
    "PoolCounters",
    "PoolSettings",
    "PoolView",
    "Preempting",
    "Probe",
    "ProbeAnswered",
    "QueueReport",
    "Recall",
    "Reclaimed",
    "Recorded",
    "Redundancy",
    "Reject",
    "RejectReason",
    "Replace",
    "ReplicaSeen",
    "Replicas",
    "Residency",
    "ResidencyControl",
    "ResidencyCounters",
    "Resident",
    "RolloutAct",
    "RolloutAction",
    "RolloutConfig",
    "RolloutDecision",
    "RolloutPhase",
    "RolloutStart",
    "RolloutStep",
    "RolloutStrategy",
    "RolloutVerdict",
    "Rollouts",
    "Route",
    "Scale",
    "ScaleDecision",
    "ScaleDirection",
    "Scraped",
    "ScrapedLoad",
    "ServedModel",
    "Sleep",
    "SpareConfig",
    "SpareDecision",
    "SpotMarket",
    "Standby",
    "Standbys",
    "Tick",
    "UnloadAdapter",
    "Wake",
    "Weights",
    "asleep_at",
    "command_to_json",
    "decision_record",
    "event_from_json",
    "event_to_json",
    "read_recording",
    "redundancy",
    "replay",
]
