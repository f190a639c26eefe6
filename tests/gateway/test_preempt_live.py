"""L4: a spot replica preempted under 16 clients loses no request. ``gpufleet up``'s wiring
(the local runtime with two real sim engine processes, auth on), the official ``openai``
client in 16 threads (streams and whole answers, each in a loop), and an operator's
``POST /admin/replicas/{name}/preempt``: the controller drains the replica and abandons what
is left on it ``abandon_before`` ahead of the deadline (here: at once), the runtime kills it
at the deadline, as a provider takes its GPUs, and starts a replacement."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from gpufleet.fleet import ReplicaState
from gpufleet.store import Role
from tests.gateway.console_fleet import MODEL, console_fleet
from tests.gateway.test_hang_live import Client, loop

CLIENTS = 16
NOTICE_S = 1.0
SPOT_POOL = {
    "name": MODEL,
    "engine": "sim",
    "replicas": 2,
    "routing": "least_request",
    "args": ["--time-scale", "1", "--max-model-len", "4096"],
    "capacity": "spot",
    "spot": {"abandon_before": NOTICE_S},  # the notice's whole lead: abandon at once
}


@pytest.mark.asyncio
async def test_a_preempted_spot_replica_loses_no_request(tmp_path: Path) -> None:
    async with console_fleet(tmp_path, [SPOT_POOL]) as cf:
        live = cf.fleet
        clients = [Client(stream=i % 2 == 0) for i in range(CLIENTS)]
        until = time.monotonic() + 9.0
        with openai.OpenAI(
            base_url=live.v1, api_key=cf.tenant_key, max_retries=0, timeout=60
        ) as client:
            threads = [
                threading.Thread(target=loop, args=(client, c, i, until))
                for i, c in enumerate(clients)
            ]
            for t in threads:
                t.start()
            try:
                await asyncio.sleep(2.0)
                pool = live.gateway.control.pools[MODEL]
                victim = max(pool.attempts, key=lambda r: pool.attempts[r])  # the busier one
                url = live.gateway.control.upstreams[victim].url
                async with httpx.AsyncClient(base_url=cf.url) as admin:
                    path = f"/admin/replicas/{victim}/preempt"
                    refused = await admin.post(path, headers=cf.headers(Role.VIEWER))
                    assert refused.status_code == 403
                    bad = await admin.post(
                        path, json={"notice_s": -1}, headers=cf.headers(Role.OPERATOR)
                    )
                    assert bad.status_code == 400, bad.text
                    assert "notice_s" in bad.json()["error"]["message"]
                    answer = await admin.post(
                        path, json={"notice_s": NOTICE_S}, headers=cf.headers(Role.OPERATOR)
                    )
                assert answer.status_code == 202, answer.text
                assert answer.json()["reclaim"] == "runtime"
                # drained at once: the pool routes to one replica from the notice on
                assert len(pool.routable()) == 1
                # the runtime takes it at the deadline and starts a replacement process
                await live.until(
                    lambda s: (
                        (r := s.get(victim)) is not None
                        and r.state is ReplicaState.READY
                        and r.url != url
                    ),
                    timeout=30.0,
                )
            finally:
                await asyncio.to_thread(lambda: [t.join() for t in threads])
        errors = [e for c in clients for e in c.errors]
        assert not errors, errors[:3]
        done = sum(len(c.took) for c in clients)
        assert done > CLIENTS * 3, done
        # every answer whole: 128 tokens a stream, 32 a chat (tests.gateway.test_hang_live)
        assert all(n == (128 if c.stream else 32) for c in clients for n in c.tokens)
        abandoned = live.sample("gpufleet:gateway_abandoned_attempts_total", model=MODEL)
        assert abandoned > 0  # the attempts there at the notice moved at once
        preempted = live.sample(
            "gpufleet:runtime_replica_crashes_total", pool=MODEL, reason="preempted"
        )
        assert preempted == 1
        await live.routable(MODEL, 2)  # the replacement serves
        print(f"{done} requests, 0 failed; {abandoned:g} attempts moved at the notice")
