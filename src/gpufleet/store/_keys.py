"""API keys: ``gfk_<key id>_<secret>``, random, shown once, stored only as a hash.

The key id (12 hex digits) is the public half: it names the key in listings, the ledger and
the audit log, and finds the row to check. The secret (32 random bytes, URL-safe base64) is
high-entropy, so one SHA-256 is enough to store it: there is nothing to brute-force that a
slow hash would protect (a slow hash would only cost every request CPU).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Final, NamedTuple

PREFIX: Final = "gfk_"


class NewKey(NamedTuple):
    key_id: str
    secret_hash: str
    key: str
    """The whole key: shown once, never stored."""


def new_key(prefix: str = PREFIX) -> NewKey:
    """A tenant's key, or with ``prefix`` another kind (admin credentials: ``gfa_``)."""
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return NewKey(key_id, hash_secret(secret), f"{prefix}{key_id}_{secret}")


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def split_key(key: str, prefix: str = PREFIX) -> tuple[str, str] | None:
    """``(key_id, secret)`` of a well-formed key with ``prefix``, else ``None``."""
    if not key.startswith(prefix):
        return None
    key_id, sep, secret = key[len(prefix) :].partition("_")
    if not sep or len(key_id) != 12 or not secret:
        return None
    return key_id, secret


def secret_matches(secret: str, secret_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), secret_hash)
