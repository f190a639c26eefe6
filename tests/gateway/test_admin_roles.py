"""Admin roles over real HTTP on loopback: viewer < operator < admin, 403 (OpenAI-shaped,
audited) below a route's role, the environment's credential as admin, revocation at once,
and who may read ``/metrics``. A real SQLite store and a real sim replica."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufleet.gateway._admin import ROUTES
from gpufleet.store import Role, TenantSettings
from tests.gateway.conftest import fleet as plain_fleet
from tests.gateway.conftest import serve_gateway, sim_replica
from tests.gateway.tenants import ADMIN, TenantGateway, serve_tenant_gateway, tenant_fleet


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantGateway]:
    tmp = tmp_path_factory.mktemp("roles")
    with sim_replica(seed=3) as a, serve_tenant_gateway(tmp, tenant_fleet(), [a]) as gw:
        yield gw


def credential(gw: TenantGateway, role: Role, name: str | None = None) -> str:
    _, key = gw.store.admins.create(role, name)
    gw.tenancy.reload()
    return key


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def audit(gw: TenantGateway, action: str) -> list[dict[str, Any]]:
    gw.tenancy.flush_denials()
    gw.flush()
    return [e for e in gw.store.audit_entries(10_000) if e["action"] == action]


_BODIES = {
    ("PUT", ("tenants", "{}")): {"rpm": 60},
    ("POST", ("keys",)): {"tenant": "roles-made"},
    ("POST", ("admins",)): {"role": "viewer", "name": "made"},
}


def test_each_route_answers_each_role_by_the_table(gateway: TenantGateway) -> None:
    """Every route of the table, called with each role: 403 exactly when the role is below
    the route's; otherwise the route's own answer (200, 201, 404 for an unknown id …)."""
    keys = {role: credential(gateway, role) for role in Role}
    for route in ROUTES:
        path = "/admin/" + "/".join("roles-x" if p == "{}" else p for p in route.path)
        body = _BODIES.get((route.method, route.path))
        for role, key in keys.items():
            answer = httpx.request(route.method, gateway.url + path, json=body, headers=bearer(key))
            if role.allows(route.role):
                assert answer.status_code not in (401, 403), (route, role, answer.text)
            else:
                assert answer.status_code == 403, (route, role, answer.text)
                error = answer.json()["error"]
                assert error["type"] == "permission_error"
                assert f"needs {route.role.value}" in error["message"]


def test_a_wrong_role_is_403_and_audited(gateway: TenantGateway) -> None:
    viewer = credential(gateway, Role.VIEWER, "vera")
    key_id = viewer.split("_")[1]
    answer = httpx.put(gateway.url + "/admin/tenants/t1", json={"rpm": 5}, headers=bearer(viewer))
    assert answer.status_code == 403
    assert set(answer.json()["error"]) >= {"message", "type", "code"}
    assert gateway.store.tenant("t1") is None  # nothing was done
    (entry,) = [e for e in audit(gateway, "admin.forbidden") if e["actor"] == f"admin:{key_id}"]
    assert entry["target"] == "PUT /admin/tenants/t1"
    assert entry["outcome"] == "denied"
    assert json.loads(entry["detail"]) == {"role": "viewer", "needs": "operator"}
    assert viewer not in json.dumps(audit(gateway, "admin.forbidden"))


def test_the_environment_credential_is_admin_and_a_tenant_key_is_none(
    gateway: TenantGateway,
) -> None:
    who = httpx.get(gateway.url + "/admin/whoami", headers=bearer(ADMIN)).json()
    assert who == {"actor": "admin:env", "role": "admin", "auth": True}
    made = httpx.post(
        gateway.url + "/admin/admins",
        json={"role": "operator", "name": "olga"},
        headers=bearer(ADMIN),
    )
    assert made.status_code == 201
    operator = made.json()["key"]
    assert httpx.get(gateway.url + "/admin/whoami", headers=bearer(operator)).json()["role"] == (
        "operator"
    )
    # an operator acts on tenants but cannot make admin credentials
    assert (
        httpx.put(
            gateway.url + "/admin/tenants/t2", json={"rpm": 5}, headers=bearer(operator)
        ).status_code
        == 200
    )
    assert (
        httpx.post(
            gateway.url + "/admin/admins", json={"role": "admin"}, headers=bearer(operator)
        ).status_code
        == 403
    )
    _, tenant_key = gateway.store.create_key("roles-tenant", TenantSettings())
    gateway.tenancy.reload()
    assert httpx.get(gateway.url + "/admin/whoami", headers=bearer(tenant_key)).status_code == 401
    assert httpx.get(gateway.url + "/admin/whoami").status_code == 401
    listed = httpx.get(gateway.url + "/admin/admins", headers=bearer(ADMIN)).json()
    assert any(a["name"] == "olga" and a["role"] == "operator" for a in listed)
    assert "key" not in json.dumps(listed).replace('"key_id"', "")
    actions = {e["action"] for e in audit(gateway, "admin.post")}
    assert actions == {"admin.post"}


def test_a_revoked_credential_stops_at_once(gateway: TenantGateway) -> None:
    operator = credential(gateway, Role.OPERATOR)
    key_id = operator.split("_")[1]
    assert httpx.get(gateway.url + "/admin/tenants", headers=bearer(operator)).status_code == 200
    gone = httpx.delete(f"{gateway.url}/admin/admins/{key_id}", headers=bearer(ADMIN))
    assert gone.status_code == 200
    assert gone.json()["revoked_at"] is not None
    assert httpx.get(gateway.url + "/admin/tenants", headers=bearer(operator)).status_code == 401
    again = httpx.delete(f"{gateway.url}/admin/admins/{key_id}", headers=bearer(ADMIN))
    assert again.status_code == 404


def test_roles_hold_under_concurrent_calls_and_every_refusal_is_audited(
    gateway: TenantGateway,
) -> None:
    """Eight threads call at once, viewers writing (refused) and operators writing (done);
    each answer is its role's, and the audit log holds one row per refusal and per action."""
    viewers = [credential(gateway, Role.VIEWER) for _ in range(4)]
    operators = [credential(gateway, Role.OPERATOR) for _ in range(4)]
    before_forbidden = len(audit(gateway, "admin.forbidden"))
    before_put = len([e for e in audit(gateway, "admin.put") if e["outcome"] == "ok"])
    seen: Counter[tuple[str, int]] = Counter()
    lock = threading.Lock()

    def work(i: int, key: str, kind: str) -> None:
        with httpx.Client(base_url=gateway.url, headers=bearer(key)) as c:
            for n in range(20):
                status = c.put(f"/admin/tenants/conc-{i}-{n}", json={"rpm": 10}).status_code
                read = c.get("/admin/tenants").status_code
                with lock:
                    seen[kind, status] += 1
                    seen["read", read] += 1

    threads = [
        threading.Thread(target=work, args=(i, key, kind))
        for i, (key, kind) in enumerate(
            [*((k, "viewer") for k in viewers), *((k, "operator") for k in operators)]
        )
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {("viewer", 403): 80, ("operator", 200): 80, ("read", 200): 160}
    assert len(audit(gateway, "admin.forbidden")) - before_forbidden == 80
    puts = [e for e in audit(gateway, "admin.put") if e["outcome"] == "ok"]
    assert len(puts) - before_put == 80
    assert len([t for t in gateway.store.tenants() if t.name.startswith("conc-")]) == 80


def test_metrics_take_a_viewer_an_allowed_address_or_a_tenant_key(tmp_path: Path) -> None:
    allowed = tenant_fleet(gateway={"metrics_allow": ["127.0.0.1/32"]})
    elsewhere = tenant_fleet(gateway={"metrics_allow": ["10.0.0.0/8", "::1/128"]})
    with sim_replica() as a:
        with serve_tenant_gateway(tmp_path / "a", allowed, [a]) as gw:
            page = httpx.get(gw.url + "/metrics")  # from 127.0.0.1: no key needed
            assert page.status_code == 200
            assert "gpufleet:gateway_requests" in page.text
        with serve_tenant_gateway(tmp_path / "b", elsewhere, [a]) as gw:
            assert httpx.get(gw.url + "/metrics").status_code == 401
            viewer = credential(gw, Role.VIEWER)
            assert httpx.get(gw.url + "/metrics", headers=bearer(viewer)).status_code == 200
            assert httpx.get(gw.url + "/metrics", headers=bearer(ADMIN)).status_code == 200
            _, key = gw.store.create_key("scraper", TenantSettings())
            gw.tenancy.reload()
            assert httpx.get(gw.url + "/metrics", headers=bearer(key)).status_code == 200
            assert httpx.get(gw.url + "/metrics", headers=bearer("gfa_nope")).status_code == 401
            denied = audit(gw, "access.denied")
            assert any(e["target"] == "/metrics" for e in denied)


def test_with_auth_off_there_is_no_credential_and_no_store(tmp_path: Path) -> None:
    with sim_replica() as a, serve_gateway(plain_fleet(), [a]) as gw:
        who = httpx.get(gw.url + "/admin/whoami").json()
        assert who == {"actor": "anonymous", "role": "viewer", "auth": False}
        assert httpx.get(gw.url + "/admin/tenants").status_code == 404
        refused = httpx.post(gw.url + "/admin/keys", json={"tenant": "x"})
        assert refused.status_code == 404  # no store, so no tenants nor keys to act on
        assert "needs auth on" in refused.json()["error"]["message"]
        assert httpx.get(gw.url + "/admin/nope").status_code == 404
        fleet = httpx.get(gw.url + "/admin/fleet").json()
        assert [r["name"] for r in fleet["pools"][0]["replicas"]] == ["llama-3.1-8b-0"]
        drain = httpx.post(gw.url + "/admin/replicas/llama-3.1-8b-0/drain")
        assert drain.status_code == 403
        assert "auth is off" in drain.json()["error"]["message"]
