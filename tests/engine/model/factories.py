"""Factories for replica-model tests: tiny caches, explicit prompts, drivers in virtual time.

In the spirit of vLLM's ``tests/v1/core/utils.py`` (``create_scheduler``, ``create_requests``).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from gpufleet.catalog import get_gpu, get_model
from gpufleet.engine.model import (
    NewRequest,
    ReplicaConfig,
    ReplicaModel,
    RequestOutput,
    StepPlan,
)

MODEL = get_model("llama-3.1-8b")
GPU = get_gpu("h100-sxm")


def make_config(**overrides: Any) -> ReplicaConfig:
    """Llama-3.1-8B on one H100 with a 64-block cache (1,024 tokens) unless overridden."""
    fields: dict[str, Any] = {"model": MODEL, "gpu": GPU, "num_gpu_blocks_override": 64}
    fields.update(overrides)
    return ReplicaConfig(**fields)


def make_replica(**overrides: Any) -> ReplicaModel:
    return ReplicaModel(make_config(**overrides))


def tokens(n: int, start: int = 0) -> tuple[int, ...]:
    """``n`` distinct token ids from ``start`` (distinct starts give disjoint prompts)."""
    return tuple(range(start, start + n))


def request(
    request_id: str,
    prompt: int | tuple[int, ...] = 32,
    max_tokens: int = 8,
    *,
    ignore_eos: bool = True,
    priority: int = 0,
) -> NewRequest:
    """A request; an ``int`` prompt is that many tokens unique to ``request_id``."""
    if isinstance(prompt, int):
        start = 1000 + int(hashlib.blake2b(request_id.encode(), digest_size=3).hexdigest(), 16)
        prompt = tokens(prompt, start % (MODEL.vocab_size - prompt))
    return NewRequest(request_id, prompt, max_tokens, ignore_eos=ignore_eos, priority=priority)


@dataclass
class Driver:
    """Steps a replica in virtual time, as a shell would, and keeps what came out."""

    model: ReplicaModel
    now: float = 0.0
    outputs: dict[str, list[RequestOutput]] = field(default_factory=lambda: defaultdict(list))
    plans: list[StepPlan] = field(default_factory=list)

    def add(self, new: NewRequest) -> None:
        self.model.add_request(new, self.now)

    def step(self) -> list[RequestOutput]:
        """One plan/finish cycle; [] when the replica is idle."""
        plan = self.model.plan_step(self.now)
        if plan is None:
            return []
        self.plans.append(plan)
        self.now += plan.duration
        outs = self.model.finish_step(plan, self.now)
        for out in outs:
            self.outputs[out.request_id].append(out)
        return outs

    def run(self, max_steps: int = 100_000) -> None:
        """Step until the replica has no work (``AssertionError`` past ``max_steps``)."""
        for _ in range(max_steps):
            if not self.model.has_work():
                return
            self.step()
        raise AssertionError(f"still busy after {max_steps} steps: {self.model.stats()}")

    def generated(self, request_id: str) -> list[int]:
        return [t for out in self.outputs[request_id] for t in out.new_token_ids]

    def finish_reason(self, request_id: str) -> str | None:
        outs = self.outputs[request_id]
        return outs[-1].finish_reason if outs else None
