"""Latency budgets through the real gateway (``x-gpufleet-ttft-budget-ms``): one served
name over two sim engine pools of the same model, one on H100s and one on cheaper, slower
L40S (each engine process times its steps by the performance model of its GPU). 16
``openai`` clients at once, half with a tight budget only the H100s meet for their
prompts, half with a loose one: the tight ones are served on the H100s, the loose ones on
the L40S, none fails, and a malformed budget is a clear 400."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.live import fleet_file, live_fleet

ENGINE = ["--time-scale", "1", "--max-num-seqs", "8"]
FLEET = {
    "models": [
        {"name": "fast", "model": "llama-3.1-8b", "gpu": "h100-sxm", "args": ENGINE},
        {"name": "cheap", "model": "llama-3.1-8b", "gpu": "l40s", "args": ENGINE},
    ],
    "served": [{"name": "chat", "variants": {"fast": 1, "cheap": 1}}],
}
PROMPT = "word " * 1600  # about 2,000 prompt tokens: ~50 ms of prefill on an H100, ~140 on an L40S
CLIENTS, PER_CLIENT = 16, 6


@pytest.mark.asyncio
async def test_tight_budgets_go_to_the_fast_gpus_and_loose_ones_to_the_cheap(
    tmp_path: Path,
) -> None:
    served: dict[str, list[str]] = {"tight": [], "loose": []}
    failures: list[str] = []
    lock = threading.Lock()

    def client_loop(client: openai.OpenAI, n: int) -> None:
        kind = "tight" if n % 2 else "loose"
        budget = "100" if kind == "tight" else "2000"
        for i in range(PER_CLIENT):
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model="chat",
                    messages=[{"role": "user", "content": f"{n}-{i} {PROMPT}"}],
                    max_tokens=8,
                    stream=i % 2 == 0,
                    extra_headers={"x-gpufleet-ttft-budget-ms": budget},
                )
                replica = raw.headers["x-gpufleet-replica"]
                if raw.parse is not None:
                    answer = raw.parse()
                    if not isinstance(answer, openai.types.chat.ChatCompletion):
                        for _ in answer:  # the stream, to its end
                            pass
                with lock:
                    served[kind].append(replica)
            except Exception as error:
                with lock:
                    failures.append(f"{kind}: {type(error).__name__}: {error}")

    async with live_fleet(fleet_file(FLEET), tmp_path) as live:
        with openai.OpenAI(base_url=live.v1, api_key="none", max_retries=0, timeout=60) as client:
            threads = [
                threading.Thread(target=client_loop, args=(client, n)) for n in range(CLIENTS)
            ]
            started = time.monotonic()
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                assert time.monotonic() - started < 90, "the clients did not finish"
                await asyncio.sleep(0.05)
        async with httpx.AsyncClient() as http:
            bad = await http.post(
                f"{live.v1}/chat/completions",
                headers={"x-gpufleet-ttft-budget-ms": "soon"},
                json={"model": "chat", "messages": [{"role": "user", "content": "x"}]},
            )
    assert failures == []
    assert len(served["tight"]) == len(served["loose"]) == CLIENTS // 2 * PER_CLIENT
    assert {r.rsplit("-", 1)[0] for r in served["tight"]} == {"fast"}
    assert {r.rsplit("-", 1)[0] for r in served["loose"]} == {"cheap"}
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "x-gpufleet-ttft-budget-ms" in error["message"]
