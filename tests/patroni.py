"""A real Patroni-managed PostgreSQL cluster on loopback, for failover tests.

:class:`PatroniCluster` runs one etcd member and two PostgreSQL nodes, ``node0`` and
``node1``, under Debian's Patroni (which runs on the system's Python, not the venv),
on free ports of 127.0.0.1, with every file in one folder. Run as root (as CI
runs), Patroni and so PostgreSQL run as the ``postgres`` user, since PostgreSQL
refuses root; etcd runs as the tests do. The timings are a test's (:data:`TIMINGS`:
Patroni 3.0.2 takes them, later versions want a ``ttl`` of 20 s at least): a
standby is promoted about 10 s after the leader dies. Nothing is waited for by
sleeping: etcd's and Patroni's REST APIs are polled.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from .postgres import postgres_bin

__all__ = ["NODES", "TIMINGS", "PatroniCluster", "patroni_available"]

NODES = ("node0", "node1")
# How soon a dead leader's key expires, how often Patroni looks, how long it retries
# etcd and PostgreSQL; Patroni's rule: loop_wait + 2 * retry_timeout <= ttl.
TIMINGS = {"ttl": 10, "loop_wait": 2, "retry_timeout": 3}
RUNNING_PRIMARY = {("running", "master"), ("running", "primary")}  # "master" in 3.0.2
T = TypeVar("T")


def _bin_dir() -> Path | None:
    """PostgreSQL's whole bin folder, links resolved: Patroni runs pg_controldata,
    pg_rewind and pg_basebackup from it, and PATH may hold links to a few only."""
    found = postgres_bin()
    return None if found is None else (found / "pg_ctl").resolve().parent


def patroni_available() -> str | None:
    """None when Patroni, etcd and PostgreSQL are installed; what is missing otherwise."""
    missing = [name for name in ("patroni", "etcd") if shutil.which(name) is None]
    bin_dir = _bin_dir()
    if bin_dir is None or not (bin_dir / "pg_rewind").exists():
        missing.append("PostgreSQL")
    return f"not installed: {', '.join(missing)}" if missing else None


def _free_ports(count: int) -> list[int]:
    """``count`` free ports of 127.0.0.1, all different (bound at the same time)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def _get(url: str) -> tuple[int, Any]:
    """GET a JSON answer: status and body; (0, None) when the server is down."""
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read() or b"null")
    except (OSError, ValueError):
        return 0, None


def _processes() -> dict[int, tuple[int, str]]:
    """Each live process (zombies are dead already): pid to (parent, command line)."""
    table = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue  # it ended while we looked
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if state != "Z":
            table[int(pid)] = (int(ppid), cmdline.decode(errors="replace"))
    return table


def _kill_all(marker: str) -> None:
    """SIGKILL, at once, each process whose command line names ``marker`` (a path of
    the cluster: Patroni's config; the data directory of a postmaster, which
    Patroni starts in a session of its own, of pg_rewind or pg_basebackup; etcd's)
    and all their descendants, such as a postmaster's children. Each is stopped
    first, so that none forks unseen; returns once all are gone."""
    spared = {1, os.getpid(), os.getppid()}
    doomed: set[int] = set()
    while found := {
        pid
        for pid, (ppid, cmdline) in _processes().items()
        if pid not in spared | doomed and (marker in cmdline or ppid in doomed)
    }:
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        doomed |= found
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive := doomed & _processes().keys():
        if time.monotonic() > deadline:
            raise RuntimeError(f"still alive after SIGKILL: {alive}")
        time.sleep(0.01)


class PatroniCluster:
    """etcd and two Patroni nodes in ``directory`` (a fresh one). ``synchronous``
    turns Patroni's ``synchronous_mode`` on (not strict): a commit waits for the
    standby, and only a standby Patroni knows to be synchronous may be promoted,
    so a failover loses no acknowledged commit. Use it as a context manager: its
    end stops everything, however far :meth:`start` got."""

    def __init__(self, directory: Path, *, synchronous: bool = True) -> None:
        bin_dir = _bin_dir()
        if bin_dir is None:
            raise RuntimeError("PostgreSQL is not installed")
        self.directory = directory
        self.synchronous = synchronous
        self.bin = bin_dir
        ports = iter(_free_ports(2 + 2 * len(NODES)))
        self._etcd_ports = (next(ports), next(ports))  # client, peer
        self._ports = {name: (next(ports), next(ports)) for name in NODES}  # PostgreSQL, REST
        self._root = os.geteuid() == 0
        self._etcd: subprocess.Popen[bytes] | None = None
        self._patroni: dict[str, subprocess.Popen[bytes]] = {}  # the nodes that run

    def pg_port(self, name: str) -> int:
        return self._ports[name][0]

    def url(self, database: str = "fenceproxy", user: str = "fenceproxy") -> str:
        """Both nodes; a client finds the primary with ``target_session_attrs``."""
        hosts = ",".join(f"127.0.0.1:{self.pg_port(name)}" for name in NODES)
        return f"postgresql://{user}@{hosts}/{database}"

    def node_url(self, name: str, database: str = "fenceproxy", user: str = "fenceproxy") -> str:
        return f"postgresql://{user}@127.0.0.1:{self.pg_port(name)}/{database}"

    # -- starting ------------------------------------------------------------------

    def _write_config(self, name: str) -> None:
        """The node's patroni.yml, in JSON (which is YAML)."""
        pg, rest = self._ports[name]
        home = self.directory / name
        parameters = {
            "wal_log_hints": "on",  # what pg_rewind needs, short of data checksums
            "max_connections": 200,
            "hot_standby": "on",
            "fsync": "off",  # the tests kill processes, not the machine
        }
        dcs = {
            **TIMINGS,
            "synchronous_mode": self.synchronous,
            "postgresql": {"use_pg_rewind": True, "use_slots": True, "parameters": parameters},
        }
        config = {
            "scope": "fenceproxy-test",
            "name": name,
            "log": {"dir": str(home), "level": "INFO"},
            "restapi": {"listen": f"127.0.0.1:{rest}", "connect_address": f"127.0.0.1:{rest}"},
            "etcd3": {"hosts": f"127.0.0.1:{self._etcd_ports[0]}"},
            "bootstrap": {"dcs": dcs, "initdb": [{"encoding": "UTF8"}, "no-sync"]},
            "postgresql": {
                "listen": f"127.0.0.1:{pg}",
                "connect_address": f"127.0.0.1:{pg}",
                "data_dir": str(home / "data"),
                "bin_dir": str(self.bin),
                "pgpass": str(home / "pgpass"),
                "parameters": {"unix_socket_directories": str(home)},
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    "host replication all 127.0.0.1/32 trust",
                ],
                "authentication": {  # trust ignores the passwords; Patroni wants them
                    "superuser": {"username": "postgres", "password": "test"},
                    "replication": {"username": "replicator", "password": "test"},
                },
                # The default, a spread checkpoint, makes a copy take 90 s.
                "basebackup": [{"checkpoint": "fast"}],
                "remove_data_directory_on_rewind_failure": True,
                "remove_data_directory_on_diverged_timelines": True,
            },
        }
        (home / "patroni.yml").write_text(json.dumps(config, indent=1))

    def _spawn(self, argv: list[str], log: Path, as_postgres: bool) -> subprocess.Popen[bytes]:
        """A daemon, writing to ``log``, in an environment of its own: no venv
        Python paths, none of the tests' PG* variables, and ``log``'s folder as its
        working directory (one the postgres user can enter, as the tests' own may
        not be: a clone in a home folder, or in one ``mktemp -d`` made)."""
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": str(log.parent)}
        user = "postgres" if as_postgres and self._root else None
        with open(log, "ab") as out:
            return subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                cwd=log.parent, start_new_session=True, user=user, group=user,
                extra_groups=[] if user else None,
            )  # fmt: skip

    def _start_node(self, name: str) -> None:
        if name in self._patroni:
            raise RuntimeError(f"{name} runs already")
        home = self.directory / name  # PostgreSQL's own log goes to patroni.out
        argv = ["patroni", str(home / "patroni.yml")]
        self._patroni[name] = self._spawn(argv, home / "patroni.out", as_postgres=True)

    def start(self, timeout: float = 120.0) -> PatroniCluster:
        """etcd; node0, which bootstraps and leads; the ``fenceproxy`` role and
        database; node1, which copies node0. Returns once node1 streams from node0,
        as its synchronous standby when synchronous (about 15 s)."""
        try:
            if self._root:
                shutil.chown(self.directory, "postgres", "postgres")
                probe = ["runuser", "-u", "postgres", "--", "test", "-w", str(self.directory)]
                if subprocess.run(probe, check=False).returncode != 0:
                    raise RuntimeError(f"postgres cannot reach {self.directory}: o+x on parents?")
            client, peer = self._etcd_ports
            self._etcd = self._spawn(
                ["etcd", "--name", "etcd0", "--data-dir", str(self.directory / "etcd"),
                 "--listen-client-urls", f"http://127.0.0.1:{client}",
                 "--advertise-client-urls", f"http://127.0.0.1:{client}",
                 "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-cluster", f"etcd0=http://127.0.0.1:{peer}"],
                self.directory / "etcd.log", as_postgres=False,
            )  # fmt: skip
            for name in NODES:
                (self.directory / name).mkdir(mode=0o700)
                if self._root:
                    shutil.chown(self.directory / name, "postgres", "postgres")
                self._write_config(name)
            self._until("etcd is healthy", timeout, self._etcd_healthy)
            self._start_node(NODES[0])
            self.wait_role(NODES[0], "leader", timeout)
            self._create_database(NODES[0])
            self._start_node(NODES[1])
            self.wait_role(NODES[1], "replica", timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _etcd_healthy(self) -> bool:
        health = _get(f"http://127.0.0.1:{self._etcd_ports[0]}/health")[1]
        return bool(health and health.get("health") == "true")

    def _create_database(self, leader: str) -> None:
        """The role and database of the proxy's store; Patroni makes only its own."""
        result = subprocess.run(
            [str(self.bin / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1",
             "-d", self.node_url(leader, "postgres", user="postgres"),
             "-c", "CREATE ROLE fenceproxy LOGIN",
             "-c", "CREATE DATABASE fenceproxy OWNER fenceproxy"],
            capture_output=True, text=True, check=False, timeout=60, env={},
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"creating the fenceproxy database failed: {result.stderr}")

    # -- watching ------------------------------------------------------------------

    def _rest(self, name: str, path: str) -> tuple[int, Any]:
        """GET from a node's Patroni REST API (503: the node is not in that role)."""
        return _get(f"http://127.0.0.1:{self._ports[name][1]}{path}")

    def _until(self, what: str, timeout: float, found: Callable[[], T | None]) -> T:
        """Poll ``found`` until it returns something true, and return that; fail at
        once if the Patroni of a node that should run has exited."""
        deadline = time.monotonic() + timeout
        while not (result := found()):
            exited = [name for name, process in self._patroni.items() if process.poll() is not None]
            if exited or time.monotonic() > deadline:
                why = f"{exited} exited" if exited else f"not within {timeout} s"
                raise RuntimeError(f"{why}: {what}\n{self.logs()}")
            time.sleep(0.05)
        return result

    def leader(self) -> str | None:
        """The node whose Patroni holds the leader key and whose PostgreSQL is out of
        recovery, by the nodes' own REST APIs (etcd names a dead leader until its
        key expires)."""
        for name in NODES:
            status, body = self._rest(name, "/primary")
            if status == 200 and (body.get("state"), body.get("role")) in RUNNING_PRIMARY:
                return name
        return None

    def _streaming(self, name: str) -> bool:
        """Whether the leader's PostgreSQL streams to ``name``; when synchronous, as
        to its synchronous standby, and recorded so in etcd (what lets Patroni
        promote it)."""
        leader = self.leader()
        if leader is None or leader == name:
            return False
        standbys = (self._rest(leader, "/patroni")[1] or {}).get("replication", ())
        state = {s["application_name"]: s for s in standbys if s["state"] == "streaming"}
        if name not in state:
            return False
        if not self.synchronous:
            return self._rest(name, "/replica")[0] == 200
        return state[name]["sync_state"] == "sync" and self._rest(name, "/sync")[0] == 200

    def wait_role(self, name: str, role: str, timeout: float = 60.0) -> None:
        """Until ``name`` is the ``"leader"``, or a ``"replica"`` streaming from the
        leader (its synchronous standby, when synchronous)."""
        if role not in ("leader", "replica"):
            raise ValueError(role)
        if role == "leader":
            self._until(f"{name} leads", timeout, lambda: self.leader() == name)
        else:
            self._until(f"{name} is a replica", timeout, lambda: self._streaming(name))

    def wait_leader(
        self, other_than: str | None = None, timeout: float = 60.0
    ) -> tuple[str, float]:
        """The leader, once there is one other than ``other_than``, and the
        ``time.monotonic()`` of when it was first seen promoted (polled each 50 ms)."""

        def new() -> str | None:
            leader = self.leader()
            return None if leader == other_than else leader

        return self._until(f"a leader other than {other_than}", timeout, new), time.monotonic()

    def logs(self, lines: int = 20) -> str:
        """The end of each log of the cluster, for a failure's message."""
        paths = [self.directory / "etcd.log"]
        paths += [self.directory / n / log for n in NODES for log in ("patroni.log", "patroni.out")]
        return "\n".join(
            f"--- {path.relative_to(self.directory)}\n"
            + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            for path in paths
            if path.exists()
        )

    # -- faults and stopping ---------------------------------------------------------

    def wal_senders(self, name: str) -> list[int]:
        """The node's WAL sender processes: what streams its commits to the standby."""
        postmaster = self.directory / name / "data" / "postmaster.pid"
        main = int(postmaster.read_text().split()[0])
        return [
            pid
            for pid, (parent, command) in _processes().items()
            if parent == main and "walsender" in command
        ]

    def kill(self, name: str) -> None:
        """SIGKILL, at once, the node's Patroni and its PostgreSQL: the postmaster and
        all its children (and a pg_rewind or pg_basebackup, if one runs). The
        postmaster is found by the data directory on its command line, not by
        postmaster.pid, which a kill leaves behind with a pid that may be reused."""
        _kill_all(f"{self.directory / name}/")
        if name in self._patroni:
            self._patroni.pop(name).wait(timeout=10)

    def restart(self, name: str) -> None:
        """Start the node's Patroni again, same config, on the data the kill left: it
        rejoins as a standby, by pg_rewind (or by a fresh copy if that fails).
        ``wait_role(name, "replica")`` waits for it."""
        self._start_node(name)

    def stop(self) -> None:
        """Kill all the cluster runs (Patroni, PostgreSQL, pg_rewind, etcd), whatever
        state it is in."""
        _kill_all(f"{self.directory}/")
        for process in [*self._patroni.values(), *filter(None, [self._etcd])]:
            process.kill()  # dead already: this and wait() only reap it
            process.wait(timeout=10)
        self._patroni.clear()

    def __enter__(self) -> PatroniCluster:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
