"""Memory arithmetic, checked against values worked out by hand."""

from __future__ import annotations

import pytest

from gpufleet.perf import (
    GIB,
    Dtype,
    EngineLimits,
    Parallelism,
    kv_bytes_per_token,
    memory_plan,
    parse_dtype,
    weight_bytes,
)
from tests.factories import make_70b, make_gpu, make_model


def test_kv_bytes_per_token_llama2_13b_fp16() -> None:
    # 2 (K and V) x 40 layers x 40 KV heads x 128 head dim x 2 bytes = 819,200 bytes (800 KiB).
    assert kv_bytes_per_token(make_model(), Dtype.FP16) == 819_200


def test_kv_bytes_per_token_gqa_and_fp8() -> None:
    # Llama-3.1-70B: 2 x 80 x 8 x 128 x 2 = 327,680 bytes in bf16; fp8 halves it.
    assert kv_bytes_per_token(make_70b(), Dtype.BF16) == 327_680
    assert kv_bytes_per_token(make_70b(), Dtype.FP8) == 163_840


def test_weight_bytes_scale_with_dtype() -> None:
    model = make_model()
    bf16 = weight_bytes(model, Dtype.BF16)
    assert bf16 == pytest.approx(2 * model.param_count(), rel=1e-9)
    assert weight_bytes(model, Dtype.FP32) == pytest.approx(4 * model.param_count(), rel=1e-9)
    # fp8 halves the linear layers only: embeddings and LM head stay 16-bit.
    table_bytes = 2 * 2 * model.vocab_size * model.hidden_size
    fp8 = weight_bytes(model, Dtype.FP8)
    assert fp8 == pytest.approx((bf16 - table_bytes) / 2 + table_bytes, rel=1e-3)
    assert weight_bytes(model, Dtype.INT4) < fp8


def test_70b_fp16_needs_at_least_two_80gb_gpus() -> None:
    model, gpu = make_70b(), make_gpu()
    assert weight_bytes(model, Dtype.FP16) > 140e9
    assert not memory_plan(model, gpu, weights_dtype=Dtype.FP16).fits
    two = memory_plan(model, gpu, parallel=Parallelism(tp=2), weights_dtype=Dtype.FP16)
    assert two.fits
    assert two.kv_tokens > 0


def test_budget_adds_up() -> None:
    plan = memory_plan(make_model(), make_gpu(), limits=EngineLimits(gpu_memory_utilization=0.9))
    assert plan.usable == int(80 * GIB * 0.9)
    assert plan.weights + plan.activation + plan.overhead + plan.kv_cache == pytest.approx(
        plan.usable, abs=4
    )
    assert plan.kv_tokens == plan.kv_blocks * 16
    assert plan.kv_blocks == plan.kv_cache // (16 * 819_200)


def test_sharded_weights_sum_to_the_checkpoint() -> None:
    model, gpu = make_70b(), make_gpu()
    whole = weight_bytes(model, Dtype.BF16)
    tp4 = memory_plan(model, gpu, parallel=Parallelism(tp=4))
    assert tp4.weights * 4 == pytest.approx(whole, rel=1e-3)
    # With pipeline stages the first and last stage also hold the embedding or the LM head.
    pp2 = memory_plan(model, gpu, parallel=Parallelism(tp=2, pp=2))
    assert pp2.weights * 4 == pytest.approx(whole, rel=0.01)


def test_tensor_parallel_splits_kv_heads_and_replicates_past_them() -> None:
    model, gpu = make_70b(), make_gpu()
    per_gpu = {tp: memory_plan(model, gpu, parallel=Parallelism(tp=tp)) for tp in (2, 4, 8)}
    assert per_gpu[2].kv_bytes_per_token_per_gpu == 327_680 / 2
    assert per_gpu[8].kv_bytes_per_token_per_gpu == 327_680 / 8
    # 16 GPUs cannot split 8 KV heads further: each GPU keeps one head (replicated).
    wide = memory_plan(
        make_70b().model_copy(update={"num_attention_heads": 64}),
        gpu,
        parallel=Parallelism(tp=16),
    )
    assert wide.kv_bytes_per_token_per_gpu == 327_680 / 8


def test_max_concurrency_rounds_up_to_blocks_and_caps_at_max_num_seqs() -> None:
    plan = memory_plan(make_model(), make_gpu(), limits=EngineLimits(max_num_seqs=100_000))
    assert plan.max_concurrency(4096) == plan.kv_blocks // 256
    assert plan.max_concurrency(4097) == plan.kv_blocks // 257
    capped = memory_plan(make_model(), make_gpu(), limits=EngineLimits(max_num_seqs=8))
    assert capped.max_concurrency(16) == 8
    with pytest.raises(ValueError, match="context_tokens"):
        plan.max_concurrency(0)


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (Parallelism(tp=3), "does not divide"),
        (Parallelism(pp=41), "exceeds"),
    ],
)
def test_bad_parallelism_is_rejected(parallel: Parallelism, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        memory_plan(make_model(), make_gpu(), parallel=parallel)


def test_bad_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineLimits(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="tp and pp"):
        Parallelism(tp=0)
    with pytest.raises(ValueError, match="KV-cache dtype"):
        parse_dtype("int4", kv=True)
    assert parse_dtype(" BF16 ") is Dtype.BF16
