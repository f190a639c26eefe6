"""Step time: how long one engine iteration takes for a given batch, on a given GPU setup.

One iteration (vLLM's "step") runs every scheduled token through the model once: prompt
tokens of sequences that are prefilling (whole prompts or chunks of them) and one token for
each decoding sequence. There is no separate prefill phase; the batch says how many tokens of
each kind the step carries, aggregated so that evaluating it is O(1)::

    model = StepTimeModel(get_model("llama-3.1-8b"), get_gpu("h100-sxm"))
    batch = BatchShape.prefill(512, cached=1024) + BatchShape.decode([900, 2000, 35])
    model.step_time(batch).seconds        # 0.015 with the packaged constants
    model.decode_time(64, 2048)           # 64 sequences at 2048 tokens of context each
    model.decode_seconds(64, 64 * 2048)   # the same step from its sums, without dataclasses

The model is a roofline per kernel family, summed (kernels run one after another)::

    step = stage + pipeline_bubble + overhead
    stage = linear + attention + elementwise + communication   (one GPU of one pipeline stage)
    linear      = Σ_layers R(FLOPs / achievable FLOP/s, weight bytes / achievable bandwidth)
    attention   = Σ_layers [R(prefill pairs' FLOPs, prefill KV bytes)     (chunks and decodes:
                            + R(decode pairs' FLOPs, decode KV bytes)]      separate rooflines)
    elementwise = Σ_layers (fixed per-layer floor + activation bytes / achievable bandwidth)
    R(c, m)     = (c^p + m^p)^(1/p)                        (smooth roofline; p = inf is max)

The GEMMs of a step run over all its tokens at once, so prompt and decode tokens share one
weight read; their attention does not share a roofline (a decode batch's KV streaming adds to a
prompt chunk's attention compute instead of hiding under it, as measured on H100).

docs/perf-model.md derives every term and reports the error against published measurements.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from gpufleet.catalog import GPUSpec, ModelSpec
from gpufleet.perf._calibration import Efficiency, efficiency_for
from gpufleet.perf._dtype import KV_DTYPES, Dtype
from gpufleet.perf._memory import Parallelism, _linear_bytes_per_param

# All-reduces, the logits gather and pipeline hand-offs move 16-bit activations.
_ACTIVATION_BYTES = 2.0
# The LM head, embeddings, norms and routers stay 16-bit in quantised checkpoints.
_HEAD_BYTES_PER_PARAM = 2.0


class Bound(StrEnum):
    """Which roof dominates a step: FLOPs or bytes."""

    COMPUTE = "compute"
    MEMORY = "memory"


@dataclass(frozen=True, slots=True)
class BatchShape:
    """What one engine iteration runs, aggregated over its sequences.

    A prefilling sequence adds a chunk of ``n`` new tokens on top of ``c`` tokens already in
    its KV cache (``c = 0`` for the first chunk). Causal attention makes new token ``i`` attend
    to ``c + i`` positions::

        KV:    [ c cached tokens ][ n new tokens ]
        token c+1 attends ────────────────► c+1 positions
        token c+n attends ─────────────────────────────► c+n positions
        Σ attended = n·c + n(n+1)/2        (prefill_attn_context)

    A decoding sequence adds one token and attends to its whole context (``decode_context``
    sums the context lengths). Sums over sequences add, so ``a + b`` is the batch that runs
    ``a`` and ``b`` together.

    ``prefill_context`` (Σ of ``c + n``) is what the attention kernel streams from the KV cache
    for the prefilling sequences; ``BatchShape.prefill`` fills it. Left at 0 in a hand-built
    batch, only the chunk's own ``n`` tokens are counted: exact for whole prompts, low for small
    chunks on long cached prefixes.
    """

    prefill_tokens: int = 0
    """New prompt tokens in this step (whole prompts or chunks)."""
    prefill_seqs: int = 0
    """Sequences contributing prefill tokens."""
    prefill_attn_context: int = 0
    """Σ over prefill tokens of the positions each attends to (see the diagram)."""
    decode_seqs: int = 0
    """Sequences decoding one token each."""
    decode_context: int = 0
    """Σ of the decoding sequences' context lengths (tokens in their KV cache)."""
    prefill_context: int = 0
    """Σ over prefilling sequences of their context after this step (cached + new tokens)."""

    def __post_init__(self) -> None:
        for name in _BATCH_FIELDS:
            if getattr(self, name) < 0:
                raise ValueError(f"BatchShape.{name} must be >= 0, got {getattr(self, name)}")
        if self.prefill_tokens == 0:
            if self.prefill_seqs or self.prefill_attn_context:
                raise ValueError(
                    "BatchShape has prefill_seqs or prefill_attn_context but no prefill_tokens"
                )
        elif not 1 <= self.prefill_seqs <= self.prefill_tokens:
            raise ValueError(
                f"BatchShape.prefill_seqs must be in [1, prefill_tokens={self.prefill_tokens}], "
                f"got {self.prefill_seqs}"
            )
        elif self.prefill_attn_context < self.prefill_tokens:
            raise ValueError(
                f"BatchShape.prefill_attn_context ({self.prefill_attn_context}) must be at least "
                f"prefill_tokens ({self.prefill_tokens}): every token attends to itself; "
                "build prefill batches with BatchShape.prefill(new_tokens, cached)"
            )
        if self.prefill_context > self.prefill_attn_context:
            raise ValueError(
                f"BatchShape.prefill_context ({self.prefill_context}) cannot exceed "
                f"prefill_attn_context ({self.prefill_attn_context})"
            )
        if self.decode_context < self.decode_seqs:
            raise ValueError(
                f"BatchShape.decode_context ({self.decode_context}) must be at least decode_seqs "
                f"({self.decode_seqs}): every decoding sequence has at least one token of context"
            )

    @classmethod
    def prefill(cls, new_tokens: int, cached: int = 0) -> BatchShape:
        """One sequence prefilling ``new_tokens`` on top of ``cached`` tokens already in KV."""
        if new_tokens < 1:
            raise ValueError(f"a prefill chunk needs at least one new token, got {new_tokens}")
        if cached < 0:
            raise ValueError(f"cached tokens must be >= 0, got {cached}")
        attended = new_tokens * cached + new_tokens * (new_tokens + 1) // 2
        return cls(
            prefill_tokens=new_tokens,
            prefill_seqs=1,
            prefill_attn_context=attended,
            prefill_context=cached + new_tokens,
        )

    @classmethod
    def decode(cls, context_lengths: Iterable[int]) -> BatchShape:
        """Sequences decoding one token each, with these context lengths."""
        seqs = total = 0
        for length in context_lengths:
            if length < 1:
                raise ValueError(f"a decoding sequence needs context >= 1, got {length}")
            seqs += 1
            total += length
        return cls(decode_seqs=seqs, decode_context=total)

    @classmethod
    def uniform_decode(cls, seqs: int, context: int) -> BatchShape:
        """``seqs`` sequences decoding, each with ``context`` tokens of context."""
        if seqs < 0 or (seqs and context < 1):
            raise ValueError(f"need seqs >= 0 and context >= 1, got seqs={seqs} context={context}")
        return cls(decode_seqs=seqs, decode_context=seqs * context)

    def __add__(self, other: BatchShape) -> BatchShape:
        if not isinstance(other, BatchShape):
            return NotImplemented
        return BatchShape(
            self.prefill_tokens + other.prefill_tokens,
            self.prefill_seqs + other.prefill_seqs,
            self.prefill_attn_context + other.prefill_attn_context,
            self.decode_seqs + other.decode_seqs,
            self.decode_context + other.decode_context,
            self.prefill_context + other.prefill_context,
        )

    @property
    def is_empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_seqs == 0

    @property
    def tokens(self) -> int:
        """Tokens that run through the model in this step."""
        return self.prefill_tokens + self.decode_seqs

    @property
    def seqs(self) -> int:
        return self.prefill_seqs + self.decode_seqs


_BATCH_FIELDS = (
    "prefill_tokens",
    "prefill_seqs",
    "prefill_attn_context",
    "decode_seqs",
    "decode_context",
    "prefill_context",
)


@dataclass(frozen=True, slots=True)
class StepTime:
    """One step's duration and where it goes (all in seconds).

    ``seconds = linear + attention + elementwise + communication + pipeline_bubble + overhead``.
    ``compute`` and ``memory`` are the roofs the kernel terms combine: the step's FLOPs at
    achievable FLOP/s and its bytes (weights, KV cache, activations) at achievable bandwidth,
    on one GPU of one stage. They overlap, so they do not add up to ``seconds``; ``bound``
    names the larger.
    """

    seconds: float
    linear: float
    """Linear layers and LM head (GEMMs): weights read once, FLOPs per token."""
    attention: float
    """Attention kernels: KV reads and writes, FLOPs per attended pair; the prefill chunks'
    and the decoding sequences' parts each under their own roofline, added."""
    elementwise: float
    """Norms, rotary, activation and residual kernels: a per-layer floor plus their bytes."""
    communication: float
    """Tensor-parallel all-reduces (two per layer) and the logits gather."""
    pipeline_bubble: float
    """Time this batch waits on the other pipeline stages (0 when pp = 1)."""
    overhead: float
    """Per-step CPU work the GPU waits for (scheduling, sampling), calibrated."""
    compute: float
    memory: float
    bound: Bound
    interval: float
    """Time between step completions when ``pp`` batches are in flight (= seconds at pp = 1)."""


_DecodeTerms = tuple[float, float, float, float, float]
"""(linear, elementwise, communication, pipeline hand-off, overhead) of a decode-only step."""

_EMPTY = StepTime(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, Bound.MEMORY, 0.0)


class StepTimeModel:
    """Step times of one model on one GPU type, split ``tp`` ways per stage and ``pp`` stages.

    Everything that depends only on the setup is computed here, so ``step_time`` is a few dozen
    float operations. All quantities are per GPU of the most loaded pipeline stage.
    """

    def __init__(
        self,
        model: ModelSpec,
        gpu: GPUSpec,
        *,
        tp: int = 1,
        pp: int = 1,
        weights_dtype: Dtype = Dtype.BF16,
        kv_dtype: Dtype = Dtype.BF16,
        efficiency: Efficiency | None = None,
    ) -> None:
        Parallelism(tp=tp, pp=pp).check(model)
        if kv_dtype not in KV_DTYPES:
            allowed = ", ".join(sorted(KV_DTYPES))
            raise ValueError(f"kv_dtype {kv_dtype!r} is not a KV-cache dtype; expected {allowed}")
        eff = efficiency if efficiency is not None else efficiency_for(gpu)
        self.model = model
        self.gpu = gpu
        self.tp = tp
        self.pp = pp
        self.weights_dtype = weights_dtype
        self.kv_dtype = kv_dtype
        self.efficiency = eff

        self._layers = math.ceil(model.num_layers / pp)
        self._count_work(model, tp, weights_dtype, kv_dtype)
        self._set_rates(gpu, weights_dtype, eff)
        self._set_links(model, gpu, tp, pp, eff)
        self._layer_floor = eff.layer_overhead_s
        self._step_overhead = eff.step_overhead_s
        self._prefill_overhead = eff.prefill_overhead_s
        self._seq_overhead = eff.sequence_overhead_s
        self._decode_terms: dict[int, _DecodeTerms] = {}
        """``decode_seconds``' terms that depend on the batch size only, by batch size."""

    def _count_work(self, model: ModelSpec, tp: int, weights: Dtype, kv: Dtype) -> None:
        """FLOPs and bytes per token, per layer and GPU (q and o sharded by tp, k and v by head)."""
        h = model.hidden_size
        kv_heads = max(1, model.num_kv_heads // tp)  # replicated when tp > kv heads
        bytes_per_param = _linear_bytes_per_param(weights)
        attn_params = 2 * h * model.q_dim / tp + 2 * h * kv_heads * model.head_dim
        expert_params = model.expert_params() / tp
        router_params = h * model.num_experts if model.is_moe else 0
        dense_params = attn_params + (0.0 if model.is_moe else expert_params)
        self._dense_flops_per_token = 2.0 * (dense_params + router_params)
        self._dense_bytes = dense_params * bytes_per_param + router_params * _HEAD_BYTES_PER_PARAM
        self._moe = model.is_moe
        self._experts = float(model.num_experts)
        self._expert_miss = 1.0 - model.experts_per_token / model.num_experts
        self._moe_flops_per_token = 2.0 * model.experts_per_token * expert_params
        self._expert_bytes = expert_params * bytes_per_param
        head_params = model.vocab_size * h / tp
        self._head_flops_per_logit = 2.0 * head_params
        self._head_bytes = head_params * _HEAD_BYTES_PER_PARAM
        self._attn_flops_per_pair = 4.0 * model.q_dim / tp
        self._kv_bytes_per_token = 2.0 * kv_heads * model.head_dim * kv.bytes
        # Elementwise traffic: SwiGLU's silu-and-mul reads 2 and writes 1 intermediate vector
        # per active expert, two fused add-norms read and write 4 hidden vectors each, rotary
        # reads and writes q and k.
        act_elements = (
            3 * model.experts_per_token * model.intermediate_size / tp
            + 8 * h
            + 2 * (model.q_dim / tp + kv_heads * model.head_dim)
        )
        self._act_bytes_per_token = act_elements * _ACTIVATION_BYTES

    def _set_rates(self, gpu: GPUSpec, weights: Dtype, eff: Efficiency) -> None:
        """Achievable FLOP/s and bytes/s: datasheet peaks times the calibrated fractions."""
        peak16 = (gpu.fp16_tflops if weights is Dtype.FP16 else gpu.bf16_tflops) * 1e12
        self._linear_rate = _linear_flops_rate(gpu, weights, eff)
        self._head_rate = peak16 * eff.gemm_flops_fraction
        self._attn_rate = peak16 * eff.attention_flops_fraction
        self._bandwidth = gpu.memory_bandwidth_gb_s * 1e9 * eff.memory_bandwidth_fraction
        self._kv_bandwidth = gpu.memory_bandwidth_gb_s * 1e9 * eff.kv_bandwidth_fraction
        # Attention, per layer: seconds per attended (query, key) pair at the attention FLOP
        # rate, and per KV-cache token read or written at the KV bandwidth.
        self._attn_s_per_pair = self._attn_flops_per_pair / self._attn_rate
        self._kv_s_per_token = self._kv_bytes_per_token / self._kv_bandwidth
        p = eff.roofline_exponent
        self._p = p if math.isfinite(p) else None
        self._inv_p = 1.0 / p if math.isfinite(p) else 0.0

    def _set_links(self, model: ModelSpec, gpu: GPUSpec, tp: int, pp: int, eff: Efficiency) -> None:
        """All-reduce and pipeline hand-off costs over the GPU's scale-up link, else PCIe."""
        link = gpu.interconnect
        if link.has_scale_up_link and link.gpu_link_gb_s is not None:
            link_gb_s = link.gpu_link_gb_s / 2.0  # the catalog quotes both directions together
        else:
            link_gb_s = link.pcie_gb_s
        link_eff = eff.link(link.kind)
        link_bw = link_gb_s * 1e9 * link_eff.bandwidth_fraction
        act = _ACTIVATION_BYTES
        self._ar_latency = self._ar_s_per_token = self._gather_s_per_logit = 0.0
        self._allreduces = 0
        if tp > 1:  # a ring all-reduce sends and receives 2(tp-1)/tp of the message
            self._ar_latency = link_eff.allreduce_latency_s
            self._ar_s_per_token = 2.0 * (tp - 1) / tp * model.hidden_size * act / link_bw
            self._gather_s_per_logit = (tp - 1) / tp * model.vocab_size * act / link_bw
            self._allreduces = 2 * self._layers + 1  # two per layer + vocab-parallel embedding
        self._p2p_latency = eff.pipeline_transfer_latency_s if pp > 1 else 0.0
        self._p2p_s_per_token = model.hidden_size * act / link_bw if pp > 1 else 0.0

    @property
    def weight_bytes_per_gpu(self) -> float:
        """Weight bytes one GPU streams per step when every expert is touched."""
        experts = self._experts if self._moe else 0.0
        per_layer = self._dense_bytes + experts * self._expert_bytes
        return self._layers * per_layer + self._head_bytes

    @property
    def achievable_bandwidth(self) -> float:
        """Bytes per second one GPU streams from HBM (peak × calibrated fraction)."""
        return self._bandwidth

    def step_time(self, batch: BatchShape) -> StepTime:
        """The duration of one iteration that runs ``batch`` (zero for an empty batch)."""
        tokens = batch.prefill_tokens + batch.decode_seqs
        if tokens == 0:
            return _EMPTY
        seqs = batch.prefill_seqs + batch.decode_seqs  # each produces logits (vLLM V1)
        layers = self._layers
        bw = self._bandwidth

        dense_c = tokens * self._dense_flops_per_token / self._linear_rate
        dense_m = self._dense_bytes / bw
        compute = layers * dense_c
        memory = layers * dense_m
        linear = layers * self._roof(dense_c, dense_m)
        if self._moe:
            touched = self._experts * (1.0 - math.pow(self._expert_miss, tokens))
            moe_c = tokens * self._moe_flops_per_token / self._linear_rate
            moe_m = touched * self._expert_bytes / bw
            compute += layers * moe_c
            memory += layers * moe_m
            linear += layers * self._roof(moe_c, moe_m)
        head_c = seqs * self._head_flops_per_logit / self._head_rate
        head_m = self._head_bytes / bw
        compute += head_c
        memory += head_m
        linear += self._roof(head_c, head_m)

        # Prefill chunks and decoding sequences are separate attention work, each under its own
        # roofline, and the two add: a decode batch's KV reads do not hide under a chunk's FLOPs.
        # FlashInfer runs them as separate kernels; a single varlen FlashAttention launch gives
        # them separate thread blocks, the decode ones bound by HBM and the chunk's by math. On
        # H100 a decode batch added to a chunk costs its whole KV-streaming time (measured mixed
        # steps, docs/perf-model.md). A chunk streams its context once per layer (its query tiles
        # share it through L2), a decoding sequence its whole context; every new token's K and V
        # are written.
        prefill_reads = max(batch.prefill_context, batch.prefill_tokens)
        pre_c = batch.prefill_attn_context * self._attn_s_per_pair
        pre_m = (prefill_reads + batch.prefill_tokens) * self._kv_s_per_token
        dec_c = batch.decode_context * self._attn_s_per_pair
        dec_m = (batch.decode_context + batch.decode_seqs) * self._kv_s_per_token
        compute += layers * (pre_c + dec_c)
        memory += layers * (pre_m + dec_m)
        prefill_attn = self._roof(pre_c, pre_m) if pre_m else 0.0
        attention = layers * (prefill_attn + (self._roof(dec_c, dec_m) if dec_m else 0.0))

        act_m = tokens * self._act_bytes_per_token / bw
        memory += layers * act_m
        elementwise = layers * (self._layer_floor + act_m)

        communication = 0.0
        if self._allreduces:
            per_allreduce = self._ar_latency + tokens * self._ar_s_per_token
            gather = self._ar_latency + seqs * self._gather_s_per_logit
            communication = self._allreduces * per_allreduce + gather

        stage = linear + attention + elementwise + communication
        bubble = 0.0
        hand_off = 0.0
        if self.pp > 1:
            hand_off = self._p2p_latency + tokens * self._p2p_s_per_token
            bubble = (self.pp - 1) * (stage + hand_off)
        overhead = self._step_overhead + seqs * self._seq_overhead
        if batch.prefill_tokens:
            overhead += self._prefill_overhead
        return StepTime(
            seconds=stage + bubble + overhead,
            linear=linear,
            attention=attention,
            elementwise=elementwise,
            communication=communication,
            pipeline_bubble=bubble,
            overhead=overhead,
            compute=compute,
            memory=memory,
            bound=Bound.COMPUTE if compute >= memory else Bound.MEMORY,
            interval=stage + hand_off + overhead,
        )

    def decode_seconds(self, seqs: int, context: int) -> float:
        """``step_time(BatchShape(decode_seqs=seqs, decode_context=context)).seconds``, bit for bit.

        The same float operations in the same order, building neither dataclass (about 1 µs
        instead of 8): a decode-only step of ``seqs`` sequences whose contexts sum to
        ``context``. The terms that depend on ``seqs`` alone are computed once per ``seqs``
        and kept (a replica sees at most ``max_num_seqs`` sizes); the attention term is
        computed on every call. The replica model's fast-forward over pure-decode steps calls
        it once per step.
        """
        if seqs <= 0 or context < seqs:
            if seqs == 0 and context >= 0:
                return 0.0  # the empty batch
            raise ValueError(
                f"a decode step needs seqs >= 0 and context >= seqs, got seqs={seqs} "
                f"context={context}"
            )
        terms = self._decode_terms.get(seqs)
        if terms is None:
            terms = self._decode_terms[seqs] = self._decode_step_terms(seqs)
        linear, elementwise, communication, hand_off, overhead = terms
        # step_time's attention with no prefill chunk: its prefill term is 0.0, and
        # 0.0 + x is x for every x >= 0. The roofline is _roof, inlined (same operations).
        dec_c = context * self._attn_s_per_pair
        dec_m = (context + seqs) * self._kv_s_per_token
        roof = 0.0
        if dec_m:
            roof = dec_c if dec_c > dec_m else dec_m
            if self._p is not None and roof != 0.0:
                small = (dec_c + dec_m - roof) / roof
                roof = roof * math.pow(1.0 + math.pow(small, self._p), self._inv_p)
        attention = self._layers * (0.0 + roof)
        stage = linear + attention + elementwise + communication
        bubble = (self.pp - 1) * (stage + hand_off) if self.pp > 1 else 0.0
        return stage + bubble + overhead

    def decode_run_seconds(
        self, seqs: int, context: int, count: int, slowdown: float = 1.0
    ) -> list[float]:
        """``[decode_seconds(seqs, context + i·seqs) × slowdown for i in range(count)]``, bit
        for bit: the durations of ``count`` consecutive pure-decode steps of ``seqs``
        sequences (each step adds one token to every context).

        The same float operations as :meth:`decode_seconds` in the same order, in one loop
        with no call per step (the replica model prices its decode runs with it). The terms
        that ``decode_seconds`` adds as ``0.0`` (the prefill attention, the bubble at
        ``pp = 1``) are left out: ``x + 0.0`` is ``x`` for every ``x >= 0``.
        """
        if count <= 0:
            return []
        if seqs <= 0 or context < seqs or not self._kv_s_per_token > 0:
            # errors, the empty batch, and a roofline with no memory term: one by one
            return [self.decode_seconds(seqs, context + i * seqs) * slowdown for i in range(count)]
        terms = self._decode_terms.get(seqs)
        if terms is None:
            terms = self._decode_terms[seqs] = self._decode_step_terms(seqs)
        linear, elementwise, communication, hand_off, overhead = terms
        attn, kv, layers, p, inv_p = (
            self._attn_s_per_pair,
            self._kv_s_per_token,
            self._layers,
            self._p,
            self._inv_p,
        )
        pow_ = math.pow
        bubbles = self.pp - 1 if self.pp > 1 else 0
        out: list[float] = []
        append = out.append
        for ctx in range(context, context + count * seqs, seqs):
            dec_c = ctx * attn
            dec_m = (ctx + seqs) * kv
            roof = dec_c if dec_c > dec_m else dec_m
            if p is not None and roof != 0.0:
                roof = roof * pow_(1.0 + pow_((dec_c + dec_m - roof) / roof, p), inv_p)
            stage = linear + layers * roof + elementwise + communication
            if bubbles:
                append((stage + bubbles * (stage + hand_off) + overhead) * slowdown)
            else:
                append((stage + overhead) * slowdown)
        return out

    def _decode_step_terms(self, seqs: int) -> _DecodeTerms:
        """``step_time``'s linear, elementwise, communication, hand-off and overhead terms for
        ``seqs`` decoding sequences (one token each), computed as ``step_time`` does."""
        tokens = seqs
        layers = self._layers
        bw = self._bandwidth
        dense_c = tokens * self._dense_flops_per_token / self._linear_rate
        dense_m = self._dense_bytes / bw
        linear = layers * self._roof(dense_c, dense_m)
        if self._moe:
            touched = self._experts * (1.0 - math.pow(self._expert_miss, tokens))
            moe_c = tokens * self._moe_flops_per_token / self._linear_rate
            moe_m = touched * self._expert_bytes / bw
            linear += layers * self._roof(moe_c, moe_m)
        head_c = seqs * self._head_flops_per_logit / self._head_rate
        head_m = self._head_bytes / bw
        linear += self._roof(head_c, head_m)
        act_m = tokens * self._act_bytes_per_token / bw
        elementwise = layers * (self._layer_floor + act_m)
        communication = 0.0
        if self._allreduces:
            per_allreduce = self._ar_latency + tokens * self._ar_s_per_token
            gather = self._ar_latency + seqs * self._gather_s_per_logit
            communication = self._allreduces * per_allreduce + gather
        hand_off = self._p2p_latency + tokens * self._p2p_s_per_token if self.pp > 1 else 0.0
        overhead = self._step_overhead + seqs * self._seq_overhead
        return linear, elementwise, communication, hand_off, overhead

    def prefill_time(self, tokens: int, cached: int = 0) -> float:
        """Seconds for one step that prefills ``tokens`` of one sequence on top of ``cached``."""
        return self.step_time(BatchShape.prefill(tokens, cached)).seconds

    def decode_time(self, batch: int, context: int) -> float:
        """Seconds for one decode step of ``batch`` sequences with ``context`` tokens each."""
        return self.step_time(BatchShape.uniform_decode(batch, context)).seconds

    def _roof(self, compute: float, memory: float) -> float:
        # smooth_roofline with the exponent bound at construction (this runs ~6x per step)
        big = compute if compute > memory else memory
        if self._p is None or big == 0.0:
            return big
        small = (compute + memory - big) / big
        return big * math.pow(1.0 + math.pow(small, self._p), self._inv_p)


def smooth_roofline(compute_s: float, memory_s: float, exponent: float) -> float:
    """Time of a kernel that needs ``compute_s`` at full FLOP rate and ``memory_s`` at full
    bandwidth: ``(compute_s**p + memory_s**p)**(1/p)``, ``max`` for ``p = inf``.

    It is never below either roof and at most ``2**(1/p)`` above the larger, reached at the
    ridge point where both are equal (26 % for p = 3). Being a p-norm it is subadditive, so
    one kernel over two batches is never slower than two kernels, one per batch.
    """
    big = max(compute_s, memory_s)
    if not math.isfinite(exponent) or big == 0.0:
        return big
    small = min(compute_s, memory_s) / big
    return big * math.pow(1.0 + math.pow(small, exponent), 1.0 / exponent)


def _linear_flops_rate(gpu: GPUSpec, dtype: Dtype, eff: Efficiency) -> float:
    """Achievable FLOP/s of the linear layers for weights stored as ``dtype``.

    fp8/int8 weights compute in 8 bits (W8A8) where the GPU has the tensor-core rate; without
    it they are weight-only, dequantised to 16 bits like int4 (W4A16). fp32 runs as TF32.
    """
    if dtype is Dtype.FP8 and gpu.fp8_tflops is not None:
        return gpu.fp8_tflops * 1e12 * eff.quantized_gemm_flops_fraction
    if dtype is Dtype.INT8 and gpu.int8_tops is not None:
        return gpu.int8_tops * 1e12 * eff.quantized_gemm_flops_fraction
    if dtype is Dtype.FP16:
        return gpu.fp16_tflops * 1e12 * eff.gemm_flops_fraction
    if dtype is Dtype.FP32:
        return gpu.bf16_tflops * 0.5e12 * eff.gemm_flops_fraction
    return gpu.bf16_tflops * 1e12 * eff.gemm_flops_fraction
