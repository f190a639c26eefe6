"""Each package's ``__all__`` lists exactly the public names it exports (after httpx's test)."""

from __future__ import annotations

import importlib
import types

import pytest

PACKAGES = [
    "gpufleet.catalog",
    "gpufleet.perf",
    "gpufleet.planner",
    "gpufleet.control",
    "gpufleet.cli",
    "gpufleet.store",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_matches_public_names(name: str) -> None:
    package = importlib.import_module(name)
    public = {
        attr
        for attr, value in vars(package).items()
        if not attr.startswith("_")
        and not isinstance(value, types.ModuleType)
        and attr != "annotations"
    }
    # a name the package makes on first use (a module ``__getattr__``: the CLI's ``app``)
    lazy = {n for n in package.__all__ if n not in vars(package) and hasattr(package, n)}
    assert set(package.__all__) == public | lazy
    assert list(package.__all__) == sorted(package.__all__, key=lambda n: (not n.isupper(), n))
