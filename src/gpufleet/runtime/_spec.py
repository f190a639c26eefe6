"""What the runtime should run: engine specs, pools and their deterministically named replicas.

A pool is a template and a count; replica ``i`` of pool ``p`` is named ``f"{p}-{i}"``::

    pool = PoolSpec("llama-3.1-8b", EngineSpec(model="llama-3.1-8b"), replicas=2)
    [spec.name for spec in desired_replicas([pool], {"llama-3.1-8b": 2})]
    # ['llama-3.1-8b-0', 'llama-3.1-8b-1']

A new pool serves ``0 .. n-1``. The runtime's ``scale`` may retire any named replica (the
autoscaler picks the least loaded); a new one takes the lowest index no live replica has, so a
replica's name never depends on timing or a counter that a restart would move.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Final

from gpufleet.fleet import ReplicaId, ReplicaProfile

_POOL_NAME = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?")
"""Lower-case letters, digits, ``.`` and ``-``: safe in a replica name, a file name and a URL."""


class EngineKind(StrEnum):
    """How a replica is run."""

    SIM = "sim"
    """``gpufleet engine sim`` as a child process: a modelled vLLM replica."""
    VLLM = "vllm"
    """vLLM's OpenAI server as a child process (a GPU, or vLLM's CPU build: docs/engines.md)."""
    EXTERNAL = "external"
    """An endpoint someone else runs: nothing is started, its URL is probed and routed to."""


SPAWNED: Final = frozenset({EngineKind.SIM, EngineKind.VLLM})
"""Kinds for which the runtime owns a child process."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine replica's recipe: what it serves, on what, with which engine flags and env.

    ``profile`` holds the engine flags (``ReplicaProfile.to_argv``, last on the command line
    the runtime builds, its pass-through flags last of all, e.g. ``("--time-scale", "50")``
    for a sim engine); ``env`` is added to the parent's environment. ``endpoints`` is for
    ``EXTERNAL`` only: replica ``i`` is ``endpoints[i]``; ``ca_file`` verifies the
    ``https://`` ones (default: the system's trust store).
    """

    model: str = "llama-3.1-8b"
    """Catalog model name (sim) or Hugging Face model id / path (vLLM)."""
    kind: EngineKind = EngineKind.SIM
    gpu: str = "h100-sxm"
    served_model_name: str | None = None
    """The name clients send as ``model`` (default: ``model``)."""
    profile: ReplicaProfile = field(default_factory=ReplicaProfile)
    """The engine flags: tensor parallelism, limits, prefix caching, seed, pass-through."""
    ready_timeout_s: float | None = None
    """The startup budget: seconds from launch to a 200 from ``/health`` before the start is
    killed and counted a crash (``None``: ``RuntimeSettings.ready_timeout_s``)."""
    env: Mapping[str, str] = field(default_factory=dict)
    endpoints: tuple[str, ...] = ()
    ca_file: str | None = None
    """PEM CA bundle of the ``https://`` endpoints (``EXTERNAL`` only)."""
    kv_events: bool = False
    """Publish KV-cache events (a sim engine: ``--kv-events-config`` on free ports, which it
    prints; the runtime reports them as ``ReplicaStatus.kv_events``; docs/kv-events.md)."""
    traces: str | None = None
    """An OTLP/HTTP traces URL a sim engine sends its requests' spans to
    (``--otlp-traces-endpoint``; ``gpufleet up`` passes ``gateway.tracing.endpoint``)."""

    def __post_init__(self) -> None:
        # A read-only copy: a frozen spec must not change under the reconciler's feet.
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        object.__setattr__(self, "endpoints", tuple(e.rstrip("/") for e in self.endpoints))
        budget = self.ready_timeout_s
        if budget is not None and not (math.isfinite(budget) and budget > 0):
            raise ValueError(f"ready_timeout_s must be finite and > 0, got {budget}")
        if self.kind is EngineKind.EXTERNAL:
            if not self.endpoints:
                raise ValueError("an external engine needs at least one endpoint URL")
            for url in self.endpoints:
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"endpoint must be an http(s) URL, got {url!r}")
        elif self.endpoints:
            raise ValueError(f"endpoints are for external engines, not {self.kind.value!r}")
        if self.ca_file is not None and self.kind is not EngineKind.EXTERNAL:
            raise ValueError(f"ca_file is for external engines, not {self.kind.value!r}")

    @property
    def served_name(self) -> str:
        """The model name clients use."""
        return self.served_model_name or self.model


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One desired replica: pool, index and recipe. Two specs are equal iff nothing differs.

    ``start_delay_s`` emulates provisioning (a cloud VM or a node joining): a new replica
    waits that long before its process starts. A restart after a crash does not wait for it.
    """

    pool: str
    index: int
    engine: EngineSpec
    start_delay_s: float = 0.0

    def __post_init__(self) -> None:
        _check_pool_name(self.pool)
        if self.index < 0:
            raise ValueError(f"index must be >= 0, got {self.index}")
        _check_delay(self.start_delay_s)
        if self.engine.kind is EngineKind.EXTERNAL and self.index >= len(self.engine.endpoints):
            raise ValueError(
                f"pool {self.pool!r} has {len(self.engine.endpoints)} external endpoint(s), "
                f"no replica {self.index}"
            )

    @property
    def name(self) -> ReplicaId:
        """``<pool>-<index>``: deterministic, unique in the fleet."""
        return ReplicaId(f"{self.pool}-{self.index}")

    @property
    def endpoint(self) -> str | None:
        """The given base URL of an external replica; ``None`` for spawned ones."""
        if self.engine.kind is EngineKind.EXTERNAL:
            return self.engine.endpoints[self.index]
        return None


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """A pool: a name, a recipe, an initial replica count and a provisioning delay.

    ``standby`` prewarmed replicas run beside the serving ones (started, ready, not routed);
    a promoted standby is shown ``STARTING`` for ``promote_delay_s`` (a real standby's
    attach-and-warm time) before it is ``READY``.
    """

    name: str
    engine: EngineSpec
    replicas: int = 1
    start_delay_s: float = 0.0
    standby: int = 0
    promote_delay_s: float = 0.0

    def __post_init__(self) -> None:
        _check_pool_name(self.name)
        _check_delay(self.start_delay_s)
        _check_delay(self.promote_delay_s, "promote_delay_s")
        check_count(self, self.replicas)
        if self.standby < 0:
            raise ValueError(f"pool {self.name!r}: standby must be >= 0, got {self.standby}")

    def replica(self, index: int) -> ReplicaSpec:
        """The spec of replica ``index`` (whatever the current count)."""
        return ReplicaSpec(self.name, index, self.engine, self.start_delay_s)


def check_count(pool: PoolSpec, count: int) -> None:
    """Raise ``ValueError`` unless ``pool`` can have ``count`` replicas."""
    if count < 0:
        raise ValueError(f"pool {pool.name!r}: replica count must be >= 0, got {count}")
    if pool.engine.kind is EngineKind.EXTERNAL and count > len(pool.engine.endpoints):
        raise ValueError(
            f"pool {pool.name!r}: {count} replicas wanted, "
            f"{len(pool.engine.endpoints)} external endpoint(s) given"
        )


def desired_replicas(pools: Sequence[PoolSpec], counts: Mapping[str, int]) -> list[ReplicaSpec]:
    """Replicas ``0 .. counts[pool]-1`` of every pool, in pool then index order."""
    return [pool.replica(i) for pool in pools for i in range(counts.get(pool.name, 0))]


def _check_pool_name(name: str) -> None:
    if not _POOL_NAME.fullmatch(name):
        raise ValueError(
            f"pool name {name!r}: use lower-case letters, digits, '.' and '-' "
            "(it names replicas and their log files)"
        )


def _check_delay(seconds: float, name: str = "start_delay_s") -> None:
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {seconds}")
