"""Replicas: the replica model (``engine.model``), the sim engine server and engine adapters.

``Tokenizer`` is the deterministic stand-in tokenizer both use to count tokens. The server
lives in ``gpufleet.engine.server`` (imported on demand: it pulls in Starlette and
prometheus_client, which the fleet simulator does not need).
"""

from gpufleet.engine._tokenizer import WORDS, Tokenizer

__all__ = ["WORDS", "Tokenizer"]
