"""Replicas: the replica model (``engine.model``), the sim engine server and engine adapters."""
