"""LoRA adapters registered at run time: what a restarted gateway registers again.

::

    store.adapters.put("sql", "base", "/adapters/sql", 8)   # POST /admin/adapters
    store.adapters.all()    # [("sql", "base", "/adapters/sql", 8), ...]: at the gateway's start

One row per adapter, in the order they were registered. The fleet file's adapters are not
here: the fleet file keeps them. A table of its own: ``create_all`` adds it to an older
database, which loses nothing.
"""

from __future__ import annotations

import time

from sqlalchemy import Engine, insert, select

from gpufleet.store import _schema as s
from gpufleet.store._errors import clean


class AdapterRows:
    """The ``adapters`` table."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def put(self, name: str, model: str, path: str, rank: int) -> None:
        """Keep adapter ``name`` (of pool ``model``) for the next start."""
        row = {
            "name": clean(name),
            "model": clean(model),
            "path": clean(path),
            "rank": rank,
            "created_at": time.time(),
        }
        with self._engine.begin() as conn:
            conn.execute(insert(s.adapters).values(**row))

    def all(self) -> list[tuple[str, str, str, int]]:
        """``(name, model, path, rank)`` of every kept adapter, oldest first."""
        t = s.adapters
        with self._engine.connect() as conn:
            rows = conn.execute(
                select(t.c.name, t.c.model, t.c.path, t.c.rank).order_by(t.c.created_at)
            ).all()
        return [(str(n), str(m), str(p), int(r)) for n, m, p, r in rows]
