"""Rollouts' state in the store: one row per served name, replaced at each step, read back
by a store opened again (a restarted gateway)."""

from __future__ import annotations

from gpufleet.store import Store


def test_a_rollouts_state_survives_reopening_the_store(db_url: str) -> None:
    store = Store.open(db_url)
    assert store.rollouts.all() == {}
    assert store.rollouts.get("chat") is None
    state = {"model": "chat", "step": 0, "phase": "running", "base": {"v1": 100.0, "v2": 0.0}}
    store.rollouts.put("chat", state)
    store.rollouts.put("chat", state | {"step": 1})  # a step later: replaced, not added
    store.rollouts.put("code", {"model": "code", "step": 0, "phase": "promoted"})
    store.close()
    again = Store.open(db_url)
    try:
        assert again.rollouts.get("chat") == state | {"step": 1}
        assert list(again.rollouts.all()) == ["chat", "code"]
    finally:
        again.close()
