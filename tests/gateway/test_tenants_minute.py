"""Quotas over a whole minute, live: real keys, real HTTP, the official openai client, a
client sending about twice faster than each limit for 60 s. The rpm tenant and the tpm
tenant run at the same time (one minute of wall time for both)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import openai

from gpufleet.store import TenantSettings
from tests.gateway.conftest import MODEL, sim_replica
from tests.gateway.tenants import TenantGateway, serve_tenant_gateway, tenant_fleet

MINUTE = 60.0
RPM = 120
TPM = 3000


class PacedClient:
    """Sends ``per_second`` requests for a minute; ``results`` holds the tokens of each
    accepted one (``None`` for a 429)."""

    def __init__(self, gw: TenantGateway, key: str, per_second: float, max_tokens: int) -> None:
        self.gw, self.key, self.per_second, self.max_tokens = gw, key, per_second, max_tokens
        self.results: list[int | None] = []
        self.retry_after: list[int] = []

    def __call__(self) -> None:
        with openai.OpenAI(base_url=self.gw.v1, api_key=self.key, max_retries=0) as client:
            start = time.monotonic()
            sent = 0
            while (now := time.monotonic()) - start < MINUTE:
                due = start + sent / self.per_second
                if due > now:
                    time.sleep(due - now)
                    continue
                sent += 1
                try:
                    reply = client.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": "count"}],
                        max_tokens=self.max_tokens,
                    )
                except openai.RateLimitError as denied:
                    self.retry_after.append(int(denied.response.headers["retry-after"]))
                    self.results.append(None)
                else:
                    assert reply.usage is not None
                    self.results.append(reply.usage.total_tokens)


def test_rpm_and_tpm_hold_within_5_percent_over_a_minute(tmp_path: Path) -> None:
    with (
        sim_replica(seed=5) as replica,
        serve_tenant_gateway(tmp_path, tenant_fleet(), [replica]) as gw,
    ):
        _, rpm_key = gw.store.create_key("minute-rpm", TenantSettings(rpm=RPM))
        _, tpm_key = gw.store.create_key("minute-tpm", TenantSettings(tpm=TPM))
        gw.tenancy.reload()
        clients = [
            PacedClient(gw, rpm_key, 2 * RPM / MINUTE, 1),  # 240 requests in the minute
            PacedClient(gw, tpm_key, 4.0, 20),  # ~30 tokens each: ~7,000 offered in the minute
        ]
        threads = [threading.Thread(target=c) for c in clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    by_rpm, by_tpm = clients[0].results, clients[1].results
    accepted = sum(1 for r in by_rpm if r is not None)
    tokens = sum(r for r in by_tpm if r is not None)
    offered_tokens = tokens / sum(1 for r in by_tpm if r is not None) * len(by_tpm)
    print(
        f"\nover a minute: rpm {RPM}: {accepted} of {len(by_rpm)} requests accepted; "
        f"tpm {TPM}: {tokens} tokens accepted of ~{offered_tokens:.0f} offered "
        f"({len(by_tpm)} requests)"
    )
    assert all(1 <= r <= 60 for c in clients for r in c.retry_after)
    assert len(by_rpm) >= 1.9 * RPM  # the client did send about twice the limit
    assert offered_tokens >= 1.5 * TPM
    assert abs(accepted - RPM) <= 0.05 * RPM
    assert abs(tokens - TPM) <= 0.05 * TPM
