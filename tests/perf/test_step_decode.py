"""``StepTimeModel.decode_seconds``: a decode-only step's duration, bit for bit ``step_time``'s.

The replica model's fast-forward times every pure-decode step with it, and the simulator
promises the same results with and without the fast-forward, so equality here is exact (the
float's bits), not approximate.
"""

from __future__ import annotations

import pytest
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from gpufleet.catalog import get_gpu, get_model, load_gpus, load_models
from gpufleet.perf import BatchShape, Dtype, StepTimeModel
from gpufleet.perf._dtype import KV_DTYPES


@st.composite
def step_models(draw: st.DrawFn) -> StepTimeModel:
    """Any catalog model on any catalog GPU, split any valid way, in any dtype."""
    model = get_model(draw(st.sampled_from(sorted(load_models()))))
    gpu = get_gpu(draw(st.sampled_from(sorted(load_gpus()))))
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    pp = draw(st.sampled_from([1, 1, 2, 4]))
    weights = draw(st.sampled_from(sorted(Dtype)))
    kv = draw(st.sampled_from(sorted(KV_DTYPES)))
    try:
        return StepTimeModel(model, gpu, tp=tp, pp=pp, weights_dtype=weights, kv_dtype=kv)
    except ValueError:  # tp does not divide this model's heads
        reject()


@settings(max_examples=400, deadline=None)
@given(
    steps=step_models(),
    seqs=st.integers(1, 1024),
    context_per_seq=st.integers(1, 131072),
    extra=st.integers(0, 4096),
)
def test_decode_seconds_is_step_time_bit_for_bit(
    steps: StepTimeModel, seqs: int, context_per_seq: int, extra: int
) -> None:
    context = seqs * context_per_seq + extra  # any sum of contexts >= seqs
    expected = steps.step_time(BatchShape(decode_seqs=seqs, decode_context=context)).seconds
    assert steps.decode_seconds(seqs, context).hex() == expected.hex()
    # The second call reads the per-size terms from the cache: still the same bits.
    assert steps.decode_seconds(seqs, context).hex() == expected.hex()
    assert steps.decode_seconds(seqs, context + seqs) == (
        steps.step_time(BatchShape(decode_seqs=seqs, decode_context=context + seqs)).seconds
    )


def test_the_empty_batch_takes_no_time_and_bad_input_is_refused() -> None:
    steps = StepTimeModel(get_model("llama-3.1-8b"), get_gpu("h100-sxm"))
    assert steps.decode_seconds(0, 0) == steps.step_time(BatchShape()).seconds == 0.0
    with pytest.raises(ValueError, match="context >= seqs"):
        steps.decode_seconds(4, 3)
    with pytest.raises(ValueError, match="seqs >= 0"):
        steps.decode_seconds(-1, 5)


@settings(max_examples=300, deadline=None)
@given(
    steps=step_models(),
    seqs=st.integers(1, 512),
    context_per_seq=st.integers(1, 65536),
    extra=st.integers(0, 4096),
    count=st.integers(0, 40),
    slowdown=st.sampled_from([1.0, 0.5, 3.0, 1.7]),
)
def test_decode_run_seconds_is_decode_seconds_step_by_step_bit_for_bit(  # noqa: PLR0917
    steps: StepTimeModel, seqs: int, context_per_seq: int, extra: int, count: int, slowdown: float
) -> None:
    context = seqs * context_per_seq + extra
    expected = [steps.decode_seconds(seqs, context + i * seqs) * slowdown for i in range(count)]
    got = steps.decode_run_seconds(seqs, context, count, slowdown)
    assert [d.hex() for d in got] == [d.hex() for d in expected]


def test_decode_run_seconds_refuses_what_decode_seconds_refuses() -> None:
    steps = StepTimeModel(get_model("llama-3.1-8b"), get_gpu("h100-sxm"))
    assert steps.decode_run_seconds(4, 100, 0) == []
    assert steps.decode_run_seconds(0, 0, 3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="context >= seqs"):
        steps.decode_run_seconds(4, 3, 2)
