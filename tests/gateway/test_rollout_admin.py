"""Rollouts through the admin API and ``gpufleet rollout`` over real HTTP, auth on (a real
SQLite store): roles, OpenAI-shaped refusals, operators' actions, and a rollout that
survives a gateway restart (its state is in the store)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

from gpufleet.cli._app import app as cli
from gpufleet.config import parse_fleet
from gpufleet.engine.server import SimEngineConfig, create_app
from gpufleet.fleet import ReplicaId
from gpufleet.gateway import StaticReplicas, Tenancy, Upstream, create_gateway
from gpufleet.store import Role, Store, TenantSettings
from tests.gateway.conftest import FAST, MODEL, serve_app

ADMIN = "rollout-test-admin-secret"
FLEET = parse_fleet(
    {
        "tenants": {"auth": True, "refresh_interval": 0.2},
        "models": [
            {"name": name, "model": MODEL, "replicas": 1, "routing": "least_request"}
            for name in ("v1", "v2")
        ],
        "served": [{"name": "chat", "variants": {"v1": 100, "v2": 0}}],
    },
    source="test",
)


@contextmanager
def engines() -> Iterator[list[Upstream]]:
    with ExitStack() as stack:
        upstreams = []
        for name in ("v1", "v2"):
            engine = SimEngineConfig(time_scale=FAST, served_model_name=name, max_model_len=4096)
            url = stack.enter_context(serve_app(create_app(engine)))
            upstreams.append(Upstream(ReplicaId(f"{name}-0"), name, url))
        yield upstreams


@contextmanager
def gateway(tmp: Path, store: Store, upstreams: list[Upstream]) -> Iterator[str]:
    journal = store.journal(tmp / "journal", flush_interval=0.02)
    tenancy = Tenancy(FLEET, store, journal=journal, admin_key=ADMIN)
    app = create_gateway(FLEET, StaticReplicas(upstreams), CollectorRegistry(), tenancy=tenancy)
    with serve_app(app, "own") as url:
        deadline = time.monotonic() + 10
        while httpx.get(url + "/ready").status_code != 200:
            assert time.monotonic() < deadline, "gateway not ready"
            time.sleep(0.02)
        yield url
        journal.flush()


def call(url: str, key: str, method: str, path: str, body: Any = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    return httpx.request(method, url + path, json=body, headers=headers)


def refused(answer: httpx.Response, status: int, message: str) -> None:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert message in error["message"], error


def test_operators_start_steer_and_a_restart_keeps_the_rollout(tmp_path: Path) -> None:
    store = Store.open(f"sqlite:///{tmp_path / 'gpufleet.db'}")
    operator = store.admins.create(Role.OPERATOR, "op")[1]
    viewer = store.admins.create(Role.VIEWER, "view")[1]
    start = {"model": "chat", "to": "v2", "steps": [5, 20], "step_seconds": 600}
    try:
        with engines() as upstreams:
            with gateway(tmp_path, store, upstreams) as url:
                assert call(url, viewer, "GET", "/admin/rollouts").json() == {"rollouts": []}
                refused(call(url, viewer, "POST", "/admin/rollouts", start), 403, "needs operator")
                refused(
                    call(url, operator, "POST", "/admin/rollouts", start | {"steps": [50, 20]}),
                    400,
                    "steps: [50.0, 20.0] must increase",
                )
                refused(
                    call(url, operator, "POST", "/admin/rollouts", start | {"model": "nope"}),
                    404,
                    "no served model 'nope'",
                )
                refused(
                    call(url, operator, "POST", "/admin/rollouts", start | {"to": "v9"}),
                    400,
                    "'v9' is not one of its variants",
                )
                refused(call(url, operator, "GET", "/admin/rollouts/chat"), 404, "no rollout")
                started = call(url, operator, "POST", "/admin/rollouts", start)
                assert started.status_code == 201, started.text
                assert (started.json()["share"], started.json()["phase"]) == (5.0, "running")
                assert started.json()["weights"] == {"v1": 95.0, "v2": 5.0}
                refused(call(url, operator, "POST", "/admin/rollouts", start), 409, "already")
                paused = call(url, operator, "POST", "/admin/rollouts/chat/pause")
                assert paused.json()["phase"] == "paused"
                refused(call(url, operator, "POST", "/admin/rollouts/chat/yolo"), 404, "actions")
                promoted = call(url, operator, "POST", "/admin/rollouts/chat/promote")
                assert (promoted.json()["share"], promoted.json()["phase"]) == (20.0, "running")
            stored = store.rollouts.get("chat")
            assert stored is not None
            assert (stored["step"], stored["phase"]) == (1, "running")
            actions = {e["action"] for e in store.audit_entries(200)}
            assert {"rollout.start", "rollout.pause", "rollout.promote", "admin.post"} <= actions

            # a new gateway process on the same store: the rollout goes on at its step
            with gateway(tmp_path, store, upstreams) as url:
                status = call(url, viewer, "GET", "/admin/rollouts/chat").json()
                assert (status["share"], status["phase"]) == (20.0, "running")
                assert status["weights"] == {"v1": 80.0, "v2": 20.0}
                runner = CliRunner()
                env = {"GPUFLEET_URL": url, "GPUFLEET_ADMIN_KEY": operator}
                shown = runner.invoke(cli, ["rollout", "status", "--model", "chat"], env=env)
                assert shown.exit_code == 0, shown.output
                assert json.loads(shown.output)["share"] == 20.0
                aborted = runner.invoke(cli, ["rollout", "abort", "--model", "chat"], env=env)
                assert aborted.exit_code == 0, aborted.output
                assert json.loads(aborted.output)["weights"] == {"v1": 100.0, "v2": 0.0}
                again = runner.invoke(cli, ["rollout", "abort", "--model", "chat"], env=env)
                assert again.exit_code == 1
                assert "409" in again.output
                assert "is over (aborted)" in again.output
                bad = runner.invoke(
                    cli, ["rollout", "start", "--model", "chat", "--to", "v2", "--steps", "5,x"]
                )
                assert bad.exit_code == 2
                # the aborted rollout's traffic: every session on the old version
                with httpx.Client(base_url=url) as http:
                    key = store.create_key("team", TenantSettings())[1]
                    time.sleep(0.5)  # the gateway reloads its keys every refresh_interval
                    for i in range(20):
                        answer = http.post(
                            "/v1/chat/completions",
                            headers={"authorization": f"Bearer {key}"},
                            json={
                                "model": "chat",
                                "messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 4,
                                "user": f"u{i}",
                            },
                        )
                        assert answer.status_code == 200, answer.text
                        assert answer.json()["model"] == "v1"
    finally:
        store.close()


@pytest.mark.parametrize("path", ["/admin/rollouts", "/admin/rollouts/chat/promote"])
def test_with_auth_off_no_one_can_act_on_a_rollout(path: str) -> None:
    config = parse_fleet(FLEET.model_dump(mode="json") | {"tenants": {"auth": False}})
    with engines() as upstreams:
        app = create_gateway(config, StaticReplicas(upstreams), CollectorRegistry())
        with serve_app(app, "own") as url:
            refused(httpx.post(url + path, json={}), 403, "auth is off")
            assert httpx.get(url + "/admin/rollouts").json() == {"rollouts": []}


@pytest.mark.parametrize("server", ["own", "uvicorn"])
def test_a_served_name_with_a_slash_is_one_url_segment(tmp_path: Path, server: str) -> None:
    """Hugging Face names (``meta-llama/Llama-3.1-8B``) are served names: sent as ``%2F``,
    the name is one segment of the admin URL, under either server, and the CLI sends it so."""
    data = FLEET.model_dump(mode="json")
    data["served"] = [{"name": "org/chat", "variants": {"v1": 100, "v2": 0}}]
    fleet = parse_fleet(data)
    store = Store.open(f"sqlite:///{tmp_path / 'gpufleet.db'}")
    operator = store.admins.create(Role.OPERATOR, "op")[1]
    try:
        with engines() as upstreams:
            tenancy = Tenancy(fleet, store, admin_key=ADMIN)
            app = create_gateway(
                fleet, StaticReplicas(upstreams), CollectorRegistry(), tenancy=tenancy
            )
            with serve_app(app, server) as url:
                start = {"model": "org/chat", "to": "v2", "steps": [5, 20], "step_seconds": 600}
                assert call(url, operator, "POST", "/admin/rollouts", start).status_code == 201
                status = call(url, operator, "GET", "/admin/rollouts/org%2Fchat")
                assert status.status_code == 200, status.text
                assert status.json()["model"] == "org/chat"
                paused = call(url, operator, "POST", "/admin/rollouts/org%2Fchat/pause")
                assert paused.json()["phase"] == "paused"
                # unencoded, it reads as action `chat` on `org`: a POST route
                refused(call(url, operator, "GET", "/admin/rollouts/org/chat"), 405, "use POST")
                env = {"GPUFLEET_URL": url, "GPUFLEET_ADMIN_KEY": operator}
                runner = CliRunner()
                resumed = runner.invoke(cli, ["rollout", "resume", "--model", "org/chat"], env=env)
                assert resumed.exit_code == 0, resumed.output
                assert json.loads(resumed.output)["phase"] == "running"
    finally:
        store.close()
