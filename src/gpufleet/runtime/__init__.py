"""Where replicas run: local child processes (default), or pods in Kubernetes (`kubernetes`).

``LocalRuntime`` starts each replica of each pool as a child process on a loopback port,
publishes which are ready (``snapshot``, ``subscribe``, ``watch``), restarts crashed ones with
capped exponential backoff, scales pools (``scale``: to a count, retiring the replicas the
caller names; ``set_standby`` / ``promote``: prewarmed standbys), and drains then stops
everything on the way out. Its decisions come from ``reconcile``, a pure function of
``now``, the desired replicas and the observed processes. See docs/design/local-runtime.md.
"""

from gpufleet.runtime._drain import in_flight
from gpufleet.runtime._launch import LaunchPlan, launch_plan
from gpufleet.runtime._local import LocalRuntime
from gpufleet.runtime._members import PoolMembers
from gpufleet.runtime._metrics import RuntimeMetrics
from gpufleet.runtime._reconcile import (
    LIVE,
    Abort,
    Action,
    Create,
    Drain,
    Forget,
    Kill,
    Launch,
    Phase,
    Plan,
    ProcessState,
    ResetBackoff,
    RuntimeSettings,
    Terminate,
    backoff_delay,
    reconcile,
)
from gpufleet.runtime._snapshot import ReplicaStatus, RuntimeSnapshot
from gpufleet.runtime._spec import (
    SPAWNED,
    EngineKind,
    EngineSpec,
    PoolSpec,
    ReplicaSpec,
    desired_replicas,
)

__all__ = [
    "LIVE",
    "SPAWNED",
    "Abort",
    "Action",
    "Create",
    "Drain",
    "EngineKind",
    "EngineSpec",
    "Forget",
    "Kill",
    "Launch",
    "LaunchPlan",
    "LocalRuntime",
    "Phase",
    "Plan",
    "PoolMembers",
    "PoolSpec",
    "ProcessState",
    "ReplicaSpec",
    "ReplicaStatus",
    "ResetBackoff",
    "RuntimeMetrics",
    "RuntimeSettings",
    "RuntimeSnapshot",
    "Terminate",
    "backoff_delay",
    "desired_replicas",
    "in_flight",
    "launch_plan",
    "reconcile",
]
