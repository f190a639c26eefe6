"""The web console in real headless Chromium (Debian's package), on a live two-replica sim
fleet like ``make run``'s with auth on: it loads with no JS errors, shows both replicas, its
TTFT chart changes under load and its GPU gauges (the engines' dcgm-exporter series) rise
with it; a viewer has no drain button (and the API refuses one), an
operator drains a replica from the page. Skipped without Chromium, failed with ``CI=true``.

``GPUFLEET_CONSOLE_SHOTS=docs`` writes the screenshots docs/console.md shows.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from gpufleet.fleet import ReplicaState
from gpufleet.store import Role
from tests.gateway.cdp import Chromium, Page, require_chromium
from tests.gateway.console_fleet import MODEL, console_fleet, load

ROWS = "document.querySelectorAll('tr[data-replica]').length"
TTFT = "document.querySelector('canvas[data-chart=ttft]').toDataURL()"
GPU_UTILS = "[...document.querySelectorAll('td.gpu[data-util]')].map((td) => +td.dataset.util)"
TTFT_POINTS = (
    "(window.gpufleetConsole.lastFleet?.pools[0].series.ttft_p99 || [])"
    ".filter((v) => v !== null).length"
)


async def sign_in(page: Page, credential: str) -> None:
    await page.until("!document.getElementById('signin').hidden")
    await page.evaluate(
        f"document.getElementById('credential').value = {credential!r};"
        "document.getElementById('signin-form').requestSubmit(); true"
    )
    await page.until("!document.getElementById('main').hidden")


async def sign_out(page: Page) -> None:
    await page.evaluate("document.getElementById('signout').click(); true")


async def click_drain(page: Page, replica: str) -> None:
    button = f"document.querySelector('button[data-drain=\"{replica}\"]')"
    await page.until(f"!!{button}")
    await page.evaluate(f"{button}.click(); true")  # arms it
    await page.until(f"{button}?.textContent === 'Confirm drain'")
    await page.evaluate(f"{button}.click(); true")  # drains


@pytest.mark.asyncio
async def test_the_console_in_chromium(tmp_path: Path) -> None:
    require_chromium()
    shots = Path(os.environ.get("GPUFLEET_CONSOLE_SHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    async with console_fleet(tmp_path) as cf, Chromium.launch(tmp_path / "profile") as browser:
        page = await browser.page()
        try:
            await page.goto(cf.url + "/console")

            # a viewer: both replicas, read-only
            await sign_in(page, cf.credentials[Role.VIEWER])
            assert await page.until(f"{ROWS} === 2 && {ROWS}")
            assert await page.evaluate("document.getElementById('who').textContent") == (
                "viewer · admin:" + cf.credentials[Role.VIEWER].split("_")[1]
            )
            assert (
                await page.evaluate("document.querySelectorAll('button[data-drain]').length") == 0
            )
            status = await page.evaluate(
                "fetch('/admin/replicas/llama-3.1-8b-1/drain', {method: 'POST', headers: "
                "{authorization: 'Bearer ' + sessionStorage.getItem('gpufleet.credential')}})"
                ".then((r) => r.status)"
            )
            assert status == 403

            # the TTFT chart moves under load, and the GPUs' utilisation rises with it
            await page.until("document.querySelector('canvas[data-chart=ttft]').width > 0")
            before = await page.evaluate(TTFT)
            assert await page.evaluate(TTFT_POINTS) == 0
            await page.until(f"{GPU_UTILS}.length === 2")
            idle = max(await page.evaluate(GPU_UTILS))
            waves = asyncio.create_task(_waves(cf.url, cf.tenant_key))
            await page.until(f"{TTFT_POINTS} >= 3", timeout=30)
            assert await page.evaluate(TTFT) != before
            await page.until(f"Math.max(...{GPU_UTILS}) > {idle} + 0.05", timeout=30)
            await waves
            await page.screenshot(shots / "console-viewer.png")

            # an operator drains a replica from the page
            await sign_out(page)
            await sign_in(page, cf.credentials[Role.OPERATOR])
            await page.until(f"{ROWS} === 2")
            await page.until("document.querySelectorAll('button[data-drain]').length === 2")
            await page.screenshot(shots / "console.png")
            await click_drain(page, f"{MODEL}-1")
            await page.until(
                f"!document.querySelector('tr[data-replica=\"{MODEL}-1\"][data-state=ready]')"
            )
            await page.until(
                "[...document.querySelectorAll('#events li')]"
                ".some((li) => li.textContent.includes('drain asked by'))"
            )
            status_of = cf.fleet.runtime.snapshot.get(f"{MODEL}-1")
            assert status_of is None or status_of.state in (
                ReplicaState.DRAINING,
                ReplicaState.STOPPED,
            )
            await cf.fleet.routable(MODEL, 1)
            await page.screenshot(shots / "console-drain.png")

            assert page.errors == [], page.errors
            # the refusals the test provoked on purpose (the first 401, the viewer's 403)
            assert all(("401" in r or "403" in r) for r in page.refused), page.refused
        finally:
            await page.close()


async def _waves(url: str, key: str) -> None:
    """Rising load for a few seconds: the chart's points go up with it."""
    for concurrency in (2, 4, 8, 16):
        await load(url, key, requests=3 * concurrency, concurrency=concurrency)
        await asyncio.sleep(0.5)
