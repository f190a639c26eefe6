"""``gpufleet.sim`` exports exactly its ``__all__``, sorted isort-style."""

from __future__ import annotations

import types

import gpufleet.sim


def test_all_matches_public_names() -> None:
    public = {
        attr
        for attr, value in vars(gpufleet.sim).items()
        if not attr.startswith("_")
        and not isinstance(value, types.ModuleType)
        and attr != "annotations"
    }
    assert set(gpufleet.sim.__all__) == public
    names = list(gpufleet.sim.__all__)
    assert names == sorted(names, key=lambda n: (not n.isupper(), n))
