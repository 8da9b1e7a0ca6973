"""Whether compiling the per-request path pays: this tree's package as it is (pure
Python) against copies of it whose hot modules are compiled with mypyc and with
Cython (pure-Python mode: the same ``.py`` files), each serving the fenced write of
``bench/run.py`` under the same wrk load, in turn, in rotating order.

    python bench/compiled.py [--with mypyc,cython] [--rounds 3] [--seconds 5]
                             [--connections 32] [--warmup 1] [--json FILE]

Each build runs from the same venv with a SQLite store of its own, on the server
core, as ``bench/tracing_cost.py`` runs its two; the order of the builds rotates each
round so that drift on the machine hits them alike. The figure is each build's CPU
per request (``utime + stime`` over the requests served) and its req/s, medians,
against the pure build's. A compiler that is not installed is left out and said so
(mypyc comes with mypy, in the dev venv; Cython with ``pip install cython``). Exits
1 when a build failed to compile or start, or a run answered anything but 2xx.

What is compiled is :data:`HOT_PATH`, every module a fenced write runs through but
the two that mypyc cannot compile (async generators: the body reader and the
upstream client's answer stream). mypyc also leaves out the modules whose classes
interpreted code subclasses (:data:`MYPYC_LEAVES_OUT`), which it forbids.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from run import (
    HERE,
    LOAD_CORE,
    Processes,
    Setup,
    all_2xx,
    free_port,
    load_options,
    measure,
    need_wrk,
    said,
)
from tracing_cost import build

ROOT = HERE.parent
HOT_PATH = [
    "fenceproxy/fence/write.py",
    "fenceproxy/fence/fencing.py",
    "fenceproxy/fence/tokens.py",
    "fenceproxy/store/batch.py",
    "fenceproxy/server/turn.py",
    "fenceproxy/server/proxy.py",
    "fenceproxy/server/relay.py",
    "fenceproxy/http/answer.py",
    "fenceproxy/http/body.py",
    "fenceproxy/http/connection_states.py",
    "fenceproxy/http/request.py",
    "fenceproxy/http/server.py",
    "fenceproxy/http/upstream.py",
    "fenceproxy/http/target.py",
    "fenceproxy/http/routes.py",
    "fenceproxy/http/httptools_parser.py",
]
MYPYC_LEAVES_OUT = {
    "fenceproxy/http/body.py": "Flow, which the upstream client's connection subclasses",
    "fenceproxy/http/upstream.py": "UpstreamPool, which tracing's pool subclasses",
}


def mypyc(tree: Path) -> list[str]:
    modules = [m for m in HOT_PATH if m not in MYPYC_LEAVES_OUT]
    return [sys.executable, "-m", "mypyc", *modules]


def cython(tree: Path) -> list[str]:
    jobs = str(len(os.sched_getaffinity(0)))
    return [sys.executable, "-m", "Cython.Build.Cythonize", "-i", "-3", "-j", jobs, *HOT_PATH]


COMPILERS: dict[str, tuple[str, Callable[[Path], list[str]]]] = {
    "mypyc": ("mypyc", mypyc),
    "cython": ("Cython", cython),
}


def compiled_copy(directory: Path, name: str) -> Path | None:
    """A copy of the package with :data:`HOT_PATH` compiled by ``name``, or None when
    that compiler is not installed. SystemExit when it fails to compile, or when the
    copy does not load the compiled modules."""
    module, command = COMPILERS[name]
    if subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode:
        print(f"{name}: not installed, left out", file=sys.stderr)
        return None
    tree = directory / name
    tree.mkdir()
    leave = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(ROOT / "fenceproxy", tree / "fenceproxy", ignore=leave)
    print(f"{name}: compiling the hot path ...", file=sys.stderr, flush=True)
    done = subprocess.run(command(tree), cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    loaded = subprocess.run(
        [sys.executable, "-P", "-c", "import fenceproxy.fence.write as m; print(m.__file__)"],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": str(tree)},
    ).stdout.strip()  # fmt: skip
    if not loaded.endswith(".so"):
        raise SystemExit(f"{name}: the copy loads {loaded}, not a compiled module")
    return tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--with", dest="compilers", default="mypyc,cython")
    load_options(parser)
    args = parser.parse_args()
    need_wrk()
    wanted = [n.strip() for n in args.compilers.split(",") if n.strip()]
    if unknown := set(wanted) - set(COMPILERS):
        raise SystemExit(f"--with: no such compiler {sorted(unknown)} (mypyc, cython)")

    with tempfile.TemporaryDirectory(prefix="fenceproxy-compiled-") as tmp:
        directory = Path(tmp)
        trees = {"pure": ROOT}
        for name in wanted:
            if (tree := compiled_copy(directory, name)) is not None:
                trees[name] = tree
        processes = Processes(directory)
        try:
            port = free_port()
            command = [sys.executable, str(HERE / "upstream.py"), str(port)]
            processes.start("upstream", command, port, LOAD_CORE)
            builds = [build(processes, directory, n, t, port) for n, t in trees.items()]
            for n in range(args.rounds):
                for setup in builds[n % len(builds) :] + builds[: n % len(builds)]:
                    run = measure(setup, args.seconds, args.connections, args.warmup)
                    setup.runs.append(run)
                    print(said(n, setup, run), flush=True)
        finally:
            processes.stop()
    return report(builds, args)


def report(builds: list[Setup], args: argparse.Namespace) -> int:
    cpu = {s.name: statistics.median(r["cpu_us"] for r in s.runs) for s in builds}
    rps = {s.name: statistics.median(r["rps"] for r in s.runs) for s in builds}
    print(
        f"\nwrk -t1 -c{args.connections}, {args.seconds} s per run, {args.rounds} rounds "
        "in rotating order, medians; the fenced write of bench/run.py on SQLite"
    )
    print(f"{'build':<8} {'CPU µs/req':>10} {'vs pure':>8} {'req/s':>8} {'vs pure':>8}")
    for name in cpu:
        print(
            f"{name:<8} {cpu[name]:>10.1f} {cpu[name] / cpu['pure']:>8.3f} "
            f"{rps[name]:>8,.0f} {rps[name] / rps['pure']:>8.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({s.name: s.runs for s in builds}, indent=2))
    return 0 if all_2xx([s.name for s in builds if any(r["failed"] for r in s.runs)]) else 1


if __name__ == "__main__":
    sys.exit(main())
