"""``runtime.reclaim``: which Kubernetes nodes count as being taken back (docs/kubernetes.md)."""

from __future__ import annotations

import pytest

from gpufleet.config import (
    DEFAULT_RECLAIM_TAINTS,
    FleetFileError,
    ReclaimConfig,
    ReclaimTaintConfig,
    parse_fleet,
)

MODELS = [{"name": "llama-3.1-8b"}]


def reclaim(**settings: object) -> ReclaimConfig:
    fleet = parse_fleet({"models": MODELS, "runtime": {"kind": "kubernetes", "reclaim": settings}})
    return fleet.runtime.reclaim


def test_the_defaults_watch_the_well_known_taints_not_cordons_with_30_s_of_notice() -> None:
    default = parse_fleet({"models": MODELS}).runtime.reclaim
    assert default == reclaim() == ReclaimConfig()
    assert (default.enabled, default.cordon, default.notice_s) == (True, False, 30.0)
    assert default.taints == DEFAULT_RECLAIM_TAINTS
    assert {(t.key, t.value, t.notice_s) for t in default.taints} == {
        ("cloud.google.com/impending-node-termination", None, None),
        ("aws-node-termination-handler/spot-itn", None, None),
        ("karpenter.sh/disrupted", None, None),
        ("karpenter.sh/disruption", "disrupting", None),
        ("node.kubernetes.io/out-of-service", None, 0.0),  # down already
    }
    # a rebalance recommendation is advice, not a reclaim
    assert all("rebalance" not in t.key for t in default.taints)


def test_a_list_of_taints_replaces_the_defaults() -> None:
    settings = reclaim(
        taints=[{"key": "example.com/going", "value": "now", "notice_s": 110}],
        cordon=False,
        notice_s=0,
    )
    assert settings.taints == (
        ReclaimTaintConfig(key="example.com/going", value="now", notice_s=110),
    )
    assert (settings.cordon, settings.notice_s) == (False, 0.0)
    assert reclaim(taints=[]).taints == ()  # cordons only
    assert reclaim(enabled=False).enabled is False


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"notice_s": -1}, "runtime.reclaim.notice_s: "),
        ({"notice_s": 3601}, "runtime.reclaim.notice_s: "),
        ({"notice_s": "inf"}, "runtime.reclaim.notice_s: "),
        ({"taints": [{"key": "a b"}]}, "runtime.reclaim.taints[0].key: 'a b' is not a taint key"),
        ({"taints": [{"key": "/x"}]}, "is not a taint key"),
        ({"taints": [{"key": "x" * 64}]}, "is not a taint key"),
        ({"taints": [{"key": "k", "value": "-v"}]}, "taints[0].value: '-v' is not a taint value"),
        ({"taints": [{"key": "k", "notice_s": -5}]}, "runtime.reclaim.taints[0].notice_s: "),
        ({"taints": [{"key": "k"}, {"key": "k"}]}, "taint k is listed twice"),
        ({"taints": [{"key": "k", "effect": "NoSchedule"}]}, "taints[0].effect: "),  # unknown
        ({"cordon_s": 5}, "runtime.reclaim.cordon_s: "),
    ],
)
def test_errors_name_the_field(settings: dict[str, object], message: str) -> None:
    with pytest.raises(FleetFileError) as caught:
        reclaim(**settings)
    assert message in str(caught.value)


def test_the_same_key_with_two_values_is_two_rules() -> None:
    settings = reclaim(
        taints=[{"key": "k", "value": "a"}, {"key": "k", "value": "b"}, {"key": "k"}]
    )
    assert len(settings.taints) == 3
