"""The sim engine's spans (``--otlp-traces-endpoint``, as vLLM's flag): a process exporting to
a local OTLP/HTTP receiver; and how ``gpufleet up`` hands a fleet's tracing endpoint to the
engines it starts."""

from __future__ import annotations

import signal
import sys

import httpx
import pytest
import typer

from gpufleet.cli._engine_cmd import app as engine_app
from gpufleet.cli._engine_cmd import engine_config
from gpufleet.cli._up_cmd import pool_spec
from gpufleet.config import parse_fleet
from gpufleet.engine.server import SimEngineConfig, create_app
from gpufleet.runtime import launch_plan
from tests.otlp_receiver import SERVER, otlp_receiver
from tests.up_process import sim_engine_child

SIM_ENGINE = typer.main.get_command(engine_app)
PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


def test_a_request_is_an_llm_request_span_under_the_callers() -> None:
    with (
        otlp_receiver() as (receiver, endpoint),
        sim_engine_child(
            "--time-scale", "50", "--otlp-traces-endpoint", endpoint
        ) as (url, process),
    ):  # fmt: skip
        answers = [
            httpx.post(
                url + "/v1/completions",
                json={"model": "llama-3.1-8b", "prompt": "hello", "max_tokens": 8, **extra},
                headers={"traceparent": f"00-{PARENT_TRACE}-{PARENT_SPAN}-01"},
                timeout=30,
            )
            for extra in ({}, {"stream": True}, {"n": 2, "ignore_eos": True})
        ]
        assert [a.status_code for a in answers] == [200, 200, 200]
        process.send_signal(signal.SIGTERM)  # a clean stop exports what is left
        process.wait(timeout=30)
        spans = receiver.traces()[PARENT_TRACE]
    assert len(spans) == 3
    for span in spans:
        assert (span.name, span.kind, span.parent_id) == ("llm_request", SERVER, PARENT_SPAN)
        assert span.service == "sim-engine llama-3.1-8b"
        assert span.attributes["gen_ai.usage.prompt_tokens"] > 0
        assert span.attributes["gen_ai.latency.time_to_first_token"] > 0
        assert (
            span.attributes["gen_ai.latency.time_to_first_token"]
            <= (span.attributes["gen_ai.latency.e2e"])
        )
    two = [s for s in spans if s.attributes["gen_ai.request.n"] == 2]
    assert [s.attributes["gen_ai.usage.completion_tokens"] for s in two] == [16]  # 2 × 8


def test_without_the_extra_the_flag_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gpufleet.engine.server._tracing", None)
    with pytest.raises(ValueError, match=r"pip install 'gpufleet\[tracing\]'"):
        create_app(SimEngineConfig(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces"))


def test_gpufleet_up_hands_the_gateways_endpoint_to_sim_engines_only() -> None:
    fleet = parse_fleet(
        {
            "gateway": {"tracing": {"endpoint": "http://127.0.0.1:4318/v1/traces"}},
            "models": [
                {"name": "llama-3.1-8b"},
                {"name": "big", "engine": "vllm", "model": "llama-3.1-70b", "gpu": "h100-sxm"},
            ],
        }
    )
    assert fleet.gateway.tracing is not None
    endpoint = fleet.gateway.tracing.endpoint
    sim, vllm = (pool_spec(m, 0, endpoint) for m in fleet.models)
    argv = launch_plan(sim.replica(0), "127.0.0.1").argv
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == endpoint
    engine = engine_config(SIM_ENGINE.make_context("sim", list(argv[5:])))
    assert engine.otlp_traces_endpoint == endpoint
    # vLLM needs OpenTelemetry in its own environment: the fleet file's `args` say so
    assert "--otlp-traces-endpoint" not in launch_plan(vllm.replica(0), "127.0.0.1", 8000).argv
    assert pool_spec(fleet.models[0], 0).engine.traces is None
