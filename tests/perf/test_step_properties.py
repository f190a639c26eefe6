"""Properties of the step-time model that hold for every batch (Hypothesis).

Batching never loses: one step over ``a + b`` is never slower than a step over ``a`` followed
by a step over ``b``. Every term of the model is subadditive in the batch — FLOPs and bytes
per token are linear, weights are read once per step whatever its size, the experts a batch
touches grow concavely with its tokens, and the smooth roofline is a p-norm, for which the
triangle inequality holds — so the whole step is too. Adding work never makes a step faster.
A step's prefill and decode attention are separate rooflines that add.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gpufleet.catalog import get_gpu, get_model
from gpufleet.perf import BatchShape, Dtype, StepTimeModel

MODELS = {
    "8b-h100": StepTimeModel(get_model("llama-3.1-8b"), get_gpu("h100-sxm")),
    "8b-h100-fp8-pp2": StepTimeModel(
        get_model("llama-3.1-8b"), get_gpu("h100-sxm"), pp=2, weights_dtype=Dtype.FP8
    ),
    "mixtral-a100-tp2": StepTimeModel(get_model("mixtral-8x7b"), get_gpu("a100-80gb-sxm"), tp=2),
    "70b-l40s-pcie-tp4": StepTimeModel(
        get_model("llama-3.1-70b"), get_gpu("l40s"), tp=4, weights_dtype=Dtype.INT4
    ),
}


@st.composite
def batches(draw: st.DrawFn) -> BatchShape:
    total = BatchShape()
    for _ in range(draw(st.integers(0, 3))):
        total = total + BatchShape.prefill(draw(st.integers(1, 4096)), draw(st.integers(0, 32768)))
    contexts = draw(st.lists(st.integers(1, 131072), max_size=6))
    extra = draw(st.integers(0, 500))
    return total + BatchShape.decode(contexts) + BatchShape.uniform_decode(extra, 1 + extra % 4000)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(MODELS)), a=batches(), b=batches())
def test_batching_two_batches_is_never_slower_than_running_them_apart(
    name: str, a: BatchShape, b: BatchShape
) -> None:
    model = MODELS[name]
    together = model.step_time(a + b).seconds
    apart = model.step_time(a).seconds + model.step_time(b).seconds
    assert together <= apart * (1 + 1e-12)
    assert together >= max(model.step_time(a).seconds, model.step_time(b).seconds) * (1 - 1e-12)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(MODELS)), batch=batches())
def test_step_time_is_positive_finite_and_adds_up(name: str, batch: BatchShape) -> None:
    t = MODELS[name].step_time(batch)
    if batch.is_empty:
        assert t.seconds == 0.0
        return
    assert 0.0 < t.seconds < math.inf
    parts = t.linear + t.attention + t.elementwise + t.communication
    assert math.isclose(t.seconds, parts + t.pipeline_bubble + t.overhead, rel_tol=1e-9)
    assert t.interval <= t.seconds * (1 + 1e-12)


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(sorted(MODELS)), batch=batches())
def test_prefill_and_decode_attention_are_separate_rooflines(name: str, batch: BatchShape) -> None:
    """A decode batch's KV reads never hide under a prefill chunk's attention FLOPs."""
    model = MODELS[name]
    prefill = BatchShape(
        batch.prefill_tokens,
        batch.prefill_seqs,
        batch.prefill_attn_context,
        prefill_context=batch.prefill_context,
    )
    decode = BatchShape(decode_seqs=batch.decode_seqs, decode_context=batch.decode_context)
    apart = model.step_time(prefill).attention + model.step_time(decode).attention
    assert math.isclose(model.step_time(batch).attention, apart, rel_tol=1e-9, abs_tol=1e-15)
