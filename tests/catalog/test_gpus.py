"""The packaged GPU catalog: every entry loads, follows the conventions, and the figures that
capacity plans lean on hardest are checked by hand against the datasheets."""

from __future__ import annotations

import pytest

from gpufleet.catalog import GPUSpec, LinkKind, UnknownGPUError, get_gpu, load_gpus

REQUIRED = {
    "a10g",
    "l4",
    "l40s",
    "a100-40gb-sxm",
    "a100-80gb-sxm",
    "a100-80gb-pcie",
    "h100-sxm",
    "h100-pcie",
    "h200",
    "b200",
    "mi300x",
}
ALL_GPUS = sorted(load_gpus())


def test_catalog_has_the_required_gpus() -> None:
    assert set(load_gpus()) >= REQUIRED


@pytest.mark.parametrize("name", ALL_GPUS)
def test_every_gpu_validates_and_cites_its_sources(name: str) -> None:
    gpu = get_gpu(name)
    assert GPUSpec.model_validate(gpu.model_dump()) == gpu
    assert gpu.name == name
    assert {"compute", "memory", "price"} <= set(gpu.sources)
    assert all(text.strip() for text in gpu.sources.values())
    assert "assumption" in gpu.sources["price"]


@pytest.mark.parametrize("name", ALL_GPUS)
def test_every_gpu_follows_the_unit_conventions(name: str) -> None:
    gpu = get_gpu(name)
    # BF16 and FP16 tensor rates are the same on every GPU we list (FP32 accumulate).
    assert gpu.fp16_tflops == gpu.bf16_tflops
    # Dense FP8 is twice dense BF16; a sparse figure slipped in would break the ratio.
    if gpu.fp8_tflops is not None:
        assert gpu.fp8_tflops / gpu.bf16_tflops == pytest.approx(2.0, rel=0.03)
    # PCIe-only cards have no scale-up link; the rest have one.
    link = gpu.interconnect
    assert (link.kind is LinkKind.PCIE) == (link.gpu_link_gb_s is None)
    assert link.has_scale_up_link == (link.kind is not LinkKind.PCIE)
    # One direction of an x16 slot: Gen4 or Gen5.
    assert link.pcie_gb_s in {32, 64}


@pytest.mark.parametrize(
    ("name", "memory_mib"),
    [
        ("a10g", 23028),
        ("l4", 23034),
        ("l40s", 46068),
        ("a100-40gb-sxm", 40960),
        ("a100-80gb-sxm", 81920),
        ("a100-80gb-pcie", 81920),
        ("h100-sxm", 81559),
        ("h100-pcie", 81559),
        ("h100-nvl", 95830),
        ("h200", 143771),
        ("b200", 183359),
        ("mi300x", 196592),
    ],
)
def test_memory_is_what_the_driver_reports(name: str, memory_mib: int) -> None:
    assert get_gpu(name).memory_gib == pytest.approx(memory_mib / 1024, abs=0.001)


def test_h100_sxm_by_hand() -> None:
    gpu = get_gpu("h100-sxm")
    assert gpu.bf16_tflops == 989
    assert gpu.fp8_tflops == 1979
    assert gpu.memory_bandwidth_gb_s == 3350
    assert gpu.interconnect.kind is LinkKind.NVLINK
    assert gpu.interconnect.gpu_link_gb_s == 900
    assert gpu.tdp_watts == 700
    assert gpu.idle_watts == 120
    assert gpu.memory_bytes == pytest.approx(81559 * 2**20, rel=1e-5)


def test_other_figures_by_hand() -> None:
    a100 = get_gpu("a100-80gb-sxm")
    assert (a100.bf16_tflops, a100.memory_bandwidth_gb_s, a100.fp8_tflops) == (312, 2039, None)
    assert get_gpu("a100-40gb-sxm").memory_bandwidth_gb_s == 1555
    assert get_gpu("a100-80gb-pcie").memory_bandwidth_gb_s == 1935
    h100_pcie = get_gpu("h100-pcie")
    assert (h100_pcie.bf16_tflops, h100_pcie.memory_bandwidth_gb_s) == (756, 2000)
    assert not h100_pcie.interconnect.has_scale_up_link
    h200 = get_gpu("h200")
    assert (h200.bf16_tflops, h200.memory_bandwidth_gb_s) == (989, 4800)
    b200 = get_gpu("b200")
    assert (b200.bf16_tflops, b200.fp8_tflops, b200.memory_bandwidth_gb_s) == (2250, 4500, 8000)
    assert b200.interconnect.gpu_link_gb_s == 1800
    l4 = get_gpu("l4")
    assert (l4.bf16_tflops, l4.fp8_tflops, l4.memory_bandwidth_gb_s) == (121, 242.5, 300)
    l40s = get_gpu("l40s")
    assert (l40s.bf16_tflops, l40s.fp8_tflops, l40s.memory_bandwidth_gb_s) == (362, 733, 864)
    a10g = get_gpu("a10g")
    assert (a10g.bf16_tflops, a10g.fp8_tflops, a10g.memory_bandwidth_gb_s) == (70, None, 600)
    mi300x = get_gpu("mi300x")
    assert mi300x.interconnect.kind is LinkKind.INFINITY_FABRIC
    assert (mi300x.bf16_tflops, mi300x.memory_bandwidth_gb_s) == (1307.4, 5300)


def test_no_fp8_before_hopper_and_ada() -> None:
    for name in ("a10g", "a100-40gb-sxm", "a100-80gb-sxm", "a100-80gb-pcie"):
        assert get_gpu(name).fp8_tflops is None


def test_lookup_ignores_case_and_spaces() -> None:
    assert get_gpu("  H100-SXM ") is get_gpu("h100-sxm")


def test_unknown_gpu_lists_the_known_ones() -> None:
    with pytest.raises(UnknownGPUError) as info:
        get_gpu("h300")
    message = str(info.value)
    assert "'h300'" in message
    for name in ALL_GPUS:
        assert name in message


def test_with_price_overrides_only_the_price() -> None:
    gpu = get_gpu("h100-sxm")
    cheaper = gpu.with_price(1.5)
    assert cheaper.price_per_hour_usd == 1.5
    assert cheaper.model_dump(exclude={"price_per_hour_usd"}) == gpu.model_dump(
        exclude={"price_per_hour_usd"}
    )


@pytest.mark.parametrize("name", ALL_GPUS)
def test_idle_power_is_measured_or_absent_and_below_the_tdp(name: str) -> None:
    gpu = get_gpu(name)
    if gpu.idle_watts is None:
        return
    assert gpu.idle_watts < gpu.tdp_watts / 2
    assert "idle" in gpu.sources["power"].lower()
