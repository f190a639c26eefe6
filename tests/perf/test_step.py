"""The step-time model: batch arithmetic, the roofline's regimes, parallelism and dtypes."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gpufleet.catalog import GPUSpec, Interconnect, LinkKind, get_gpu, get_model
from gpufleet.perf import BatchShape, Bound, Dtype, StepTime, StepTimeModel
from gpufleet.perf._step import smooth_roofline
from tests.factories import make_70b, make_gpu, make_model


def h100_8b(**kwargs: Any) -> StepTimeModel:
    return StepTimeModel(get_model("llama-3.1-8b"), get_gpu("h100-sxm"), **kwargs)


def parts(t: StepTime) -> float:
    return t.linear + t.attention + t.elementwise + t.communication + t.pipeline_bubble + t.overhead


# --- BatchShape ------------------------------------------------------------------------------


def test_prefill_counts_causal_attention_by_hand() -> None:
    # 4 new tokens on 10 cached: they attend to 11, 12, 13 and 14 positions.
    batch = BatchShape.prefill(4, cached=10)
    assert batch == BatchShape(
        prefill_tokens=4, prefill_seqs=1, prefill_attn_context=50, prefill_context=14
    )
    assert BatchShape.prefill(3).prefill_attn_context == 1 + 2 + 3


def test_decode_sums_contexts_and_batches_add() -> None:
    decode = BatchShape.decode([100, 28])
    assert (decode.decode_seqs, decode.decode_context) == (2, 128)
    assert BatchShape.uniform_decode(2, 64) == BatchShape(decode_seqs=2, decode_context=128)
    both = BatchShape.prefill(4, cached=10) + decode
    assert both == BatchShape(4, 1, 50, 2, 128, prefill_context=14)
    assert (both.tokens, both.seqs) == (6, 3)
    assert BatchShape().is_empty
    assert not both.is_empty


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill_tokens": -1}, "prefill_tokens must be >= 0"),
        ({"decode_seqs": 2, "decode_context": 1}, "at least decode_seqs"),
        ({"prefill_seqs": 1}, "no prefill_tokens"),
        ({"prefill_tokens": 8, "prefill_seqs": 0, "prefill_attn_context": 36}, "prefill_seqs"),
        ({"prefill_tokens": 8, "prefill_seqs": 1}, "BatchShape.prefill"),
        (
            {
                "prefill_tokens": 2,
                "prefill_seqs": 1,
                "prefill_attn_context": 3,
                "prefill_context": 9,
            },
            "cannot exceed",
        ),
    ],
)
def test_bad_batches_are_rejected(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchShape(**kwargs)


def test_bad_helper_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="at least one new token"):
        BatchShape.prefill(0)
    with pytest.raises(ValueError, match="cached tokens must be >= 0"):
        BatchShape.prefill(5, cached=-1)
    with pytest.raises(ValueError, match="context >= 1"):
        BatchShape.decode([5, 0])
    with pytest.raises(ValueError, match="context >= 1"):
        BatchShape.uniform_decode(3, 0)


# --- StepTimeModel: construction ----------------------------------------------------------------


def test_bad_setups_raise_clear_errors() -> None:
    model, gpu = get_model("llama-3.1-8b"), get_gpu("h100-sxm")
    with pytest.raises(ValueError, match="tp and pp must be at least 1"):
        StepTimeModel(model, gpu, tp=0)
    with pytest.raises(ValueError, match="tp and pp must be at least 1"):
        StepTimeModel(model, gpu, pp=0)
    with pytest.raises(ValueError, match=r"tp=3 does not divide .* 32 attention heads"):
        StepTimeModel(model, gpu, tp=3)
    with pytest.raises(ValueError, match="not a KV-cache dtype"):
        StepTimeModel(model, gpu, kv_dtype=Dtype.INT4)


# --- the two regimes -------------------------------------------------------------------------


def test_decode_at_batch_one_streams_the_weights() -> None:
    model = h100_8b()
    t = model.step_time(BatchShape.uniform_decode(1, 512))
    assert t.bound is Bound.MEMORY
    streaming = model.weight_bytes_per_gpu / model.achievable_bandwidth
    # Llama-3.1-8B streams its 15 GB of non-embedding weights (the LM head included).
    assert model.weight_bytes_per_gpu == pytest.approx(15.0e9, rel=0.01)
    assert t.linear == pytest.approx(streaming, rel=0.01)
    assert t.seconds == pytest.approx(streaming + t.elementwise + t.overhead, rel=0.02)


def test_large_prefill_is_compute_bound() -> None:
    model = h100_8b()
    t = model.step_time(BatchShape.prefill(8192))
    assert t.bound is Bound.COMPUTE
    gpu, eff = model.gpu, model.efficiency
    flops = 2 * 8192 * (get_model("llama-3.1-8b").param_count() - 2 * 128256 * 4096)
    assert t.linear == pytest.approx(
        flops / (gpu.bf16_tflops * 1e12 * eff.gemm_flops_fraction), rel=0.02
    )
    assert t.linear > 10 * t.overhead


def test_breakdown_adds_up() -> None:
    for model in (h100_8b(), h100_8b(pp=2), StepTimeModel(make_70b(), get_gpu("h100-sxm"), tp=4)):
        t = model.step_time(
            BatchShape.prefill(700, cached=300) + BatchShape.uniform_decode(40, 900)
        )
        assert t.seconds == pytest.approx(parts(t))
        assert t.seconds > 0


def test_empty_batch_takes_no_time() -> None:
    assert h100_8b().step_time(BatchShape()).seconds == 0.0


def test_conveniences_match_step_time() -> None:
    model = h100_8b()
    assert (
        model.prefill_time(300, cached=100) == model.step_time(BatchShape.prefill(300, 100)).seconds
    )
    assert (
        model.decode_time(16, 1000) == model.step_time(BatchShape.uniform_decode(16, 1000)).seconds
    )


# --- monotonicity --------------------------------------------------------------------------------


def test_more_tokens_batch_or_context_never_runs_faster() -> None:
    model = h100_8b()
    prefill = [model.prefill_time(n) for n in (1, 16, 128, 512, 2048, 8192)]
    batch = [model.decode_time(b, 1024) for b in (1, 2, 8, 32, 128, 512)]
    context = [model.decode_time(32, c) for c in (1, 128, 1024, 8192, 65536)]
    for series in (prefill, batch, context):
        assert series == sorted(series)
        assert series[0] < series[-1]


# --- mixed prefill + decode steps --------------------------------------------------------------
#
# Measured on H100 (Llama-3.1-8B, docs/perf-model.md "Mixed steps"): a decode batch of 64 at
# context 2048 adds 9.2-12.1 ms to a 256-4096-token chunk step against 14.25 ms as its own step,
# and the saving of one mixed step over the two steps apart shrinks from ~5 ms at L = 256 to
# ~2-3 ms at L >= 2048: the decode's weight read is shared, its KV reads are not.


def test_a_decode_batch_added_to_a_chunk_costs_its_kv_reads() -> None:
    model = h100_8b()
    decode = BatchShape.uniform_decode(64, 2048)
    alone = model.step_time(decode)
    for new in (256, 2048, 4096):
        chunk = BatchShape.prefill(new)
        added = model.step_time(chunk + decode).seconds - model.step_time(chunk).seconds
        # Measured: 9.2-12.1 ms of 14.25 ms. The old single attention roofline let the KV
        # reads hide under the chunk's attention FLOPs and charged as little as 3-4 ms.
        assert added >= 0.5 * alone.seconds, new
        # What it adds is at least its own attention: nothing of it hides under the chunk.
        assert added >= alone.attention


def test_the_batching_saving_is_the_shared_weight_read_and_does_not_grow_with_the_chunk() -> None:
    model = h100_8b()
    decode = BatchShape.uniform_decode(64, 2048)
    alone = model.step_time(decode)
    savings = []
    for new in (256, 512, 1024, 2048, 4096):
        chunk = BatchShape.prefill(new)
        apart = alone.seconds + model.step_time(chunk).seconds
        savings.append(apart - model.step_time(chunk + decode).seconds)
    assert savings == sorted(savings, reverse=True)
    # Mixing saves at most the decode step's non-attention time (weights, floors, overhead).
    assert savings[0] <= alone.seconds - alone.attention
    # Measured 2.1-5.0 ms of a 14.25 ms decode step; the old model gave 10 ms at L = 4096.
    assert savings[-1] < 0.5 * alone.seconds
    assert all(s > 0 for s in savings)


def test_prefill_and_decode_attention_add_while_two_chunks_share_one_roofline() -> None:
    model = h100_8b()
    decode = BatchShape.uniform_decode(32, 4096)
    chunk = BatchShape.prefill(1024, cached=2048)
    assert model.step_time(decode + chunk).attention == pytest.approx(
        model.step_time(decode).attention + model.step_time(chunk).attention
    )
    # A compute-bound chunk and a KV-bound one (16 tokens on a long prefix) run in one kernel.
    long_prefix = BatchShape.prefill(16, cached=100_000)
    together = model.step_time(chunk + long_prefix).attention
    assert together < model.step_time(chunk).attention + model.step_time(long_prefix).attention


# --- parallelism --------------------------------------------------------------------------------


def test_tp2_on_nvlink_speeds_up_70b_decode_but_not_twice() -> None:
    gpu, model = get_gpu("h100-sxm"), make_70b()
    batch = BatchShape.uniform_decode(16, 2048)
    one = StepTimeModel(model, gpu, tp=1).step_time(batch)
    two = StepTimeModel(model, gpu, tp=2).step_time(batch)
    assert 1.2 < one.seconds / two.seconds < 2.0
    assert two.communication > 0 == one.communication


def test_pcie_tensor_parallelism_pays_more_communication_than_nvlink() -> None:
    model = make_70b()
    nvlink = make_gpu()
    pcie = make_gpu(interconnect=Interconnect(kind=LinkKind.PCIE, pcie_gb_s=64.0))
    batch = BatchShape.prefill(2048) + BatchShape.uniform_decode(32, 1024)
    over_nvlink = StepTimeModel(model, nvlink, tp=4).step_time(batch)
    over_pcie = StepTimeModel(model, pcie, tp=4).step_time(batch)
    assert over_pcie.communication > 3 * over_nvlink.communication
    assert over_pcie.seconds > over_nvlink.seconds


def test_pipeline_parallelism_adds_latency_not_throughput() -> None:
    gpu, model = get_gpu("h100-sxm"), make_70b()
    batch = BatchShape.uniform_decode(32, 1024)
    flat = StepTimeModel(model, gpu, tp=2).step_time(batch)
    piped = StepTimeModel(model, gpu, tp=2, pp=2).step_time(batch)
    assert piped.pipeline_bubble > 0 == flat.pipeline_bubble
    # One batch in flight: it still crosses every layer, so latency does not drop...
    assert piped.seconds >= flat.seconds * 0.99
    # ...while with two micro-batches in flight a step completes every stage time.
    assert piped.interval < 0.6 * flat.interval


# --- dtypes -------------------------------------------------------------------------------------


def test_fp8_weights_decode_faster_than_bf16() -> None:
    bf16 = h100_8b().decode_time(8, 2048)
    fp8 = h100_8b(weights_dtype=Dtype.FP8).decode_time(8, 2048)
    int4 = h100_8b(weights_dtype=Dtype.INT4).decode_time(8, 2048)
    assert int4 < fp8 < 0.8 * bf16


def test_a_small_chunk_on_a_long_prefix_streams_the_prefix() -> None:
    model = h100_8b()
    chunk = BatchShape.prefill(16, cached=100_000)
    unknown_prefix = BatchShape(16, 1, chunk.prefill_attn_context)  # prefill_context left at 0
    long_decode = model.step_time(BatchShape.uniform_decode(16, 100_000)).attention
    assert model.step_time(chunk).attention > 0.05 * long_decode
    assert model.step_time(unknown_prefix).attention < model.step_time(chunk).attention


def test_fp8_kv_cache_halves_kv_reads() -> None:
    batch = BatchShape.uniform_decode(64, 8192)
    bf16 = h100_8b().step_time(batch)
    fp8 = h100_8b(kv_dtype=Dtype.FP8).step_time(batch)
    assert fp8.attention == pytest.approx(bf16.attention / 2, rel=0.05)


def test_fp8_computes_in_8_bits_only_where_the_gpu_can() -> None:
    model = get_model("llama-3.1-8b")
    hopper = make_gpu()
    ampere = make_gpu(fp8_tflops=None, int8_tops=None)
    prefill = BatchShape.prefill(8192)

    def linear(gpu: GPUSpec, dtype: Dtype) -> float:
        return StepTimeModel(model, gpu, weights_dtype=dtype).step_time(prefill).linear

    assert linear(hopper, Dtype.FP8) < 0.7 * linear(hopper, Dtype.BF16)  # W8A8
    assert linear(ampere, Dtype.FP8) == pytest.approx(linear(ampere, Dtype.BF16), rel=0.02)
    assert linear(hopper, Dtype.INT4) == pytest.approx(linear(hopper, Dtype.BF16), rel=0.02)


# --- mixture of experts ---------------------------------------------------------------------------


def mixtral_like() -> StepTimeModel:
    model = make_model(
        name="test-moe",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_kv_heads=8,
        intermediate_size=14336,
        num_experts=8,
        experts_per_token=2,
    )
    return StepTimeModel(model, get_gpu("h100-sxm"), tp=2)


def test_moe_reads_only_the_experts_a_batch_touches() -> None:
    model = mixtral_like()
    all_experts = model.weight_bytes_per_gpu / model.achievable_bandwidth
    one = model.step_time(BatchShape.uniform_decode(1, 100))
    many = model.step_time(BatchShape.uniform_decode(256, 100))
    # One token touches 2 of 8 experts: about a third of the weights (attention included).
    assert one.linear < 0.45 * all_experts
    assert many.linear > 0.95 * all_experts
    expected_touched = 8 * (1 - (1 - 2 / 8) ** 4)  # 4 tokens → 5.47 experts on average
    four = model.step_time(BatchShape.uniform_decode(4, 100))
    assert one.linear < four.linear < many.linear
    assert expected_touched == pytest.approx(5.47, abs=0.01)


# --- the roofline itself -------------------------------------------------------------------------


def test_smooth_roofline_sits_between_max_and_sum() -> None:
    assert smooth_roofline(3.0, 4.0, math.inf) == 4.0
    assert smooth_roofline(3.0, 4.0, 2.0) == pytest.approx(5.0)
    assert smooth_roofline(2.0, 2.0, 3.0) == pytest.approx(2.0 * 2 ** (1 / 3))
    assert smooth_roofline(0.0, 0.0, 3.0) == 0.0
    for c, m in ((1.0, 9.0), (5.0, 5.0), (7.0, 0.1)):
        assert max(c, m) <= smooth_roofline(c, m, 3.0) <= c + m


def test_model_uses_the_smooth_roofline() -> None:
    model = h100_8b()
    hard = h100_8b(efficiency=model.efficiency.replace(roofline_exponent=math.inf))
    batch = BatchShape.uniform_decode(192, 16)  # close to the GEMM ridge on H100
    assert hard.step_time(batch).linear < model.step_time(batch).linear
