"""A test CA and the server certificates it signs, made at test time with the ``openssl``
command (P-256 keys: a certificate in ~10 ms). Tests that need one skip without ``openssl``;
CI installs it (.ci/run).

::

    ca = TestCA(tmp_path)                        # ca.pem, ca.key
    server = ca.issue("server")                  # server.pem, server.key: localhost, 127.0.0.1
    ssl.create_default_context(cafile=ca.cert)   # what a client trusts
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

_CA_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = gpufleet test CA
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
subjectKeyIdentifier = hash
"""

_LEAF_EXTENSIONS = """\
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
subjectAltName = {names}
"""


@dataclass(frozen=True, slots=True)
class Issued:
    """A server certificate (PEM), its key, and its serial number."""

    cert: Path
    key: Path
    serial: int


def _openssl(*args: str | Path) -> None:
    executable = shutil.which("openssl")
    if executable is None:
        pytest.skip("the openssl command is not installed")
    subprocess.run([executable, *map(str, args)], check=True, capture_output=True)


class TestCA:
    """A self-signed CA in ``folder`` (``ca.pem``, ``ca.key``) that issues server
    certificates."""

    __test__ = False  # a helper, not a test class

    def __init__(self, folder: Path, name: str = "ca") -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        config = folder / f"{name}.cnf"
        config.write_text(_CA_CONFIG)
        self.cert = folder / f"{name}.pem"
        self.key = folder / f"{name}.key"
        _openssl(
            *("req", "-x509", "-config", config, "-extensions", "ca", "-days", "2", "-nodes"),
            *("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-keyout", self.key, "-out", self.cert),
        )

    def issue(
        self,
        name: str,
        hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
        folder: Path | None = None,
    ) -> Issued:
        """``name.pem`` and ``name.key`` (in ``folder``, default the CA's) for ``hosts``
        (names and IP addresses), with a random serial number."""
        where = folder or self.folder
        where.mkdir(parents=True, exist_ok=True)
        cert, key, request = where / f"{name}.pem", where / f"{name}.key", where / f"{name}.csr"
        names = ",".join(f"IP:{h}" if h[0].isdigit() or ":" in h else f"DNS:{h}" for h in hosts)
        extensions = where / f"{name}.ext"
        extensions.write_text(_LEAF_EXTENSIONS.format(names=names))
        config = self.folder / "leaf.cnf"
        config.write_text(f"[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = {hosts[0]}\n")
        serial = secrets.randbits(63) | 1 << 62
        _openssl(
            *("req", "-new", "-config", config, "-nodes"),
            *("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-keyout", key, "-out", request),
        )
        _openssl(
            *("x509", "-req", "-in", request, "-CA", self.cert, "-CAkey", self.key),
            *("-set_serial", str(serial), "-days", "2", "-extfile", extensions, "-out", cert),
        )
        request.unlink()
        extensions.unlink()
        return Issued(cert, key, serial)
