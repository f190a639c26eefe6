"""docs/catalog.md names every catalog entry, so the page cannot silently fall behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.catalog import load_gpus, load_models

DOC = Path(__file__).resolve().parents[2] / "docs" / "catalog.md"


@pytest.mark.parametrize("name", sorted(load_gpus()) + sorted(load_models()))
def test_docs_name_every_entry(name: str) -> None:
    assert f"| `{name}` |" in DOC.read_text("utf-8")
