"""Fault injection: real processes on loopback, broken on purpose, then checked.

``fenceproxy chaos`` (or ``python -m fenceproxy.chaos``) starts one proxy or several
(``--proxies``), with their lease API, on a SQLite store or on a PostgreSQL database
that they share (``--store``), a recording upstream with a durable ledger
(:mod:`.ledger`) and N worker processes (:mod:`.worker`), injects the faults
switched on, then checks the invariants (:mod:`.checker`) and prints one table.
It exits 1 on any violation (with ``--expect-violations``, 1 when there is none: for
a deliberately broken build given as ``--proxy-command``). Every random choice is
seeded (the runner's timetable of faults, each worker's and the upstream's choices);
what the processes' timing decides, such as who wins a claim, is not: ``--keep``
keeps what to analyse.

Faults (``--faults``, all by default):

    stall    a worker's event loop blocked past its lease before a write
    sigstop  SIGSTOP of a worker process past its lease, then SIGCONT
    clock    each worker's wall clock off by up to an hour either way (nothing may use it)
    crash    kill -9 of a proxy at random moments, restarted on the same store
    slow     the upstream applies some writes only after the proxy's timeout
    drop     the upstream drops connections, half of them after applying
    error    the upstream answers some writes 503
    dup      keyed writes sent twice, in sequence and at once

Competing claims are always on: more workers than jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import shlex
import signal
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from ..store import migrate_store
from ..store.url import parse_store_url
from ..testing import ProxyProcess, accepting, free_port
from .checker import Report, check

__all__ = ["FAULTS", "ChaosOptions", "main", "run_chaos"]

FAULTS = ("stall", "sigstop", "clock", "crash", "slow", "drop", "error", "dup")
_TTL = 1.0
_PROXY_TIMEOUT = 0.5
_SLOW_SECONDS = 1.0
_QUARANTINE = 2.0  # above the upstream's late application: no newer write overtakes it


@dataclass(frozen=True)
class ChaosOptions:
    duration: float = 30.0
    workers: int = 6
    jobs: int = 3
    seed: int = 1
    faults: frozenset[str] = frozenset(FAULTS)
    proxy_command: tuple[str, ...] = (sys.executable, "-m", "fenceproxy")
    """What runs the proxy; ``serve -c FILE --listen ...`` is appended."""
    store: str | None = None
    """A PostgreSQL URL the proxies share; None for a new SQLite file (one proxy)."""
    proxies: int = 1
    keep: Path | None = None


@dataclass
class _Run:
    opts: ChaosOptions
    dir: Path
    rng: random.Random
    workers: list[asyncio.subprocess.Process] = field(default_factory=list)
    report_counts: dict[str, int] = field(
        default_factory=lambda: {"crashes": 0, "sigstops": 0, "holders paused": 0}
    )
    job_prefix: str = field(default_factory=lambda: f"{random.getrandbits(32):08x}-")
    """Jobs are named apart per run: a shared database may hold an earlier run's."""


async def run_chaos(opts: ChaosOptions, out: TextIO = sys.stdout) -> Report:
    """Run once with ``opts``; returns the checker's report (also printed)."""
    if opts.keep is not None:
        opts.keep.mkdir(parents=True, exist_ok=True)
        if any(opts.keep.iterdir()):
            raise ValueError(f"{opts.keep} is not empty: each run needs its own folder")
        return await _run_in(opts, opts.keep, out)
    with tempfile.TemporaryDirectory(prefix="fenceproxy-chaos-") as tmp:
        return await _run_in(opts, Path(tmp), out)


async def _run_in(opts: ChaosOptions, directory: Path, out: TextIO) -> Report:
    run = _Run(opts, directory, random.Random(opts.seed))
    f = opts.faults
    ledger_port, proxy_port = free_port(), free_port()
    ledger_argv = [
        "--port", str(ledger_port), "--ledger", str(directory / "ledger.jsonl"),
        "--seed", str(opts.seed),
        "--slow", "0.05" if "slow" in f else "0", "--slow-seconds", str(_SLOW_SECONDS),
        "--drop", "0.03" if "drop" in f else "0",
        "--error", "0.03" if "error" in f else "0",
    ]  # fmt: skip
    with (directory / "ledger.log").open("ab") as log:
        ledger = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fenceproxy.chaos.ledger", *ledger_argv, stdout=log, stderr=log
        )
    if opts.proxies > 1 and opts.store is None:
        raise ValueError("several proxies need a shared store: give --store postgresql://...")
    store = opts.store or f"sqlite:///{directory / 'fenceproxy.db'}"
    await migrate_store(store)
    config = directory / "fenceproxy.yaml"
    config.write_text(
        f"store: '{store}'\n"
        f"leases: {{default_ttl: {_TTL}, min_ttl: 0.1}}\n"
        "shutdown_timeout: 5s\n"
        "routes:\n"
        f"  - name: ledger\n    path: /ledger/\n    upstream: http://127.0.0.1:{ledger_port}\n"
        f"    timeout: {_PROXY_TIMEOUT}\n    quarantine: {_QUARANTINE}\n"
    )
    proxies = [
        ProxyProcess(
            config,
            proxy_port if n == 0 else free_port(),
            "--log-level",
            "WARNING",
            log=directory / f"proxy{n}.log",
            command=opts.proxy_command,
        )
        for n in range(opts.proxies)
    ]
    try:
        await _wait_port(ledger_port)
        for proxy in proxies:
            await proxy.start()
        print(
            f"chaos: seed {opts.seed}, {opts.duration:g}s, {opts.workers} workers on "
            f"{opts.jobs} jobs, {opts.proxies} prox{'y' if opts.proxies == 1 else 'ies'} "
            f"on {parse_store_url(store).describe()}, faults: {', '.join(sorted(f)) or 'none'}"
            + (
                f", proxy: {shlex.join(opts.proxy_command)}"
                if opts.proxy_command != ChaosOptions.proxy_command
                else ""
            ),
            file=out,
        )
        for n in range(opts.workers):
            run.workers.append(await _start_worker(run, n, proxies[n % len(proxies)].url))
        await _inject(run, proxies)
        for worker in run.workers:
            with contextlib.suppress(ProcessLookupError):
                worker.send_signal(signal.SIGCONT)
        await asyncio.wait_for(asyncio.gather(*(w.wait() for w in run.workers)), opts.duration + 60)
        leases = await _final_leases(proxies[0].url, directory)
    finally:
        for worker in run.workers:
            with contextlib.suppress(ProcessLookupError):
                worker.kill()
        for proxy in proxies:
            await proxy.stop()
        with contextlib.suppress(ProcessLookupError):
            ledger.kill()
        await ledger.wait()
    report = check(_lines(directory / "ledger.jsonl"), _events(directory), leases)
    report.counts.update(run.report_counts)
    for n, worker in enumerate(run.workers):
        if worker.returncode != 0:
            report.violations.append(
                f"worker w{n} exited with {worker.returncode}: see w{n}.log with --keep"
            )
    print(report.table(), file=out)
    for violation in report.violations[:20]:
        print(f"  VIOLATION: {violation}", file=out)
    if len(report.violations) > 20:
        print(f"  ... and {len(report.violations) - 20} more", file=out)
    return report


async def _start_worker(run: _Run, n: int, url: str) -> asyncio.subprocess.Process:
    f = run.opts.faults
    offset = run.rng.uniform(-3600, 3600) if "clock" in f else 0.0
    argv = [
        "--id", f"w{n}", "--url", url, "--history", str(run.dir / f"w{n}.jsonl"),
        "--jobs", str(run.opts.jobs), "--duration", str(run.opts.duration),
        "--ttl", str(_TTL), "--seed", str(run.opts.seed * 1000 + n),
        "--clock-offset", str(offset),
        "--job-prefix", run.job_prefix,
        "--stall", "0.1" if "stall" in f else "0",
        "--dup", "0.3" if "dup" in f else "0",
    ]  # fmt: skip
    with (run.dir / f"w{n}.log").open("ab") as log:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fenceproxy.chaos.worker", *argv, stdout=log, stderr=log
        )


async def _inject(run: _Run, proxies: list[ProxyProcess]) -> None:
    """Inject process faults until the workers' time is up."""
    f, rng = run.opts.faults, run.rng
    kinds = [k for k in ("sigstop", "crash") if k in f]
    loop = asyncio.get_running_loop()
    end = loop.time() + run.opts.duration
    resumes: list[asyncio.Task[None]] = []
    stopped: set[int] = set()
    half = loop.time() + run.opts.duration / 2
    missing = set(kinds)  # each switched-on kind happens at least once
    while kinds and loop.time() < end - 2:
        await asyncio.sleep(rng.uniform(0.5, 2.5))
        if missing and loop.time() > half:
            kind = sorted(missing)[0]
        else:
            kind = rng.choices(kinds, weights=[2 if k == "sigstop" else 1 for k in kinds])[0]
        missing.discard(kind)
        if kind == "sigstop":
            # Pause a worker that holds a lease, so the pause outlives it; not one that
            # is stalled already, whose lease that stall costs.
            live = [
                (n, w)
                for n, w in enumerate(run.workers)
                if w.returncode is None and n not in stopped
            ]
            holders = [
                (n, w)
                for n, w in live
                if (run.dir / f"w{n}.holding").exists()
                and not (run.dir / f"w{n}.stalling").exists()
            ]
            if holders or live:
                n, worker = rng.choice(holders or live)
                worker.send_signal(signal.SIGSTOP)
                stopped.add(n)
                run.report_counts["sigstops"] += 1
                run.report_counts["holders paused"] += bool(holders)
                pause = _TTL * rng.uniform(1.5, 3)
                resumes.append(asyncio.create_task(_resume(worker, pause, stopped, n)))
        else:
            proxy = rng.choice(proxies)
            proxy.signal(signal.SIGKILL)
            await proxy.wait()
            run.report_counts["crashes"] += 1
            await _restart(proxy, run)
    await asyncio.gather(*resumes)


async def _restart(proxy: ProxyProcess, run: _Run) -> None:
    """Start a killed proxy again, as a supervisor would (systemd's ``Restart=``):
    a proxy refuses to start while its store cannot be reached (a database failing
    over), so it is started again a second later, for up to a minute."""
    for attempt in range(60):
        try:
            await proxy.restart()
            return
        except RuntimeError as exc:
            if "cannot connect to the PostgreSQL store" not in str(exc) or attempt == 59:
                raise
            key = "restarts while the store was unreachable"
            run.report_counts[key] = run.report_counts.get(key, 0) + 1
            await asyncio.sleep(1.0)


async def _resume(
    worker: asyncio.subprocess.Process, after: float, stopped: set[int], n: int
) -> None:
    await asyncio.sleep(after)
    with contextlib.suppress(ProcessLookupError):
        worker.send_signal(signal.SIGCONT)
    stopped.discard(n)


async def _final_leases(url: str, directory: Path) -> dict[str, dict[str, Any] | None]:
    jobs = {e["job"] for e in _events(directory) if "job" in e}
    jobs |= {e["job"] for e in _lines(directory / "ledger.jsonl")}
    out: dict[str, dict[str, Any] | None] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        for job in sorted(jobs):
            async with http.get(f"{url}/_leases/{job}") as r:
                out[job] = await r.json() if r.status == 200 else None
    return out


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _events(directory: Path) -> list[dict[str, Any]]:
    return [e for path in sorted(directory.glob("w*.jsonl")) for e in _lines(path)]


async def _wait_port(port: int) -> None:
    async with asyncio.timeout(20):
        await accepting(port)


async def _until_terminated(run: Any) -> Report:
    """Run, but turn SIGTERM into a cancellation, so every child is killed on the
    way out rather than left running."""
    task = asyncio.ensure_future(run)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    result: Report = await task
    return result


def _for_people(doc: str) -> str:
    """A docstring as help text: without its reST markup (``x``, :mod:`.y`)."""
    doc = re.sub(r":[a-z]+:`\.?([^`]+)`", r"\1", doc)
    return doc.replace("``", "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fenceproxy chaos",
        description=_for_people(__doc__ or ""),
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of work")
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help="comma-separated, from: " + ", ".join(FAULTS) + " (or 'none')",
    )
    parser.add_argument(
        "--proxy-command",
        help="run the proxy with this command instead of fenceproxy's own (serve -c FILE ... "
        "is appended), e.g. a deliberately broken build: python tests/broken_fence.py",
    )
    parser.add_argument(
        "--expect-violations",
        action="store_true",
        help="exit 0 only if the checker reports a violation (for a broken --proxy-command)",
    )
    parser.add_argument(
        "--store",
        help="a PostgreSQL URL for the proxies to share (migrated first); default: a new "
        "SQLite file",
    )
    parser.add_argument("--proxies", type=int, default=1, help="proxies on the one store")
    parser.add_argument("--keep", type=Path, help="keep the histories and ledger in this folder")
    args = parser.parse_args(argv)
    faults = frozenset() if args.faults == "none" else frozenset(args.faults.split(","))
    if unknown := faults - set(FAULTS):
        parser.error(f"unknown faults: {', '.join(sorted(unknown))}")
    opts = ChaosOptions(
        duration=args.duration,
        workers=args.workers,
        jobs=args.jobs,
        seed=args.seed,
        faults=faults,
        proxy_command=(
            tuple(shlex.split(args.proxy_command))
            if args.proxy_command
            else ChaosOptions.proxy_command
        ),
        keep=args.keep,
        store=args.store,
        proxies=args.proxies,
    )
    try:
        report = asyncio.run(_until_terminated(run_chaos(opts)))
    except ValueError as exc:
        parser.error(str(exc))
    if args.expect_violations:
        caught = bool(report.violations)
        print("mutation check: the checker " + ("caught" if caught else "MISSED") + " it")
        return 0 if caught else 1
    return 1 if report.violations else 0
