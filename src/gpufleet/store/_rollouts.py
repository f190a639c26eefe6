"""Rollouts' state: what a restarted gateway resumes from (docs/fleet-file.md, "Rollouts").

::

    store.rollouts.put("chat", state)    # after each step or verdict (Rollout.snapshot)
    store.rollouts.all()                 # {"chat": state, ...}: at the gateway's start

One row per served name: its latest rollout's state as JSON (the controller's snapshot:
its settings, the weights it started from, its step and phase), replaced at each step. A
table of its own: ``create_all`` adds it to an older database, which loses nothing.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy import Engine, delete, insert, select

from gpufleet.store import _schema as s
from gpufleet.store._errors import clean


class RolloutStates:
    """The ``rollouts`` table."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def put(self, model: str, state: dict[str, Any]) -> None:
        """``model``'s rollout state from now on (the previous one is replaced)."""
        t = s.rollouts
        row = {"model": model, "state": clean(json.dumps(state)), "updated_at": time.time()}
        with self._engine.begin() as conn:
            conn.execute(delete(t).where(t.c.model == model))
            conn.execute(insert(t).values(**row))

    def get(self, model: str) -> dict[str, Any] | None:
        t = s.rollouts
        with self._engine.connect() as conn:
            text = conn.execute(select(t.c.state).where(t.c.model == model)).scalar()
        return None if text is None else dict(json.loads(text))

    def all(self) -> dict[str, dict[str, Any]]:
        t = s.rollouts
        with self._engine.connect() as conn:
            rows = conn.execute(select(t.c.model, t.c.state).order_by(t.c.model)).all()
        return {str(model): dict(json.loads(state)) for model, state in rows}
