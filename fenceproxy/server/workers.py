"""``workers: N``: N processes serving one port, each with its own event loop, all
on the one store, and the supervisor that runs them.

The supervisor is the process ``fenceproxy serve`` started. It runs each worker as
``fenceproxy serve`` again, with the same arguments and a seat (:class:`Seat`) in
its environment; every worker binds the listener with ``SO_REUSEPORT``, so the
kernel spreads new connections across them. Nothing that a guarantee rests on is
shared between workers but the store, as between proxies on several machines.

The supervisor:

* is ready (and tells systemd so) once every worker listens; a worker that cannot
  start (its port or store) ends the start, with its own error printed;
* passes SIGHUP on to every worker, each of which reloads the config file itself,
  and reads the file again for its admin listener's credentials (``admin_clients``,
  ``admin_probes``) and certificate;
* on SIGTERM or SIGINT passes SIGTERM on and waits for every worker to drain (each
  within ``shutdown_timeout``), then exits;
* starts a worker that died again (a second later if it died within
  ``_QUICK_DEATH`` of starting), so the port keeps its N processes;
* serves the admin listener: the application one process serves
  (:func:`fenceproxy.ops.admin.admin_app`), on data it asks its workers for
  (:class:`WorkersData`; each worker serves its own on a Unix socket,
  :func:`fenceproxy.ops.data.data_app`): ``/metrics`` is every worker's, each sample
  labelled ``worker="i"``, and the supervisor's own count of the workers it started
  again; ``/healthz`` and ``/readyz`` answer 200 only when every worker does, else
  as the first failing one; the page, ``/jobs`` and ``/events`` read worker 0, whose
  views of the store are every worker's, and ``?worker=i`` another.

A worker dies with its supervisor (``PR_SET_PDEATHSIG``): a supervisor killed with
``kill -9`` leaves no worker holding the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from ..config import Config, Reader, admin_credentials, parse_listen, restart_only, tls_contexts
from ..errors import ConfigError, ListenError, RequestMalformed
from ..log import server_log
from ..ops.admin import admin_app, page_url
from ..ops.data import WorkerData
from ..ops.series import Hour
from ..tls import reload_server

__all__ = ["Seat", "WorkersData", "merge_metrics", "supervise", "worker_argv"]

_T = TypeVar("_T")

_SEAT = "FENCEPROXY_WORKER"
"""The environment variable that makes ``serve`` a worker: ``INDEX:READY_FD:SOCKET``."""
_QUICK_DEATH = 5.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Seat:
    """Where one worker sits: its number, the pipe it says it is ready on, and the
    Unix socket it serves its admin data on for the supervisor."""

    index: int
    ready_fd: int
    admin_socket: str

    @classmethod
    def from_environment(cls) -> Seat | None:
        """The seat the supervisor gave this process, if it is a worker."""
        value = os.environ.get(_SEAT)
        if value is None:
            return None
        index, ready_fd, admin_socket = value.split(":", 2)
        return cls(int(index), int(ready_fd), admin_socket)

    def ready(self) -> None:
        """Tell the supervisor this worker listens."""
        with contextlib.suppress(OSError):
            os.write(self.ready_fd, b"ready\n")
            os.close(self.ready_fd)


class _Worker:
    """One worker process, started again when it dies."""

    def __init__(self, index: int, argv: Sequence[str], folder: Path) -> None:
        self.index = index
        self.argv = list(argv)
        self.socket = str(folder / f"worker-{index}.sock")
        self.process: asyncio.subprocess.Process | None = None
        self.started = 0.0
        self.restarts = 0
        """Times it died and was started again."""
        self.data = WorkerData(index, self.socket)
        """What its admin data says, asked on its socket."""

    async def start(self) -> bool:
        """Start it and wait until it listens; False when it exited first."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)
        read, write = os.pipe()
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        env[_SEAT] = f"{self.index}:{write}:{self.socket}"
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv, env=env, pass_fds=(write,), preexec_fn=_die_with_parent
            )
        finally:
            os.close(write)
        self.started = time.monotonic()
        loop = asyncio.get_running_loop()
        with os.fdopen(read, "rb") as pipe:
            said = await loop.run_in_executor(None, pipe.readline)
        return said == b"ready\n"

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signum)

    async def close(self) -> None:
        await self.data.close()


def _die_with_parent() -> None:
    """In the worker, before it runs: SIGTERM it when the supervisor dies."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is not None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(libc_name).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


async def supervise(
    config: Config, argv: Sequence[str], ready: Callable[[], object], read: Reader
) -> int:
    """Run ``config.workers`` workers, each ``argv`` (the command that started this
    process) with a seat, until SIGTERM or SIGINT; the exit code: 0 when every worker
    stopped cleanly, 2 when one could not start. ``read`` reads the config file
    again, on SIGHUP."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    folder = Path(tempfile.mkdtemp(prefix="fenceproxy-workers-"))
    workers = [_Worker(i, argv, folder) for i in range(config.workers)]
    admin_tls = tls_contexts(config, "config").admin
    running = [(config, admin_credentials(config, "config"))]

    def hup() -> None:
        for worker in workers:
            worker.signal(signal.SIGHUP)
        # The admin listener's credentials and admin_probes as a worker reloading the
        # same file takes them, and its certificate renewed where it is (admin and
        # admin_tls take a restart); a file the workers refuse changes none of them.
        try:
            fresh = read(None)
            kept = restart_only(config, fresh)
            fresh = read(kept) if kept else fresh
            running[0] = (fresh, admin_credentials(fresh, "config"))
        except ConfigError as exc:
            server_log.error(
                "the admin listener keeps its credentials and certificate: %s",
                "; ".join(exc.lines),
            )
            return
        if admin_tls is not None and config.admin_tls is not None:
            try:
                reload_server(admin_tls, config.admin_tls.server())
            except ValueError as exc:
                server_log.error("admin_tls: %s; the admin listener keeps its certificate", exc)

    loop.add_signal_handler(signal.SIGHUP, hup)
    admin: web.AppRunner | None = None
    try:
        started = await asyncio.gather(*(w.start() for w in workers))
        if not all(started):
            server_log.error("a worker could not start; stopping the others")
            return 2
        if config.admin is not None:
            data = WorkersData([w.data for w in workers], lambda: [w.restarts for w in workers])
            app = admin_app(lambda: running[0][0], data, lambda: running[0][1])
            admin = web.AppRunner(app, access_log=None, handle_signals=False)
            await admin.setup()
            host, port = parse_listen(config.admin)
            try:
                await web.TCPSite(admin, host, port, ssl_context=admin_tls).start()
            except OSError as exc:
                reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
                raise ListenError(f"cannot listen on {config.admin}: {reason}") from None
        page = page_url(config)
        server_log.info(
            "%d workers serve %s%s",
            len(workers),
            config.listen,
            "" if page is None else f", operator page: {page}",
        )
        ready()
        return await _watch(workers, stop)
    finally:
        for worker in workers:
            worker.signal(signal.SIGTERM)
        for worker in workers:
            if worker.process is not None:
                await worker.process.wait()
            await worker.close()
        if admin is not None:
            await admin.cleanup()
        shutil.rmtree(folder, ignore_errors=True)


async def _watch(workers: list[_Worker], stop: asyncio.Event) -> int:
    """Start again each worker that dies, until ``stop``; then the exit code."""
    stopping = asyncio.ensure_future(stop.wait())
    while True:
        exits = {
            asyncio.ensure_future(w.process.wait()): w for w in workers if w.process is not None
        }
        done, _ = await asyncio.wait({stopping, *exits}, return_when=asyncio.FIRST_COMPLETED)
        for waiting in exits:
            waiting.cancel()
        if stopping in done:
            break
        for exited in done:
            worker = exits[exited]
            assert worker.process is not None
            server_log.error(
                "worker %d exited with %s; starting it again",
                worker.index,
                _how(worker.process.returncode),
            )
            worker.restarts += 1
            if time.monotonic() - worker.started < _QUICK_DEATH:
                await asyncio.sleep(1.0)
            if not await worker.start():
                server_log.error("worker %d could not start again; stopping", worker.index)
                return 1
    for worker in workers:
        worker.signal(signal.SIGTERM)
    codes = [await w.process.wait() for w in workers if w.process is not None]
    return 0 if all(code == 0 for code in codes) else 1


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        return signal.Signals(-code).name
    return f"code {code}"


# -- the admin listener ---------------------------------------------------------


def merge_metrics(pages: Iterable[tuple[int, str]], *own: Metric) -> bytes:
    """Each worker's ``/metrics`` page, ``(index, text)``, as one page: every sample
    labelled ``worker="index"``, each family's help and type said once; then the
    supervisor's ``own`` families."""
    families: dict[str, Metric] = {}
    for index, text in pages:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                labels = {**sample.labels, "worker": str(index)}
                merged.samples.append(sample._replace(labels=labels))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([*families.values(), *own]))
    return generate_latest(registry)


class _Fixed:
    """A collector of families already gathered."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


class WorkersData:
    """The admin listener's data under ``workers:`` (an
    :class:`~fenceproxy.ops.data.AdminData`), asked of the workers: the metrics of
    every one, each sample labelled ``worker="i"``; the probes' answers when every
    one answers (worker 0's), else the first failure in their order; the last hour's
    series, every worker's added up; the rest of the one ``?worker=`` names, worker 0
    by default. ``restarts`` tells how many times each worker, in order, was started
    again."""

    def __init__(self, workers: Sequence[WorkerData], restarts: Callable[[], list[int]]) -> None:
        self._workers = list(workers)
        self._restarts = restarts

    def one(self, worker: str | None) -> WorkerData:
        which = worker or "0"
        if not (which.isascii() and which.isdigit()) or int(which) >= len(self._workers):
            raise RequestMalformed(
                f"?worker= takes a worker's number, 0 to {len(self._workers) - 1}"
            )
        return self._workers[int(which)]

    async def metrics(self) -> bytes:
        pages = await _every([w.metrics() for w in self._workers])
        restarts = CounterMetricFamily(
            "fenceproxy_worker_restarts",
            "Times the supervisor started a worker again after it died, by worker",
            labels=["worker"],
        )
        for index, count in enumerate(self._restarts()):
            restarts.add_metric([str(index)], count)
        return merge_metrics(
            ((w.index, page.decode()) for w, page in zip(self._workers, pages, strict=True)),
            restarts,
        )

    async def health(self) -> dict[str, Any]:
        return (await _every([w.health() for w in self._workers]))[0]

    async def ready(self) -> dict[str, Any]:
        return (await _every([w.ready() for w in self._workers]))[0]

    async def series(self) -> Hour:
        return Hour.merged(await _every([w.series() for w in self._workers]))


async def _every(asked: list[Awaitable[_T]]) -> list[_T]:
    """Every answer, all asked at once; the first failure, in the workers' order."""
    found: list[_T] = []
    for answer in await asyncio.gather(*asked, return_exceptions=True):
        if isinstance(answer, BaseException):
            raise answer
        found.append(answer)
    return found


def worker_argv(args: Sequence[str]) -> list[str]:
    """The command that runs ``fenceproxy`` with ``args`` again, as a worker: this
    interpreter, ``-m fenceproxy``."""
    return [sys.executable, "-m", "fenceproxy", *args]
