"""``gpufleet keys`` and ``gpufleet usage`` against a real SQLite store."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from gpufleet.cli._app import app
from gpufleet.store import ADMIN_PREFIX, Store, split_key

runner = CliRunner()


def test_keys_lifecycle(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'g.db'}"
    made = runner.invoke(
        app,
        ["keys", "create", "--tenant", "team-a", "--models", "m1,m2", "--rpm", "60",
         "--priority", "batch", "--weight", "2", "--batch-queue", "50000", "--db", db],
    )  # fmt: skip
    assert made.exit_code == 0, made.output
    assert "batch_queue 50000" in made.output
    key = made.output.strip().splitlines()[-1]
    parts = split_key(key)
    assert parts is not None
    key_id = parts[0]
    listed = runner.invoke(app, ["keys", "list", "--db", db])
    assert key_id in listed.output
    assert "m1,m2" in listed.output
    assert key not in listed.output
    rotated = runner.invoke(app, ["keys", "rotate", key_id, "--db", db])
    assert rotated.exit_code == 0
    new_key = rotated.output.strip().splitlines()[-1]
    assert split_key(new_key) is not None
    assert new_key != key
    again = runner.invoke(app, ["keys", "revoke", key_id, "--db", db])
    assert again.exit_code == 2
    assert "no active key" in again.output
    store = Store.open(db)
    try:
        tenant = store.tenant("team-a")
        assert tenant is not None
        assert (tenant.settings.rpm, tenant.settings.priority) == (60, "batch")
        assert tenant.settings.batch_queue == 50000
        actions = [e["action"] for e in store.audit_entries()]
        assert {"keys.create", "keys.rotate"} <= set(actions)
    finally:
        store.close()


def test_bad_settings_are_one_line_errors(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'g.db'}"
    result = runner.invoke(
        app, ["keys", "create", "--tenant", "t", "--priority", "urgent", "--db", db]
    )
    assert result.exit_code == 2
    assert "priority must be one of" in result.output
    result = runner.invoke(
        app, ["keys", "create", "--tenant", "t", "--batch-queue", "0", "--db", db]
    )
    assert result.exit_code == 2
    assert "batch_queue must be >= 1" in result.output


def test_usage_report(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'g.db'}"
    store = Store.open(db)
    row = {
        "request_id": "r", "time": 1_700_000_000.0, "tenant": "team-a", "key_id": "k",
        "model": "m", "replica": "m-0", "status": 200, "prompt_tokens": 10,
        "cached_tokens": 2, "completion_tokens": 5, "queue_s": 0.0, "ttft_s": 0.1, "e2e_s": 0.2,
    }  # fmt: skip
    store.write([("usage", {**row, "id": "1"}), ("usage", {**row, "id": "2", "status": 429})])
    store.close()
    as_json = runner.invoke(app, ["usage", "--format", "json", "--db", db])
    assert json.loads(as_json.output) == [
        {"tenant": "team-a", "model": "m", "requests": 2, "errors": 1, "prompt_tokens": 20,
         "cached_tokens": 4, "completion_tokens": 10}
    ]  # fmt: skip
    as_csv = runner.invoke(app, ["usage", "--format", "csv", "--db", db])
    assert as_csv.output.splitlines()[1] == "team-a,m,2,1,20,4,10"
    later = runner.invoke(app, ["usage", "--since", "2030-01-01", "--format", "json", "--db", db])
    assert json.loads(later.output) == []
    table = runner.invoke(app, ["usage", "--db", db])
    assert "team-a" in table.output


def test_admin_credentials(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'g.db'}"
    made = runner.invoke(
        app, ["keys", "create", "--admin", "--role", "operator", "--name", "alice", "--db", db]
    )
    assert made.exit_code == 0, made.output
    assert "(operator) for alice" in made.output
    key = made.output.strip().splitlines()[-1]
    parts = split_key(key, ADMIN_PREFIX)
    assert parts is not None
    listed = runner.invoke(app, ["keys", "list", "--admin", "--db", db])
    assert parts[0] in listed.output
    assert "operator" in listed.output
    assert key not in listed.output
    assert parts[0] not in runner.invoke(app, ["keys", "list", "--db", db]).output
    revoked = runner.invoke(app, ["keys", "revoke", parts[0], "--db", db])
    assert revoked.exit_code == 0, revoked.output
    assert "revoked admin key" in revoked.output
    again = runner.invoke(app, ["keys", "revoke", parts[0], "--db", db])
    assert again.exit_code == 2
    assert "no active key" in again.output
    store = Store.open(db)
    try:
        assert store.admins.list() == []
        actions = {e["action"] for e in store.audit_entries()}
        assert {"admins.create", "admins.revoke"} <= actions
    finally:
        store.close()


def test_admin_credential_errors(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'g.db'}"
    for args, message in [
        (["--admin"], "--admin needs --role"),
        (["--admin", "--role", "root"], "role must be one of viewer, operator, admin"),
        (["--admin", "--role", "viewer", "--tenant", "t"], "no tenant"),
        (["--role", "viewer", "--rpm", "5"], "no tenant"),
        ([], "give --tenant NAME"),
    ]:
        result = runner.invoke(app, ["keys", "create", *args, "--db", db])
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
