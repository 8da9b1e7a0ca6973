"""How soon a waiting claim gets its job once the holder releases it.

A holder claims a job; a second worker's claim, sent with ``wait``, is held by the
proxy; the holder releases. Measured: from the moment the release is sent to the
moment the waiting claim's grant arrives, on the worker's side, so the release's own
round trip and commit are in it. On SQLite one proxy serves both (the release wakes
the claim in its own process); on PostgreSQL the holder releases through one proxy
and the claim waits on another (LISTEN/NOTIFY carries the release). Latency, not
throughput: one claim at a time, so the client's speed is not what is measured.

    python bench/wake.py [--rounds 200] [--no-postgres]

Prints the median, p90, p99 and worst, in milliseconds, for each store.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository's tests/ helpers

from fenceproxy.testing import ProxyProcess, free_port  # noqa: E402
from tests.postgres import PostgresServer, postgres_bin, sql  # noqa: E402

WAITING = "fenceproxy_lease_claims_waiting 1.0"


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url, json=body) as response:
        answer: dict[str, Any] = await response.json(content_type=None)
        if response.status != 200:
            raise SystemExit(f"{url}: {response.status} {answer}")
        return answer


async def held(http: aiohttp.ClientSession, proxy: ProxyProcess) -> None:
    """Until ``proxy`` holds a claim waiting (its gauge says so)."""
    while True:
        async with http.get(proxy.admin_url + "/metrics") as response:
            if WAITING in await response.text():
                return
        await asyncio.sleep(0.001)


async def rounds(holder: ProxyProcess, waiter: ProxyProcess, count: int) -> list[float]:
    """Milliseconds from each release sent to the waiting claim's grant received."""
    found = []
    async with aiohttp.ClientSession() as http:
        for n in range(count):
            job = f"wake-{n}"
            lease = await post(http, f"{holder.url}/_leases/{job}/claim", {"owner": "a"})
            claim = asyncio.create_task(
                post(http, f"{waiter.url}/_leases/{job}/claim", {"owner": "b", "wait": 10})
            )
            await held(http, waiter)
            sent = time.perf_counter()
            release = {"owner": "a", "generation": lease["generation"]}
            await post(http, f"{holder.url}/_leases/{job}/release", release)
            granted = await claim
            found.append((time.perf_counter() - sent) * 1000)
            if granted.get("generation") != lease["generation"] + 1:
                raise SystemExit(f"the waiting claim got {granted}, not the next generation")
    return found


def start(folder: Path, store: str, count: int) -> list[ProxyProcess]:
    config = folder / f"wake-{count}.yaml"
    config.write_text(f"store: '{store}'\nleases: {{}}\nroutes: []\n")
    return [ProxyProcess(config, free_port(), "--log-level", "WARNING") for _ in range(count)]


async def measure(folder: Path, store: str, count: int, rounds_: int) -> list[float]:
    proxies = start(folder, store, count)
    try:
        for proxy in proxies:
            await proxy.start()
        return await rounds(proxies[0], proxies[-1], rounds_)
    finally:
        for proxy in proxies:
            await proxy.stop()


def line(name: str, ms: list[float]) -> str:
    ms = sorted(ms)
    q = statistics.quantiles(ms, n=100)
    return (
        f"| {name} | {len(ms)} | {statistics.median(ms):.1f} | {q[89]:.1f} | {q[98]:.1f} "
        f"| {ms[-1]:.1f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()
    table = [
        "| store | releases | median ms | p90 | p99 | worst |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    with tempfile.TemporaryDirectory(prefix="fenceproxy-wake-") as tmp:
        folder = Path(tmp)
        sqlite = f"sqlite:///{folder / 'wake.db'}"
        table.append(
            line("SQLite, one proxy", asyncio.run(measure(folder, sqlite, 1, args.rounds)))
        )
        if not args.no_postgres:
            bin_dir = postgres_bin()
            if bin_dir is None:
                raise SystemExit("PostgreSQL is not installed (or --no-postgres)")
            os.chmod(folder, 0o755)  # the postgres user's cluster is below it
            (folder / "postgres").mkdir()
            server = PostgresServer(folder / "postgres", bin_dir, durable=True)
            server.init().start()
            try:
                asyncio.run(sql(server.url(), "CREATE DATABASE wake"))
                url = server.url("wake")
                asyncio.run(migrate(url))
                ms = asyncio.run(measure(folder, url, 2, args.rounds))
                table.append(line("PostgreSQL, released on another proxy", ms))
            finally:
                server.stop("immediate")
    print("\n".join(table))
    return 0


async def migrate(url: str) -> None:
    from fenceproxy.store import migrate_store

    await migrate_store(url)


if __name__ == "__main__":
    sys.exit(main())
