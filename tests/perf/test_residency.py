"""The sleep / wake / load times of the performance model (``perf.residency_times``)."""

from __future__ import annotations

import pytest

from gpufleet.catalog import get_gpu, get_model
from gpufleet.perf import (
    PINNED_COPY_EFFICIENCY,
    STORAGE_GB_S,
    Parallelism,
    residency_times,
)


def test_level_1_wake_is_the_weights_over_pcie() -> None:
    t = residency_times(get_model("llama-3.1-8b"), get_gpu("h100-sxm"))
    link = 64e9 * PINNED_COPY_EFFICIENCY  # H100 SXM: PCIe Gen5 x16, one way
    assert t.copy_s == pytest.approx(t.weights_per_gpu / link)
    assert 0.3 < t.wake(1) < 0.5  # 16 GB of bf16 weights
    assert t.sleep(1) == pytest.approx(t.wake(1))  # the same copy, the other way


def test_level_2_wake_reads_the_checkpoint_from_storage_first() -> None:
    t = residency_times(get_model("llama-3.1-8b"), get_gpu("h100-sxm"))
    assert t.wake(2) == pytest.approx(t.wake(1) + t.weights / (STORAGE_GB_S * 1e9))
    assert t.wake(2) > 10 * t.wake(1)
    assert t.sleep(2) < t.sleep(1)  # level 2 drops the weights: nothing to copy


def test_tensor_parallel_shards_copy_in_parallel_but_storage_reads_the_whole_model() -> None:
    model, gpu = get_model("llama-3.1-70b"), get_gpu("h100-sxm")
    tp2 = residency_times(model, gpu, parallel=Parallelism(tp=2))
    tp4 = residency_times(model, gpu, parallel=Parallelism(tp=4))
    assert tp4.copy_s == pytest.approx(tp2.copy_s / 2, rel=0.01)
    assert tp4.read_s == tp2.read_s
    assert 30 < tp2.wake(2) < 45  # the seeds: NVMe loads a 70B model in 30–60 s


def test_a_slower_link_wakes_slower() -> None:
    model = get_model("llama-3.1-8b")
    gen4 = residency_times(model, get_gpu("a100-80gb-pcie"))
    gen5 = residency_times(model, get_gpu("h100-sxm"))
    assert gen4.wake(1) > 1.8 * gen5.wake(1) - 0.1


@pytest.mark.parametrize("level", [0, 3])
def test_only_levels_1_and_2(level: int) -> None:
    t = residency_times(get_model("llama-3.1-8b"), get_gpu("h100-sxm"))
    with pytest.raises(ValueError, match="1 or 2"):
        t.wake(level)
