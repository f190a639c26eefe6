"""The replica model's public values: its configuration, what goes in and what comes out."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from gpufleet.catalog import GPUSpec, ModelSpec
from gpufleet.perf import BatchShape, Dtype, StepTime

if TYPE_CHECKING:
    from gpufleet.engine.model._request import Request

SCHEDULING_POLICIES = frozenset({"fcfs", "priority"})


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """One replica's engine settings, in vLLM's names and with vLLM's defaults.

    ``max_model_len=None`` takes the model's ``max_context``, clamped to the tokens the KV
    cache holds (vLLM refuses to start when one sequence cannot fit; the model serves the
    longest one that can). An explicit value above either limit is a ``ValueError``, as in
    vLLM.

    Output lengths without ``ignore_eos`` are drawn from a log-normal with median
    ``output_len_median`` tokens and shape ``output_len_sigma``, then bounded by the request's
    ``max_tokens`` (docs/design/replica-model.md says why).
    """

    model: ModelSpec
    gpu: GPUSpec
    tp: int = 1
    pp: int = 1
    weights_dtype: Dtype = Dtype.BF16
    kv_dtype: Dtype = Dtype.BF16
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    num_gpu_blocks_override: int | None = None
    seed: int = 0
    output_len_median: float = 150.0
    output_len_sigma: float = 0.9
    kv_events: bool = False
    """Keep vLLM-shaped KV events of the prefix cache for ``take_kv_events()`` (with
    ``enable_prefix_caching``; docs/kv-events.md)."""

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            allowed = ", ".join(sorted(SCHEDULING_POLICIES))
            raise ValueError(
                f"scheduling_policy must be one of {allowed}, got {self.scheduling_policy!r}"
            )
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_model_len", "num_gpu_blocks_override"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1 (or None), got {value}")
        if not (math.isfinite(self.output_len_median) and self.output_len_median > 0):
            raise ValueError(f"output_len_median must be > 0, got {self.output_len_median}")
        if not (math.isfinite(self.output_len_sigma) and self.output_len_sigma >= 0):
            raise ValueError(f"output_len_sigma must be >= 0, got {self.output_len_sigma}")


class FinishReason(StrEnum):
    """Why a request ended (the OpenAI ``finish_reason`` values vLLM reports)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request as the engine receives it: tokenised prompt and sampling limits.

    A ``pooling`` request (an embedding) is prompt-only: it is scheduled and prefilled like
    any other, and when its prompt is computed it finishes with one output that carries no
    token (finish reason ``stop``), as vLLM's pooling requests do. ``max_tokens`` and
    ``ignore_eos`` do not apply to it.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    ignore_eos: bool = False
    priority: int = 0
    """Under the ``priority`` policy, lower values run first (then earlier arrivals)."""
    pooling: bool = False
    continues_at: int | None = None
    """A continuation: its output is the filler from this position on, as the output of
    the request it continues would have gone on (a stream resumed on another replica; see
    :meth:`FillerTokens.position_after`). ``None``: the position is drawn from its id."""


@dataclass(frozen=True, slots=True)
class Progress:
    """A request's output so far (:meth:`ReplicaModel.progress`)."""

    output_token_ids: tuple[int, ...]
    next_position: int
    """The filler position its next token would come from: a continuation's
    ``continues_at``."""


@dataclass(frozen=True, slots=True, init=False)
class RequestOutput:
    """What one request produced in one step: one per request that generated a token, and
    one (with no token) for a pooling request when its prompt is computed."""

    request_id: str
    new_token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache, fixed when the request is first scheduled."""
    num_output_tokens: int
    """Tokens generated so far, this one included."""
    finish_reason: FinishReason | None
    first_token: bool
    """True on the output that carries the request's first generated token."""

    # The generated __init__ of a frozen dataclass looks up object.__setattr__ once per
    # field; this one binds it once. Same signature and behaviour; building the outputs is
    # most of a decode step's cost (bench/replica_model_speed.py), and this saves ~15 % of it.
    def __init__(  # noqa: PLR0917 - the generated dataclass signature, field by field
        self,
        request_id: str,
        new_token_ids: tuple[int, ...],
        num_prompt_tokens: int,
        num_cached_tokens: int,
        num_output_tokens: int,
        finish_reason: FinishReason | None,
        first_token: bool,
    ) -> None:
        put = object.__setattr__
        put(self, "request_id", request_id)
        put(self, "new_token_ids", new_token_ids)
        put(self, "num_prompt_tokens", num_prompt_tokens)
        put(self, "num_cached_tokens", num_cached_tokens)
        put(self, "num_output_tokens", num_output_tokens)
        put(self, "finish_reason", finish_reason)
        put(self, "first_token", first_token)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One iteration, decided by ``plan_step`` and applied by ``finish_step``.

    Shells read ``duration`` (seconds on the modelled GPU, slowdown included) and may log
    ``batch``, ``timing`` and ``num_scheduled_tokens``; the rest is the model's own
    bookkeeping.
    """

    duration: float
    batch: BatchShape
    step: int
    """Sequence number of this step in the replica (0, 1, 2, ...)."""
    decodes: tuple[Request, ...] = field(repr=False, compare=False)
    prefills: tuple[tuple[Request, int], ...] = field(repr=False, compare=False)
    """(request, tokens) for each prompt chunk."""
    timing: StepTime = field(repr=False, compare=False)
    """Where the step's time goes, as ``perf`` splits it, before slowdown (``duration`` is
    ``timing.seconds × slowdown``)."""

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Tokens each scheduled request runs in this step, by request id."""
        counts = dict.fromkeys((r.request_id for r in self.decodes), 1)
        counts.update((r.request_id, n) for r, n in self.prefills)
        return counts


@dataclass(frozen=True, slots=True)
class DecodeRun:
    """Consecutive pure-decode steps that ``ReplicaModel.run_decodes`` applied at once.

    Step ``i`` of the run is the replica's step ``first_step + i``; it took ``durations[i]``
    seconds on the modelled GPU (slowdown included: what ``plan_step`` would have said), and
    every request in ``request_ids`` produced one token in it, the same token it would have
    produced step by step. No request finished and none produced its first token. A shell
    times the steps as it would have one by one, ``t += duration`` from the run's start, so
    the times agree to the bit::

        now ──d0──► t1 ──d1──► t2 ── ... ──► tk        tk: plan the next step here
                    │          │             │
                    one token per request at each step end
    """

    durations: tuple[float, ...]
    request_ids: tuple[str, ...]
    """The running requests, in running order (the order step outputs would have had)."""
    first_step: int
    """``StepPlan.step`` the first step would have had; the next plan numbers on from the end."""
    times: list[float] | None = field(default=None, compare=False, repr=False)
    """When given, ``times[i]`` is ``now + durations[0] + … + durations[i - 1]`` summed left to
    right (``times[0]`` the run's start, ``times[-1]`` its end): the step ends the model
    already summed, for a shell that would sum them again."""

    @property
    def num_steps(self) -> int:
        return len(self.durations)


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """A snapshot of the replica, in the quantities vLLM exports as metrics.

    ``kv_cache_usage`` is referenced blocks / all blocks (``vllm:kv_cache_usage_perc``): free
    blocks that still hold cached prefixes count as free. Prefix-cache queries and hits are in
    tokens, counted once per request when it is first scheduled.
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_gpu_blocks: int
    block_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    finished: Mapping[str, int]
    """Finished requests by finish reason (every ``FinishReason`` value is a key)."""
