"""Auth, model access, quotas, the ledger and the admin API over real HTTP, with real keys
in a real SQLite store and the official openai client."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gpufleet.engine.server import SimEngineConfig, create_app
from gpufleet.gateway import _app, _tenancy
from gpufleet.store import TenantSettings
from tests.gateway.conftest import MODEL, serve_app, sim_replica
from tests.gateway.tenants import ADMIN, TenantGateway, serve_tenant_gateway, tenant_fleet


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantGateway]:
    tmp = tmp_path_factory.mktemp("tenants")
    with sim_replica(seed=1) as a, serve_tenant_gateway(tmp, tenant_fleet(), [a]) as gw:
        yield gw


def client(gw: TenantGateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0)


def new_key(gw: TenantGateway, tenant: str, **settings: object) -> str:
    _, key = gw.store.create_key(tenant, TenantSettings(**settings))  # type: ignore[arg-type]
    gw.tenancy.reload()
    return key


def chat(c: openai.OpenAI, **kw: object) -> object:
    return c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kw
    )


def test_health_and_ready_need_no_key(gateway: TenantGateway) -> None:
    assert httpx.get(gateway.url + "/health").status_code == 200
    assert httpx.get(gateway.url + "/ready").status_code == 200


@pytest.mark.parametrize("path", ["/v1/models", "/metrics"])
def test_every_other_path_needs_a_key(gateway: TenantGateway, path: str) -> None:
    answer = httpx.get(gateway.url + path)
    assert answer.status_code == 401
    assert answer.json()["error"]["type"] == "authentication_error"


def test_missing_or_wrong_key_is_401_and_audited(gateway: TenantGateway) -> None:
    key = new_key(gateway, "audited")
    with client(gateway, key[:-2] + "xx") as c, pytest.raises(openai.AuthenticationError):
        chat(c)
    with client(gateway, "not-a-key") as c, pytest.raises(openai.AuthenticationError):
        c.models.list()
    gateway.tenancy.flush_denials()  # repeats within a minute are one row with a count
    gateway.flush()
    denied = [e for e in gateway.store.audit_entries() if e["action"] == "access.denied"]
    assert sum(json.loads(e["detail"])["count"] for e in denied) >= 2


def test_failed_authentications_are_audited_once_per_client_and_minute(
    gateway: TenantGateway,
) -> None:
    """A client without a key cannot grow the audit table per request: the first 401 of a
    minute from an address is a row at once, the rest one row with their count."""
    gateway.tenancy.flush_denials()
    gateway.flush()
    before = len(gateway.store.audit_entries(limit=10_000))
    with httpx.Client() as http:
        for _ in range(30):
            assert http.get(gateway.url + "/v1/models").status_code == 401
    gateway.flush()
    grown = len(gateway.store.audit_entries(limit=10_000)) - before
    assert grown <= 2  # (2 if the requests straddle a minute)
    gateway.tenancy.flush_denials()
    gateway.flush()
    rows = gateway.store.audit_entries(limit=10_000)
    new = [e for e in rows[: len(rows) - before] if e["action"] == "access.denied"]
    assert 1 <= len(new) <= 4
    assert sum(json.loads(e["detail"])["count"] for e in new) == 30


def test_a_good_key_is_served_and_ledgered(gateway: TenantGateway) -> None:
    key = new_key(gateway, "ledgered")
    with client(gateway, key) as c:
        reply = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=5,
            extra_headers={"x-request-id": "ledger-1"},
        )
        assert reply.usage is not None
        chunks = list(
            c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "stream"}],
                max_tokens=6,
                stream=True,
                extra_headers={"x-request-id": "ledger-2"},
            )
        )
    assert all(ch.choices for ch in chunks)  # the usage event the gateway asked for is dropped
    gateway.flush()
    (row,) = gateway.store.usage(tenant="ledgered")
    assert row.requests == 2
    assert row.completion_tokens == 5 + 6
    assert row.prompt_tokens > reply.usage.prompt_tokens > 0  # both prompts, as replicas counted
    assert {"ledger-1", "ledger-2"} <= gateway.store.usage_ids()


def test_a_model_the_tenant_may_not_use_is_403(gateway: TenantGateway) -> None:
    key = new_key(gateway, "narrow", models=("another-model",))
    with client(gateway, key) as c, pytest.raises(openai.PermissionDeniedError):
        chat(c)


def test_a_request_is_read_once_and_reserialised_only_when_it_may_run(
    gateway: TenantGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hot path: the prompt text is extracted once per request (the admission estimate
    is the routing request's), prefix hashes only for a router that reads them (this pool
    is least_request), and the body is re-serialised to ask for usage only once the
    request passed the model and quota checks."""
    calls: Counter[str] = Counter()

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(_app, "_prompt_text", counting("prompt", _app._prompt_text))
    monkeypatch.setattr(_app, "text_prefix_hashes", counting("hashes", _app.text_prefix_hashes))
    monkeypatch.setattr(_tenancy, "ask_for_usage", counting("usage", _tenancy.ask_for_usage))
    narrow = new_key(gateway, "narrow-once", models=("another-model",))
    with client(gateway, narrow) as c, pytest.raises(openai.PermissionDeniedError):
        chat(c)
    assert calls == {"prompt": 1}
    with client(gateway, new_key(gateway, "served-once")) as c:
        chat(c)
    assert calls == {"prompt": 2, "usage": 1}


def test_over_rpm_is_429_with_retry_after(gateway: TenantGateway) -> None:
    key = new_key(gateway, "rpm3", rpm=3)
    with client(gateway, key) as c:
        for _ in range(3):
            chat(c)
        with pytest.raises(openai.RateLimitError) as raised:
            chat(c)
    retry_after = int(raised.value.response.headers["retry-after"])
    assert 1 <= retry_after <= 60


def test_tpm_is_charged_at_completion_and_never_cuts_a_stream(gateway: TenantGateway) -> None:
    key = new_key(gateway, "tpm", tpm=20)
    with client(gateway, key) as c:
        stream = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "long"}], max_tokens=40, stream=True
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in stream)
        assert len(text.split()) >= 30  # all 40 tokens came, over the 20 tpm
        with pytest.raises(openai.RateLimitError):
            chat(c)


def test_concurrency_limit(tmp_path: Path) -> None:
    slow = SimEngineConfig(time_scale=1.0, max_model_len=4096)  # a stream that stays open
    with (
        serve_app(create_app(slow)) as a,
        serve_tenant_gateway(tmp_path, tenant_fleet(), [a]) as gw,
    ):
        key = new_key(gw, "one-at-a-time", concurrency=1)
        with client(gw, key) as c:
            stream = c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                max_tokens=2000,
                stream=True,
            )
            next(iter(stream))
            with pytest.raises(openai.RateLimitError) as raised:
                chat(c)
            assert raised.value.response.headers["retry-after"] == "1"
            stream.close()


def test_revocation_is_effective_within_a_second(gateway: TenantGateway) -> None:
    info, key = gateway.store.create_key("revoked", TenantSettings())
    with client(gateway, key) as c:
        deadline = time.monotonic() + 2
        while True:  # the gateway learns of a key made elsewhere within its refresh
            try:
                chat(c)
                break
            except openai.AuthenticationError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        gateway.store.revoke_key(info.key_id)  # as `gpufleet keys revoke` would, from outside
        revoked_at = time.monotonic()
        while True:
            try:
                chat(c)
            except openai.AuthenticationError:
                break
            time.sleep(0.02)
    assert time.monotonic() - revoked_at < 1.0


def test_admin_api(gateway: TenantGateway) -> None:
    base = gateway.url + "/admin"
    assert httpx.get(base + "/keys").status_code == 401
    user = new_key(gateway, "not-admin")
    assert httpx.get(base + "/keys", headers={"authorization": f"Bearer {user}"}).status_code == 401
    admin = {"authorization": f"Bearer {ADMIN}"}
    made = httpx.post(base + "/keys", json={"tenant": "via-api", "rpm": 100}, headers=admin)
    assert made.status_code == 201
    key, key_id = made.json()["key"], made.json()["key_id"]
    with client(gateway, key) as c:
        chat(c)  # usable at once
    rotated = httpx.post(f"{base}/keys/{key_id}/rotate", headers=admin).json()
    with client(gateway, key) as c, pytest.raises(openai.AuthenticationError):
        chat(c)
    with client(gateway, rotated["key"]) as c:
        chat(c)
    assert httpx.delete(f"{base}/keys/{rotated['key_id']}", headers=admin).status_code == 200
    assert httpx.delete(f"{base}/keys/{rotated['key_id']}", headers=admin).status_code == 404
    tenants = httpx.get(base + "/tenants", headers=admin).json()
    assert next(t for t in tenants if t["name"] == "via-api")["rpm"] == 100
    assert (
        httpx.put(base + "/tenants/x", json={"priority": "urgent"}, headers=admin).status_code
        == 400
    )
    gateway.flush()
    usage = httpx.get(base + "/usage", params={"tenant": "via-api"}, headers=admin).json()
    assert usage[0]["requests"] == 2
    audit = httpx.get(base + "/audit", headers=admin).json()
    assert any(e["action"] == "admin.post" for e in audit)
    assert all("gfk_" not in str(e) for e in audit)  # keys never reach the audit log


def test_admin_api_is_off_without_a_credential(tmp_path: Path) -> None:
    from gpufleet.gateway._tenancy import Tenancy  # noqa: PLC0415

    with sim_replica() as a, serve_tenant_gateway(tmp_path, tenant_fleet(), [a]) as gw:
        gw.tenancy.admin_key = None
        answer = httpx.get(gw.url + "/admin/keys", headers={"authorization": "Bearer x"})
        assert answer.status_code == 403
        assert "GPUFLEET_ADMIN_KEY" in answer.json()["error"]["message"]
        assert isinstance(gw.tenancy, Tenancy)


def test_a_saturated_pool_queues_and_answers_503_at_the_deadline(tmp_path: Path) -> None:
    """One replica that holds one sequence: while a stream runs the pool is saturated; a
    request that cannot start within its deadline gets 503, one that can waits and runs."""
    slow = SimEngineConfig(time_scale=1.0, max_model_len=4096)
    config = tenant_fleet(args=["--max-num-seqs", "1"], admission={"max_wait": 5.0})
    with serve_app(create_app(slow)) as a, serve_tenant_gateway(tmp_path, config, [a]) as gw:
        key = new_key(gw, "queued")
        with client(gw, key) as c:
            stream = c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "x"}],
                max_tokens=2000,
                stream=True,
            )
            next(iter(stream))
            assert gw.saturated()
            with pytest.raises(openai.InternalServerError) as raised:
                chat(c, extra_headers={"x-gpufleet-deadline-ms": "200"})
            assert raised.value.status_code == 503
            assert "deadline" in raised.value.message
            assert raised.value.response.headers["retry-after"] == "1"
            stream.close()  # the slot frees: a waiting request starts
            assert chat(c, extra_headers={"x-gpufleet-deadline-ms": "4000"})
        gw.flush()
        (row,) = gw.store.usage(tenant="queued")
        assert (row.requests, row.errors) == (3, 2)  # the closed stream (499) and the 503
