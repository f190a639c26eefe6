"""Rollout settings as the fleet file (and ``gpufleet rollout start``) write them: every
default is here, once.

A served name's ``rollout`` block names what it overrides::

    rollout: {to: llama-v2, steps: [5, 20, 100], step_seconds: 60,
              analysis: {min_samples: 50, ttft_p99_ratio: 1.5}}

``RolloutConfig.model_validate`` turns that mapping into a validated, frozen value; an
unknown field or a contradiction (steps that go down, a weight past 100) is a ``ValueError``
(pydantic's ``ValidationError``) that names it.
"""

from __future__ import annotations

import itertools
import math
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _RolloutSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RolloutStrategy(StrEnum):
    CANARY = "canary"
    """The new variant takes each step's share of sessions; each step ends in an analysis."""
    BLUE_GREEN = "blue-green"
    """The new pool warms to the old one's size with no traffic, then takes all of it at once;
    the old pool serves nothing but stays up until the analysis after the switch passes."""


class AnalysisConfig(_RolloutSettings):
    """What a step's analysis compares, new variant against old, on the same window
    (docs/design/rollout.md)."""

    min_samples: int = Field(30, ge=5)
    """Requests each side needs in the window before a verdict (fewer: hold, the window
    grows by one step). The same for TTFT samples; ITL is judged only when both sides have
    this many (a shell that does not measure it sends none)."""
    alpha: float = Field(0.001, gt=0.0, lt=0.5)
    """One-sided significance level of each test (Mann-Whitney U on latencies, a two-proportion
    z-test on error rates): a metric fails only when the new variant is worse with p < alpha
    *and* by more than its tolerance below."""
    ttft_p99_ratio: float = Field(1.5, ge=1.0)
    """Tolerated new/old ratio of the window's time-to-first-token P99."""
    itl_p99_ratio: float = Field(1.5, ge=1.0)
    """Tolerated new/old ratio of the window's inter-token latency P99."""
    error_rate_margin: float = Field(0.02, ge=0.0, le=1.0)
    """Tolerated excess of the new variant's 5xx/timeout rate over the old's (absolute)."""
    max_samples: int = Field(5000, ge=10)
    """Latency samples kept per side and window (the newest)."""


class RolloutConfig(_RolloutSettings):
    """One rollout of a served name to its variant ``to``."""

    to: str
    """The new variant (a pool listed among the served name's variants)."""
    strategy: RolloutStrategy = RolloutStrategy.CANARY
    steps: tuple[float, ...] = (5.0, 20.0, 50.0, 100.0)
    """Canary: the new variant's share (%) of the name's traffic at each step; increasing,
    in (0, 100]; 100 is appended when missing (the last step is the switch). Blue-green
    ignores them (one switch)."""
    step_seconds: float = Field(60.0, gt=0.0)
    """How long each step runs before its analysis (blue-green: the warm-up's least length,
    and the bake after the switch)."""
    settle_seconds: float | None = Field(None, ge=0.0)
    """Blue-green: seconds after the switch whose samples are not analysed (all traffic
    moves at once: the new pool starts with cold caches and every new session's first
    request); the bake's window starts after them. ``None``: half a step, at most 30 s."""
    analysis: AnalysisConfig = AnalysisConfig()

    @field_validator("steps")
    @classmethod
    def _increasing(cls, steps: tuple[float, ...]) -> tuple[float, ...]:
        if not steps:
            raise ValueError("steps: give at least one step (a share in %, e.g. [5, 20, 100])")
        for s in steps:
            if not (math.isfinite(s) and 0 < s <= 100):
                raise ValueError(f"steps: {s:g} is not a share in (0, 100]")
        if any(b <= a for a, b in itertools.pairwise(steps)):
            raise ValueError(f"steps: {list(steps)} must increase")
        return steps if steps[-1] == 100 else (*steps, 100.0)
