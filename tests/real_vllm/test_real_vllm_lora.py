"""LoRA adapters on real vLLM engines (``make test-vllm``), through ``gpufleet up``.

Two vLLM replicas of the tiny random model (vLLM's CPU build) started by the fleet file's
``lora`` block: ``--enable-lora --max-loras 1 --max-lora-rank 8`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, three random rank-8 adapters made with ``peft`` at test
time. Nothing is registered at start: the controller loads each adapter on demand
(``POST /v1/load_lora_adapter``), routes its requests to the replica that holds it, and
unloads the least demanded idle one (``POST /v1/unload_lora_adapter``) when a replica's one
slot is needed. Each engine's own ``/v1/models`` (what vLLM has registered) is the proof.
The adapter directories stay on disk for the whole run: vLLM re-reads an adapter it dropped
from its cache, and a missing directory then kills its engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("vllm", reason="vLLM is installed by `make test-vllm` only")
pytest.importorskip("peft", reason="peft is installed by `make test-vllm` only")

from tests.real_vllm.fleet import MODEL, RunningFleet, vllm_fleet
from tests.real_vllm.tiny_model import make_tiny_lora

pytestmark = pytest.mark.timeout(900)

ADAPTERS = ("sql", "poet", "legal")
PROMPT = "The router sends a repeated prefix"


def _lora_block(base: Path) -> str:
    lines = ["    lora:", "      max_loras: 1", "      max_lora_rank: 8", "      adapters:"]
    for seed, name in enumerate(ADAPTERS):
        path = make_tiny_lora(base, base.parent / f"lora-{name}", seed=seed + 1)
        lines.append(f"        - {{name: {name}, path: {path}, rank: 8}}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    with vllm_fleet(tmp_path_factory.mktemp("vllm-lora"), extra=_lora_block) as running:
        yield running
    assert running.process.returncode == 0, running.output()


def _ask(fleet: RunningFleet, model: str) -> tuple[str, str]:
    """One completion (temperature 0): the replica that answered, and the text."""
    answer = httpx.post(
        fleet.base + "/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["model"] == model
    return answer.headers["x-gpufleet-replica"], body["choices"][0]["text"]


def _registered(fleet: RunningFleet) -> dict[str, set[str]]:
    """What each engine has registered: its own ``/v1/models``, less the base model."""
    out = {}
    for name, url in fleet.replicas.items():
        ids = {m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}
        out[name] = ids - {MODEL}
    return out


def _loads(fleet: RunningFleet) -> float:
    return fleet.gateway_metric("gpufleet:adapter_loads_total", outcome="ok") or 0.0


def test_adapters_load_on_demand_stay_by_affinity_and_unload_when_evicted(
    fleet: RunningFleet,
) -> None:
    with openai.OpenAI(base_url=fleet.base + "/v1", api_key="none", max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == [MODEL, *ADAPTERS]
    assert _registered(fleet) == {name: set() for name in fleet.replicas}  # none at start
    _, base_text = _ask(fleet, MODEL)

    # loaded on demand, then every request for it goes where it is
    first, sql_text = _ask(fleet, "sql")
    assert sql_text != base_text  # the adapter's random weights change the answer
    for _ in range(3):
        assert _ask(fleet, "sql") == (first, sql_text)
    assert _loads(fleet) == 1
    assert _registered(fleet)[first] == {"sql"}

    # a second adapter: the other replica's slot is free, so it goes there (sql stays)
    second, poet_text = _ask(fleet, "poet")
    assert second != first
    assert poet_text not in (base_text, sql_text)
    assert _registered(fleet) == {first: {"sql"}, second: {"poet"}}

    # a third: both slots hold an idle adapter; poet (asked once) is worth less than sql
    # (asked four times): poet is unloaded, legal loaded in its place
    third, _ = _ask(fleet, "legal")
    assert third == second
    assert _registered(fleet) == {first: {"sql"}, second: {"legal"}}
    assert fleet.gateway_metric("gpufleet:adapter_unloads_total", outcome="ok") == 1
    assert _loads(fleet) == 3

    # sql never moved, and poet asked again loads again (where legal is the cheaper victim)
    assert _ask(fleet, "sql") == (first, sql_text)
    again, text = _ask(fleet, "poet")
    assert text == poet_text  # the same adapter, loaded again from its directory
    assert _loads(fleet) == 4
    assert _registered(fleet)[again] == {"poet"}
