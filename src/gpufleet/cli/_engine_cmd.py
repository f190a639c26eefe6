"""``gpufleet engine sim``: a modelled vLLM replica behind vLLM's HTTP API, on loopback or not."""

from __future__ import annotations

import gc
import json
import logging
import os
import socket
from pathlib import Path
from typing import Annotated

import typer
import uvicorn

from gpufleet.cli._errors import user_errors
from gpufleet.engine.server import SimEngineConfig, create_app
from gpufleet.fleet import ENGINE_FLAGS, ReplicaProfile

app = typer.Typer(help="Engine replicas: the sim engine.", no_args_is_help=True)

_FLAGS = {  # pydantic field → the flag a user typed, for error messages
    "time_scale": "--time-scale",
    "faults.crash_after_s": "--fault-crash-after",
    "faults.slowdown": "--fault-slowdown",
    "faults.error_rate": "--fault-error-rate",
    "faults.error_status": "--fault-error-status",
}
_ENGINE_FLAGS_HELP = (
    "Engine flags, as vLLM spells them and with vLLM's defaults (docs/sim-engine.md): "
    + ", ".join(ENGINE_FLAGS)
    + "; -tp or --tp is --tensor-parallel-size."
)


def _rename(message: str) -> str:
    for field, flag in _FLAGS.items():
        if message.startswith(field + ":"):
            return flag + message[len(field) :]
    return message


def engine_config(ctx: typer.Context) -> SimEngineConfig:
    """The sim engine a parsed ``gpufleet engine sim`` command line describes: this command's
    own options (``ctx.params``), and the engine flags it leaves over (``ctx.args``), read by
    the one replica profile, as every engine command line is written."""
    options = ctx.params
    profile = ReplicaProfile.from_argv(ctx.args, passthrough=False)
    return SimEngineConfig.model_validate(
        {
            "model": options["model"],
            "gpu": options["gpu"],
            "served_model_name": options["served_model_name"],
            "time_scale": options["time_scale"],
            "faults": {
                "crash_after_s": options["fault_crash_after"],
                "hang": options["fault_hang"],
                "slowdown": options["fault_slowdown"],
                "error_rate": options["fault_error_rate"],
                "error_status": options["fault_error_status"],
                "unhealthy": options["fault_unhealthy"],
            },
            "enable_admin": options["enable_admin"],
            "enable_sleep_mode": options["enable_sleep_mode"],
            "dev_mode": os.environ.get("VLLM_SERVER_DEV_MODE", "0").strip().lower()
            in ("1", "true"),
            "kv_events": _kv_events_config(options["kv_events_config"]),
            "otlp_traces_endpoint": options["otlp_traces_endpoint"],
            **profile.settings(),
        }
    )


def _kv_events_config(text: str | None) -> dict[str, object]:
    """``--kv-events-config``: vLLM's JSON object (``{}`` when not given)."""
    if text is None:
        return {}
    try:
        data = json.loads(text)
    except ValueError as error:
        raise ValueError(f"--kv-events-config is not JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    return data


@app.command(
    "sim",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    epilog=_ENGINE_FLAGS_HELP,
)
def sim(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="Catalog model name or a config.json path.")] = (
        "llama-3.1-8b"
    ),
    gpu: Annotated[str, typer.Option(help="Catalog GPU name.")] = "h100-sxm",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = 8001,
    served_model_name: Annotated[
        str | None, typer.Option(help="Name clients send as `model` (default: --model).")
    ] = None,
    time_scale: Annotated[
        float, typer.Option(help="Modelled seconds per real second (latencies stay modelled).")
    ] = 1.0,
    fault_crash_after: Annotated[
        float | None, typer.Option(help="Exit with status 1 after this many seconds.")
    ] = None,
    fault_hang: Annotated[bool, typer.Option(help="Accept requests, never answer.")] = False,
    fault_slowdown: Annotated[float, typer.Option(help="Step time × this factor.")] = 1.0,
    fault_error_rate: Annotated[
        float, typer.Option(help="Share of completions answered with --fault-error-status.")
    ] = 0.0,
    fault_error_status: Annotated[
        int, typer.Option(help="Status of the injected errors: 500 or 503.")
    ] = 500,
    fault_unhealthy: Annotated[bool, typer.Option(help="GET /health answers 503.")] = False,
    enable_admin: Annotated[
        bool, typer.Option(help="Serve POST /admin/faults to change faults at run time.")
    ] = False,
    enable_sleep_mode: Annotated[
        bool,
        typer.Option(
            help="vLLM's sleep mode: POST /sleep, /wake_up (served with VLLM_SERVER_DEV_MODE=1)."
        ),
    ] = False,
    access_log: Annotated[bool, typer.Option(help="Log every request.")] = False,
    ssl_certfile: Annotated[
        str | None,
        typer.Option(help="Serve HTTPS with this PEM certificate chain (as vLLM's flag)."),
    ] = None,
    ssl_keyfile: Annotated[
        str | None, typer.Option(help="The PEM private key of --ssl-certfile.")
    ] = None,
    kv_events_config: Annotated[
        str | None,
        typer.Option(
            help="Publish KV-cache events as vLLM does: its JSON object, e.g. "
            '\'{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", '
            '"replay_endpoint": "tcp://127.0.0.1:5558"}\' (port 0: any free one).'
        ),
    ] = None,
    otlp_traces_endpoint: Annotated[
        str | None,
        typer.Option(
            help="Send a span per request (OTLP/HTTP, e.g. http://127.0.0.1:4318/v1/traces), "
            "the child of the caller's traceparent, as vLLM's flag does."
        ),
    ] = None,
) -> None:
    """Serve a simulated vLLM replica: OpenAI-compatible API, vLLM metrics, injectable faults.

    Example: gpufleet engine sim --model llama-3.1-8b --gpu h100-sxm --port 8001
    --max-num-seqs 64
    """
    with user_errors(_rename):
        config = engine_config(ctx)  # the options above, as click parsed them, and the rest
        sim_app = create_app(config)
        if (ssl_certfile is None) != (ssl_keyfile is None):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together")
        for path in (ssl_certfile, ssl_keyfile):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{path}: no such file")
        try:
            sock = socket.create_server((host, port), family=_family(host), reuse_port=False)
        except OSError as error:
            raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    # The model's long-lived objects (block pool, filler tokens, catalog) never become garbage:
    # keep the cyclic collector from rescanning them in the middle of a step.
    gc.freeze()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    scheme = "http" if ssl_certfile is None else "https"
    kv = sim_app.state.engine.kv_events
    events = "" if kv is None else f", KV events on {kv.endpoint} replay {kv.replay_endpoint}"
    typer.echo(
        f"gpufleet sim engine: {config.name} on {config.gpu} (tp={config.tp}), "
        f"listening on {scheme}://{shown}:{bound_port}, time scale {config.time_scale:g} "
        f"(latencies in modelled seconds){events}",
    )
    server = uvicorn.Server(
        uvicorn.Config(
            sim_app,
            log_level="info",
            access_log=access_log,
            ws="none",
            timeout_graceful_shutdown=5,
            ssl_certfile=ssl_certfile,
            ssl_keyfile=ssl_keyfile,
        )
    )
    server.run(sockets=[sock])


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
