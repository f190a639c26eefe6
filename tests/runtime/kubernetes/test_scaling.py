"""The pure parts of operator mode: slices → pods, and the drain → mark → scale plan."""

from __future__ import annotations

from typing import Any

import pytest

from gpufleet.runtime.kubernetes import (
    Desired,
    Drain,
    Mark,
    Observed,
    PatchScale,
    PodEndpoint,
    PodState,
    plan_pool,
    pod_endpoints,
)

P = "pool"
READY, STARTING, TERMINATING = PodState.READY, PodState.STARTING, PodState.TERMINATING


def pods(**states: PodState) -> tuple[PodEndpoint, ...]:
    return tuple(PodEndpoint(P, n, f"http://{n}:8000", s) for n, s in sorted(states.items()))


def _slice(service: str, *endpoints: dict[str, Any], port: int = 8000) -> dict[str, Any]:
    return {
        "metadata": {"name": f"{service}-x", "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": "http", "port": port}],
        "endpoints": list(endpoints),
    }


def _endpoint(
    pod: str, address: str, node: str | None = None, **conditions: bool
) -> dict[str, Any]:
    found = {"addresses": [address], "conditions": conditions, "targetRef": {"name": pod}}
    return found if node is None else {**found, "nodeName": node}


def test_slices_become_pods_by_service_with_their_state() -> None:
    slices = [
        _slice("svc", _endpoint("a", "10.0.0.1", "n1", ready=True), _endpoint("b", "fd00::2")),
        _slice("svc", _endpoint("c", "10.0.0.3", ready=False, terminating=True)),
        _slice("svc", _endpoint("d", "10.0.0.4", ready=False), {"addresses": []}),
        _slice("other", _endpoint("x", "10.0.0.9", ready=True)),
        # a pod the controller is moving between two slices: listed once, ready
        _slice("svc", _endpoint("d", "10.0.0.4", ready=True)),
    ]
    assert pod_endpoints(slices, {"svc": P}) == (
        PodEndpoint(P, "a", "http://10.0.0.1:8000", READY, node="n1"),  # its nodeName
        PodEndpoint(P, "b", "http://[fd00::2]:8000", READY),  # no conditions: ready
        PodEndpoint(P, "c", "http://10.0.0.3:8000", TERMINATING),
        PodEndpoint(P, "d", "http://10.0.0.4:8000", READY),
    )


def test_nothing_is_done_before_the_scale_is_known_or_without_a_wish() -> None:
    assert plan_pool(P, Desired(1), Observed(None, pods(a=READY))).actions == ()
    assert plan_pool(P, None, Observed(2, pods(a=READY, b=READY))).actions == ()
    assert plan_pool(P, Desired(2), Observed(2, pods(a=READY, b=READY))).actions == ()


def test_scale_up_is_one_patch() -> None:
    plan = plan_pool(P, Desired(3), Observed(1, pods(a=READY)))
    assert plan.actions == (PatchScale(P, 3),)
    assert plan.draining == frozenset()


def test_scale_down_drains_then_marks_then_patches_the_chosen_pod() -> None:
    live = pods(a=READY, b=READY, c=READY)
    wish = Desired(2, remove=("b",))
    step1 = plan_pool(P, wish, Observed(3, live))
    assert step1.actions == (Drain(P, "b", "http://b:8000"),)
    assert step1.draining == {"b"}
    step2 = plan_pool(P, wish, Observed(3, live, drained=frozenset({"b"})))
    assert step2.actions == (Mark(P, "b"),)
    step3 = plan_pool(P, wish, Observed(3, live, drained=frozenset({"b"}), marked=frozenset("b")))
    assert step3.actions == (PatchScale(P, 2, ("b",)),)
    # the ReplicaSet has not deleted it yet: still out of routing
    step4 = plan_pool(P, wish, Observed(2, live, retired=frozenset("b")))
    assert (step4.actions, step4.draining) == ((), {"b"})


def test_unready_and_unseen_pods_go_first_and_need_no_drain() -> None:
    # 4 wanted → 2: one pod has no endpoint yet (pending) and one is loading; the ReplicaSet
    # removes those two before any ready one, whatever their deletion cost
    plan = plan_pool(P, Desired(2, remove=("a",)), Observed(4, pods(a=READY, b=READY, c=STARTING)))
    assert plan.actions == (PatchScale(P, 2, ("c",)),)
    # without a choice: the operator picks by name
    plan = plan_pool(P, Desired(1), Observed(2, pods(a=READY, b=READY)))
    assert plan.actions == (Drain(P, "a", "http://a:8000"),)


def test_terminating_pods_do_not_count_and_a_spared_retired_pod_serves_again() -> None:
    live = pods(a=READY, b=READY, old=TERMINATING)
    assert plan_pool(P, Desired(1), Observed(2, live)).actions[0] == Drain(P, "a", "http://a:8000")
    # the ReplicaSet removed another pod than the retired one: it is spared and routable
    spared = plan_pool(P, Desired(2), Observed(2, pods(a=READY, b=READY), retired=frozenset("a")))
    assert spared.draining == frozenset()


def test_the_fleet_file_names_the_runtime_and_a_redis() -> None:
    from gpufleet.config import RuntimeKind, parse_fleet  # noqa: PLC0415

    base = {"models": [{"name": "llama-3.1-8b"}]}
    assert parse_fleet(base).runtime.kind is RuntimeKind.LOCAL
    fleet = parse_fleet({**base, "runtime": "kubernetes", "gateway": {"redis_url": "redis://r"}})
    assert (fleet.runtime.kind, fleet.runtime.namespace) == (RuntimeKind.KUBERNETES, None)
    assert fleet.gateway.redis_url == "redis://r"
    for bad, where in [
        ({"runtime": {"kind": "kubernetes", "namespace": "Bad_NS"}}, "runtime: namespace"),
        ({"runtime": {"kind": "nomad"}}, "runtime.kind"),
        ({"gateway": {"redis_url": "http://r"}}, "gateway: redis_url"),
    ]:
        with pytest.raises(ValueError, match=where):
            parse_fleet({**base, **bad})
