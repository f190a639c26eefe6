"""LoRA adapters registered at run time, kept in the store: read back, in the order they
were registered, by a store opened again (a restarted gateway); a name is kept once."""

from __future__ import annotations

import pytest
import sqlalchemy

from gpufleet.store import Store


def test_registered_adapters_survive_reopening_the_store(db_url: str) -> None:
    store = Store.open(db_url)
    assert store.adapters.all() == []
    store.adapters.put("sql", "base", "/adapters/sql", 8)
    store.adapters.put("poet", "base", "/adapters/poet\x00", 16)  # NUL: kept as U+FFFD
    with pytest.raises(sqlalchemy.exc.IntegrityError):
        store.adapters.put("sql", "other", "/x", 8)  # the controller refuses it before this
    store.close()
    again = Store.open(db_url)
    try:
        assert again.adapters.all() == [
            ("sql", "base", "/adapters/sql", 8),
            ("poet", "base", "/adapters/poet\ufffd", 16),
        ]
    finally:
        again.close()
