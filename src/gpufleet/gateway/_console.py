"""``/console``: the web console's three static files, served from the package.

The page holds no data and no secret, so it is served to anyone; everything it shows comes
from ``/admin`` with the credential the user pastes (docs/console.md). Its headers keep it
to itself: scripts and styles from this origin only (no inline script, so an injected string
cannot run), never framed (a drain button cannot be clickjacked), no referrer, no caching.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from functools import cache
from importlib.resources import files
from typing import Any, Final

from gpufleet.gateway._errors import MethodNotAllowedError, RouteNotFoundError

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_FILES: Final = {
    "/console": ("index.html", b"text/html; charset=utf-8"),
    "/console/": ("index.html", b"text/html; charset=utf-8"),
    "/console/console.js": ("console.js", b"text/javascript; charset=utf-8"),
    "/console/console.css": ("console.css", b"text/css; charset=utf-8"),
}
_HEADERS: Final = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        b"img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-cache"),
]


@cache
def _read(name: str) -> bytes:
    return files("gpufleet.gateway").joinpath("console", name).read_bytes()


async def serve_console(method: str, path: str, send: Send, rid: tuple[bytes, bytes]) -> None:
    found = _FILES.get(path)
    if found is None:
        raise RouteNotFoundError(f"no route {method} {path}")
    if method not in ("GET", "HEAD"):
        raise MethodNotAllowedError(f"{method} is not allowed on {path}")
    name, content_type = found
    body = _read(name)
    headers = [
        (b"content-type", content_type),
        (b"content-length", b"%d" % len(body)),
        *_HEADERS,
        rid,
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})
