"""System calls per request: nginx, fenceproxy's pass-through and its fenced writes.

Starts on loopback what ``bench/run.py`` starts for these three setups (the bench
upstream, nginx with one worker, one fenceproxy on a SQLite store, each pinned as
there) and drives each with the same wrk load (``bench/load.lua``, ``-t1``), after a
warm-up, while ``strace -c -f`` is attached to the server process (every thread of
it: the SQLite store's too). Each setup's system calls, counted by strace over the
run, are divided by the requests wrk saw answered:

    python bench/syscalls.py [--seconds 5] [--connections 32] [--warmup 1]
                             [--only NAME,...] [--json FILE]

Prints, per setup, the calls per request by system call and in all, and the total's
ratio to nginx's. strace slows what it traces: the counts per request hold, the
rates do not. Needs strace and the right to trace the servers (root, or
``kernel.yama.ptrace_scope`` 0). Exits 1 when a setup answered anything but 2xx.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from run import (
    HERE,
    LOAD_CORE,
    NGINX,
    SERVER_CORE,
    Load,
    Processes,
    all_2xx,
    free_port,
    nginx_config,
    proxy_config,
    wrk,
)

SETUPS = ("nginx", "pass-through", "fenced")
SHOWN = 0.01  # calls per request below this are left out of the table (not the total)


@dataclass
class Traced:
    """One setup: the process strace attaches to, and the load wrk sends it."""

    name: str
    pid: int
    url: str
    load: Load
    calls: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    failed: int = 0

    def per_request(self) -> dict[str, float]:
        """Calls per request by system call, the most first."""
        counts = sorted(self.calls.items(), key=lambda item: -item[1])
        return {name: calls / self.requests for name, calls in counts}

    @property
    def total(self) -> float:
        return sum(self.calls.values()) / self.requests


def summary(text: str) -> dict[str, int]:
    """The calls by system call in ``strace -c``'s table (its ``total`` row left out)."""
    calls = {}
    for line in text.splitlines():
        fields = line.split()
        # % time, seconds, usecs/call, calls, [errors,] syscall
        if len(fields) < 5 or not fields[3].isdigit() or fields[-1] == "total":
            continue
        calls[fields[-1]] = int(fields[3])
    return calls


@contextlib.contextmanager
def tracing(pid: int, output: Path) -> Iterator[None]:
    """``strace -c -f`` attached to ``pid`` and every thread of it, from when it has
    attached to all of them until the block ends; its table is then in ``output``."""
    strace = subprocess.Popen(
        ["strace", "-c", "-f", "-p", str(pid), "-o", str(output)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert strace.stderr is not None
        # "Process N attached [with M threads]", once every thread is: or why not.
        said = strace.stderr.readline()
        if "attached" not in said:
            raise SystemExit(f"strace could not attach to {pid}: {said}{strace.stderr.read()}")
        yield
    finally:
        strace.send_signal(signal.SIGINT)  # detaches, and writes its table
        try:
            strace.wait(30)
        except subprocess.TimeoutExpired:
            strace.kill()
            strace.wait()


@contextlib.contextmanager
def servers(directory: Path, only: set[str]) -> Iterator[list[Traced]]:
    """The upstream, nginx and one fenceproxy, started and pinned as ``bench/run.py``
    does; the setups wanted in ``only``, each with its server's process."""
    processes = Processes(directory)
    try:
        upstream = free_port()
        command = [sys.executable, str(HERE / "upstream.py"), str(upstream)]
        processes.start("upstream", command, upstream, LOAD_CORE)
        setups = []
        if "nginx" in only:
            if NGINX is None:
                raise SystemExit("nginx is not installed (make bench installs it)")
            port = free_port()
            config = nginx_config(directory, port, upstream)
            nginx = processes.start("nginx", [NGINX, "-c", str(config)], port, SERVER_CORE)
            setups.append(Traced("nginx", nginx.pid, f"http://127.0.0.1:{port}", Load()))
        if only & {"pass-through", "fenced"}:
            store = f"sqlite:///{directory / 'fences.db'}"
            config = proxy_config(directory, "fenceproxy", upstream, store)
            port = free_port()
            argv = [
                sys.executable, "-m", "fenceproxy", "serve", "-c", str(config),
                "--listen", f"127.0.0.1:{port}", "--loop", "auto",
            ]  # fmt: skip
            proxy = processes.start("fenceproxy", argv, port, SERVER_CORE)
            url = f"http://127.0.0.1:{port}"
            if "pass-through" in only:
                setups.append(Traced("pass-through", proxy.pid, url, Load(path="/open/x")))
            if "fenced" in only:
                setups.append(Traced("fenced", proxy.pid, url, Load()))
        yield setups
    finally:
        processes.stop()


def count(setup: Traced, directory: Path, args: argparse.Namespace) -> None:
    """Drive ``setup`` under strace: its calls and the requests answered."""
    if args.warmup:
        wrk([setup.url], setup.load, args.warmup, args.connections)  # discarded
    output = directory / f"{setup.name}.strace"
    with tracing(setup.pid, output):
        (result,) = wrk([setup.url], setup.load, args.seconds, args.connections)
    setup.calls = summary(output.read_text())
    setup.requests = result["requests"]
    setup.failed = result["non2xx"] + result["socket_errors"]
    if not setup.requests:
        raise SystemExit(f"{setup.name}: no request was answered")


def report(setups: list[Traced], args: argparse.Namespace) -> None:
    rows = {s.name: s for s in setups}
    nginx = rows.get("nginx")
    print(
        f"\nsystem calls per request, strace -c -f on the server; wrk -t1 "
        f"-c{args.connections}, {args.seconds} s after {args.warmup} s of warm-up"
    )
    for s in setups:
        ratio = f", {s.total / nginx.total:.2f}x nginx's" if nginx else ""
        print(f"\n{s.name}: {s.total:.2f} per request ({s.requests:,} requests{ratio})")
        for name, calls in s.per_request().items():
            if calls >= SHOWN:
                print(f"  {name:<16} {calls:>7.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument(
        "--warmup", type=int, default=1, help="seconds of load, untraced, before each run"
    )
    parser.add_argument("--only", help=f"comma-separated setup names ({', '.join(SETUPS)})")
    parser.add_argument("--json", metavar="FILE", help="also write every setup's figures here")
    args = parser.parse_args()
    for tool, why in (("wrk", "the load"), ("strace", "the count")):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed ({why}; make servers installs it)")
    only = set(SETUPS) if args.only is None else {n.strip() for n in args.only.split(",")}
    if unknown := only - set(SETUPS):
        raise SystemExit(f"--only: no setup {', '.join(sorted(unknown))} (of {', '.join(SETUPS)})")

    with (
        tempfile.TemporaryDirectory(prefix="fenceproxy-syscalls-") as tmp,
        servers(Path(tmp), only) as setups,
    ):
        for setup in setups:
            count(setup, Path(tmp), args)
    report(setups, args)
    if args.json:
        nginx = next((s for s in setups if s.name == "nginx"), None)
        figures = {
            s.name: {
                "requests": s.requests,
                "failed": s.failed,
                "calls": s.calls,
                "per_request": s.per_request(),
                "total_per_request": s.total,
                "vs_nginx": s.total / nginx.total if nginx else None,
            }
            for s in setups
        }
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if all_2xx([s.name for s in setups if s.failed]) else 1


if __name__ == "__main__":
    sys.exit(main())
