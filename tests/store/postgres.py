"""A throwaway PostgreSQL server for tests: initdb in a temporary directory, pg_ctl start on a
free loopback port, stopped and removed afterwards.

PostgreSQL refuses to run as root; as root (CI here) the server runs as the ``postgres``
system user (``runuser``). The tests using it are skipped, saying why, only when the binaries
(or, as root, that user) are missing.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_DIRS = (Path("/usr/lib/postgresql/15/bin"), Path("/usr/local/bin"), Path("/usr/bin"))


def _binary(name: str) -> str | None:
    for folder in _DIRS:
        if (folder / name).exists():
            return str(folder / name)
    return shutil.which(name)


def unavailable() -> str | None:
    """Why no server can be started here, or ``None``."""
    for name in ("initdb", "pg_ctl"):
        if _binary(name) is None:
            return f"PostgreSQL's {name} is not installed (apt-get install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run the server as"
    return None


@contextmanager
def postgres_server() -> Iterator[str]:
    """Start a server; yields its SQLAlchemy URL (psycopg 3)."""
    initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
    assert initdb is not None
    assert pg_ctl is not None
    prefix: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="gpufleet-pg-"))
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    data = root / "data"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:
        subprocess.run(
            [*prefix, initdb, "-D", str(data), "-U", "gpufleet", "--auth=trust", "-E", "UTF8"],
            check=True,
            capture_output=True,
        )
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off"
        subprocess.run(
            [*prefix, pg_ctl, "-D", str(data), "-o", options, "-l", str(root / "log"), "-w",
             "start"],
            check=True,
            capture_output=True,
        )  # fmt: skip
        try:
            yield f"postgresql://gpufleet@127.0.0.1:{port}/postgres"
        finally:
            subprocess.run(
                [*prefix, pg_ctl, "-D", str(data), "-m", "immediate", "stop"],
                check=False,
                capture_output=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
