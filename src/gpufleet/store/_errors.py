"""The store's one error, and text made fit for every database."""

from __future__ import annotations


class StoreError(ValueError):
    """A request the store cannot do (unknown tenant or key, bad setting); says why."""


def clean(text: str) -> str:
    """``text`` as every database keeps it: PostgreSQL refuses NUL and text that is not
    UTF-8 (a JSON string can spell both), so those characters are replaced."""
    return text.replace("\x00", "\ufffd").encode(errors="replace").decode()
