"""TLS on both sides of the gateway: its own certificate (reloaded when the files change) and
the CA bundles that verify ``https://`` replicas.

::

    tls = ServerTLS("server.pem", "server.key", reload_interval=5.0)
    server = GatewayServer(app, tls=tls)          # listens with tls.context; polls the files
    client = Http11ReplicaClient(connect=1.0, tls=ReplicaTLS.of(config))

**Reloading without a restart.** An ``asyncio`` server keeps the ``SSLContext`` it was
started with, and loading a new pair into a live context is not safe: when the key does not
match the new certificate, OpenSSL has already dropped the old key, and every handshake after
fails. So each reload loads the pair into a *fresh* context, and only one that loaded becomes
``current``. The listening context's SNI callback, which OpenSSL calls for every ClientHello
(with a server name or without, e.g. a client that dialled an IP address), moves the
connection onto ``current``: new handshakes get the new certificate, connections already up
keep theirs, and a bad pair is logged and changes nothing.
"""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

from gpufleet.config import EngineKind, FleetConfig

logger = logging.getLogger("gpufleet.tls")

_ALPN: Final = ["http/1.1"]
"""Both sides speak HTTP/1.1 only: said in the handshake, so no client tries h2."""

_Stamp = tuple[tuple[int, int, int], ...]
"""What a file looked like (inode, size, mtime in ns), per file: a change is a reload."""


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server context with ``cert_file`` and its ``key_file`` (TLS 1.2 at least, HTTP/1.1);
    ``ValueError`` naming the files when they do not load."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(_ALPN)
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as error:  # SSLError is an OSError; both named for clarity
        raise ValueError(
            f"cannot load the certificate {cert_file} with the key {key_file}: {_reason(error)}"
        ) from None
    return context


def client_context(ca_file: str | None = None) -> ssl.SSLContext:
    """A client context that verifies the replica's certificate and name: against
    ``ca_file`` only, or the system's trust store; ``ValueError`` naming a bad bundle."""
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as error:
        raise ValueError(f"cannot load the CA bundle {ca_file}: {_reason(error)}") from None
    context.set_alpn_protocols(_ALPN)
    return context


def _reason(error: OSError) -> str:
    return str(getattr(error, "reason", None) or error.strerror or error)


class ServerTLS:
    """The gateway's certificate: ``context`` to listen with, and :meth:`poll`, which loads
    a changed pair of files for the handshakes that follow."""

    def __init__(self, cert_file: str, key_file: str, *, reload_interval: float = 5.0) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.reload_interval = reload_interval
        self._stamp = self._look()
        self.current = server_context(cert_file, key_file)
        """The context new handshakes move onto: the last pair that loaded."""
        self.context = server_context(cert_file, key_file)
        """The listening context (its certificate is only the first handshake step's)."""
        self.context.sni_callback = self._choose
        self.reloads = 0
        """Pairs loaded since the start (the first one not counted)."""
        self._next_look: float | None = None

    def _choose(self, conn: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        conn.context = self.current

    def poll(self, now: float) -> None:
        """Look at the files if ``reload_interval`` has passed since the last look (``now``:
        the loop's clock); load them if they changed."""
        if self._next_look is None:
            self._next_look = now + self.reload_interval
            return
        if now < self._next_look:
            return
        self._next_look = now + self.reload_interval
        self.reload_if_changed()

    def reload_if_changed(self) -> bool:
        """Load the files if they changed since the last attempt; whether a new pair is now
        in use. A pair that does not load (a key that does not match, a file half written) is
        logged and the one in use kept; it is tried again when a file changes again."""
        stamp = self._look()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            fresh = server_context(self.cert_file, self.key_file)
        except ValueError as error:
            logger.error("TLS certificate not reloaded, the one in use is kept: %s", error)
            return False
        self.current = fresh
        self.reloads += 1
        logger.info("TLS certificate reloaded from %s", self.cert_file)
        return True

    def _look(self) -> _Stamp:
        stamps = []
        for path in (self.cert_file, self.key_file):
            try:
                info = os.stat(path)
            except OSError:
                stamps.append((0, -1, 0))  # gone for now (being replaced): a change too
                continue
            stamps.append((info.st_ino, info.st_size, info.st_mtime_ns))
        return tuple(stamps)


class ReplicaTLS:
    """Which context verifies an ``https://`` replica: the one of its origin's CA bundle
    (``models[].ca_file`` of an external model's endpoints), else the system's trust store.
    Contexts are built once, not per connection."""

    def __init__(self, by_origin: Mapping[tuple[str, int], ssl.SSLContext] | None = None) -> None:
        self._by_origin = dict(by_origin or {})
        self._default: ssl.SSLContext | None = None

    @classmethod
    def of(cls, config: FleetConfig) -> ReplicaTLS:
        """The fleet file's CA bundles, by the ``(host, port)`` of each ``https://`` endpoint
        of a model that names one; ``ValueError`` for a bundle that does not load."""
        by_file: dict[str, ssl.SSLContext] = {}
        by_origin: dict[tuple[str, int], ssl.SSLContext] = {}
        for model in config.models:
            if model.engine is not EngineKind.EXTERNAL or model.ca_file is None:
                continue
            context = by_file.get(model.ca_file)
            if context is None:
                try:
                    context = by_file[model.ca_file] = client_context(model.ca_file)
                except ValueError as error:
                    raise ValueError(f"models: {model.name}: ca_file: {error}") from None
            for url in model.endpoints:
                parts = urlsplit(url)
                if parts.scheme == "https" and parts.hostname is not None:
                    by_origin[(parts.hostname, parts.port or 443)] = context
        return cls(by_origin)

    def context(self, host: str, port: int) -> ssl.SSLContext:
        """The context for a replica at ``host:port``."""
        context = self._by_origin.get((host, port))
        if context is not None:
            return context
        if self._default is None:
            self._default = client_context()
        return self._default
