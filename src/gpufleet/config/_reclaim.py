"""The fleet file's ``runtime.reclaim``: which Kubernetes nodes count as being taken back.

Operator mode watches the cluster's nodes; a replica pod on a node that carries one of these
taints (or is cordoned, with ``cordon``) gets a preemption notice, as an operator's
``POST /admin/replicas/{name}/preempt`` gives one (docs/spot.md, docs/kubernetes.md).
"""

from __future__ import annotations

import re
from typing import Final

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_NOTICE_S: Final = 3600.0
"""The longest notice a rule may give (the admin route's bound too)."""
DEFAULT_NOTICE_S: Final = 30.0
"""The shortest notice a large cloud gives (a spot VM's 30 s; others give two minutes)."""

_NAME: Final = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX: Final = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"
_KEY: Final = re.compile(rf"({_PREFIX}/)?{_NAME}")
"""A taint key is a label key: an optional DNS-subdomain prefix and ``/``, then a name."""
_KEY_MAX: Final = 253 + 1 + 63
_VALUE: Final = re.compile(rf"({_NAME})?")


def node_label(text: str) -> tuple[str, str]:
    """``key=value``, a node label (``ValueError`` unless the key is a label key and the
    value a label value)."""
    key, eq, value = text.partition("=")
    if not eq or not _KEY.fullmatch(key) or len(key) > _KEY_MAX or not _VALUE.fullmatch(value):
        raise ValueError(f"{text!r} is not a node label (key=value, as Kubernetes labels are)")
    return key, value


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ReclaimTaintConfig(_Strict):
    """A node taint that says the node is being taken back."""

    key: str
    value: str | None = None
    """Only a taint with this value counts (default: any value)."""
    notice_s: float | None = Field(None, ge=0.0, le=MAX_NOTICE_S, allow_inf_nan=False)
    """Seconds from the taint (its ``timeAdded``, else when the gateway sees it) to the
    node's end; default: ``reclaim.notice_s``."""

    @field_validator("key")
    @classmethod
    def _key(cls, key: str) -> str:
        if not _KEY.fullmatch(key) or len(key) > _KEY_MAX:
            raise ValueError(f"{key!r} is not a taint key (a label key: [prefix/]name)")
        return key

    @field_validator("value")
    @classmethod
    def _value(cls, value: str | None) -> str | None:
        if value is not None and not _VALUE.fullmatch(value):
            raise ValueError(f"{value!r} is not a taint value (a label value)")
        return value


DEFAULT_RECLAIM_TAINTS: Final = (
    # GKE: a Spot or preemptible VM about to be preempted, a GPU VM about to go for host
    # maintenance
    ReclaimTaintConfig(key="cloud.google.com/impending-node-termination"),
    # AWS Node Termination Handler (with its node tainting on): a spot interruption notice
    ReclaimTaintConfig(key="aws-node-termination-handler/spot-itn"),
    # Karpenter v1, and before it (v0.32-v0.37): a node chosen for disruption (consolidation,
    # drift, expiry, a spot interruption), drained and deleted once its replacement is up
    ReclaimTaintConfig(key="karpenter.sh/disrupted"),
    ReclaimTaintConfig(key="karpenter.sh/disruption", value="disrupting"),
    # an operator marked the node out of service: it is down already, nothing on it answers
    ReclaimTaintConfig(key="node.kubernetes.io/out-of-service", notice_s=0.0),
)
"""The taints watched by default (docs/kubernetes.md says why each)."""


class ReclaimConfig(_Strict):
    """Which nodes count as being taken back, and the notice each gives (kubernetes)."""

    enabled: bool = True
    """Watch the cluster's nodes (a ClusterRole: ``gpufleet deploy k8s`` renders it)."""
    taints: tuple[ReclaimTaintConfig, ...] = DEFAULT_RECLAIM_TAINTS
    """The taints that count; a list given here replaces the defaults."""
    cordon: bool = False
    """A cordoned node (``spec.unschedulable``: ``kubectl cordon``, ``kubectl drain``)
    counts too. Off by default: the termination handlers taint as well, and an
    operator's cordon alone (for maintenance, then an uncordon) would take the pods out
    of routing until they are replaced (a notice is not taken back)."""
    notice_s: float = Field(DEFAULT_NOTICE_S, ge=0.0, le=MAX_NOTICE_S, allow_inf_nan=False)
    """Seconds of notice of a cordon and of a taint that names none."""

    @model_validator(mode="after")
    def _distinct(self) -> ReclaimConfig:
        seen: set[tuple[str, str | None]] = set()
        for taint in self.taints:
            if (taint.key, taint.value) in seen:
                shown = taint.key if taint.value is None else f"{taint.key}={taint.value}"
                raise ValueError(f"taint {shown} is listed twice")
            seen.add((taint.key, taint.value))
        return self
