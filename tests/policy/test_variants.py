"""Choosing a served model's variant: weighted, sticky per key, deterministic."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.policy import choose_variant, variant_point

KEYS = [f"user-{i}" for i in range(20_000)]


def shares(variants: list[tuple[str, float]], keys: list[str] = KEYS) -> dict[str, float]:
    counts: dict[str, int] = {}
    for key in keys:
        chosen = choose_variant(key, variants)
        assert chosen is not None
        counts[chosen] = counts.get(chosen, 0) + 1
    return {name: n / len(keys) for name, n in counts.items()}


@pytest.mark.parametrize(
    "weights",
    [
        {"old": 80.0, "new": 20.0},
        {"old": 95.0, "new": 5.0},
        {"a": 1.0, "b": 1.0, "c": 2.0},
        {"a": 0.5, "b": 0.25, "c": 0.125, "d": 0.125},
    ],
)
def test_weights_are_honoured_over_many_keys(weights: dict[str, float]) -> None:
    got = shares(list(weights.items()))
    total = sum(weights.values())
    for name, weight in weights.items():
        # 20,000 keys: the binomial's standard deviation is ≤ 0.0036; 0.015 is > 4 σ
        assert got.get(name, 0.0) == pytest.approx(weight / total, abs=0.015), got


def test_a_key_always_gets_the_same_variant() -> None:
    variants = [("v1", 80.0), ("v2", 20.0)]
    first = [choose_variant(key, variants) for key in KEYS[:500]]
    again = [choose_variant(key, list(reversed(variants))) for key in KEYS[:500]]
    assert first == again  # the order variants are listed in does not matter either


def test_the_choice_is_the_same_in_another_process() -> None:
    """No salted ``hash()``: the gateway, its replay and the simulator agree."""
    code = (
        "from gpufleet.policy import choose_variant as c;"
        "print(','.join(c(f'k{i}', [('a', 3.0), ('b', 1.0), ('c', 1.0)]) for i in range(50)))"
    )
    here = ",".join(
        str(choose_variant(f"k{i}", [("a", 3.0), ("b", 1.0), ("c", 1.0)])) for i in range(50)
    )
    there = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", **_env()},
    ).stdout.strip()
    assert there == here


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}


def test_raising_a_weight_moves_keys_only_to_that_variant() -> None:
    """A rollout's steps (5 → 20 → 50 → 100 %): each key moves at most once, old → new."""
    keys = KEYS[:5000]
    steps = [5.0, 20.0, 50.0, 100.0]
    history = {
        key: [choose_variant(key, [("old", 100.0 - s), ("new", s)]) for s in steps] for key in keys
    }
    for path in history.values():
        moved = path.index("new") if "new" in path else len(path)
        assert path[:moved] == ["old"] * moved
        assert path[moved:] == ["new"] * (len(path) - moved)
    on_new = sum(1 for path in history.values() if path[1] == "new") / len(keys)
    assert on_new == pytest.approx(0.20, abs=0.02)


def test_keys_move_only_from_a_lowered_weight_or_to_a_raised_one() -> None:
    before = {k: choose_variant(k, [("a", 60.0), ("b", 20.0), ("c", 20.0)]) for k in KEYS[:3000]}
    after = {k: choose_variant(k, [("a", 30.0), ("b", 50.0), ("c", 20.0)]) for k in KEYS[:3000]}
    moved = [(was, after[k]) for k, was in before.items() if after[k] != was]
    assert moved
    assert all(was == "a" or now == "b" for was, now in moved), moved


def test_zero_weights_are_never_chosen() -> None:
    assert shares([("a", 0.0), ("b", 1.0)], KEYS[:1000]) == {"b": 1.0}
    assert choose_variant("k", [("a", 0.0)]) is None
    assert choose_variant("k", []) is None
    assert choose_variant("k", [("a", 2.0)]) == "a"


@given(st.text(max_size=40), st.text(min_size=1, max_size=20))
def test_points_are_inside_the_unit_interval(key: str, variant: str) -> None:
    point = variant_point(key, variant)
    assert 0.0 < point < 1.0
