"""What a real client's upload costs through the proxy: boto3's PutObject, timed
straight to moto's S3 server and through a fenced route to it, and curl's PUT,
straight to the benchmark's aiohttp upstream and through a fenced route to it, in
alternating rounds of one run.

    python bench/uploads.py [--rounds 30] [--size 4KiB]

botocore sends every PutObject with ``Expect: 100-continue`` and waits up to 1 s for
the ``100 Continue``; curl does the same for bodies over 1 KiB. A proxy that never
answers it costs each upload that second. The table gives the median and the 90th
percentile of each path in milliseconds, and the proxy's median over the direct one.
Latency, not throughput: one request at a time, so the client is never the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import boto3
import httpx
from botocore.config import Config

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "examples"))

from fenced_boto3 import fence_writes  # noqa: E402

from fenceproxy.testing import ProxyProcess, free_port  # noqa: E402
from fenceproxy.units import parse_size  # noqa: E402

BUCKET = "bench"
CREDENTIALS = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}


@contextmanager
def started(name: str, command: list[str], url: str, probe: str) -> Iterator[str]:
    """``command`` running until the block ends, once ``probe`` answers."""
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.get(probe, timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(f"{name} did not start") from None
                time.sleep(0.05)
        yield url
    finally:
        server.kill()
        server.wait()


def upstream_server() -> contextlib.AbstractContextManager[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return started("the upstream", [sys.executable, str(HERE / "upstream.py"), str(port)], url, url)


def moto_server() -> contextlib.AbstractContextManager[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    return started("moto's server", command, url, f"{url}/moto-api/")


def s3(url: str) -> object:
    config = Config(s3={"addressing_style": "path"}, retries={"mode": "standard"})
    return boto3.client(
        "s3", endpoint_url=url, region_name="us-east-1", config=config, **CREDENTIALS
    )


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return (time.perf_counter() - started) * 1000


def curl_put(url: str, path: Path, headers: dict[str, str]) -> float:
    args = ["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code} %{time_total}", "-T", str(path)]
    for name, value in headers.items():
        args += ["-H", f"{name}: {value}"]
    out = subprocess.run([*args, url], capture_output=True, text=True, check=True).stdout
    status, seconds = out.split()
    if not status.startswith("2"):
        raise SystemExit(f"curl PUT {url} answered {status}")
    return float(seconds) * 1000


def row(name: str, direct: list[float], proxied: list[float]) -> str:
    def p90(values: list[float]) -> float:
        return statistics.quantiles(values, n=10)[-1]

    d, p = statistics.median(direct), statistics.median(proxied)
    return f"| {name} | {d:.1f} | {p90(direct):.1f} | {p:.1f} | {p90(proxied):.1f} | {p / d:.2f} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--size", default="4KiB")
    return asyncio.run(run(parser.parse_args()))


async def run(args: argparse.Namespace) -> int:
    """The proxy is a process of its own; the clients run here, one at a time."""
    size = parse_size(args.size)
    with tempfile.TemporaryDirectory() as folder, moto_server() as moto, upstream_server() as up:
        config = Path(folder) / "fenceproxy.yaml"
        config.write_text(
            f"store: sqlite:///{folder}/fences.db\n"
            "routes:\n"
            f"  - {{name: s3, path: /{BUCKET}, upstream: '{moto}', host: preserve,"
            " paths: exact, max_body: 64MiB}\n"
            f"  - {{name: up, path: /up/, upstream: '{up}', max_body: 64MiB}}\n"
        )
        proxy = ProxyProcess(config, free_port())
        await proxy.start()
        try:
            direct = s3(moto)
            direct.create_bucket(Bucket=BUCKET)  # type: ignore[attr-defined]
            fenced = fence_writes(
                s3(proxy.url), lambda: {"Fencing-Job": "bench", "Fencing-Token": "1"}
            )
            body = os.urandom(size)
            small, large = Path(folder) / "2KiB", Path(folder) / "1MiB"
            small.write_bytes(os.urandom(2048))
            large.write_bytes(os.urandom(1024 * 1024))
            fence = {"Fencing-Job": "bench", "Fencing-Token": "1"}
            times: dict[str, tuple[list[float], list[float]]] = {
                name: ([], []) for name in ("boto3", "curl-2KiB", "curl-1MiB")
            }
            for n in range(args.rounds + 1):  # the first round warms up, discarded
                sample = {
                    "boto3": (
                        timed(lambda: direct.put_object(Bucket=BUCKET, Key="d", Body=body)),  # type: ignore[attr-defined]
                        timed(lambda: fenced.put_object(Bucket=BUCKET, Key="p", Body=body)),
                    ),
                    "curl-2KiB": (
                        curl_put(f"{up}/up/c2", small, {}),
                        curl_put(f"{proxy.url}/up/c2", small, fence),
                    ),
                    "curl-1MiB": (
                        curl_put(f"{up}/up/c1", large, {}),
                        curl_put(f"{proxy.url}/up/c1", large, fence),
                    ),
                }
                if n:
                    for name, (d, p) in sample.items():
                        times[name][0].append(d)
                        times[name][1].append(p)
        finally:
            await proxy.stop()
    print(f"uploads, {args.rounds} rounds, PutObject of {args.size}; milliseconds")
    print("| client | direct p50 | direct p90 | proxy p50 | proxy p90 | proxy / direct |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (d, p) in times.items():
        print(row(name, d, p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
