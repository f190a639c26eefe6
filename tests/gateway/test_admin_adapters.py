"""LoRA adapters registered through the admin API, over real HTTP: a pool with a ``lora``
block and no adapter in the fleet file; an operator registers one; it is a served name at
once, loaded on demand on a real sim engine when asked for, shown by ``GET
/admin/adapters``, and registered again by a restarted gateway (the store keeps it). Bad
bodies, a viewer, an unknown pool, a taken name: clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from gpufleet.control import AdapterAdded, event_from_json, event_to_json
from gpufleet.store import Role
from tests.gateway.console_fleet import MODEL, console_fleet

POOL = {
    "name": MODEL,
    "engine": "sim",
    "replicas": 2,
    "routing": "least_request",
    "args": ["--time-scale", "1"],
    "lora": {"max_loras": 2, "max_lora_rank": 16},
}


@pytest.mark.asyncio
async def test_an_operator_registers_an_adapter_and_clients_use_it(tmp_path: Path) -> None:
    adapter_dir = tmp_path / "support-fr"
    adapter_dir.mkdir()
    (adapter_dir / "adapter_config.json").write_text(json.dumps({"r": 8}))
    body = {"model": MODEL, "name": "support-fr", "path": str(adapter_dir), "rank": 8}
    async with console_fleet(tmp_path, [POOL]) as cf, httpx.AsyncClient(base_url=cf.url) as http:
        operator, viewer = cf.headers(Role.OPERATOR), cf.headers(Role.VIEWER)
        assert (await http.post("/admin/adapters", json=body, headers=viewer)).status_code == 403
        for bad, status in (
            ({**body, "rank": 0}, 400),
            ({**body, "rank": 32}, 400),  # above the pool's max_lora_rank
            ({k: v for k, v in body.items() if k != "path"}, 400),
            ({**body, "model": "nope"}, 404),
            ({**body, "name": MODEL}, 409),  # a served name already
        ):
            answer = await http.post("/admin/adapters", json=bad, headers=operator)
            assert answer.status_code == status, (bad, answer.text)
            assert answer.json()["error"]["message"]
        not_json = await http.post("/admin/adapters", content=b"{", headers=operator)
        assert not_json.status_code == 400

        tenant = {"authorization": f"Bearer {cf.tenant_key}"}
        ask = {"model": "support-fr", "prompt": "bonjour", "max_tokens": 4}
        before = await http.post("/v1/completions", json=ask, headers=tenant)
        assert before.status_code == 404  # not a model yet
        added = await http.post("/admin/adapters", json=body, headers=operator)
        assert added.status_code == 201, added.text
        again = await http.post("/admin/adapters", json=body, headers=operator)
        assert again.status_code == 409
        models = (await http.get("/v1/models", headers=tenant)).json()
        assert [m["id"] for m in models["data"]] == [MODEL, "support-fr"]

        replicas = set()
        for _ in range(4):
            answer = await http.post("/v1/completions", json=ask, headers=tenant)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "support-fr"
            replicas.add(answer.headers["x-gpufleet-replica"])
        assert len(replicas) == 1  # loaded once, then affinity
        listed = (await http.get("/admin/adapters", headers=viewer)).json()["pools"][MODEL]
        assert listed["adapters"] == [{"name": "support-fr", "path": str(adapter_dir)}]
        holder = replicas.pop()
        assert listed["held"] == {holder: ["support-fr"]}
        # the console's view: each replica's adapters (no residency: always resident)
        (pool,) = (await http.get("/admin/fleet", headers=viewer)).json()["pools"]
        shown = {r["name"]: (r["residency"], r["adapters"]) for r in pool["replicas"]}
        assert shown[holder] == (None, ["support-fr"])
        assert [a for name, (_, a) in shown.items() if name != holder] == [[]]
        assert (listed["counters"]["requests"], listed["counters"]["loads"]) == (4, 1)

    # a restarted gateway (the same store) registers it again: served at once
    async with console_fleet(tmp_path, [POOL]) as cf, httpx.AsyncClient(base_url=cf.url) as http:
        tenant = {"authorization": f"Bearer {cf.tenant_key}"}
        models = (await http.get("/v1/models", headers=tenant)).json()
        assert [m["id"] for m in models["data"]] == [MODEL, "support-fr"]
        answer = await http.post("/v1/completions", json=ask, headers=tenant)
        assert answer.status_code == 200, answer.text
        again = await http.post("/admin/adapters", json=body, headers=cf.headers(Role.OPERATOR))
        assert again.status_code == 409


def test_the_event_is_recorded_as_json() -> None:
    event = AdapterAdded("base", "sql", "/a/sql", 8)
    assert event_from_json(json.loads(json.dumps(event_to_json(event)))) == event
