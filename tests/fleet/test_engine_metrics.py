"""The engine-metrics name table read on real engines' pages (tests/fleet/data/README.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.fleet import ENGINE_METRICS, EngineSignal, Histogram, read_engine_metrics

DATA = Path(__file__).parent / "data"


def page(name: str) -> str:
    return (DATA / name).read_text()


def test_every_signal_has_names_and_no_name_is_shared() -> None:
    assert set(ENGINE_METRICS) == set(EngineSignal)
    names = [name for names in ENGINE_METRICS.values() for name in names]
    assert len(names) == len(set(names))


def test_vllm_v0_page_is_read_by_its_old_names() -> None:
    sample = read_engine_metrics(page("vllm-v0-qwen3.prom"))
    assert sample is not None
    assert (sample.running, sample.waiting, sample.kv_cache_usage) == (0, 0, 0.0)
    assert sample.prompt_tokens == 43952.0
    assert sample.generation_tokens == 4874.0
    assert sample.ttft == Histogram(4941.843970537186, 69.0)
    assert sample.itl == Histogram(662.8116002082825, 4805.0)
    assert sample.prefix_hits is None  # the V0 engine exported a hit *rate* only
    assert {"vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"} <= sample.names


def test_a_page_with_only_the_old_kv_gauge() -> None:
    sample = read_engine_metrics(page("vllm-0.6-llama-busy.prom"))
    assert sample is not None
    assert sample.kv_cache_usage == pytest.approx(0.38849487785658)
    assert sample.running is None
    assert sample.in_flight is None  # absent is not zero


def test_sglang_page_is_read_by_its_own_names() -> None:
    sample = read_engine_metrics(page("sglang-llama-3.1-8b.prom"))
    assert sample is not None
    assert (sample.running, sample.waiting, sample.kv_cache_usage) == (162, 2826, 0.28)
    assert sample.in_flight == 162 + 2826
    assert sample.prompt_tokens == 8.128902e06
    assert sample.itl == Histogram(866964.5791549598, 7.400757e06)
    assert sample.names == {
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:prompt_tokens",
        "sglang:generation_tokens",
        "sglang:time_to_first_token_seconds",
        "sglang:time_per_output_token_seconds",
    }


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("vllm-cpu-*.prom")))
def test_current_vllm_page_is_read_by_its_new_names(name: str) -> None:
    sample = read_engine_metrics(page(name))
    assert sample is not None
    assert sample.running is not None
    assert sample.waiting is not None
    assert sample.kv_cache_usage is not None
    assert sample.prefix_queries is not None
    assert sample.prefix_hits is not None
    assert sample.itl is not None
    assert {"vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds"} <= sample.names


def test_a_new_name_wins_over_a_deprecated_one_on_the_same_page() -> None:
    both = "\n".join(
        [
            'vllm:gpu_cache_usage_perc{engine="0"} 0.9',
            'vllm:kv_cache_usage_perc{engine="0"} 0.25',
            'vllm:time_per_output_token_seconds_sum{engine="0"} 100.0',
            'vllm:time_per_output_token_seconds_count{engine="0"} 10.0',
            'vllm:inter_token_latency_seconds_sum{engine="0"} 1.0',
            'vllm:inter_token_latency_seconds_count{engine="0"} 50.0',
            'vllm:gpu_cache_usage_perc{engine="1"} 0.95',
        ]
    )
    sample = read_engine_metrics(both)
    assert sample is not None
    assert sample.kv_cache_usage == 0.25
    assert sample.itl == Histogram(1.0, 50.0)
    assert sample.itl.mean == pytest.approx(0.02)


def test_series_are_summed_and_kv_usage_is_the_fullest_engine() -> None:
    text = "\n".join(
        [
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 4.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75',
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 32.0',
            'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9',
            "vllm:prefix_cache_hits 16",  # an exporter without the _total suffix
        ]
    )
    sample = read_engine_metrics(text)
    assert sample is not None
    assert (sample.running, sample.kv_cache_usage, sample.prefix_hits) == (7, 0.75, 48.0)
    assert sample.waiting is None


def test_labels_with_braces_spaces_and_timestamps() -> None:
    sample = read_engine_metrics('vllm:num_requests_waiting{a="} x {"} 4 1700000000000\n')
    assert sample is not None
    assert sample.waiting == 4


def test_unknown_pages_malformed_values_and_nan() -> None:
    assert read_engine_metrics("") is None
    assert read_engine_metrics("# HELP x\nprocess_cpu_seconds_total 9\nup 1\n") is None
    with pytest.raises(ValueError, match="could not convert"):
        read_engine_metrics("vllm:num_requests_running{} NaN-ish\n")
    with pytest.raises(ValueError, match="no value"):
        read_engine_metrics("vllm:num_requests_running{}\n")
    sample = read_engine_metrics('sglang:token_usage{model_name="x"} NaN\n')
    assert sample is not None
    assert sample.kv_cache_usage is None
    over = read_engine_metrics("sglang:token_usage 1.5\n")
    assert over is not None
    assert over.kv_cache_usage == 1.0
