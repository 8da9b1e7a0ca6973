"""fenceproxy beside nginx and the bare upstream, driven by wrk, in one run.

Starts on loopback a minimal aiohttp upstream (``bench/upstream.py``), nginx as the
pass-through baseline (one worker, upstream keep-alive), and fenceproxy once per
setup, each with its own store; then drives every setup with wrk (``-t1``, fenced
POSTs of ``bench/load.lua``) in interleaved rounds, so machine noise hits them all
alike. A 1 s warm-up before each measured run is discarded (``--warmup``).

On two cores or more the server under test runs alone on core 0, and wrk and the
upstream share core 1; "direct" moves the upstream to core 0 for its run. A ratio
to direct is then the proxy's throughput on one core against a minimal aiohttp
server's on one core. CPU per request is the server's ``utime + stime`` from
``/proc`` over the run (PostgreSQL's processes included on that store) divided by
the requests served: steadier than req/s, and where a target is missed it shows why.

    python bench/run.py [--rounds 3] [--seconds 5] [--connections 32] [--warmup 1]
                        [--no-postgres] [--only NAME,...] [--json FILE]

Exits 1 when a setup answered anything but 2xx, or failed to start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository's tests/ helpers

from fenceproxy.testing import free_port  # noqa: E402
from tests.certs import Certificates  # noqa: E402
from tests.nginx import NGINX, temp_paths  # noqa: E402
from tests.postgres import PostgresServer, postgres_bin, sql  # noqa: E402

PG_BIN = postgres_bin()
# Beside initdb when it is there; Debian's wrapper on PATH otherwise.
if PG_BIN is not None and (PG_BIN / "pgbench").exists():
    PGBENCH = str(PG_BIN / "pgbench")
else:
    PGBENCH = shutil.which("pgbench") or "pgbench"

TICK = os.sysconf("SC_CLK_TCK")
TWO_CORES = (os.cpu_count() or 1) >= 2
SERVER_CORE, LOAD_CORE = ({0}, {1}) if TWO_CORES else (None, None)
MILLION = 1_000_000


@dataclass(frozen=True)
class Load:
    """What wrk sends: see bench/load.lua."""

    path: str = "/w/x"
    jobs: int = 1_000
    raise_every: int = 0  # a job's generation rises every this many of its writes; 0: never
    keys: bool = False

    def args(self, base: int, first: int, sent: int) -> list[str]:
        """load.lua's arguments for one run: ``base`` above every key and token earlier
        runs sent, ``first`` the setup's first run's, and ``sent`` at least as many
        requests as the setup's earlier runs sent."""
        generation = f"raise:{first}:{self.raise_every}" if self.raise_every else "1"
        if self.jobs >= MILLION:  # a different stretch each run, so each run's are uncached
            offset = base % self.jobs
        elif self.raise_every:  # each job's writes count on from the last run's
            offset = sent
        else:
            offset = 0
        keys = f"keys:{base}" if self.keys else "-"
        return [self.path, str(self.jobs), str(offset), generation, keys]


@dataclass
class Setup:
    """One row of the table: the servers under test, and the load driven at them."""

    name: str
    urls: list[str]  # one wrk per URL, the connections split between them
    pids: Callable[[], list[int]]  # the processes whose CPU is the server's
    memory_pids: Callable[[], list[int]]  # the processes whose peak RSS is reported
    load: Load = field(default_factory=Load)
    database_pids: Callable[[], list[int]] = list  # PostgreSQL's, counted apart
    database_url: str = ""  # the PostgreSQL database it writes to
    # What drives it instead of wrk (pgbench): seconds, connections -> wrk's figures
    drive: Callable[[int, int], dict[str, int]] | None = None
    before: Callable[[], None] = lambda: None
    after: Callable[[], None] = lambda: None
    runs: list[dict[str, float]] = field(default_factory=list)
    first: int = field(default_factory=lambda: time.time_ns() // 1000)  # its first run's base
    sent: int = 0  # at least as many requests as its runs have sent


# A job's holder changes, its generation rising, every this many of its writes.
NEW_HOLDER = 50

# The route ordered by generation (fence: {order: generation}) in proxy_config.
BY_GENERATION = "/g/x"

PG_SETUPS: list[tuple[str, Load, int]] = [
    # name, load, proxies on the one database
    ("pg fenced", Load(), 1),
    ("pg fenced, 1M jobs", Load(jobs=MILLION), 1),
    ("pg raising", Load(raise_every=NEW_HOLDER), 1),
    ("pg keys", Load(keys=True), 1),
    ("pg hot job", Load(jobs=1), 1),
    ("pg hot job by gen", Load(path=BY_GENERATION, jobs=1), 1),
    ("pg x2 fenced", Load(), 2),
    ("pg x2 raising", Load(raise_every=NEW_HOLDER), 2),
    ("pg x2 keys", Load(keys=True), 2),
    # The database's own ceiling: bench/admission.sql, an admission's statements
    # without a proxy (fence and in-flight record upserted, commit, record deleted).
    ("pgbench", Load(), 0),
]

# Every core: the server unpinned (wrk and the upstream too), nginx with 2 worker
# processes against one proxy with workers: 1 and workers: 2 on the one database.
CORE_SETUPS: list[tuple[str, Load, int]] = [
    # name, load, workers
    ("w1 pass-through", Load(path="/open/x"), 1),
    ("w2 pass-through", Load(path="/open/x"), 2),
    ("w1 pg fenced", Load(), 1),
    ("w2 pg fenced", Load(), 2),
]


# ---- processes -------------------------------------------------------------------


def wait_for_port(port: int, process: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{what} exited {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.05)
    raise SystemExit(f"{what} did not listen on {port} within 30 s")


def pin(pid: int, cores: set[int] | None) -> None:
    """Every thread of ``pid`` onto ``cores``."""
    if cores is None:
        return
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task), cores)


def pinned(cores: set[int] | None) -> list[str]:
    return [] if cores is None else ["taskset", "-c", ",".join(map(str, sorted(cores)))]


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of each process, and of its children it has waited for."""
    total = 0
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(f) for f in fields[11:15])
    return total / TICK


def peak_rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
    return total / 1024


class Processes:
    """Every process the run starts, killed at the end whatever happens."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[subprocess.Popen[bytes]] = []

    def start(
        self, name: str, argv: list[str], port: int, cores: set[int] | None
    ) -> subprocess.Popen[bytes]:
        log = open(self.directory / f"{name}.log", "wb")  # noqa: SIM115 (lives with it)
        process = subprocess.Popen([*pinned(cores), *argv], stdout=log, stderr=log)
        self.started.append(process)
        try:
            wait_for_port(port, process, name)
        except SystemExit:
            print((self.directory / f"{name}.log").read_text()[-2000:], file=sys.stderr)
            raise
        return process

    def stop(self) -> None:
        """SIGTERM, and SIGKILL what is left after 10 s: a process with children of its
        own (nginx's master, fenceproxy's supervisor) takes them with it only when it
        may stop them itself."""
        for process in reversed(self.started):
            if process.poll() is None:
                process.terminate()
        for process in reversed(self.started):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def nginx_config(directory: Path, port: int, upstream: int, workers: int = 1) -> Path:
    temp = temp_paths(directory)
    config = directory / f"nginx-{workers}.conf"
    master = "off" if workers == 1 else "on"
    config.write_text(f"""
daemon off; master_process {master}; worker_processes {workers};
pid {directory / f"nginx-{workers}.pid"}; error_log {directory / f"nginx-{workers}-error.log"};
events {{ worker_connections 1024; }}
http {{
  access_log off; {temp}
  upstream app {{ server 127.0.0.1:{upstream}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://app;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}
}}
""")
    return config


def proxy_config(directory: Path, name: str, upstream: int, store: str, extra: str = "") -> Path:
    config = directory / f"{name}.yaml"
    config.write_text(f"""
store: {store}
admin: false
{extra}
routes:
  - name: open
    path: /open/
    upstream: http://127.0.0.1:{upstream}
    fence: false
  - name: writes
    path: /w/
    upstream: http://127.0.0.1:{upstream}
  - name: parts
    path: /g/
    upstream: http://127.0.0.1:{upstream}
    fence: {{order: generation}}
""")
    return config


def prefill_sqlite(path: Path, jobs: int) -> None:
    """Give ``jobs`` jobs a fence at generation 1, as a long-running store has."""
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.executemany(
            "INSERT INTO fences (job, generation, updated_at) VALUES (?, 1, ?)",
            ((f"job-{n}", time.time()) for n in range(jobs)),
        )


def prefill_postgres(url: str, jobs: int) -> None:
    """Give ``jobs`` jobs a fence at generation 1, as a long-running store has."""
    fill = f"INSERT INTO fences SELECT 'job-' || n, 1, 0 FROM generate_series(0, {jobs - 1}) AS n"
    asyncio.run(sql(url, fill, "ANALYZE fences"))


# ---- one measured run ------------------------------------------------------------


def wrk(
    urls: list[str], load: Load, seconds: int, connections: int, first: int = 0, sent: int = 0
) -> list[dict[str, int]]:
    """One wrk per URL at once; each prints its done() line. ``first`` and ``sent`` as
    :meth:`Load.args` takes them (of no matter for a load that keeps its generation)."""
    base = time.time_ns() // 1000  # above every earlier run's generations and keys
    first = first or base
    share = max(1, connections // len(urls))
    processes = [
        subprocess.Popen(
            [
                *pinned(LOAD_CORE),
                "wrk",
                "-t1",
                f"-c{share}",
                f"-d{seconds}s",
                "--timeout",
                "10s",
                "-s",
                str(HERE / "load.lua"),
                url,
                "--",
                *load.args(base + n * 10_000_000, first + n * 10_000_000, sent),
                "job-" if n == 0 else f"w{n}-job-",  # each wrk its own jobs
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n, url in enumerate(urls)
    ]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=seconds + 60)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if process.returncode != 0 or not lines:
            raise SystemExit(f"wrk failed ({process.returncode}):\n{out}{err}")
        results.append(json.loads(lines[-1]))
    return results


def pgbench(url: str, seconds: int, connections: int) -> dict[str, int]:
    """pgbench's admission-shaped transactions (bench/admission.sql) against ``url``,
    from the load core: wrk's figures, from its per-transaction log."""
    with tempfile.TemporaryDirectory(prefix="fenceproxy-pgbench-") as logs:
        command = [
            *pinned(LOAD_CORE), PGBENCH, "-n", "-M", "prepared", "-f", str(HERE / "admission.sql"),
            "-c", str(connections), "-j", "1", "-T", str(seconds), "-l",
            "--log-prefix", f"{logs}/tx", url,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
        if done.returncode != 0:
            raise SystemExit(f"pgbench failed ({done.returncode}):\n{done.stdout}{done.stderr}")
        # One line per transaction: client, number, latency (µs), script, epoch s, µs.
        latencies, failed, first, last = [], 0, float("inf"), 0.0
        for log in Path(logs).iterdir():
            for line in log.read_text().splitlines():
                fields = line.split()
                if fields[2] == "failed":
                    failed += 1
                    continue
                latencies.append(int(fields[2]))
                ended = int(fields[4]) + int(fields[5]) / 1e6
                first, last = min(first, ended - int(fields[2]) / 1e6), max(last, ended)
    if not latencies:
        raise SystemExit(f"pgbench ran no transaction:\n{done.stdout}{done.stderr}")
    latencies.sort()
    return {
        "requests": len(latencies),
        "duration_us": int((last - first) * 1e6),
        "non2xx": failed,
        "socket_errors": 0,
        "p50_us": latencies[len(latencies) // 2],
        "p99_us": latencies[min(len(latencies) - 1, len(latencies) * 99 // 100)],
    }


def measure(setup: Setup, seconds: int, connections: int, warmup: int = 1) -> dict[str, float]:
    def drive(seconds: int) -> list[dict[str, int]]:
        if setup.drive is not None:
            return [setup.drive(seconds, connections)]
        results = wrk(setup.urls, setup.load, seconds, connections, setup.first, setup.sent)
        # wrk may have sent a request a connection beyond those answered.
        setup.sent += sum(r["requests"] for r in results) + connections
        return results

    setup.before()
    try:
        if warmup:
            drive(warmup)  # discarded
        pids, database = setup.pids(), setup.database_pids()
        cpu, database_cpu = cpu_seconds(pids), cpu_seconds(database)
        results = drive(seconds)
        cpu = cpu_seconds(pids) - cpu
        # Backends that ended meanwhile are in the postmaster's children's time.
        database_cpu = cpu_seconds(sorted({*database, *setup.database_pids()})) - database_cpu
    finally:
        setup.after()
    requests = sum(r["requests"] for r in results)
    duration = max(r["duration_us"] for r in results) / 1e6
    per = (lambda seconds: seconds / requests * 1e6) if requests else lambda _: float("nan")
    return {
        "rps": requests / duration,
        "p50_ms": statistics.mean(r["p50_us"] for r in results) / 1000,
        "p99_ms": max(r["p99_us"] for r in results) / 1000,
        "cpu_us": per(cpu + database_cpu),
        "proxy_cpu_us": per(cpu),
        "database_cpu_us": per(database_cpu),
        "failed": sum(r["non2xx"] + r["socket_errors"] for r in results),
        "requests": requests,
    }


# ---- the setups ------------------------------------------------------------------


@contextlib.contextmanager
def setups(directory: Path, with_postgres: bool, only: set[str] | None) -> Iterator[list[Setup]]:
    processes = Processes(directory)
    postgres: PostgresServer | None = None
    wanted = (lambda name: True) if only is None else (lambda name: name in only)
    try:
        upstream_port = free_port()
        upstream = processes.start(
            "upstream",
            [sys.executable, str(HERE / "upstream.py"), str(upstream_port)],
            upstream_port,
            LOAD_CORE,
        )
        result: list[Setup] = []

        def one(pid: int) -> Callable[[], list[int]]:
            return lambda: [pid]

        if wanted("direct"):
            result.append(
                Setup(
                    "direct",
                    [f"http://127.0.0.1:{upstream_port}"],
                    one(upstream.pid),
                    one(upstream.pid),
                    before=lambda: pin(upstream.pid, SERVER_CORE),
                    after=lambda: pin(upstream.pid, LOAD_CORE),
                )
            )
        if wanted("nginx"):
            if NGINX is None:
                raise SystemExit("nginx is not installed (make bench installs it)")
            port = free_port()
            config = nginx_config(directory, port, upstream_port)
            nginx = processes.start("nginx", [NGINX, "-c", str(config)], port, SERVER_CORE)
            result.append(
                Setup("nginx", [f"http://127.0.0.1:{port}"], one(nginx.pid), one(nginx.pid))
            )

        def proxies(
            name: str,
            store: str,
            count: int = 1,
            extra: str = "",
            cores: set[int] | None = SERVER_CORE,
            scheme: str = "http",
        ) -> tuple[list[int], list[str]]:
            """``count`` proxies on ``store``: their pids and URLs."""
            config = proxy_config(directory, name, upstream_port, store, extra)
            pids, urls = [], []
            for n in range(count):
                port = free_port()
                argv = [
                    sys.executable,
                    "-m",
                    "fenceproxy",
                    "serve",
                    "-c",
                    str(config),
                    "--listen",
                    f"127.0.0.1:{port}",
                    "--loop",
                    "auto",
                ]
                pids.append(processes.start(f"{name}-{n}", argv, port, cores).pid)
                urls.append(f"{scheme}://127.0.0.1:{port}")
            return pids, urls

        def migrate(name: str, store: str) -> None:
            config = proxy_config(directory, name, upstream_port, store)
            command = [sys.executable, "-m", "fenceproxy", "migrate", "-c", str(config)]
            subprocess.run(command, check=True, capture_output=True)

        def sqlite_setup(
            name: str, load: Load, prefill: int = 0, extra: str = "", scheme: str = "http"
        ) -> None:
            if not wanted(name):
                return
            path = directory / f"{name}.db"
            store = f"sqlite:///{path}"
            if prefill:
                migrate(name, store)
                prefill_sqlite(path, prefill)
            pids, urls = proxies(name, store, extra=extra, scheme=scheme)
            result.append(Setup(name, urls, lambda: pids, lambda: pids, load))

        sqlite_setup("pass-through", Load(path="/open/x"))
        sqlite_setup("fenced", Load())
        # The same over TLS (1.3, wrk's keep-alive connections: one handshake each).
        if wanted("fenced tls"):
            cert, key = Certificates(directory / "tls").server()
            tls = f"tls: {{cert: {cert}, key: {key}}}"
            sqlite_setup("fenced tls", Load(), extra=tls, scheme="https")
        # Every decision logged, as JSON, to a file: what a decision line costs.
        sqlite_setup(
            "logged",
            Load(),
            extra="log_format: json\nlog_levels: {fenceproxy.decisions: DEBUG}",
        )
        # Every request traced (a server and a client span each), exported over OTLP/HTTP
        # to a sink that takes each batch and drops it: what tracing costs when it is
        # on (bench/tracing_cost.py measures it off).
        if wanted("fenced traced"):
            sink = free_port()
            command = [sys.executable, str(HERE / "upstream.py"), str(sink)]
            processes.start("otlp-sink", command, sink, LOAD_CORE)
            endpoint = f"http://127.0.0.1:{sink}/v1/traces"
            traced = f"tracing: {{endpoint: '{endpoint}', sample_ratio: 1.0}}"
            sqlite_setup("fenced traced", Load(), extra=traced)
        sqlite_setup("fenced, 1M jobs", Load(jobs=MILLION), prefill=MILLION)
        sqlite_setup("raising", Load(raise_every=NEW_HOLDER))
        sqlite_setup("keys", Load(keys=True))
        sqlite_setup("hot job", Load(jobs=1))
        sqlite_setup("fenced by gen", Load(path=BY_GENERATION))
        sqlite_setup("hot job by gen", Load(path=BY_GENERATION, jobs=1))

        pg_wanted = [setup for setup in PG_SETUPS if wanted(setup[0])]
        cores_wanted = [setup for setup in CORE_SETUPS if wanted(setup[0])]
        if wanted("nginx w2") and NGINX is not None and cores_wanted:
            port = free_port()
            config = nginx_config(directory, port, upstream_port, workers=2)
            nginx2 = processes.start("nginx-2", [NGINX, "-c", str(config)], port, None)
            result.append(
                Setup(
                    "nginx w2", [f"http://127.0.0.1:{port}"], family(nginx2.pid), family(nginx2.pid)
                )
            )
        if with_postgres and (pg_wanted or cores_wanted):
            postgres = start_postgres(directory)
            postmaster = postgres_pids(postgres)
            for name, load, count in pg_wanted:
                database = name.replace(" ", "_").replace(",", "").lower()
                asyncio.run(sql(postgres.url(), f"CREATE DATABASE {database}"))
                store = postgres.url(database) + "?pool=10"
                migrate(database, store)
                if load.jobs >= MILLION:
                    prefill_postgres(postgres.url(database), load.jobs)
                if name == "pgbench":
                    drive = functools.partial(pgbench, postgres.url(database))
                    result.append(Setup(name, [], list, list, load, postmaster, drive=drive))
                    continue
                pids, urls = proxies(database, store, count)
                url = postgres.url(database)
                result.append(
                    Setup(
                        name,
                        urls,
                        lambda p=pids: p,
                        lambda p=pids: p,
                        load,
                        postmaster,
                        database_url=url,
                    )
                )
            for name, load, workers in cores_wanted:
                database = name.replace(" ", "_").replace("-", "_").lower()
                asyncio.run(sql(postgres.url(), f"CREATE DATABASE {database}"))
                store = postgres.url(database) + "?pool=10"
                migrate(database, store)
                extra = f"workers: {workers}"
                pids, urls = proxies(database, store, 1, extra, cores=None)
                result.append(Setup(name, urls, family(pids[0]), family(pids[0]), load, postmaster))
        yield result
    finally:
        processes.stop()
        if postgres is not None:
            with contextlib.suppress(RuntimeError):
                postgres.stop("immediate")


def start_postgres(directory: Path) -> PostgresServer:
    """A durable cluster (fsync on, synchronous_commit on) on the server's core."""
    bin_dir = PG_BIN
    if bin_dir is None:
        raise SystemExit("PostgreSQL is not installed (make bench installs it; or --no-postgres)")
    folder = directory / "postgres"
    folder.mkdir()
    os.chmod(directory, 0o755)
    server = PostgresServer(folder, bin_dir, durable=True)
    server.init()
    server.start(wrapper=pinned(SERVER_CORE))
    return server


def family(pid: int) -> Callable[[], list[int]]:
    """A process and its children (a supervisor's workers, nginx's master's), looked
    up at each call."""

    def pids() -> list[int]:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [pid, *map(int, children)]

    return pids


def postgres_pids(server: PostgresServer) -> Callable[[], list[int]]:
    """The postmaster and its children (the backends serving the proxies, the WAL
    writer, the checkpointer), looked up at each call: backends come and go."""
    postmaster = int((server.data / "postmaster.pid").read_text().split()[0])

    def pids() -> list[int]:
        children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split()
        return [postmaster, *map(int, children)]

    return pids


# ---- the table -------------------------------------------------------------------


def median(setup: Setup, key: str) -> float:
    return statistics.median(run[key] for run in setup.runs)


HOT_MODULE = "fenceproxy.http.server"
"""A module of the per-request path: built from its source, or compiled (an extension
module beside it), it tells which build of the package a run measured."""


def package_build(env: dict[str, str] | None = None) -> str:
    """Which build of the package ``python -m fenceproxy`` runs under ``env``: pure
    Python, or compiled, and from where."""
    where = subprocess.run(
        [sys.executable, "-c", f"import {HOT_MODULE} as m; print(m.__file__)"],
        capture_output=True, text=True, check=True, env=env,
    ).stdout.strip()  # fmt: skip
    kind = "pure Python" if where.endswith(".py") else "compiled"
    return f"{kind}, {HOT_MODULE} from {where}"


def report(table: list[Setup], rounds: int, seconds: float, connections: int) -> list[str]:
    rows = {s.name: s for s in table}
    direct, nginx = rows.get("direct"), rows.get("nginx")
    print(
        f"\nwrk -t1 -c{connections}, {seconds:g} s per run, {rounds} interleaved rounds, "
        f"medians; {'server on core 0, wrk and upstream on core 1' if TWO_CORES else 'unpinned'}"
    )
    print(f"the package measured: {package_build()}")
    header = (
        f"{'setup':<16} {'req/s':>8} {'vs direct':>9} {'vs nginx':>8} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'CPU µs':>7} {'of it, DB':>9} {'CPU vs nginx':>12} {'peak RSS':>9}"
    )
    print(header)
    print("-" * len(header))
    for s in table:
        rps, cpu = median(s, "rps"), median(s, "cpu_us")
        vs_direct = f"{rps / median(direct, 'rps'):.2f}" if direct else "-"
        vs_nginx = f"{rps / median(nginx, 'rps'):.2f}" if nginx else "-"
        cpu_nginx = f"{cpu / median(nginx, 'cpu_us'):.2f}" if nginx else "-"
        database = median(s, "database_cpu_us")
        of_database = f"{database:.0f}" if database else "-"
        print(
            f"{s.name:<16} {rps:>8,.0f} {vs_direct:>9} {vs_nginx:>8} {median(s, 'p50_ms'):>7.2f} "
            f"{median(s, 'p99_ms'):>7.2f} {cpu:>7.0f} {of_database:>9} {cpu_nginx:>12} "
            f"{peak_rss_mib(s.memory_pids()):>6.0f} MiB"
        )
    return targets(rows)


@dataclass(frozen=True)
class Target:
    """One setup's median ``key`` over another's: PASS or MISS as it is ``op`` (">="
    or "<=") ``bound``, or only shown where ``op`` is None."""

    text: str
    setup: str
    against: str
    key: str
    op: str | None = None
    bound: float = 0.0


TARGETS = [
    Target("pass-through CPU/request <= 1.5x nginx's", "pass-through", "nginx", "cpu_us",
           "<=", 1.5),
    Target("fenced req/s >= 0.45x direct", "fenced", "direct", "rps", ">=", 0.45),
    Target("fenced req/s >= 0.8x nginx", "fenced", "nginx", "rps", ">=", 0.8),
    Target("fenced p99 <= 1.5x nginx's", "fenced", "nginx", "p99_ms", "<=", 1.5),
    Target("fenced CPU/request <= 3x nginx's", "fenced", "nginx", "cpu_us", "<=", 3.0),
    Target("hot job by generation >= 0.5x fenced", "hot job by gen", "fenced", "rps", ">=", 0.5),
    Target("hot job, job order, vs fenced", "hot job", "fenced", "rps"),
    Target("fenced over TLS req/s vs plain", "fenced tls", "fenced", "rps"),
    Target("fenced over TLS CPU/request vs plain", "fenced tls", "fenced", "cpu_us"),
    Target("traced req/s vs fenced", "fenced traced", "fenced", "rps"),
    Target("traced CPU/request vs fenced", "fenced traced", "fenced", "cpu_us"),
    Target("workers: 2 pass-through >= 1.7x workers: 1", "w2 pass-through", "w1 pass-through",
           "rps", ">=", 1.7),
    Target("workers: 2 pg fenced >= 1.4x workers: 1", "w2 pg fenced", "w1 pg fenced", "rps",
           ">=", 1.4),
    Target("workers: 2 pass-through vs nginx w2", "w2 pass-through", "nginx w2", "rps"),
    Target("1M jobs req/s >= 0.8x 1k jobs", "fenced, 1M jobs", "fenced", "rps", ">=", 0.8),
    Target("a key's CPU <= 1.3x fenced", "keys", "fenced", "cpu_us", "<=", 1.3),
    Target("keys req/s vs fenced", "keys", "fenced", "rps"),
    Target("raising req/s >= 0.35x direct", "raising", "direct", "rps", ">=", 0.35),
    # PostgreSQL: the proxy and the database share core 0, as the proxy alone does
    # on SQLite; CPU per write counts both.
    Target("pg fenced req/s >= 0.7x SQLite's", "pg fenced", "fenced", "rps", ">=", 0.7),
    Target("pg raising req/s >= 0.7x SQLite's", "pg raising", "raising", "rps", ">=", 0.7),
    Target("pg fenced req/s >= 0.5x pgbench's", "pg fenced", "pgbench", "rps", ">=", 0.5),
    Target("pg 1M jobs req/s >= 0.8x 1k jobs", "pg fenced, 1M jobs", "pg fenced", "rps", ">=", 0.8),
    Target("pg fenced CPU/write <= 2x SQLite's", "pg fenced", "fenced", "cpu_us", "<=", 2.0),
    Target("pg a key's CPU <= 1.3x fenced", "pg keys", "pg fenced", "cpu_us", "<=", 1.3),
    Target("pg fenced p99 <= 2x SQLite's", "pg fenced", "fenced", "p99_ms", "<=", 2.0),
    Target("pg two proxies req/s >= 1.0x one", "pg x2 fenced", "pg fenced", "rps", ">=", 1.0),
    Target("pg two proxies CPU <= 1.2x one", "pg x2 fenced", "pg fenced", "cpu_us", "<=", 1.2),
]  # fmt: skip


def targets(rows: dict[str, Setup]) -> list[str]:
    """The targets, each PASS or MISS, from this run's medians, for the setups run; the
    misses."""
    print()
    missed = []
    for target in TARGETS:
        if target.setup not in rows or target.against not in rows:
            continue
        key, bound = target.key, target.bound
        value = median(rows[target.setup], key) / median(rows[target.against], key)
        if target.op is None:
            print(f"       {target.text}: {value:.2f}")
            continue
        ok = value >= bound if target.op == ">=" else value <= bound
        shown = f"{value:.2f}" if ok or round(value, 2) != bound else f"{value:.3f}"
        print(f"{'PASS' if ok else 'MISS'}   {target.text}: {shown}")
        if not ok:
            missed.append(target.text)
    return missed


# At light load, one request at a time: the latency each adds over direct's.
LIGHT = ("direct", "pass-through", "fenced")
LIGHT_TARGET_MS = 0.5  # a fenced write's


def light_load(
    table: list[Setup], rounds: int, seconds: int, warmup: int
) -> tuple[dict[str, list[float]], list[str]]:
    """``LIGHT``'s setups driven by one connection, one request at a time, in
    interleaved rounds: each one's median latency per round (ms), and the target if
    missed. Nothing when one of them was not run."""
    rows = {s.name: s for s in table}
    if not all(name in rows for name in LIGHT):
        return {}, []
    medians: dict[str, list[float]] = {name: [] for name in LIGHT}
    for _ in range(rounds):
        for name in LIGHT:
            run = measure(rows[name], seconds, 1, warmup)
            if run["failed"]:
                raise SystemExit(f"{name} answered {run['failed']} non-2xx at light load")
            medians[name].append(run["p50_ms"])
    direct = statistics.median(medians["direct"])
    print("\none connection, one request at a time: median latency, and over direct's")
    for name in LIGHT:
        p50 = statistics.median(medians[name])
        print(f"       {name:<13} {p50:.3f} ms   +{p50 - direct:.3f} ms")
    added = statistics.median(medians["fenced"]) - direct
    text = f"fenced latency at light load <= {LIGHT_TARGET_MS} ms over direct's"
    ok = added <= LIGHT_TARGET_MS
    print(f"{'PASS' if ok else 'MISS'}   {text}: {added:.3f} ms")
    return medians, [] if ok else [text]


def said(n: int, setup: Setup, run: dict[str, float]) -> str:
    """The line that tells round ``n``'s ``run`` of ``setup``."""
    return (
        f"round {n + 1} {setup.name:<16} {run['rps']:>8,.0f} req/s "
        f"{run['cpu_us']:>6.0f} µs/req p99 {run['p99_ms']:.1f} ms"
        + (f"  {run['failed']} FAILED" if run["failed"] else "")
    )


def all_2xx(failed: list[str]) -> bool:
    """Whether every setup answered 2xx only; the ``failed`` ones are said on stderr."""
    if failed:
        print(f"\nnot every answer was 2xx: {', '.join(failed)}", file=sys.stderr)
    return not failed


def load_options(parser: argparse.ArgumentParser) -> None:
    """The options of wrk's load every benchmark of this folder that drives a fenced
    write takes, and ``--json``."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument(
        "--warmup", type=int, default=1, help="seconds of load discarded before each run"
    )
    parser.add_argument("--json", metavar="FILE", help="also write every run's figures here")


def need_wrk() -> None:
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (make bench installs it)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    load_options(parser)
    parser.add_argument("--no-postgres", action="store_true", help="SQLite setups only")
    parser.add_argument("--only", help="comma-separated setup names (e.g. direct,nginx,fenced)")
    args = parser.parse_args()
    need_wrk()
    only = None if args.only is None else {n.strip() for n in args.only.split(",")}

    with (
        tempfile.TemporaryDirectory(prefix="fenceproxy-bench-") as tmp,
        setups(Path(tmp), not args.no_postgres, only) as table,
    ):
        for n in range(args.rounds):
            for setup in table:
                run = measure(setup, args.seconds, args.connections, args.warmup)
                setup.runs.append(run)
                print(said(n, setup, run), flush=True)
        missed = report(table, args.rounds, args.seconds, args.connections)
        light, light_missed = light_load(table, args.rounds, args.seconds, args.warmup)
        missed += light_missed
        if args.json:
            figures: dict[str, object] = {
                s.name: {"runs": s.runs, "peak_rss_mib": peak_rss_mib(s.memory_pids())}
                for s in table
            }
            if light:
                figures["light load p50 ms"] = light
            Path(args.json).write_text(json.dumps(figures, indent=2))
    if not all_2xx([s.name for s in table if any(run["failed"] for run in s.runs)]):
        return 1
    if missed:
        print(f"\n{len(missed)} target(s) missed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
