"""Fenced-write throughput on each store, driven by wrk, in one run.

Starts a minimal aiohttp upstream and, for each store named, the proxy on it; then
wrk (Debian's package) sends fenced POSTs over 1,000 jobs, every write keeping its
job's generation (one holder writing), through each proxy in interleaved rounds, so
machine noise hits every store alike. Prints requests per second per round, the
medians, and each store's ratio to the first one named.

    .venv/bin/python bench/stores.py sqlite:////tmp/b.db postgresql://u@127.0.0.1:5432/db \\
        [--rounds 3] [--seconds 5] [--connections 32]

A PostgreSQL database is migrated first. On a 2-core machine the proxy and the
database share the cores with wrk and the upstream: read ratios, not req/s.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from fenceproxy.config import parse_store_url
from fenceproxy.store import migrate_store
from fenceproxy.testing import ProxyProcess, free_port

UPSTREAM = """
import sys
from aiohttp import web
async def ok(request):
    await request.read()
    return web.Response(text="ok")
app = web.Application()
app.router.add_route("*", "/{tail:.*}", ok)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""

# Rotates over 1,000 jobs; the generation stays put, as one holder's writes do.
WRK_SCRIPT = """
local n = 0
request = function()
  n = n + 1
  local headers = {}
  headers["Fencing-Job"] = "job-" .. (n % 1000)
  headers["Fencing-Token"] = "1"
  headers["Content-Type"] = "application/json"
  return wrk.format("POST", "/billing/charges", headers, '{"amount": 1}')
end
"""


async def wait_port(port: int) -> None:
    async with asyncio.timeout(20):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            return


def wrk(url: str, script: Path, seconds: int, connections: int) -> float:
    """Requests per second; raises if any answer was not 2xx."""
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", str(script), url],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    return float(next(line for line in out.splitlines() if "Requests/sec" in line).split()[1])


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("stores", nargs="+", help="store URLs, the first the baseline")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", type=int, default=32)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    upstream_port = free_port()
    upstream = await asyncio.create_subprocess_exec(
        sys.executable, "-c", UPSTREAM, str(upstream_port)
    )
    proxies: list[ProxyProcess] = []
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "fenced.lua"
        script.write_text(WRK_SCRIPT)
        try:
            await wait_port(upstream_port)
            for n, store in enumerate(args.stores):
                await migrate_store(store)
                config = Path(tmp) / f"proxy{n}.yaml"
                config.write_text(
                    f"store: '{store}'\nroutes:\n  - {{name: billing, path: /billing, "
                    f"upstream: 'http://127.0.0.1:{upstream_port}'}}\n"
                )
                proxy = ProxyProcess(config, free_port(), "--log-level", "WARNING")
                proxies.append(await proxy.start())
            for proxy in proxies:  # warm-up, discarded
                await asyncio.to_thread(wrk, proxy.url, script, 1, args.connections)
            rates: list[list[float]] = [[] for _ in proxies]
            for round_ in range(args.rounds):
                for n, proxy in enumerate(proxies):
                    rate = await asyncio.to_thread(
                        wrk, proxy.url, script, args.seconds, args.connections
                    )
                    rates[n].append(rate)
                    print(f"round {round_ + 1}: {args.stores[n]}: {rate:,.0f} req/s", flush=True)
        finally:
            for proxy in proxies:
                await proxy.stop()
            upstream.kill()
            await upstream.wait()
    base = statistics.median(rates[0])
    print(f"\nfenced POSTs, 1,000 jobs, wrk -t1 -c{args.connections}, medians of {args.rounds}:")
    for store, values in zip(args.stores, rates, strict=True):
        median = statistics.median(values)
        where = parse_store_url(store).describe()
        print(f"  {where:55} {median:8,.0f} req/s   {median / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
