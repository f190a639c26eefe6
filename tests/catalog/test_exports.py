"""The package's public surface is exactly its ``__all__`` (STYLE 15)."""

from __future__ import annotations

from gpufleet import catalog


def test_all_is_sorted_and_names_exactly_the_public_members() -> None:
    public = {
        name
        for name, value in vars(catalog).items()
        if not name.startswith("_")
        and getattr(value, "__module__", "").startswith("gpufleet.catalog")
    }
    assert catalog.__all__ == sorted(catalog.__all__)
    assert set(catalog.__all__) == public
    assert len(catalog.__all__) == len(set(catalog.__all__))


def test_every_exported_member_is_defined_in_a_private_module() -> None:
    for name in catalog.__all__:
        module = getattr(catalog, name).__module__
        assert module.startswith("gpufleet.catalog._"), (name, module)
