"""``gpufleet.fleet`` exports exactly its ``__all__``, sorted as the other packages are."""

from __future__ import annotations

import types

import gpufleet.fleet as package


def test_all_matches_public_names() -> None:
    public = {
        attr
        for attr, value in vars(package).items()
        if not attr.startswith("_")
        and not isinstance(value, types.ModuleType)
        and attr != "annotations"
    }
    assert set(package.__all__) == public
    assert list(package.__all__) == sorted(package.__all__, key=lambda n: (not n.isupper(), n))
