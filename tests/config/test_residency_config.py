"""The fleet file's ``residency``: its defaults, the shorthand, what it adds to the engines'
command line and environment, and which pools may share GPU slots."""

from __future__ import annotations

from typing import Any

import pytest

from gpufleet.config import FleetFileError, parse_fleet
from gpufleet.policy import ResidencyMode


def _model(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "model": "llama-3.1-8b", "replicas": 1, **extra}


def test_the_default_is_always_resident_and_changes_no_engine_flag() -> None:
    model = parse_fleet({"models": [_model("a")]}).models[0]
    assert model.residency.mode is ResidencyMode.ALWAYS
    assert "--enable-sleep-mode" not in model.profile().to_argv()
    assert "VLLM_SERVER_DEV_MODE" not in model.engine_env


def test_on_demand_starts_engines_with_sleep_mode_and_dev_mode() -> None:
    model = parse_fleet({"models": [_model("a", residency="on_demand", env={"X": "1"})]}).models[0]
    assert model.residency.on_demand
    assert model.residency.idle == 300.0
    assert model.residency.level == 1
    assert model.profile().to_argv()[-1] == "--enable-sleep-mode"
    assert model.engine_env == {"VLLM_SERVER_DEV_MODE": "1", "X": "1"}


def test_memory_is_the_engines_gpu_memory_utilization() -> None:
    models = parse_fleet({"models": [_model("a"), _model("b", gpu_memory_utilization=0.45)]}).models
    assert [m.memory for m in models] == [0.9, 0.45]


@pytest.mark.parametrize(
    ("models", "message"),
    [
        (
            [
                _model("a", residency={"slots": "g"}),
                _model("b", replicas=2, residency={"slots": "g"}),
            ],
            "differ in replicas",
        ),
        (
            [_model("a", residency={"slots": "g"}), _model("b", tp=2, residency={"slots": "g"})],
            "differ in tp",
        ),
        (
            [
                _model(
                    "a",
                    replicas=None,
                    autoscale={"min_replicas": 2, "max_replicas": 3},
                    residency={"mode": "on_demand", "slots": "g"},
                )
            ],
            "no autoscale",
        ),
        ([_model("a", residency={"mode": "on_demand", "level": 3})], "level"),
        ([_model("a", residency={"mode": "sometimes"})], "mode"),
    ],
)
def test_bad_residency_is_the_files_error(models: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(FleetFileError, match=message):
        parse_fleet({"models": models})


def test_an_external_model_cannot_be_on_demand() -> None:
    external = {
        "name": "x",
        "engine": "external",
        "endpoints": ["http://127.0.0.1:9"],
        "residency": "on_demand",
    }
    with pytest.raises(FleetFileError, match="external"):
        parse_fleet({"models": [external]})
