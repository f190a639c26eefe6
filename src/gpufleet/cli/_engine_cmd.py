"""``gpufleet engine sim``: a modelled vLLM replica behind vLLM's HTTP API, on loopback or not."""

from __future__ import annotations

import gc
import logging
import socket
from typing import Annotated

import typer
import uvicorn

from gpufleet.cli._errors import user_errors
from gpufleet.engine.server import SimEngineConfig, create_app

app = typer.Typer(help="Engine replicas: the sim engine.", no_args_is_help=True)

_FLAGS = {  # pydantic field → the flag a user typed, for error messages
    "tp": "--tp",
    "pp": "--pp",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "num_gpu_blocks_override": "--num-gpu-blocks-override",
    "block_size": "--block-size",
    "time_scale": "--time-scale",
    "faults.crash_after_s": "--fault-crash-after",
    "faults.slowdown": "--fault-slowdown",
    "faults.error_rate": "--fault-error-rate",
}


def _rename(message: str) -> str:
    for field, flag in _FLAGS.items():
        if message.startswith(field + ":"):
            return flag + message[len(field) :]
    return message


@app.command("sim")
def sim(
    model: Annotated[str, typer.Option(help="Catalog model name or a config.json path.")] = (
        "llama-3.1-8b"
    ),
    gpu: Annotated[str, typer.Option(help="Catalog GPU name.")] = "h100-sxm",
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = 8001,
    tp: Annotated[int, typer.Option(help="Tensor-parallel size.")] = 1,
    served_model_name: Annotated[
        str | None, typer.Option(help="Name clients send as `model` (default: --model).")
    ] = None,
    max_num_seqs: Annotated[int, typer.Option(help="vLLM's running-batch cap.")] = 256,
    max_num_batched_tokens: Annotated[int, typer.Option(help="vLLM's token budget.")] = 8192,
    max_model_len: Annotated[int | None, typer.Option(help="Longest context served.")] = None,
    gpu_memory_utilization: Annotated[float, typer.Option(help="vLLM's setting.")] = 0.9,
    enable_prefix_caching: Annotated[
        bool, typer.Option(help="Automatic prefix caching (vLLM's flag).")
    ] = True,
    num_gpu_blocks_override: Annotated[
        int | None, typer.Option(help="KV blocks instead of the computed budget.")
    ] = None,
    time_scale: Annotated[
        float, typer.Option(help="Modelled seconds per real second (latencies stay modelled).")
    ] = 1.0,
    seed: Annotated[int, typer.Option(help="Seed of every random draw.")] = 0,
    fault_crash_after: Annotated[
        float | None, typer.Option(help="Exit with status 1 after this many seconds.")
    ] = None,
    fault_hang: Annotated[bool, typer.Option(help="Accept requests, never answer.")] = False,
    fault_slowdown: Annotated[float, typer.Option(help="Step time × this factor.")] = 1.0,
    fault_error_rate: Annotated[
        float, typer.Option(help="Share of completions answered 500.")
    ] = 0.0,
    fault_unhealthy: Annotated[bool, typer.Option(help="GET /health answers 503.")] = False,
    enable_admin: Annotated[
        bool, typer.Option(help="Serve POST /admin/faults to change faults at run time.")
    ] = False,
    access_log: Annotated[bool, typer.Option(help="Log every request.")] = False,
) -> None:
    """Serve a simulated vLLM replica: OpenAI-compatible API, vLLM metrics, injectable faults.

    Example: gpufleet engine sim --model llama-3.1-8b --gpu h100-sxm --port 8001
    """
    with user_errors(_rename):
        config = SimEngineConfig.model_validate(
            {
                "model": model,
                "gpu": gpu,
                "tp": tp,
                "served_model_name": served_model_name,
                "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": max_num_batched_tokens,
                "max_model_len": max_model_len,
                "gpu_memory_utilization": gpu_memory_utilization,
                "enable_prefix_caching": enable_prefix_caching,
                "num_gpu_blocks_override": num_gpu_blocks_override,
                "time_scale": time_scale,
                "seed": seed,
                "faults": {
                    "crash_after_s": fault_crash_after,
                    "hang": fault_hang,
                    "slowdown": fault_slowdown,
                    "error_rate": fault_error_rate,
                    "unhealthy": fault_unhealthy,
                },
                "enable_admin": enable_admin,
            }
        )
        sim_app = create_app(config)
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
    typer.echo(
        f"gpufleet sim engine: {config.name} on {config.gpu} (tp={config.tp}), "
        f"listening on http://{shown}:{bound_port}, time scale {config.time_scale:g} "
        "(latencies in modelled seconds)",
    )
    server = uvicorn.Server(
        uvicorn.Config(
            sim_app,
            log_level="info",
            access_log=access_log,
            ws="none",
            timeout_graceful_shutdown=5,
        )
    )
    server.run(sockets=[sock])


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
