"""The pure part of the node watch: which nodes are being taken back, and when.

No API server here: Node objects are plain dicts, shaped as the API serves them.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.cli._up_cmd import reclaim_rules
from gpufleet.config import DEFAULT_RECLAIM_TAINTS, ReclaimConfig
from gpufleet.runtime.kubernetes import (
    CORDON,
    Reclaim,
    ReclaimRules,
    ReclaimTaint,
    keep_first,
    node_reclaims,
    trim_node,
)

NOW = 1_750_000_000.0
"""The wall clock, in Unix seconds."""
DEFAULTS = reclaim_rules(ReclaimConfig())
assert DEFAULTS is not None
CORDONS = ReclaimRules(DEFAULTS.taints, cordon=True, notice_s=30.0)
"""The defaults, with cordons counted (``cordon: true``)."""


def node(name: str = "n1", *taints: dict[str, Any], unschedulable: bool | None = None) -> Any:
    spec: dict[str, Any] = {"providerID": f"fake://{name}"}
    if taints:
        spec["taints"] = list(taints)
    if unschedulable is not None:
        spec["unschedulable"] = unschedulable
    return {"metadata": {"name": name, "resourceVersion": "7"}, "spec": spec, "status": {}}


def taint(key: str, value: str | None = None, added: float | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {"key": key, "effect": "NoSchedule"}
    if value is not None:
        found["value"] = value
    if added is not None:
        found["timeAdded"] = rfc3339(added)
    return found


def rfc3339(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize("rule", DEFAULT_RECLAIM_TAINTS, ids=lambda t: t.key)
def test_every_default_taint_is_a_reclaim_with_its_notice(rule: Any) -> None:
    found = node_reclaims([node("n1", taint(rule.key, rule.value))], DEFAULTS, NOW)
    notice = 30.0 if rule.notice_s is None else rule.notice_s
    reason = rule.key if rule.value is None else f"{rule.key}={rule.value}"
    assert found == {"n1": Reclaim(NOW + notice, reason)}


def test_out_of_service_is_due_now_and_the_others_in_30_s() -> None:
    found = node_reclaims(
        [
            node("gke", taint("cloud.google.com/impending-node-termination")),
            node("aws", taint("aws-node-termination-handler/spot-itn", "abc123")),
            node("down", taint("node.kubernetes.io/out-of-service", "nodeshutdown")),
        ],
        DEFAULTS,
        NOW,
    )
    assert {n: r.at - NOW for n, r in found.items()} == {"gke": 30.0, "aws": 30.0, "down": 0.0}


def test_unrelated_taints_and_values_are_ignored() -> None:
    nodes = [
        node("gpu", taint("nvidia.com/gpu")),  # every GPU node of a cluster has one
        node("advice", taint("aws-node-termination-handler/rebalance-recommendation")),
        node("other-value", taint("karpenter.sh/disruption", "something-else")),
        node("prefix", taint("karpenter.sh/disrupted-not")),
        node("plain"),
        node("uncordoned", unschedulable=False),
    ]
    assert node_reclaims(nodes, DEFAULTS, NOW) == {}


def test_a_cordon_counts_only_when_the_rules_say_so() -> None:
    cordoned = [node("n1", unschedulable=True)]
    assert node_reclaims(cordoned, DEFAULTS, NOW) == {}  # off by default
    assert node_reclaims(cordoned, CORDONS, NOW) == {"n1": Reclaim(NOW + 30.0, CORDON)}


def test_time_added_starts_the_clock_within_zero_and_the_notice() -> None:
    key = "cloud.google.com/impending-node-termination"

    def at(added: float | None) -> float:
        return node_reclaims([node("n1", taint(key, added=added))], DEFAULTS, NOW)["n1"].at

    assert at(NOW - 10) == NOW + 20  # seen 10 s after it was added: 20 s left
    assert at(NOW - 3600) == NOW  # long past: due now, never in the past
    assert at(NOW + 50) == NOW + 30  # ahead of our clock (skew): no more than the notice
    assert at(None) == NOW + 30  # no timeAdded (a NoSchedule taint has none): from now


@pytest.mark.parametrize("added", ["yesterday", "", 17, None, "2025-13-45T99:00:00Z"])
def test_an_unreadable_time_added_counts_from_now(added: object) -> None:
    bad = {"key": "karpenter.sh/disrupted", "effect": "NoSchedule", "timeAdded": added}
    assert node_reclaims([node("n1", bad)], DEFAULTS, NOW)["n1"].at == NOW + 30


def test_an_offset_time_added_is_read_as_the_instant_it_names() -> None:
    added = {"key": "karpenter.sh/disrupted", "timeAdded": "2025-06-15T17:06:30+02:00"}
    utc = dt.datetime(2025, 6, 15, 15, 6, 30, tzinfo=dt.UTC).timestamp()
    assert node_reclaims([node("n1", added)], DEFAULTS, utc + 5)["n1"].at == utc + 30


def test_a_node_that_matches_several_ways_goes_at_the_soonest() -> None:
    rules = ReclaimRules(
        (ReclaimTaint("slow", notice_s=120.0), ReclaimTaint("fast", notice_s=10.0)),
        cordon=True,
        notice_s=30.0,
    )
    found = node_reclaims(
        [node("n1", taint("slow"), taint("fast"), unschedulable=True)], rules, NOW
    )
    assert found == {"n1": Reclaim(NOW + 10.0, "fast")}


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"metadata": None, "spec": {"unschedulable": True}},
        {"metadata": {"name": 5}, "spec": {"unschedulable": True}},
        {"metadata": {"name": "x"}},
        {"metadata": {"name": "x"}, "spec": "tainted"},
        {"metadata": {"name": "x"}, "spec": {"taints": "karpenter.sh/disrupted"}},
        {"metadata": {"name": "x"}, "spec": {"taints": [None, 3, "k", {"value": "v"}]}},
        {"metadata": {"name": "x"}, "spec": {"taints": None, "unschedulable": "yes"}},
        [],
        None,
    ],
)
def test_a_malformed_node_is_skipped_and_does_not_stop_the_others(bad: Any) -> None:
    found = node_reclaims([bad, node("n1", unschedulable=True)], CORDONS, NOW)
    assert found == {"n1": Reclaim(NOW + 30.0, CORDON)}
    assert trim_node(bad if isinstance(bad, dict) else {}) is not None


def test_keep_first_holds_the_first_deadline_until_a_sooner_one_or_the_end() -> None:
    first = node_reclaims([node("n1", unschedulable=True)], CORDONS, NOW)
    later = node_reclaims([node("n1", unschedulable=True)], CORDONS, NOW + 5)
    assert keep_first(first, later) == first  # seen again: the clock did not start over
    sooner = {"n1": Reclaim(NOW + 1, "node.kubernetes.io/out-of-service")}
    assert keep_first(first, sooner) == sooner
    assert keep_first(first, {}) == {}  # the taint was removed: no longer taken back
    assert keep_first({}, later) == later


def test_trim_keeps_what_the_rules_read() -> None:
    big = node("n1", taint("karpenter.sh/disrupted"), unschedulable=True)
    big["metadata"]["labels"] = {"a": "b"}
    big["status"] = {"images": [{"names": ["x"] * 100}]}
    assert trim_node(big) == {
        "metadata": {"name": "n1", "resourceVersion": "7"},
        "spec": {"taints": [taint("karpenter.sh/disrupted")], "unschedulable": True},
    }
    assert node_reclaims([trim_node(big)], DEFAULTS, NOW) == node_reclaims([big], DEFAULTS, NOW)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
_KEYS = st.sampled_from([t.key for t in DEFAULT_RECLAIM_TAINTS] + ["nvidia.com/gpu", "other"])
_TAINT = st.fixed_dictionaries(
    {"key": _KEYS},
    optional={
        "value": st.sampled_from(["disrupting", "x", ""]) | _JSON,
        "timeAdded": st.floats(NOW - 1e6, NOW + 1e6).map(rfc3339) | _JSON,
        "effect": st.sampled_from(["NoSchedule", "NoExecute"]),
    },
)
_NODE = st.fixed_dictionaries(
    {"metadata": st.fixed_dictionaries({"name": st.text(min_size=1, max_size=5)}) | _JSON},
    optional={
        "spec": st.fixed_dictionaries(
            {},
            optional={
                "taints": st.lists(_TAINT | _JSON, max_size=4) | _JSON,
                "unschedulable": st.booleans() | _JSON,
            },
        )
        | _JSON
    },
)


@settings(max_examples=300, deadline=None)
@given(nodes=st.lists(_NODE, max_size=5), cordon=st.booleans(), notice=st.floats(0, 3600))
def test_any_node_list_gives_deadlines_between_now_and_the_longest_notice(
    nodes: list[Any], cordon: bool, notice: float
) -> None:
    rules = ReclaimRules(DEFAULTS.taints, cordon=cordon, notice_s=notice)
    found = node_reclaims(nodes, rules, NOW)
    names = {n["metadata"].get("name") for n in nodes if isinstance(n.get("metadata"), dict)}
    assert set(found) <= names
    for reclaim in found.values():
        assert NOW <= reclaim.at <= NOW + notice
    # seen again later, a notice never moves later; trimmed nodes read the same
    again = keep_first(found, node_reclaims(nodes, rules, NOW + 7))
    assert all(again[n].at <= found[n].at for n in found)
    assert node_reclaims([trim_node(n) for n in nodes], rules, NOW) == found
