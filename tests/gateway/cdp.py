"""Headless Chromium driven over the Chrome DevTools Protocol: the ``chromium`` binary (Debian's
package) and the ``websockets`` client the environment already has (through
``uvicorn[standard]``), no WebDriver.

::

    async with Chromium.launch(tmp) as browser:
        page = await browser.page()
        await page.goto(url)
        await page.evaluate("document.title")
        page.errors                          # JS exceptions, console.error, non-network logs
        await page.screenshot(path)

``CI=true`` turns a missing browser into a failure (``require_chromium``), so CI cannot pass
by skipping the console's test.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def require_chromium() -> str:
    """The browser's path; skips without one, or fails with ``CI=true``."""
    for name in BINARIES:
        found = shutil.which(name)
        if found:
            return found
    why = "no chromium binary (apt-get install chromium)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}: CI=true requires it")
    pytest.skip(why)


class Page:
    """One tab: commands, their answers, and the errors it logged."""

    def __init__(self, socket: ClientConnection) -> None:
        self._socket = socket
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.errors: list[str] = []
        """JS exceptions, ``console.error`` calls and non-network error log entries."""
        self.refused: list[str] = []
        """Network error log entries (an HTTP 4xx a test provokes on purpose lands here)."""
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        async for raw in self._socket:
            message = json.loads(raw)
            waiter = self._waiting.pop(message.get("id", -1), None)
            if waiter is not None:
                if not waiter.done():
                    waiter.set_result(message)
                continue
            self._note(message.get("method"), message.get("params", {}))

    def _note(self, method: str | None, params: dict[str, Any]) -> None:
        if method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            self.errors.append(f"exception: {text}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = [a.get("value", a.get("description")) for a in params.get("args", [])]
            self.errors.append(f"console.{params['type']}: {args}")
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            entry = params["entry"]
            where = self.refused if entry.get("source") == "network" else self.errors
            where.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}")

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        ident = next(self._ids)
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = waiter
        await self._socket.send(json.dumps({"id": ident, "method": method, "params": params or {}}))
        async with asyncio.timeout(30):
            answer = await waiter
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    async def evaluate(self, expression: str) -> Any:
        result = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def until(self, expression: str, timeout: float = 20.0) -> Any:
        """The value of ``expression`` once it is truthy (polled every 0.1 s)."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"not true within {timeout} s: {expression}")
            await asyncio.sleep(0.1)

    async def goto(self, url: str) -> None:
        await self.send("Page.navigate", {"url": url})
        await self.until("document.readyState === 'complete'")

    async def screenshot(self, path: Path) -> None:
        shot = await self.send("Page.captureScreenshot", {"format": "png"})
        path.write_bytes(base64.b64decode(shot["data"]))

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self._socket.close()


class Chromium:
    """A headless Chromium process with a throwaway profile."""

    def __init__(self, process: asyncio.subprocess.Process, port: int) -> None:
        self.process = process
        self.port = port

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(
        cls, profile: Path, size: tuple[int, int] = (1400, 1000)
    ) -> AsyncIterator[Chromium]:
        binary = require_chromium()
        profile.mkdir(parents=True, exist_ok=True)
        args = [
            "--headless",
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            "--remote-debugging-port=0",
            "--remote-allow-origins=*",
            f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}",
            "about:blank",
        ]
        if os.geteuid() == 0:
            args.insert(0, "--no-sandbox")  # Chromium's sandbox refuses to run as root
        process = await asyncio.create_subprocess_exec(
            binary, *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        try:
            port_file = profile / "DevToolsActivePort"
            async with asyncio.timeout(30):
                while not port_file.exists() or not port_file.read_text().strip():
                    assert process.returncode is None, "chromium exited"
                    await asyncio.sleep(0.05)
            yield cls(process, int(port_file.read_text().split()[0]))
        finally:
            if process.returncode is None:
                process.terminate()
                try:
                    async with asyncio.timeout(10):
                        await process.wait()
                except TimeoutError:
                    process.kill()
                    await process.wait()

    async def page(self) -> Page:
        async with httpx.AsyncClient() as client:
            targets = (await client.get(f"http://127.0.0.1:{self.port}/json/list")).json()
        target = next(t for t in targets if t["type"] == "page")
        socket = await connect(target["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024)
        page = Page(socket)
        for domain in ("Page", "Runtime", "Log"):
            await page.send(f"{domain}.enable")
        return page
