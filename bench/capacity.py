"""The capacity model of docs/capacity.md, its constants measured here and checked.

One proxy on PostgreSQL (``pg fenced`` of ``bench/run.py``: 1,000 jobs, each write
keeping its generation) is driven by wrk at several connection counts, so its
batches grow and shrink; two proxies on the one database (``pg x2 fenced``) and
pgbench's admission-shaped transactions (``bench/admission.sql``) run in the same
interleaved rounds. Each run measures the proxy's CPU per write, the database's, and
the database's commits per write (transaction ids handed out over the run: every
batch that writes is one).

Both CPUs are fitted, over the one-proxy runs, as a part per write and a part per
commit (least squares; ``k`` is commits per write):

    proxy µs/write    p(k) = p0 + p1 k
    database µs/write d(k) = d0 + d1 k

and the model is checked where it can be here, every process sharing core 0: the
rate of one proxy at the default 32 connections, and that of two proxies at 16
connections each (what one proxy at 16 committed, each of two commits), predicted
as one core over p + d. Then what N proxies of a core each would serve on one
primary of C cores:

    X(N, C) = min(N / p(k), C / d(k))       writes per second

    python bench/capacity.py [--rounds 2] [--seconds 4] [--sweep 8,16,32,64]
                             [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import asyncpg

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import MILLION, Setup, all_2xx, load_options, measure, need_wrk, setups  # noqa: E402

# Every transaction that writes takes an id; reading the next one takes none.
_NEXT_XID = "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint"


async def _next_xid(url: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval(_NEXT_XID))
    finally:
        await conn.close()


def next_xid(url: str) -> int:
    return asyncio.run(_next_xid(url))


@dataclass(frozen=True)
class Run:
    """One measured run's medians: writes per second, CPU per write (the proxies',
    the database's), and commits per write."""

    rps: float
    proxy_us: float
    database_us: float
    commits: float


def counted(setup: Setup, seconds: int, connections: int, warmup: int) -> dict[str, float]:
    """``measure``'s figures for one run, and the database's commits per write: the
    count starts once the warm-up is over, as the CPU's does."""
    if warmup:
        measure(setup, warmup, connections, 0)  # discarded
    first = next_xid(setup.database_url)
    figures = measure(setup, seconds, connections, 0)
    figures["commits_per_write"] = (next_xid(setup.database_url) - first) / figures["requests"]
    return figures


def medians(runs: list[dict[str, float]]) -> Run:
    def mid(key: str) -> float:
        return statistics.median(run[key] for run in runs)

    return Run(mid("rps"), mid("proxy_cpu_us"), mid("database_cpu_us"), mid("commits_per_write"))


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` over ``points``: (a, b)."""
    slope, intercept = statistics.linear_regression(*zip(*points, strict=True))
    return intercept, slope


@dataclass(frozen=True)
class Model:
    p0: float
    p1: float
    d0: float
    d1: float

    def proxy(self, k: float) -> float:
        return self.p0 + self.p1 * k

    def database(self, k: float) -> float:
        return self.d0 + self.d1 * k

    def one_core(self, k: float) -> float:
        """Writes per second of proxies and database on one core."""
        return MILLION / (self.proxy(k) + self.database(k))

    def serves(self, proxies: int, cores: int, k: float) -> float:
        """X(N, C): N proxies of a core each, one primary of C cores."""
        return min(proxies * MILLION / self.proxy(k), cores * MILLION / self.database(k))


def report(sweep: dict[int, Run], two: Run, pgbench: Run | None) -> Model:
    ks = [run.commits for run in sweep.values()]
    p0, p1 = fit([(run.commits, run.proxy_us) for run in sweep.values()])
    d0, d1 = fit([(run.commits, run.database_us) for run in sweep.values()])
    model = Model(p0, p1, d0, d1)
    print("\none proxy on PostgreSQL, the server's core shared by proxy and database:")
    print(f"{'connections':>11} {'req/s':>7} {'commits/write':>13} {'proxy µs':>8} {'DB µs':>6}")
    for connections, run in sweep.items():
        print(
            f"{connections:>11} {run.rps:>7,.0f} {run.commits:>13.3f} "
            f"{run.proxy_us:>8.0f} {run.database_us:>6.0f}"
        )
    print(f"\nfitted over k = {min(ks):.3f} .. {max(ks):.3f} commits per write:")
    print(f"  proxy    p(k) = {p0:.0f} + {p1:.0f} k µs per write")
    print(f"  database d(k) = {d0:.0f} + {d1:.0f} k µs per write")
    if pgbench is not None:
        print(
            f"  pgbench, the database alone: {pgbench.rps:,.0f} admissions/s, "
            f"{pgbench.database_us:.0f} µs of it each (two commits, nothing batched)"
        )

    print("\nthe check: measured, and one core over p(k) + d(k)")
    one = sweep.get(32)
    checks: list[tuple[str, Run, float]] = []
    if one is not None:
        checks.append(("one proxy, 32 connections", one, one.commits))
    at16 = sweep.get(16)
    if at16 is not None:
        # Each of two proxies sees 16 connections: its batches are one proxy's at 16.
        checks.append(("two proxies, 16 connections each", two, at16.commits))
    for text, run, k in checks:
        predicted = model.one_core(k)
        print(
            f"  {text}: {run.rps:,.0f} req/s measured, {predicted:,.0f} predicted "
            f"(k = {k:.3f}; {run.rps / predicted:.2f}x)"
        )
    if one is not None:
        k = one.commits
        print(f"\nX(N, C) = min(N / p(k), C / d(k)), k = {k:.3f} (32 connections a proxy):")
        cores = (2, 4, 8, 16, 32)
        print(f"{'proxies':>7} " + " ".join(f"{f'C={c}':>9}" for c in cores))
        for proxies in (1, 2, 4, 8, 16, 32):
            row = " ".join(f"{model.serves(proxies, c, k):>9,.0f}" for c in cores)
            print(f"{proxies:>7} {row}")
        print(
            f"the primary saturates at N = C x p(k) / d(k) = "
            f"{model.proxy(k) / model.database(k):.2f} C proxies"
        )
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    load_options(parser)
    parser.set_defaults(rounds=2, seconds=4)
    parser.add_argument("--sweep", default="8,16,32,64", help="one proxy's connection counts")
    args = parser.parse_args()
    need_wrk()
    sweep = sorted({int(n) for n in args.sweep.split(",")})
    runs: dict[str, list[dict[str, float]]] = {}
    failed: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="fenceproxy-capacity-") as tmp,
        setups(Path(tmp), True, {"pg fenced", "pg x2 fenced", "pgbench"}) as table,
    ):
        rows = {setup.name: setup for setup in table}
        plan: list[tuple[str, Setup, int, Callable[..., dict[str, float]]]] = [
            *((f"one proxy c{c}", rows["pg fenced"], c, counted) for c in sweep),
            ("two proxies c32", rows["pg x2 fenced"], 32, counted),
            ("pgbench c32", rows["pgbench"], 32, measure),
        ]
        for n in range(args.rounds):
            for name, setup, connections, run in plan:
                figures = run(setup, args.seconds, connections, args.warmup)
                runs.setdefault(name, []).append(figures)
                if figures["failed"]:
                    failed.append(name)
                print(
                    f"round {n + 1} {name:<16} {figures['rps']:>8,.0f} req/s "
                    f"{figures['cpu_us']:>6.0f} µs/write "
                    f"{figures.get('commits_per_write', float('nan')):.3f} commits/write",
                    flush=True,
                )
    pgbench = runs["pgbench c32"]
    for figures in pgbench:
        figures["commits_per_write"] = 2.0  # bench/admission.sql: two transactions
    report(
        {c: medians(runs[f"one proxy c{c}"]) for c in sweep},
        medians(runs["two proxies c32"]),
        medians(pgbench),
    )
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))
    return 0 if all_2xx(sorted(set(failed))) else 1


if __name__ == "__main__":
    sys.exit(main())
