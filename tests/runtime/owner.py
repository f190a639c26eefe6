"""A process that owns a ``LocalRuntime``, for the signal and orphan tests.

``python -m tests.runtime.owner RUN_DIR [--uvicorn]`` starts one sim replica with
``handle_signals``, prints the replica pids as a JSON list once all are ready, and waits until a
signal stops it: on an event that never fires, or in a uvicorn server (as ``gpufleet up`` will
serve its gateway) whose own signal handling must compose with the runtime's.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys

import uvicorn
from starlette.applications import Starlette

from gpufleet.fleet import ReplicaProfile
from gpufleet.runtime import EngineSpec, LocalRuntime, PoolSpec, RuntimeSnapshot

FAST = ReplicaProfile(max_model_len=2048, extra=("--time-scale", "100"))


async def main(run_dir: str, *, in_uvicorn: bool) -> int:
    pools = [PoolSpec("llama-3.1-8b", EngineSpec(profile=FAST), replicas=1)]
    async with LocalRuntime(pools, run_dir=run_dir, handle_signals=True) as runtime:
        snapshot = await runtime.wait_for(RuntimeSnapshot.all_ready)
        if in_uvicorn:
            server = uvicorn.Server(uvicorn.Config(Starlette(), log_level="warning"))
            sock = socket.create_server(("127.0.0.1", 0))
            serving = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started:
                await asyncio.sleep(0.01)
            print(json.dumps([replica.pid for replica in snapshot.replicas]), flush=True)
            await serving
            print("uvicorn stopped", flush=True)
            await asyncio.Event().wait()  # the signal uvicorn raises again ends this
        else:
            print(json.dumps([replica.pid for replica in snapshot.replicas]), flush=True)
            await asyncio.Event().wait()
    assert runtime.stop_signal is not None
    print(f"stopped by {runtime.stop_signal.name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], in_uvicorn="--uvicorn" in sys.argv[2:])))
