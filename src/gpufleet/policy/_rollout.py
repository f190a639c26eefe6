"""A rollout of a served name to a new variant: steps, analysis, verdicts. Pure: the time is
an argument, the samples come in as calls, the decisions go out as frozen values.

::

    canary [5, 20, 100]:   start ─► 5 % ─(window)─► analyse ─┬─ promote ─► 20 % ─► … ─► 100 %
                                                               ├─ hold    ─► same step, the window
                                                               │            grows by step_seconds
                                                               └─ rollback ─► 0 %, old weights back
    blue-green:            start ─► warming (new pool gets 0 %; the old one's window is the
                           baseline) ─► switch: 100 % once the new pool has as many routable
                           replicas as the old ─(window)─► analyse against the baseline
                           ─► promote (old drained) | rollback (old takes it all back)

The conserved quantity: every sample lands in the window of exactly one side (the new
variant, or the old ones together), and a window only ever covers one share: a step change
(promote, switch) starts both windows afresh, a hold extends them.

The analysis (:func:`analyse`) compares the two windows metric by metric — TTFT P99, ITL P99
and the 5xx/timeout rate — and a metric fails only when the new side is worse *both*
significantly (a one-sided test, p < ``alpha``) *and* materially (past its tolerance): one
noisy P99 cannot roll a version back, and a tiny but significant difference does not either.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

from gpufleet.policy._rollout_config import AnalysisConfig, RolloutConfig, RolloutStrategy
from gpufleet.policy._rollout_stats import mann_whitney_greater, p99, two_proportion_greater


class RolloutPhase(StrEnum):
    WARMING = "warming"
    """Blue-green: the new pool gets no traffic until it is as large as the old one."""
    RUNNING = "running"
    PAUSED = "paused"
    """An operator paused it: weights stay, no verdict until it is resumed or promoted."""
    PROMOTED = "promoted"
    """Done: the new variant takes every request; the old ones drain."""
    ROLLED_BACK = "rolled_back"
    """An analysis failed: the new variant gets nothing and drains."""
    ABORTED = "aborted"
    """An operator aborted it: as rolled back."""


TERMINAL_ROLLOUT: Final = frozenset(
    {RolloutPhase.PROMOTED, RolloutPhase.ROLLED_BACK, RolloutPhase.ABORTED}
)
ACTIVE_ROLLOUT: Final = frozenset({RolloutPhase.WARMING, RolloutPhase.RUNNING, RolloutPhase.PAUSED})


class RolloutVerdict(StrEnum):
    START = "start"
    PROMOTE = "promote"
    """The analysis passed (or an operator promoted): the next step."""
    HOLD = "hold"
    """Too few samples on a side: the same step, a longer window."""
    ROLLBACK = "rollback"
    SWITCH = "switch"
    """Blue-green: the new pool is warm; it takes all the traffic."""
    WAIT = "wait"
    """Blue-green: still warming (the new pool is smaller, or the baseline too thin)."""
    PAUSE = "pause"
    RESUME = "resume"
    ABORT = "abort"


class RolloutAction(StrEnum):
    """What an operator may ask of a rollout in progress."""

    PROMOTE = "promote"
    PAUSE = "pause"
    RESUME = "resume"
    ABORT = "abort"


class CheckResult(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    INSUFFICIENT = "insufficient"
    """Fewer than ``min_samples`` on a side."""
    SUSPECT = "suspect"
    """Beyond its tolerance by the estimate, but not significantly: too few samples to
    tell (a slow version in a thin canary window looks like this)."""


class RolloutWindow:
    """One side's samples over the current window: outcomes and latencies."""

    __slots__ = ("errors", "itl", "requests", "ttft")

    def __init__(self, keep: int) -> None:
        self.requests = 0
        """Attempts that ended (answered, or failed with a 5xx or timeout)."""
        self.errors = 0
        self.ttft: deque[float] = deque(maxlen=keep)
        self.itl: deque[float] = deque(maxlen=keep)


@dataclass(frozen=True, slots=True)
class RolloutCheck:
    """One metric of an analysis: the two sides' values (P99 seconds, or a rate), their
    sample counts, the test's p-value and the result."""

    metric: str
    new: float | None
    old: float | None
    samples: tuple[int, int]
    p: float | None
    result: CheckResult

    def to_json(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "new": _round(self.new),
            "old": _round(self.old),
            "samples": list(self.samples),
            "p": _round(self.p),
            "result": self.result.value,
        }


@dataclass(frozen=True, slots=True)
class RolloutAnalysis:
    verdict: RolloutVerdict
    """``PROMOTE``, ``HOLD`` or ``ROLLBACK``."""
    checks: tuple[RolloutCheck, ...]
    reason: str


def analyse(new: RolloutWindow, old: RolloutWindow, config: AnalysisConfig) -> RolloutAnalysis:
    """Compare the new variant's window with the old one's: a failed metric rolls back;
    else a required metric (errors, TTFT) short of samples holds, and so does one beyond
    its tolerance by the estimate though not significantly (the window grows until the test
    can tell); else promote."""
    need = config.min_samples
    checks = [
        _error_check(new, old, config),
        _latency_check("ttft_p99", new.ttft, old.ttft, config.ttft_p99_ratio, config),
    ]
    if len(new.itl) >= need and len(old.itl) >= need:  # judged only when measured
        checks.append(_latency_check("itl_p99", new.itl, old.itl, config.itl_p99_ratio, config))
    failed = [c.metric for c in checks if c.result is CheckResult.FAIL]
    if failed:
        return RolloutAnalysis(
            RolloutVerdict.ROLLBACK, tuple(checks), f"worse: {', '.join(failed)}"
        )
    short = [c.metric for c in checks if c.result is CheckResult.INSUFFICIENT]
    if short:
        return RolloutAnalysis(
            RolloutVerdict.HOLD, tuple(checks), f"fewer than {need} samples: {', '.join(short)}"
        )
    suspect = [c.metric for c in checks if c.result is CheckResult.SUSPECT]
    if suspect:
        return RolloutAnalysis(
            RolloutVerdict.HOLD,
            tuple(checks),
            f"beyond tolerance, not yet significant: {', '.join(suspect)}",
        )
    return RolloutAnalysis(RolloutVerdict.PROMOTE, tuple(checks), "no metric worse")


def _error_check(new: RolloutWindow, old: RolloutWindow, config: AnalysisConfig) -> RolloutCheck:
    samples = (new.requests, old.requests)
    if min(samples) < config.min_samples:
        return RolloutCheck("error_rate", None, None, samples, None, CheckResult.INSUFFICIENT)
    rate_new, rate_old = new.errors / new.requests, old.errors / old.requests
    p = two_proportion_greater(new.errors, new.requests, old.errors, old.requests)
    beyond = rate_new - rate_old > config.error_rate_margin
    return RolloutCheck("error_rate", rate_new, rate_old, samples, p, _result(p, beyond, config))


def _latency_check(
    metric: str, new: deque[float], old: deque[float], ratio: float, config: AnalysisConfig
) -> RolloutCheck:
    samples = (len(new), len(old))
    if min(samples) < config.min_samples:
        return RolloutCheck(metric, p99(new), p99(old), samples, None, CheckResult.INSUFFICIENT)
    high_new, high_old = p99(new), p99(old)
    assert high_new is not None
    assert high_old is not None
    p = mann_whitney_greater(list(new), list(old))
    beyond = high_new > ratio * high_old
    return RolloutCheck(metric, high_new, high_old, samples, p, _result(p, beyond, config))


def _result(p: float, beyond: bool, config: AnalysisConfig) -> CheckResult:
    """Worse only when significant and beyond tolerance; beyond it alone is suspect."""
    if not beyond:
        return CheckResult.PASS
    return CheckResult.FAIL if p < config.alpha else CheckResult.SUSPECT


@dataclass(frozen=True, slots=True)
class RolloutDecision:
    """One step or verdict of a rollout: what the shells log (one JSON line), count (a
    metric) and audit, and the state they persist."""

    at: float
    model: str
    to: str
    strategy: RolloutStrategy
    verdict: RolloutVerdict
    phase: RolloutPhase
    step: int
    share: float
    """The new variant's share (%) from now on."""
    weights: tuple[tuple[str, float], ...]
    """Every variant's weight from now on."""
    reason: str = ""
    checks: tuple[RolloutCheck, ...] = ()
    window: float = 0.0
    """Seconds the analysed window covered."""

    def to_json(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "model": self.model,
            "to": self.to,
            "strategy": self.strategy.value,
            "verdict": self.verdict.value,
            "phase": self.phase.value,
            "step": self.step,
            "share": self.share,
            "weights": dict(self.weights),
            "reason": self.reason,
            "checks": [c.to_json() for c in self.checks],
            "window": round(self.window, 6),
        }


class Rollout:
    """One served name's rollout to ``config.to``; the other variants are the old side.

    ``base``: every variant's weight before it (the old ones keep their proportions; a
    rollback restores them). ``step``/``phase``: where a restored rollout resumes (its
    window starts afresh at ``now``)."""

    __slots__ = (
        "_paused_from",
        "_remaining",
        "base",
        "baseline",
        "config",
        "deadline",
        "holds",
        "model",
        "new",
        "old",
        "olds",
        "phase",
        "settle_until",
        "step",
        "window_start",
    )

    def __init__(
        self,
        model: str,
        config: RolloutConfig,
        base: Mapping[str, float],
        now: float,
        *,
        step: int = 0,
        phase: RolloutPhase | None = None,
    ) -> None:
        if config.to not in base:
            raise ValueError(
                f"rollout of {model!r}: {config.to!r} is not one of its variants "
                f"({', '.join(base)})"
            )
        olds = tuple(p for p in base if p != config.to)
        if not any(base[p] > 0 for p in olds):
            raise ValueError(
                f"rollout of {model!r}: no other variant of positive weight to roll from"
            )
        self.model = model
        self.config = config
        self.base = dict(base)
        self.olds = olds
        self.step = min(step, len(self.steps) - 1)
        blue_green = config.strategy is RolloutStrategy.BLUE_GREEN
        self.phase = phase or (RolloutPhase.WARMING if blue_green else RolloutPhase.RUNNING)
        self._paused_from = (
            RolloutPhase.WARMING if blue_green and self.step == 0 else RolloutPhase.RUNNING
        )
        self._remaining = config.step_seconds
        self.holds = 0
        self.baseline: RolloutWindow | None = None
        """Blue-green: the old side's last window before the switch."""
        self.new = RolloutWindow(config.analysis.max_samples)
        self.old = RolloutWindow(config.analysis.max_samples)
        self.window_start = now
        self.deadline = now + config.step_seconds
        self.settle_until = -math.inf
        """Samples before this are not analysed (a blue-green switch's first moments)."""

    @property
    def steps(self) -> tuple[float, ...]:
        if self.config.strategy is RolloutStrategy.BLUE_GREEN:
            return (0.0, 100.0)  # warming, then switched
        return self.config.steps

    @property
    def share(self) -> float:
        if self.phase is RolloutPhase.PROMOTED:
            return 100.0
        if self.phase in (RolloutPhase.ROLLED_BACK, RolloutPhase.ABORTED):
            return 0.0
        return self.steps[self.step]

    def weights(self) -> dict[str, float]:
        """Every variant's weight at the current share: the new one gets the share, the old
        ones the rest in their old proportions."""
        share = self.share
        total = sum(self.base[p] for p in self.olds)
        out = {p: (100.0 - share) * self.base[p] / total for p in self.olds}
        out[self.config.to] = share
        return out

    # -- samples --------------------------------------------------------------------------

    def side(self, pool: str) -> RolloutWindow | None:
        """The window a sample of ``pool`` goes to (``None``: not a variant of it)."""
        if pool == self.config.to:
            return self.new
        return self.old if pool in self.base else None

    def outcome(self, pool: str, *, error: bool, now: float | None = None) -> None:
        """A request's attempt on ``pool`` ended (``now``: when; ``None``: counted)."""
        window = self.side(pool)
        if window is not None and (now is None or now >= self.settle_until):
            window.requests += 1
            window.errors += error

    def latencies(
        self, pool: str, ttft: Iterable[float], itl: Iterable[float], now: float | None = None
    ) -> None:
        """Latencies measured on ``pool`` (``now``: when reported; ``None``: counted)."""
        window = self.side(pool)
        if window is not None and (now is None or now >= self.settle_until):
            window.ttft.extend(ttft)
            window.itl.extend(itl)

    # -- decisions ------------------------------------------------------------------------

    def next_wakeup(self) -> float | None:
        return self.deadline if self.phase in (RolloutPhase.WARMING, RolloutPhase.RUNNING) else None

    def begin(self, now: float) -> RolloutDecision:
        return self._decision(
            now, RolloutVerdict.START, f"{self.config.strategy.value} to {self.config.to}"
        )

    def decide(self, now: float, ready: Mapping[str, int]) -> RolloutDecision | None:
        """The verdict due at ``now`` (``None``: nothing due). ``ready``: routable replicas
        per pool (blue-green switches when the new pool has as many as the old ones)."""
        if self.phase not in (RolloutPhase.WARMING, RolloutPhase.RUNNING) or now < self.deadline:
            return None
        if self.phase is RolloutPhase.WARMING:
            return self._warm(now, ready)
        baseline = self.baseline if self.baseline is not None else self.old
        analysis = analyse(self.new, baseline, self.config.analysis)
        window = now - self.window_start
        if analysis.verdict is RolloutVerdict.ROLLBACK:
            self.phase = RolloutPhase.ROLLED_BACK
        elif analysis.verdict is RolloutVerdict.HOLD:
            self.holds += 1
            self.deadline = now + self.config.step_seconds
        else:
            self._advance(now)
        return self._decision(now, analysis.verdict, analysis.reason, analysis.checks, window)

    def _warm(self, now: float, ready: Mapping[str, int]) -> RolloutDecision:
        old_ready = sum(ready.get(p, 0) for p in self.olds if self.base[p] > 0)
        new_ready = ready.get(self.config.to, 0)
        need = self.config.analysis.min_samples
        if new_ready < max(old_ready, 1) or self.old.requests < need:
            self.deadline = now + min(self.config.step_seconds, 1.0)
            why = (
                f"{self.config.to} has {new_ready} routable replicas of {old_ready}"
                if new_ready < max(old_ready, 1)
                else f"baseline: {self.old.requests} of {need} requests"
            )
            return self._decision(now, RolloutVerdict.WAIT, why)
        self.baseline = self.old
        self._advance(now)
        settle = self.config.settle_seconds
        if settle is None:
            settle = min(self.config.step_seconds / 2, 30.0)
        self.settle_until = now + settle  # the bake's window starts after the switch settles
        self.window_start, self.deadline = self.settle_until, self.deadline + settle
        return self._decision(
            now, RolloutVerdict.SWITCH, f"{self.config.to} is warm ({new_ready} ready)"
        )

    def _advance(self, now: float) -> None:
        """The next step (a promote, a switch): fresh windows, or the end."""
        if self.step + 1 >= len(self.steps):
            self.phase = RolloutPhase.PROMOTED
            return
        self.step += 1
        self.phase = RolloutPhase.RUNNING
        if self.steps[self.step] >= 100 and self.config.strategy is RolloutStrategy.CANARY:
            self.phase = (
                RolloutPhase.PROMOTED
            )  # the last step is the switch: nothing left to compare
        keep = self.config.analysis.max_samples
        self.new, self.old = RolloutWindow(keep), RolloutWindow(keep)
        self.holds = 0
        self.window_start = now
        self.deadline = now + self.config.step_seconds

    def act(self, now: float, action: RolloutAction) -> RolloutDecision:
        """An operator's action; ``ValueError`` when the rollout's phase does not allow it."""
        phase = self.phase
        if phase in TERMINAL_ROLLOUT:
            raise ValueError(f"the rollout of {self.model!r} is over ({phase.value})")
        if action is RolloutAction.ABORT:
            self.phase = RolloutPhase.ABORTED
            return self._decision(now, RolloutVerdict.ABORT, "an operator aborted it")
        if action is RolloutAction.PAUSE:
            if phase is RolloutPhase.PAUSED:
                raise ValueError(f"the rollout of {self.model!r} is paused already")
            self._paused_from, self._remaining = phase, max(self.deadline - now, 0.0)
            self.phase = RolloutPhase.PAUSED
            return self._decision(now, RolloutVerdict.PAUSE, "an operator paused it")
        if action is RolloutAction.RESUME:
            if phase is not RolloutPhase.PAUSED:
                raise ValueError(f"the rollout of {self.model!r} is not paused ({phase.value})")
            self.phase, self.deadline = self._paused_from, now + self._remaining
            return self._decision(now, RolloutVerdict.RESUME, "an operator resumed it")
        # promote: the next step now, with no analysis (a paused rollout resumes)
        if phase is RolloutPhase.PAUSED:
            self.phase = self._paused_from
        if self.phase is RolloutPhase.WARMING:
            self.baseline = self.old
            self._advance(now)
            return self._decision(now, RolloutVerdict.SWITCH, "an operator promoted it")
        self._advance(now)
        return self._decision(now, RolloutVerdict.PROMOTE, "an operator promoted it")

    def _decision(
        self,
        now: float,
        verdict: RolloutVerdict,
        reason: str,
        checks: tuple[RolloutCheck, ...] = (),
        window: float = 0.0,
    ) -> RolloutDecision:
        return RolloutDecision(
            now,
            self.model,
            self.config.to,
            self.config.strategy,
            verdict,
            self.phase,
            self.step,
            self.share,
            tuple(self.weights().items()),
            reason,
            checks,
            window,
        )

    def snapshot(self) -> dict[str, Any]:
        """What survives a restart (the store keeps it): enough to rebuild it with
        :meth:`restore` at the same step and phase (with fresh windows)."""
        return {
            "model": self.model,
            "config": self.config.model_dump(mode="json"),
            "base": dict(self.base),
            "step": self.step,
            "phase": self.phase.value,
        }

    @classmethod
    def restore(cls, state: Mapping[str, Any], now: float) -> Rollout:
        """A rollout from :meth:`snapshot` (``ValueError``: not one)."""
        try:
            return cls(
                str(state["model"]),
                RolloutConfig.model_validate(state["config"]),
                {str(k): float(v) for k, v in state["base"].items()},
                now,
                step=int(state["step"]),
                phase=RolloutPhase(state["phase"]),
            )
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"not a rollout's state: {error!r}") from None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
