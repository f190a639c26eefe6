"""Which nodes are being taken back, and when: a pure function of the Node objects.

Before a node goes (a spot VM's preemption, a node autoscaler's consolidation, a shutdown),
whoever takes it back says so on the Node object, in one of two ways::

    spec.taints[]       {key, value, effect, timeAdded}   a termination handler's taint
    spec.unschedulable  true                              a cordon: a drain comes next

``node_reclaims(nodes, rules, now)`` reads them: ``{node: Reclaim(at, reason)}`` for every
node carrying a taint of ``rules.taints`` (or cordoned, with ``rules.cordon``), where ``at``
is when the node goes, on the wall clock (Unix seconds: a taint's ``timeAdded`` is one)::

    start = the taint's timeAdded, or now (none, or unreadable: a cordon has none)
    at    = start + the taint's notice (rules.notice_s unless the taint names its own),
            kept within [now, now + notice]: a notice already past is due now, and a
            timeAdded ahead of our clock (skew) promises no more than the notice itself

A node that matches several ways goes at the soonest. ``keep_first`` keeps the deadline of a
node seen before (a notice without ``timeAdded`` would otherwise move on every sighting).
What the deadline does to the node's replicas is the pool controller's rule (``Preempting``,
docs/spot.md); nothing here knows about replicas.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

CORDON: Final = "spec.unschedulable"
"""The ``reason`` of a cordoned node."""


@dataclass(frozen=True, slots=True)
class ReclaimTaint:
    """A taint that says a node is being taken back."""

    key: str
    value: str | None = None
    """Only this value (``None``: any)."""
    notice_s: float | None = None
    """Seconds from the taint to the node's end (``None``: the rules' ``notice_s``)."""


@dataclass(frozen=True, slots=True)
class ReclaimRules:
    """What counts as a reclaim, and the notice each one gives (the fleet file's
    ``runtime.reclaim``, where the defaults are)."""

    taints: tuple[ReclaimTaint, ...]
    cordon: bool
    """Whether a cordoned node (``spec.unschedulable``) counts."""
    notice_s: float
    """Seconds of notice of a cordon, and of a taint that names none."""


@dataclass(frozen=True, slots=True)
class Reclaim:
    """A node being taken back: when it goes (wall clock, Unix seconds) and why."""

    at: float
    reason: str
    """The taint's key (``key=value`` when the rule names a value), or ``CORDON``."""


def node_reclaims(
    nodes: Iterable[Mapping[str, Any]], rules: ReclaimRules, now: float
) -> dict[str, Reclaim]:
    """The nodes being taken back, by name (see the module docstring). A malformed node or
    taint is skipped, never an error: the API server is not ours to trust blindly."""
    found: dict[str, Reclaim] = {}
    for node in nodes:
        name = _get(node, "metadata", "name")
        spec = _get(node, "spec")
        if not isinstance(name, str) or not isinstance(spec, Mapping):
            continue
        soonest: Reclaim | None = None
        for reclaim in _reclaims(spec, rules, now):
            if soonest is None or reclaim.at < soonest.at:
                soonest = reclaim
        if soonest is not None:
            found[name] = soonest
    return found


def keep_first(old: Mapping[str, Reclaim], new: Mapping[str, Reclaim]) -> dict[str, Reclaim]:
    """The nodes of ``new``; one that was in ``old`` keeps its deadline unless the new one
    is sooner. A node that is no longer taken back (its taint removed) is dropped."""
    return {
        name: old[name] if name in old and old[name].at <= reclaim.at else reclaim
        for name, reclaim in new.items()
    }


def trim_node(node: Mapping[str, Any]) -> Mapping[str, Any]:
    """What ``node_reclaims`` reads of a Node (its status, images and all, is kilobytes)."""
    meta = node.get("metadata")
    spec = node.get("spec")
    meta = meta if isinstance(meta, Mapping) else {}
    spec = spec if isinstance(spec, Mapping) else {}
    return {
        "metadata": {k: meta[k] for k in ("name", "resourceVersion") if k in meta},
        "spec": {k: spec[k] for k in ("taints", "unschedulable") if k in spec},
    }


def _reclaims(spec: Mapping[str, Any], rules: ReclaimRules, now: float) -> Iterable[Reclaim]:
    if rules.cordon and spec.get("unschedulable") is True:
        yield Reclaim(now + rules.notice_s, CORDON)
    taints = spec.get("taints")
    if not isinstance(taints, list):
        return
    for taint in taints:
        if not isinstance(taint, Mapping):
            continue
        for rule in rules.taints:
            if taint.get("key") != rule.key:
                continue
            if rule.value is not None and taint.get("value") != rule.value:
                continue
            notice = rules.notice_s if rule.notice_s is None else rule.notice_s
            start = _time(taint.get("timeAdded"))
            at = now + notice if start is None else min(now + notice, max(now, start + notice))
            reason = rule.key if rule.value is None else f"{rule.key}={rule.value}"
            yield Reclaim(at, reason)


def _time(value: object) -> float | None:
    """An RFC 3339 time (``2025-01-02T03:04:05Z``) as Unix seconds; ``None`` if unreadable."""
    if not isinstance(value, str):
        return None
    try:
        moment = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)  # the API server writes UTC
    return moment.timestamp()


def _get(obj: object, *keys: str) -> object:
    for key in keys:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj
