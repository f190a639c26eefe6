"""``gpufleet engine sim`` flags: bad ones end in one line on stderr and exit status 2."""

from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from gpufleet.cli import app
from gpufleet.fleet import ENGINE_FLAGS

runner = CliRunner()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "no-such-model"], "no-such-model"),
        (["--gpu", "tpu-v9"], "tpu-v9"),
        (["--time-scale", "0"], "--time-scale"),
        (["--fault-error-rate", "1.5"], "--fault-error-rate"),
        (["--fault-error-status", "502"], "--fault-error-status"),
        (["--gpu-memory-utilization", "1.2"], "--gpu-memory-utilization"),
        (["--max-model-len", "10000000"], "max_model_len"),
        (["--model", "llama-3.1-405b", "--gpu", "l4"], "does not fit"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--block-size=x"], "--block-size 'x' is not an integer"),
        (["--enforce-eager"], "no such option: --enforce-eager"),
        (["--kv-events-config", "{oops"], "--kv-events-config is not JSON"),
        (["--kv-events-config", "[1]"], "--kv-events-config must be a JSON object"),
        (["--kv-events-config", '{"enable_kv_cache_events": 1, "hwm": -1}'], "hwm"),
        (["--kv-events-config", '{"publisher": "kafka"}'], "publisher"),
        (["--ssl-certfile", "server.pem"], "--ssl-certfile and --ssl-keyfile go together"),
        (
            ["--ssl-certfile", "/no/server.pem", "--ssl-keyfile", "/no/server.key"],
            "/no/server.pem: no such file",
        ),
    ],
)
def test_bad_flags_give_one_line_and_exit_2(flags: list[str], message: str) -> None:
    result = runner.invoke(app, ["engine", "sim", "--port", "0", *flags])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error:")
    assert message in lines[0]


def test_a_busy_port_is_a_one_line_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        result = runner.invoke(app, ["engine", "sim", "--port", str(port)])
    assert result.exit_code == 2
    assert "cannot listen on 127.0.0.1" in result.stderr


def test_help_lists_the_fault_and_engine_flags() -> None:
    result = runner.invoke(app, ["engine", "sim", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for flag in ("--time-scale", "--fault-hang", "--fault-error-rate", "--enable-admin"):
        assert flag in result.stdout
    for flag in ENGINE_FLAGS:
        assert flag in result.stdout
