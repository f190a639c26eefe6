"""Capacity planning: GPUs per replica, parallelism, KV capacity, replicas, cost and power."""

from gpufleet.planner._inputs import SLO, BatchWorkload, FleetPolicy, PlanRequest, Workload
from gpufleet.planner._plan import PlanError, plan, plan_gpu
from gpufleet.planner._report import (
    SCHEMA_VERSION,
    BatchReport,
    CandidateReport,
    CostReport,
    GPUPlan,
    KVReport,
    LatencyReport,
    MemoryReport,
    PlanReport,
    PowerReport,
    ReplicaCount,
    ThroughputReport,
)

__all__ = [
    "SCHEMA_VERSION",
    "SLO",
    "BatchReport",
    "BatchWorkload",
    "CandidateReport",
    "CostReport",
    "FleetPolicy",
    "GPUPlan",
    "KVReport",
    "LatencyReport",
    "MemoryReport",
    "PlanError",
    "PlanReport",
    "PlanRequest",
    "PowerReport",
    "ReplicaCount",
    "ThroughputReport",
    "Workload",
    "plan",
    "plan_gpu",
]
