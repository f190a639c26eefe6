"""GPU memory arithmetic: weights, KV cache, overhead, and what is left for the KV budget.

The budget follows vLLM's own accounting at start-up::

    requested  = total × gpu_memory_utilization
    kv_budget  = requested − weights − activation peak − framework overhead
    kv_blocks  = kv_budget // (block_size × KV bytes per token on this GPU)

The KV cache of one token holds a key and a value vector per layer and KV head::

    kv_bytes_per_token = 2 × layers × kv_heads × head_dim × bytes(kv_dtype)

With tensor parallelism each GPU keeps ``kv_heads / tp`` heads (at least one: heads are
replicated when tp > kv_heads); with pipeline parallelism each stage keeps its own layers.
Every stage of a replica must hold the same number of tokens, so the replica's capacity is set
by its most loaded stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpufleet.catalog import GPUSpec, ModelSpec
from gpufleet.perf._dtype import Dtype

GIB = 2**30

# int4 weights (AWQ/GPTQ) carry an fp16 scale and an int4 zero point per group of 128 weights.
_INT4_GROUP_OVERHEAD_BYTES = (2.0 + 0.5) / 128


@dataclass(frozen=True, slots=True)
class Parallelism:
    """How one replica is split: ``tp`` GPUs per stage, ``pp`` stages."""

    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tp and pp must be at least 1, got tp={self.tp} pp={self.pp}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def check(self, model: ModelSpec) -> None:
        """``ValueError`` when this split does not divide the model."""
        if model.num_attention_heads % self.tp:
            raise ValueError(
                f"tp={self.tp} does not divide {model.name}'s "
                f"{model.num_attention_heads} attention heads"
            )
        if self.tp > model.num_kv_heads and self.tp % model.num_kv_heads:
            raise ValueError(
                f"tp={self.tp} cannot replicate {model.name}'s {model.num_kv_heads} KV heads evenly"
            )
        if self.pp > model.num_layers:
            raise ValueError(f"pp={self.pp} exceeds {model.name}'s {model.num_layers} layers")


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """The engine settings that size memory (vLLM's names and defaults for online serving)."""

    gpu_memory_utilization: float = 0.90
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Overheads:
    """Memory outside weights and KV cache, per GPU.

    ``base`` is the CUDA context and the allocations torch does not see (cuBLAS workspaces,
    sampler buffers); vLLM logs 0.3-1.0 GiB of "non-torch memory" on single GPUs.
    ``collective`` is NCCL's buffers when a replica spans GPUs. ``cuda_graphs`` is what
    capturing the decode graphs keeps (vLLM logs 0.3-1.0 GiB for 8B-70B models).
    """

    base: float = 0.75 * GIB
    collective: float = 0.5 * GIB
    cuda_graphs: float = 0.5 * GIB


def kv_bytes_per_token(model: ModelSpec, kv_dtype: Dtype) -> int:
    """KV-cache bytes of one token across the whole model (all layers, all KV heads)."""
    return int(2 * model.num_layers * model.kv_dim * kv_dtype.bytes)


def _linear_bytes_per_param(dtype: Dtype) -> float:
    extra = _INT4_GROUP_OVERHEAD_BYTES if dtype is Dtype.INT4 else 0.0
    return dtype.bytes + extra


def _unquantised_bytes(dtype: Dtype) -> float:
    """Embeddings, LM head, norms, biases and routers stay 16-bit in quantised checkpoints."""
    return 4.0 if dtype is Dtype.FP32 else 2.0


def _layer_linear_params(model: ModelSpec) -> int:
    attention = model.hidden_size * (2 * model.q_dim + 2 * model.kv_dim)
    return attention + model.num_experts * model.expert_params()


def weight_bytes(model: ModelSpec, dtype: Dtype) -> int:
    """Bytes of the whole checkpoint at ``dtype`` (quantised linears, 16-bit rest)."""
    linear = model.num_layers * _layer_linear_params(model)
    rest = model.param_count() - linear
    return int(linear * _linear_bytes_per_param(dtype) + rest * _unquantised_bytes(dtype))


def _stage_weight_bytes(model: ModelSpec, dtype: Dtype, par: Parallelism, stage: int) -> float:
    """Weights on one GPU of pipeline stage ``stage`` (linears sharded by TP; vocab-parallel)."""
    layers = _layers_of_stage(model.num_layers, par.pp, stage)
    per_layer_linear = _layer_linear_params(model) * _linear_bytes_per_param(dtype) / par.tp
    per_layer_rest = (model.attention_params_per_layer() - _attention_weight_params(model)) / par.tp
    per_layer_rest += 2 * model.hidden_size
    if model.is_moe:
        per_layer_rest += model.hidden_size * model.num_experts
    table = model.vocab_size * model.hidden_size / par.tp
    tables = 0.0
    if stage == 0:
        tables += table
    if stage == par.pp - 1 and not (model.tie_word_embeddings and par.pp == 1):
        tables += table
    rest = layers * per_layer_rest + tables + model.hidden_size
    return layers * per_layer_linear + rest * _unquantised_bytes(dtype)


def _attention_weight_params(model: ModelSpec) -> int:
    return model.hidden_size * (2 * model.q_dim + 2 * model.kv_dim)


def _layers_of_stage(num_layers: int, pp: int, stage: int) -> int:
    """Layers are split as evenly as possible; the first stages take the remainder."""
    base, extra = divmod(num_layers, pp)
    return base + (1 if stage < extra else 0)


def _kv_bytes_per_token_on_gpu(model: ModelSpec, kv_dtype: Dtype, par: Parallelism) -> float:
    heads_per_gpu = max(1, model.num_kv_heads // par.tp)
    layers = _layers_of_stage(model.num_layers, par.pp, 0)  # the most loaded stage
    return 2 * layers * heads_per_gpu * model.head_dim * kv_dtype.bytes


def activation_bytes(model: ModelSpec, par: Parallelism, limits: EngineLimits) -> float:
    """Peak activation workspace of one forward over ``max_num_batched_tokens`` tokens.

    The largest live tensors are the MLP's gate/up output and the attention projections of
    the whole token batch, a few hidden-sized buffers, and the sampler's fp32 logits for every
    running sequence. This tracks the "activation peak" vLLM profiles at start-up.
    """
    tokens = limits.max_num_batched_tokens
    mlp_width = 2 * model.intermediate_size * (model.experts_per_token if model.is_moe else 1)
    width = (mlp_width + model.q_dim + 2 * model.kv_dim) / par.tp + 4 * model.hidden_size
    logits = min(limits.max_num_seqs, tokens) * model.vocab_size * 4.0 / par.tp
    return tokens * width * 2.0 + logits


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Per-GPU memory of one replica (bytes) and the KV capacity that follows."""

    total: int
    usable: int
    weights: int
    activation: int
    overhead: int
    kv_cache: int
    kv_bytes_per_token: int
    kv_bytes_per_token_per_gpu: float
    block_size: int
    max_num_seqs: int

    @property
    def fits(self) -> bool:
        """Weights, workspace and at least one KV block fit in the usable memory."""
        return self.kv_blocks >= 1

    @property
    def kv_blocks(self) -> int:
        if self.kv_cache <= 0:
            return 0
        return int(self.kv_cache // (self.block_size * self.kv_bytes_per_token_per_gpu))

    @property
    def kv_tokens(self) -> int:
        """Tokens the replica's KV cache holds (all sequences together)."""
        return self.kv_blocks * self.block_size

    def max_concurrency(self, context_tokens: int) -> int:
        """Sequences of ``context_tokens`` each that fit at once (block-rounded, ≤ max_num_seqs)."""
        if context_tokens < 1:
            raise ValueError(f"context_tokens must be at least 1, got {context_tokens}")
        blocks_per_seq = math.ceil(context_tokens / self.block_size)
        return min(self.kv_blocks // blocks_per_seq, self.max_num_seqs)


def memory_plan(
    model: ModelSpec,
    gpu: GPUSpec,
    *,
    parallel: Parallelism | None = None,
    weights_dtype: Dtype = Dtype.BF16,
    kv_dtype: Dtype = Dtype.BF16,
    limits: EngineLimits | None = None,
    overheads: Overheads | None = None,
) -> MemoryPlan:
    """Lay out one GPU of a replica of ``model`` on ``gpu`` (the most loaded GPU of the replica)."""
    par = parallel or Parallelism()
    lim = limits or EngineLimits()
    ovh = overheads or Overheads()
    par.check(model)
    total = gpu.memory_bytes
    usable = int(total * lim.gpu_memory_utilization)
    weights = max(_stage_weight_bytes(model, weights_dtype, par, s) for s in range(par.pp))
    activation = activation_bytes(model, par, lim)
    overhead = ovh.base + ovh.cuda_graphs + (ovh.collective if par.gpus > 1 else 0.0)
    kv_cache = usable - weights - activation - overhead
    return MemoryPlan(
        total=total,
        usable=usable,
        weights=int(weights),
        activation=int(activation),
        overhead=int(overhead),
        kv_cache=int(kv_cache),
        kv_bytes_per_token=kv_bytes_per_token(model, kv_dtype),
        kv_bytes_per_token_per_gpu=_kv_bytes_per_token_on_gpu(model, kv_dtype, par),
        block_size=lim.block_size,
        max_num_seqs=lim.max_num_seqs,
    )
