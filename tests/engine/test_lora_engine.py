"""LoRA adapters on the sim engine, over real HTTP: vLLM's flags and runtime routes, requests
under an adapter's name, ``/v1/models``, the resident cache (LRU, ``max_cpu_loras``), the
``max_loras`` slots, shared loads, ``vllm:lora_requests_info`` and the load counters."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import typer

from gpufleet.catalog import get_gpu, get_model
from gpufleet.cli._engine_cmd import app as engine_app
from gpufleet.cli._engine_cmd import engine_config
from gpufleet.engine.server import LoraModuleConfig, SimEngineConfig, create_app
from gpufleet.perf import UNLOAD_S, lora_load_seconds
from tests.engine.conftest import FAST, Served, serve

SPEC, GPU = get_model("llama-3.1-8b"), get_gpu("h100-sxm")
LOAD_16 = lora_load_seconds(SPEC, GPU, rank=16)
"""A load of an adapter whose path has no config: taken at ``max_lora_rank`` (16)."""
LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"
SIM_ENGINE = typer.main.get_command(engine_app)


def _config(**settings: Any) -> SimEngineConfig:
    values: dict[str, Any] = {
        "time_scale": FAST,
        "enable_lora": True,
        "allow_runtime_lora_updating": True,
        "max_model_len": 4096,
        "seed": 1,
    }
    return SimEngineConfig(**(values | settings))


def _modules(*names: str) -> tuple[LoraModuleConfig, ...]:
    return tuple(LoraModuleConfig(name=n, path=f"/adapters/{n}") for n in names)


def _counter(sim: Served, what: str) -> float:
    name = f"gpufleet:sim_engine_lora_{what}"
    return sim.sample(name, f"{name}_total")


def _lora_info(sim: Served) -> dict[str, str]:
    """The labels of ``vllm:lora_requests_info``'s latest series (the highest timestamp)."""
    samples = sim.metrics()["vllm:lora_requests_info"].samples
    return max(samples, key=lambda s: s.value).labels


def _error(answer: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = answer.json()["error"]
    assert body["code"] == answer.status_code
    return body


def _complete(http: httpx.Client, model: str, **fields: Any) -> httpx.Response:
    body = {"model": model, "prompt": "hello there", "max_tokens": 2, **fields}
    return http.post("/v1/completions", json=body)


@pytest.mark.parametrize(
    ("enable_lora", "allow", "status"), [(True, False, 404), (False, True, 400)]
)
def test_the_routes_need_the_environment_and_enable_lora(
    enable_lora: bool, allow: bool, status: int
) -> None:
    config = _config(enable_lora=enable_lora, allow_runtime_lora_updating=allow)
    with serve(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as http:
        load = http.post(LOAD, json={"lora_name": "sql", "lora_path": "/adapters/sql"})
        unload = http.post(UNLOAD, json={"lora_name": "sql"})
        for answer in (load, unload):
            assert answer.status_code == status
            if status == 400:
                assert _error(answer)["type"] == "BadRequestError"
                assert "LoRA is not enabled" in _error(answer)["message"]
        assert _complete(http, "sql").status_code == 404
        if not enable_lora:
            assert "vllm:lora_requests_info" not in sim.metrics()


def test_the_environment_variable_is_read_as_vllm_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for value, allowed in (("1", True), ("True", True), ("0", False), ("yes", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert SimEngineConfig().allow_runtime_lora_updating is allowed
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    assert SimEngineConfig().allow_runtime_lora_updating is False


def test_the_engine_command_line_takes_vllms_lora_flags() -> None:
    argv = [
        *("--enable-lora", "--max-loras", "2", "--max-lora-rank", "64"),
        *("--max-cpu-loras", "4", "--lora-modules", "sql=/adapters/sql"),
        '{"name": "chat", "path": "/adapters/chat", "base_model_name": "llama-3.1-8b"}',
    ]
    config = engine_config(SIM_ENGINE.make_context("sim", argv))
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 2, 64)
    assert config.cpu_loras == 4
    assert config.lora_modules == (
        LoraModuleConfig(name="sql", path="/adapters/sql"),
        LoraModuleConfig(name="chat", path="/adapters/chat", base_model_name="llama-3.1-8b"),
    )
    assert SimEngineConfig(enable_lora=True).cpu_loras == 1  # vLLM's: max_loras
    for bad, message in (
        ({"max_loras": 4, "max_cpu_loras": 2}, r"max_cpu_loras \(2\) must be >= max_loras"),
        ({"max_lora_rank": 24}, "max_lora_rank"),
        ({"enable_lora": False, "lora_modules": _modules("a")}, "needs --enable-lora"),
        ({"lora_modules": _modules("a", "a")}, "given twice"),
    ):
        with pytest.raises(ValueError, match=message):
            SimEngineConfig(**({"enable_lora": True} | bad))


def test_load_serve_and_unload_an_adapter() -> None:
    config = _config()
    with serve(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as http:
        loaded = http.post(LOAD, json={"lora_name": "sql", "lora_path": "/adapters/sql"})
        assert loaded.status_code == 200
        assert loaded.text == "Success: LoRA adapter 'sql' added successfully."
        assert "content-type" not in loaded.headers  # vLLM's plain Response
        assert _counter(sim, "loads") == 1.0

        client = sim.client()
        completion = client.completions.create(model="sql", prompt="hi", max_tokens=3)
        assert completion.model == "sql"
        assert completion.usage is not None
        assert completion.usage.completion_tokens == 3
        chat = client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.model == "sql"
        assert client.embeddings.create(model="sql", input="hi").model == "sql"
        assert client.responses.create(model="sql", input="hi", max_output_tokens=2).model == "sql"
        assert http.post("/tokenize", json={"model": "sql", "prompt": "hi"}).status_code == 200
        assert _counter(sim, "loads") == 1.0  # resident: no load again

        again = http.post(LOAD, json={"lora_name": "sql", "lora_path": "/adapters/sql"})
        assert again.status_code == 400
        assert _error(again)["type"] == "InvalidUserInput"
        assert "The lora adapter 'sql' has already been loaded." in _error(again)["message"]

        started = time.monotonic()
        unloaded = http.post(UNLOAD, json={"lora_name": "sql"})
        assert (time.monotonic() - started) * FAST >= UNLOAD_S
        assert unloaded.status_code == 200
        assert unloaded.text == "Success: LoRA adapter 'sql' removed successfully."
        assert _counter(sim, "unloads") == 1.0
        gone = _complete(http, "sql")
        assert gone.status_code == 404
        assert _error(gone) == {
            "message": "The model `sql` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
        twice = http.post(UNLOAD, json={"lora_name": "sql"})
        assert twice.status_code == 404
        assert _error(twice)["message"] == "The lora adapter 'sql' cannot be found."
        assert _complete(http, "no-such-model").status_code == 404
        assert _complete(http, config.name).status_code == 200


def test_the_load_takes_its_modelled_time_at_the_rank_of_its_config(tmp_path: Path) -> None:
    rank8 = tmp_path / "rank8"
    rank8.mkdir()
    (rank8 / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    scale = 2.0
    with serve(_config(time_scale=scale)) as sim, httpx.Client(base_url=sim.url) as http:
        started = time.monotonic()
        body = {"lora_name": "r8", "lora_path": str(rank8)}
        assert http.post(LOAD, json=body, timeout=30).status_code == 200
        took = (time.monotonic() - started) * scale  # modelled seconds
        modelled = lora_load_seconds(SPEC, GPU, rank=8)
        assert modelled == pytest.approx(0.1037, abs=1e-3)
        assert modelled <= took <= modelled + 1.0
        assert sim.app.state.engine.lora.registered["r8"].rank == 8


def test_a_rank_above_max_lora_rank_is_refused_as_vllm_refuses_it(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.mkdir()
    (big / "adapter_config.json").write_text(json.dumps({"r": 16, "rank_pattern": {"q": 64}}))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    with serve(_config()) as sim, httpx.Client(base_url=sim.url, timeout=30) as http:
        refused = http.post(LOAD, json={"lora_name": "big", "lora_path": str(big)})
        assert refused.status_code == 500
        assert _error(refused)["type"] == "InternalServerError"
        assert _error(refused)["message"] == (
            "Call to add_lora method failed: LoRA rank 64 is greater than max_lora_rank 16."
        )
        unreadable = http.post(LOAD, json={"lora_name": "b", "lora_path": str(broken)})
        assert unreadable.status_code == 500
        assert "adapter_config.json" in _error(unreadable)["message"]
        assert _complete(http, "big").status_code == 404  # not registered
        assert _counter(sim, "loads") == 0.0
    with serve(_config(max_lora_rank=64)) as sim, httpx.Client(base_url=sim.url) as http:
        ok = http.post(LOAD, json={"lora_name": "big", "lora_path": str(big)}, timeout=30)
        assert ok.status_code == 200
    with pytest.raises(ValueError, match="LoRA rank 64 is greater than max_lora_rank 16"):
        create_app(_config(lora_modules=(LoraModuleConfig(name="big", path=str(big)),)))


def test_models_lists_the_adapters_after_the_base_model() -> None:
    modules = (
        LoraModuleConfig(name="sql", path="/adapters/sql"),
        LoraModuleConfig(name="chat", path="/adapters/chat", base_model_name="llama-3.1-8b"),
    )
    config = _config(lora_modules=modules)
    with serve(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as http:
        body = {"lora_name": "late", "lora_path": "/adapters/late"}
        assert http.post(LOAD, json=body).status_code == 200
        cards = http.get("/v1/models").json()["data"]
        assert [c["id"] for c in cards] == [config.name, "sql", "chat", "late"]
        assert cards[0]["parent"] is None
        for card in cards[1:]:
            assert card["root"] == f"/adapters/{card['id']}"
            assert card["parent"] == config.name
            assert (card["object"], card["owned_by"]) == ("model", "vllm")
        assert [m.id for m in sim.client().models.list()] == [c["id"] for c in cards]


@pytest.fixture(scope="module")
def sim_lora() -> Iterator[Served]:
    """One LoRA-enabled engine with runtime updating, for the tests that change nothing."""
    with serve(_config()) as served:
        yield served


def _stream_until_cut(http: httpx.Client, model: str, cut: threading.Event) -> None:
    body = {"model": model, "prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as streaming:
        for _ in streaming.iter_lines():
            if cut.is_set():
                return  # closing the stream aborts the request


def _wait_for(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_lora_requests_info_shows_running_and_waiting_adapters() -> None:
    config = _config(time_scale=1.0, max_loras=1, max_cpu_loras=2, lora_modules=_modules("a", "b"))
    cut_a, cut_b = threading.Event(), threading.Event()
    with serve(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as http:
        assert _lora_info(sim) == {
            "max_lora": "1",
            "running_lora_adapters": "",
            "waiting_lora_adapters": "",
        }
        with ThreadPoolExecutor(2) as pool:
            a = pool.submit(_stream_until_cut, http, "a", cut_a)
            _wait_for(lambda: _lora_info(sim)["running_lora_adapters"] == "a")
            b = pool.submit(_stream_until_cut, http, "b", cut_b)  # max_loras 1: b waits
            _wait_for(lambda: _lora_info(sim)["waiting_lora_adapters"] == "b")
            assert _lora_info(sim) == {
                "max_lora": "1",
                "running_lora_adapters": "a",
                "waiting_lora_adapters": "b",
            }
            assert sim.sample("vllm:num_requests_running") == 1.0
            assert sim.sample("vllm:num_requests_waiting") == 1.0  # held for its slot
            cut_a.set()
            a.result(timeout=30)
            _wait_for(lambda: _lora_info(sim)["running_lora_adapters"] == "b")
            assert _lora_info(sim)["waiting_lora_adapters"] == ""
            cut_b.set()
            b.result(timeout=30)
        _wait_for(lambda: _lora_info(sim)["running_lora_adapters"] == "")
        info = sim.metrics()["vllm:lora_requests_info"].samples
        assert len(info) >= 3  # every label set seen stays, with the time it was last set
        assert all(s.value > 1e9 for s in info)  # wall-clock timestamps, as vLLM's
        assert _counter(sim, "loads") == 0.0  # both resident since the start


def test_the_least_recently_used_adapter_is_evicted_and_pays_a_load_again() -> None:
    scale = 2.0
    config = _config(time_scale=scale, max_loras=1, max_cpu_loras=2)
    with serve(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as http:
        lora = sim.app.state.engine.lora
        for name in ("a", "b", "c"):
            body = {"lora_name": name, "lora_path": f"/adapters/{name}"}
            assert http.post(LOAD, json=body).status_code == 200
        assert lora.resident() == ("b", "c")  # c's load evicted a, the least recently used
        assert (_counter(sim, "loads"), _counter(sim, "evictions")) == (3.0, 1.0)

        assert _complete(http, "b").status_code == 200  # b is now the most recently used
        assert _counter(sim, "loads") == 3.0
        started = time.monotonic()
        assert _complete(http, "a", max_tokens=1).status_code == 200
        waited = (time.monotonic() - started) * scale
        assert waited >= LOAD_16  # a was evicted: its request waited a load again
        assert (_counter(sim, "loads"), _counter(sim, "evictions")) == (4.0, 2.0)
        assert lora.resident() == ("b", "a")  # c went: least recently used, and idle
        ttft = "vllm:time_to_first_token_seconds"  # the load counts in its modelled TTFT
        assert sim.sample(ttft, f"{ttft}_sum") >= LOAD_16


def test_concurrent_requests_for_one_adapter_share_one_load() -> None:
    scale = 1.0
    config = _config(time_scale=scale, max_cpu_loras=1, lora_modules=_modules("cold", "warm"))
    with serve(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as http:
        assert sim.app.state.engine.lora.resident() == ("warm",)  # cold was evicted at start
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: _complete(http, "cold"), range(8)))
        took = (time.monotonic() - started) * scale
        assert [a.status_code for a in answers] == [200] * 8
        assert {a.json()["model"] for a in answers} == {"cold"}
        assert _counter(sim, "loads") == 1.0  # one load, shared by the 8 requests
        assert _counter(sim, "evictions") == 1.0
        assert LOAD_16 <= took < 2 * LOAD_16 + 2.0
        assert sim.sample("vllm:num_requests_waiting") == 0.0


def test_a_client_that_leaves_during_a_load_leaves_nothing_behind() -> None:
    scale = 0.1  # a load of ~0.107 modelled seconds takes ~1.07 s
    config = _config(time_scale=scale, max_cpu_loras=1, lora_modules=_modules("cold", "warm"))
    with serve(config) as sim, httpx.Client(base_url=sim.url, timeout=30) as http:
        body = {"model": "cold", "prompt": "hi", "max_tokens": 1}
        with pytest.raises(httpx.ReadTimeout):  # the client leaves while "cold" loads
            http.post("/v1/completions", json=body, timeout=0.3)
        _wait_for(lambda: _counter(sim, "loads") == 1.0)  # the load went on
        _wait_for(lambda: sim.sample("vllm:num_requests_waiting") == 0.0)
        assert _lora_info(sim)["waiting_lora_adapters"] == ""
        assert sim.app.state.engine.lora.resident() == ("cold",)
        assert _complete(http, "cold", max_tokens=1).status_code == 200
        assert _counter(sim, "loads") == 1.0


@pytest.mark.parametrize(
    ("route", "body", "status", "kind"),
    [
        (LOAD, b"{not json", 400, "BadRequestError"),
        (LOAD, b"[1, 2]", 400, "BadRequestError"),
        (LOAD, b'{"lora_path": "/adapters/x"}', 400, "BadRequestError"),
        (LOAD, b'{"lora_name": "x"}', 400, "BadRequestError"),
        (LOAD, b'{"lora_name": 3, "lora_path": "/p"}', 400, "BadRequestError"),
        (LOAD, b'{"lora_name": "", "lora_path": "/p"}', 400, "InvalidUserInput"),
        (LOAD, b'{"lora_name": "x", "lora_path": ""}', 400, "InvalidUserInput"),
        (UNLOAD, b"", 400, "BadRequestError"),
        (UNLOAD, b"{}", 400, "BadRequestError"),
        (UNLOAD, b'{"lora_name": ""}', 400, "InvalidUserInput"),
        (UNLOAD, b'{"lora_name": "x", "lora_int_id": 7}', 404, "NotFoundError"),
    ],
)
def test_bad_bodies_are_openai_shaped_errors(
    sim_lora: Served, route: str, body: bytes, status: int, kind: str
) -> None:
    with httpx.Client(base_url=sim_lora.url, timeout=30) as http:
        answer = http.post(route, content=body, headers={"content-type": "application/json"})
        assert answer.status_code == status
        error = _error(answer)
        assert error["type"] == kind
        assert isinstance(error["message"], str)
        assert error["message"]
        if b"lora_path" in body and b"lora_name" not in body:
            assert error["param"] == "lora_name"
        assert http.get("/health").status_code == 200
        assert _complete(http, sim_lora.app.state.engine.name).status_code == 200


def test_the_official_client_sees_an_unknown_adapter_as_not_found(sim_lora: Served) -> None:
    with pytest.raises(openai.NotFoundError):
        sim_lora.client().completions.create(model="nope", prompt="hi", max_tokens=1)
