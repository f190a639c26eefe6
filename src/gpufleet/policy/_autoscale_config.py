"""Autoscaler settings as the fleet file writes them: every default is here, once.

A fleet file's pool names what it overrides::

    autoscale: {min_replicas: 2, max_replicas: 12, prewarm: 1, provisioning_horizon: 420}

``AutoscaleConfig.model_validate`` turns that mapping into a validated, frozen value; an
unknown field or a contradiction (``max_replicas < min_replicas``, one replica without scale
to zero) is a ``ValueError`` (pydantic's ``ValidationError``) that names it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _AutoscaleSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ForecastConfig(_AutoscaleSettings):
    """The demand forecaster: a seasonal-naive + trend blend over bucketed history."""

    enabled: bool = True
    bucket: float = Field(60.0, gt=0.0)
    """Seconds of demand averaged into one history bucket (one number per bucket is kept)."""
    trend_window: float = Field(900.0, gt=0.0)
    """Seconds of recent history the level and the linear trend are fitted over."""
    seasonal_periods: tuple[float, ...] = (86_400.0, 604_800.0)
    """Seasons tried, longest first once enough history exists (a day, a week)."""
    seasonal_weight: float = Field(0.7, ge=0.0, le=1.0)
    """Share of the seasonal prediction in the blend (the rest is the trend's)."""
    max_level_ratio: float = Field(2.0, ge=1.0)
    """Today's level may scale last season's value by at most this factor (either way)."""

    @model_validator(mode="after")
    def _periods_positive(self) -> ForecastConfig:
        if any(p <= 0.0 for p in self.seasonal_periods):
            raise ValueError(f"seasonal_periods must be > 0, got {self.seasonal_periods}")
        return self


class AutoscaleConfig(_AutoscaleSettings):
    """One model pool's autoscaling (docs/design/autoscaling.md)."""

    min_replicas: int = Field(2, ge=0)
    """Fewest replicas while the pool serves; at least 2 (N+1) unless ``scale_to_zero``."""
    max_replicas: int = Field(16, ge=1)
    target_utilisation: float = Field(0.65, gt=0.0, le=1.0)
    """Mean saturation per ready replica the pool is sized for: scale out at 60–70 %, not
    90 %, because capacity takes minutes to arrive."""
    stable_window: float = Field(60.0, gt=0.0)
    """Seconds of utilisation averaged for the ordinary decision (Knative's stable window)."""
    panic_window: float = Field(6.0, gt=0.0)
    """Seconds averaged to detect a burst; shorter than ``stable_window``."""
    panic_threshold: float = Field(2.0, gt=1.0)
    """Panic when the panic window's utilisation reaches this multiple of the target: scale
    out at once to the panic window's need, and do not scale in for a stable window."""
    scale_down_cooldown: float = Field(300.0, ge=0.0)
    """Seconds after any scale decision before the pool may shrink (no flapping)."""
    scale_down_step: int = Field(1, ge=1)
    """Replicas removed by one scale-in at most."""
    scale_to_zero: bool = False
    idle_time: float = Field(900.0, gt=0.0)
    """With ``scale_to_zero``: seconds with no demand and no load before the last replica
    goes."""
    provisioning_horizon: float = Field(300.0, ge=0.0)
    """Seconds a cold replica takes to serve (machine start-up + model load): how far ahead
    the forecast looks."""
    prewarm: int = Field(0, ge=0)
    """Standby replicas kept initialised (model loaded, not routed) to join in seconds."""
    forecast: ForecastConfig = ForecastConfig()

    @model_validator(mode="after")
    def _consistent(self) -> AutoscaleConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) must be at least "
                f"min_replicas ({self.min_replicas})"
            )
        if not self.scale_to_zero and self.min_replicas < 2:
            raise ValueError(
                f"min_replicas must be at least 2 (N+1) unless scale_to_zero is on, "
                f"got {self.min_replicas}"
            )
        if self.panic_window >= self.stable_window:
            raise ValueError(
                f"panic_window ({self.panic_window}) must be shorter than "
                f"stable_window ({self.stable_window})"
            )
        return self
