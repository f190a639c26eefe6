"""One residency scenario, run live (tests/gateway/test_residency_live.py) and simulated
(tests/sim/test_residency_sim.py): two models on one GPU slot, traffic alternating A, B, A,
B. Both must take the same residency decisions in the same order."""

from __future__ import annotations

import json
from typing import Any

A, B = "chat-a", "chat-b"
PHASES = ([A], [B], [A], [B])


def fleet(args: list[str]) -> dict[str, Any]:
    return {
        "gateway": {"autoscaler": {"hold_timeout": 20}},
        "models": [
            {
                "name": name,
                "model": "llama-3.1-8b",
                "replicas": 1,
                "args": args,
                "routing": "least_request",
                "residency": {
                    "mode": "on_demand",
                    "slots": "gpu-0",
                    "idle": 600,
                    "min_awake": 1.0,
                },
            }
            for name in (A, B)
        ],
    }


EXPECTED = [
    ("sleep", f"{A}-0", "overcommit"),  # both start awake; the slot holds one (A: LRU tie)
    ("sleep", f"{B}-0", "evicted"),  # phase A
    ("wake", f"{A}-0", ""),
    ("sleep", f"{A}-0", "evicted"),  # phase B
    ("wake", f"{B}-0", ""),
    ("sleep", f"{B}-0", "evicted"),  # phase A
    ("wake", f"{A}-0", ""),
    ("sleep", f"{A}-0", "evicted"),  # phase B
    ("wake", f"{B}-0", ""),
]
"""The residency commands of the alternating phases, in order: (do, replica, reason)."""


def residency_commands(recording: str) -> list[tuple[str, str, str]]:
    """A recording's Sleep and Wake commands, in order."""
    out = []
    for text in recording.splitlines()[1:]:
        for c in json.loads(text)["commands"]:
            if c["do"] in ("sleep", "wake"):
                out.append((c["do"], c["replica"], c.get("reason", "")))
    return out
