"""Fenced-write throughput through the proxy, as a ratio of the direct upstream's.

Starts a minimal upstream and the proxy as separate processes on loopback, then
drives the same POST load (fixed count, fixed concurrency) at the upstream
directly and through the proxy, in the same run, interleaved, so machine noise
hits both. Prints requests per second and the ratios.

    .venv/bin/python bench/throughput.py [--requests 3000] [--concurrency 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp

from fenceproxy.testing import ProxyProcess, free_port

UPSTREAM = """
from aiohttp import web
async def ok(request):
    await request.read()
    return web.Response(text="ok")
app = web.Application()
app.router.add_route("*", "/{tail:.*}", ok)
web.run_app(app, host="127.0.0.1", port=int(__import__("sys").argv[1]), print=None,
            access_log=None)
"""


Headers = Callable[[int], dict[str, str]]


async def load(url: str, method: str, headers_for: Headers, requests: int, conc: int) -> float:
    """Send ``requests`` requests with ``conc`` workers; returns requests per second."""
    counter = iter(range(requests))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc)) as http:

        async def worker() -> None:
            for n in counter:
                body = b'{"amount": 1}' if method == "POST" else None
                async with http.request(method, url, data=body, headers=headers_for(n)) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"unexpected {r.status}: {await r.text()}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        return requests / (time.perf_counter() - start)


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--synchronous", default="full", choices=["full", "normal"])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        up_port = free_port()
        upstream = await asyncio.create_subprocess_exec(
            sys.executable, "-c", UPSTREAM, str(up_port)
        )
        config = Path(tmp) / "bench.yaml"
        config.write_text(
            f"store: sqlite:///{tmp}/fences.db?synchronous={args.synchronous}\n"
            "routes:\n"
            f"  - {{name: bench, path: /, upstream: 'http://127.0.0.1:{up_port}'}}\n"
        )
        proxy = await ProxyProcess(config, free_port(), "--log-level", "WARNING").start()
        try:
            direct_url = f"http://127.0.0.1:{up_port}/charges"
            proxy_url = f"{proxy.url}/charges"
            await _wait_up(direct_url)

            def fenced(job: Callable[[int], str], keyed: bool = False) -> Headers:
                def headers(n: int) -> dict[str, str]:
                    h = {"Fencing-Job": job(n), "Fencing-Token": "1"}
                    if keyed:
                        h["Idempotency-Key"] = f"k-{time.monotonic_ns()}-{n}"
                    return h

                return headers

            cases: dict[str, tuple[str, str, Headers]] = {
                "direct upstream, POST": (direct_url, "POST", lambda n: {}),
                "proxy, GET (unfenced)": (proxy_url, "GET", lambda n: {}),
                "proxy, fenced POST, 500 jobs": (
                    proxy_url, "POST", fenced(lambda n: f"job-{n % 500}")
                ),
                "proxy, fenced POST + key": (
                    proxy_url, "POST", fenced(lambda n: f"job-{n % 500}", keyed=True)
                ),
                "proxy, fenced POST, one job": (proxy_url, "POST", fenced(lambda n: "hot")),
            }  # fmt: skip
            results: dict[str, list[float]] = {name: [] for name in cases}
            for _ in range(args.rounds):
                for name, (url, method, headers_for) in cases.items():
                    results[name].append(
                        await load(url, method, headers_for, args.requests, args.concurrency)
                    )
        finally:
            await proxy.stop()
            upstream.kill()
            await upstream.wait()

    base = statistics.median(results["direct upstream, POST"])
    print(
        f"{args.requests} requests x {args.rounds} rounds, concurrency {args.concurrency}, "
        f"synchronous={args.synchronous}; medians:"
    )
    for name, values in results.items():
        med = statistics.median(values)
        print(f"  {name:<34} {med:8.0f} req/s   {med / base:5.2f} x direct")
    return 0


async def _wait_up(url: str) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(200):
            try:
                async with http.get(url):
                    return
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
