"""``gpufleet up`` with TLS and its secure default, as a user runs it.

HTTPS on the gateway's port and to an ``https://`` replica (a ``gpufleet engine sim
--ssl-certfile`` process, trusted through the fleet file's ``ca_file``); a certificate that
does not load ends the command before it starts anything; a gateway bound to an address
other than loopback requires API keys unless the file writes ``tenants.auth: false``.
"""

from __future__ import annotations

import os
import re
import signal
import ssl
from pathlib import Path

import httpx
import openai
import pytest
from typer.testing import CliRunner

from gpufleet.cli import app
from gpufleet.cli._up_cmd import secure_default
from gpufleet.config import parse_fleet
from tests.tls_certs import TestCA
from tests.up_process import sim_engine_process, start_up, stop, wait_ready

MODEL = "llama-3.1-8b"


def test_up_serves_https_and_reaches_an_https_replica(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    gateway, replica = ca.issue("gateway"), ca.issue("replica")
    trusted = ssl.create_default_context(cafile=str(ca.cert))
    tls_flags = ("--ssl-certfile", str(replica.cert), "--ssl-keyfile", str(replica.key))
    with sim_engine_process("--time-scale", "100", *tls_flags, verify=trusted) as endpoint:
        fleet = tmp_path / "fleet.yaml"
        fleet.write_text(
            f"gateway:\n"
            f"  tls: {{cert_file: {gateway.cert}, key_file: {gateway.key}}}\n"
            f"models:\n"
            f"  - name: {MODEL}\n"
            f"    engine: external\n"
            f"    endpoints: [{endpoint}]\n"
            f"    ca_file: {ca.cert}\n"
            f"    routing: kv_aware\n"  # scraped: /metrics over TLS too
            f"    health: {{active: {{interval: 0.2}}}}\n"
        )
        log = tmp_path / "up.out"
        process, base = start_up(fleet, log, run_dir=tmp_path / "run")
        try:
            assert base.startswith("https://127.0.0.1:")
            text = log.read_text()
            assert re.search(rf"replica {MODEL}-0\s+ready\s+{endpoint}\s", text), text
            assert f"TLS      {gateway.cert}" in text
            wait_ready(base, verify=trusted)
            with openai.OpenAI(
                base_url=base + "/v1",
                api_key="none",
                max_retries=0,
                http_client=httpx.Client(verify=trusted),
            ) as client:
                reply = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
                )
                assert reply.choices[0].message.content
                stream = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "count"}],
                    max_tokens=5,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                assert len(text.split()) == 5
            metrics = httpx.get(base + "/metrics", verify=trusted).text
            assert 'gpufleet:gateway_replica_kv_cache_usage{replica="llama-3.1-8b-0"}' in metrics
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0, log.read_text()
        finally:
            stop(process)


def _invoke(fleet: Path) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["up", "--fleet", str(fleet), "--port", "0"])
    return result.exit_code, result.output


def test_files_that_do_not_load_end_the_command_naming_them(tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    one, two = ca.issue("one"), ca.issue("two")
    fleet = tmp_path / "fleet.yaml"
    model = f"models: [{{name: {MODEL}}}]\n"

    fleet.write_text(f"gateway: {{tls: {{cert_file: {one.cert}, key_file: {two.key}}}}}\n{model}")
    code, output = _invoke(fleet)
    assert code == 2
    assert f"gateway.tls: cannot load the certificate {one.cert} with the key {two.key}" in output

    missing = tmp_path / "gone.key"
    fleet.write_text(f"gateway: {{tls: {{cert_file: {one.cert}, key_file: {missing}}}}}\n{model}")
    code, output = _invoke(fleet)
    assert code == 2
    assert f"gateway.tls.key_file: {missing}: no such file" in output

    not_a_bundle = tmp_path / "bundle.pem"
    not_a_bundle.write_text("not PEM\n")
    fleet.write_text(
        f"models:\n"
        f"  - name: remote\n"
        f"    engine: external\n"
        f"    endpoints: [https://127.0.0.1:9]\n"
        f"    ca_file: {not_a_bundle}\n"
    )
    code, output = _invoke(fleet)
    assert code == 2
    assert f"models: remote: ca_file: cannot load the CA bundle {not_a_bundle}" in output
    assert "Traceback" not in output


@pytest.mark.parametrize(
    ("tenants", "host", "flag", "auth", "line"),
    [
        ({}, "127.0.0.1", False, False, None),
        ({}, "localhost", False, False, None),
        ({}, "::1", False, False, None),
        ({}, "127.0.0.1", True, True, None),
        ({"auth": True}, "0.0.0.0", False, True, None),
        ({}, "0.0.0.0", False, True, "note: the gateway listens on 0.0.0.0, not on loopback"),
        ({}, "::", False, True, "note: the gateway listens on ::, not on loopback"),
        ({"database_url": "sqlite:///x.db"}, "10.1.2.3", False, True, "API keys required"),
        ({"auth": False}, "0.0.0.0", False, False, "warning: auth is off (tenants.auth: false)"),
        ({"auth": False}, "0.0.0.0", True, True, None),
        ({"auth": False}, "127.0.0.1", False, False, None),
    ],
)
def test_the_secure_default(
    tenants: dict[str, object], host: str, flag: bool, auth: bool, line: str | None
) -> None:
    config = parse_fleet({"models": [{"name": MODEL}], "tenants": tenants})
    served, said = secure_default(config, host, auth=flag)
    assert served.tenants.auth is auth
    assert (said is None) == (line is None)
    if line is not None:
        assert said is not None
        assert line in said


def test_up_off_loopback_requires_api_keys(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        f"models:\n"
        f"  - name: {MODEL}\n"
        f"    replicas: 1\n"
        f'    args: ["--time-scale", "100", "--max-model-len", "2048"]\n'
        f"    health: {{active: {{interval: 0.2}}}}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "GPUFLEET_DB_URL"}
    env["GPUFLEET_HOME"] = str(tmp_path / "home")
    log = tmp_path / "up.out"
    process, base = start_up(fleet, log, "--host", "0.0.0.0", run_dir=tmp_path / "run", env=env)
    try:
        base = base.replace("0.0.0.0", "127.0.0.1")
        text = log.read_text()
        assert "note: the gateway listens on 0.0.0.0, not on loopback: API keys required" in text
        assert "auth: on" in text
        wait_ready(base)  # /ready and /health need no key
        answer = httpx.post(
            base + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert answer.status_code == 401
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log.read_text()
    finally:
        stop(process)
