"""A throwaway PostgreSQL server on loopback for the tests.

:class:`PostgresServer` runs Debian's (or any) PostgreSQL binaries on a fresh data
directory in a temporary folder: ``initdb``, then ``pg_ctl start`` on a free port of
127.0.0.1 with trust authentication. Run as root (as CI runs), the server runs as
the ``postgres`` user, since PostgreSQL refuses to run as root. It can be stopped
and started again on the same data, to test what a database restart does.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
from pathlib import Path

import asyncpg
import pytest

__all__ = ["PostgresServer", "postgres_bin", "required_postgres_bin", "sql"]


async def sql(url: str, *statements: str) -> None:
    """Run ``statements`` on the database at ``url``, one after another."""
    conn = await asyncpg.connect(url)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def postgres_bin() -> Path | None:
    """The folder of ``initdb`` and ``pg_ctl``: on PATH, or the newest of Debian's
    /usr/lib/postgresql/*/bin; None when PostgreSQL is not installed."""
    on_path = shutil.which("pg_ctl")
    if on_path is not None and shutil.which("initdb") is not None:
        return Path(on_path).parent
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
        key=lambda p: int(Path(p).parent.parent.name),
    )
    return Path(versions[-1]).parent if versions else None


def required_postgres_bin() -> Path:
    """:func:`postgres_bin`, or the test skipped (failed under CI, which must run every
    test) when PostgreSQL is not installed."""
    bin_dir = postgres_bin()
    if bin_dir is None:
        if os.environ.get("CI"):
            pytest.fail("PostgreSQL is not installed, and CI must run every test")
        pytest.skip("PostgreSQL is not installed (make test installs it when run as root)")
    return bin_dir


class PostgresServer:
    """One PostgreSQL cluster in ``directory``, owned by whoever runs it."""

    def __init__(
        self, directory: Path, bin_dir: Path, user: str = "fenceproxy", durable: bool = False
    ) -> None:
        """``durable`` keeps PostgreSQL's fsync on (a benchmark's setting); the tests
        turn it off, since they crash the server, not the machine."""
        self.directory = directory
        self.durable = durable
        self.bin = bin_dir
        self.user = user
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port: int = s.getsockname()[1]
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self.data = directory / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def _run(self, *argv: str, wrapper: list[str] | None = None) -> None:
        """Run a PostgreSQL program, as the postgres user when root, in the cluster's
        folder: the tests' working directory may be one that user cannot enter."""
        result = subprocess.run(
            [*(wrapper or []), *self._as, *argv],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
            cwd=self.directory,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{result.stdout}{result.stderr}")

    def init(self) -> PostgresServer:
        if self._as:
            shutil.chown(self.directory, "postgres")
        self._run(
            str(self.bin / "initdb"), "-D", str(self.data), "-U", self.user,
            "--auth=trust", "-E", "UTF8", "--no-sync", "--no-instructions",
        )  # fmt: skip
        return self

    def start(self, wrapper: list[str] | None = None) -> PostgresServer:
        """Start it; ``wrapper`` is a command prefix for its processes (``taskset``)."""
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.directory} "
            f"-c max_connections=200{'' if self.durable else ' -c fsync=off'}"
        )
        self._run(
            str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options,
            "-l", str(self.directory / "server.log"), "-w", "-t", "60", "start",
            wrapper=wrapper,
        )  # fmt: skip
        return self

    def stop(self, mode: str = "fast") -> None:
        """``fast`` rolls back open transactions and closes connections;
        ``immediate`` is a crash."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")
