"""``gpufleet.engine`` and ``gpufleet.engine.server`` export exactly their ``__all__``."""

from __future__ import annotations

import importlib
import types

import pytest


@pytest.mark.parametrize("name", ["gpufleet.engine", "gpufleet.engine.server"])
def test_all_matches_public_names(name: str) -> None:
    package = importlib.import_module(name)
    public = {
        attr
        for attr, value in vars(package).items()
        if not attr.startswith("_")
        and not isinstance(value, types.ModuleType)
        and attr != "annotations"
    }
    assert set(package.__all__) == public
    assert list(package.__all__) == sorted(package.__all__, key=lambda n: (not n.isupper(), n))
