"""L4: a replica that hangs (SIGSTOP) under 16 clients: health fails it and the gateway
abandons its attempts (``health.active.abandon``), so no request waits out the hang. Two sim
engine processes, the gateway on its own server (streams relayed), the official ``openai``
client: streams and whole answers, each client in a loop."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import openai

from tests.gateway.conftest import MODEL, fleet, serve_gateway
from tests.up_process import sim_engine_child

CLIENTS = 16
HANG_S = 12.0
"""How long the replica is stopped: a request that waited it out would take longer."""
ENGINE = ("--time-scale", "1", "--max-model-len", "4096", "--seed", "3")


@dataclass
class Client:
    stream: bool
    took: list[float] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def loop(client: openai.OpenAI, me: Client, i: int, until: float) -> None:
    n = 0
    while time.monotonic() < until:
        began = time.monotonic()
        try:
            if me.stream:
                chunks = client.completions.create(
                    model=MODEL,
                    prompt=f"Client {i}, story {n}:",
                    max_tokens=128,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                usage = [c.usage for c in chunks if c.usage is not None]
                me.tokens.append(usage[-1].completion_tokens)
            else:
                answer = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"Client {i}, question {n}."}],
                    max_tokens=32,
                    extra_body={"ignore_eos": True},
                )
                assert answer.usage is not None
                me.tokens.append(answer.usage.completion_tokens)
        except BaseException as error:
            me.errors.append(error)
        me.took.append(time.monotonic() - began)
        n += 1


def test_a_hung_replicas_requests_move_on_instead_of_waiting_out_the_hang() -> None:
    config = fleet(
        routing="least_request",
        health={"active": {"interval": 0.2, "timeout": 0.3, "unhealthy_threshold": 2}},
    )
    with (
        sim_engine_child(*ENGINE) as (a, _),
        sim_engine_child(*ENGINE) as (b, stopped),
        serve_gateway(config, [a, b], server="own") as gw,
        openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0, timeout=60) as client,
    ):
        clients = [Client(stream=i % 2 == 0) for i in range(CLIENTS)]
        until = time.monotonic() + 2.0 + HANG_S + 2.0
        threads = [
            threading.Thread(target=loop, args=(client, c, i, until)) for i, c in enumerate(clients)
        ]
        for t in threads:
            t.start()
        time.sleep(2.0)  # every client under way, some of each kind on the replica
        os.kill(stopped.pid, signal.SIGSTOP)
        try:
            time.sleep(HANG_S)
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        for t in threads:
            t.join(timeout=90)
        abandoned = gw.sample("gpufleet:gateway_abandoned_attempts_total", model=MODEL)
        resumed = gw.sample("gpufleet:gateway_stream_resumes_total", model=MODEL, outcome="resumed")
    took = [t for c in clients for t in c.took]
    print(
        f"{len(took)} requests, slowest {max(took):.2f} s, abandoned {abandoned:.0f}, "
        f"resumed {resumed:.0f}"
    )
    assert [e for c in clients for e in c.errors] == []  # 0 failed requests
    assert abandoned >= 1  # the replica had attempts when it stopped
    assert resumed >= 1  # a stream caught mid-way went on elsewhere
    # no request waited out the hang: the checks (2 × 0.2 s, 0.3 s timeouts) took it out
    assert max(took) < HANG_S / 2, sorted(took)[-5:]
    assert all(n == 128 for c in clients if c.stream for n in c.tokens)  # whole answers
    assert all(n == 32 for c in clients if not c.stream for n in c.tokens)
