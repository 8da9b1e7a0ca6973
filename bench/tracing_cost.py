"""What tracing costs when it is off: this tree's fenced path, without ``tracing:``,
against a build without the code path, under the same wrk load, in turn.

    python bench/tracing_cost.py --baseline REV|DIR [--rounds 3] [--seconds 5]
                                 [--connections 32] [--warmup 1] [--json FILE]

The baseline is a git revision of this repository (its package taken with ``git
archive``) or a folder holding a copy of the package (``DIR/fenceproxy``). Both builds
run from the same venv, each with a SQLite store of its own, on the server core as
``bench/run.py`` runs its setups, and take the load in turn, in alternating order
(this, baseline; baseline, this; ...) so that drift on the machine hits both alike.
Each run's CPU per request is the proxy's ``utime + stime`` over the requests served
(:func:`run.measure`); the medians' ratio is judged against the 3 % tracing may cost
when off. Exits 1 when a run answered anything but 2xx, or a build failed to start.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from run import (
    HERE,
    LOAD_CORE,
    SERVER_CORE,
    Load,
    Processes,
    Setup,
    all_2xx,
    free_port,
    load_options,
    measure,
    need_wrk,
    proxy_config,
    said,
)

ROOT = HERE.parent
BOUND = 1.03  # off, tracing may cost at most 3 % more CPU per request


def baseline_tree(baseline: str, directory: Path) -> Path:
    """The folder whose ``fenceproxy`` package is the baseline: ``baseline`` itself
    when it is one, else that revision's package unpacked under ``directory``."""
    if Path(baseline, "fenceproxy").is_dir():
        return Path(baseline).resolve()
    tree = directory / "baseline"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", baseline, "fenceproxy"],
        capture_output=True, check=False,
    )  # fmt: skip
    if archive.returncode != 0:
        raise SystemExit(f"git archive {baseline} failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def build(processes: Processes, directory: Path, name: str, tree: Path, upstream: int) -> Setup:
    """The fenced setup of the package in ``tree``, started and checked to be that one
    (``-P``: not the working directory's, nor the venv's editable install)."""
    env = f"PYTHONPATH={tree}"
    where = subprocess.run(
        ["env", env, sys.executable, "-P", "-c", "import fenceproxy; print(fenceproxy.__file__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not Path(where).is_relative_to(tree):
        raise SystemExit(f"{name}: {tree} does not hold the package that runs ({where})")
    store = f"sqlite:///{directory / name}.db"
    config = proxy_config(directory, name, upstream, store)
    port = free_port()
    argv = [
        "env", env, sys.executable, "-P", "-m", "fenceproxy", "serve", "-c", str(config),
        "--listen", f"127.0.0.1:{port}", "--loop", "auto",
    ]  # fmt: skip
    pid = processes.start(name, argv, port, SERVER_CORE).pid
    return Setup(name, [f"http://127.0.0.1:{port}"], lambda: [pid], lambda: [pid], Load())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a git revision, or a folder")
    load_options(parser)
    args = parser.parse_args()
    need_wrk()

    with tempfile.TemporaryDirectory(prefix="fenceproxy-tracing-cost-") as tmp:
        directory = Path(tmp)
        processes = Processes(directory)
        try:
            port = free_port()
            command = [sys.executable, str(HERE / "upstream.py"), str(port)]
            processes.start("upstream", command, port, LOAD_CORE)
            this = build(processes, directory, "this", ROOT, port)
            baseline = baseline_tree(args.baseline, directory)
            base = build(processes, directory, "baseline", baseline, port)
            for n in range(args.rounds):
                for setup in (this, base) if n % 2 == 0 else (base, this):
                    run = measure(setup, args.seconds, args.connections, args.warmup)
                    setup.runs.append(run)
                    print(said(n, setup, run), flush=True)
        finally:
            processes.stop()
    return report(this, base, args)


def report(this: Setup, base: Setup, args: argparse.Namespace) -> int:
    cpu = {s.name: statistics.median(r["cpu_us"] for r in s.runs) for s in (this, base)}
    rps = {s.name: statistics.median(r["rps"] for r in s.runs) for s in (this, base)}
    ratio = cpu[this.name] / cpu[base.name]
    print(
        f"\nwrk -t1 -c{args.connections}, {args.seconds} s per run, {args.rounds} rounds "
        f"in alternating order, medians; the baseline is {args.baseline}"
    )
    for name in cpu:
        print(f"{name:<10} {cpu[name]:>7.1f} µs/request {rps[name]:>8,.0f} req/s")
    verdict = "PASS" if ratio <= BOUND else "MISS"
    print(f"{verdict}   tracing off, CPU/request vs the baseline <= {BOUND}x: {ratio:.3f}")
    if args.json:
        figures = {s.name: s.runs for s in (this, base)}
        Path(args.json).write_text(json.dumps({**figures, "ratio": ratio}, indent=2))
    return 0 if all_2xx([s.name for s in (this, base) if any(r["failed"] for r in s.runs)]) else 1


if __name__ == "__main__":
    sys.exit(main())
