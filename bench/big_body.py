"""One big fenced body through a real proxy process, and what it costs the proxy in
memory: its peak resident size (VmHWM) against its idle size, both measured in this
run. The body is kept on disk (``limits.body_buffer``) and sent from there.

    python bench/big_body.py [--size 1GiB] [--body-buffer 1MiB]

The upstream reads and discards the body, checking its length and SHA-256; the
client streams it from a generator, so neither holds it in memory. The target is a
peak under 100 MiB above idle for a 1 GiB body.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fenceproxy.testing import DiscardingUpstream, ProxyProcess, free_port
from fenceproxy.units import parse_size

BLOCK = 1024 * 1024


def memory_of(pid: int) -> tuple[int, int]:
    """VmRSS and VmHWM of a process, in KiB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


async def run(size: int, body_buffer: str) -> int:
    block = os.urandom(BLOCK)
    with tempfile.TemporaryDirectory(prefix="fenceproxy-bench-") as work:
        folder = Path(work)
        config = folder / "proxy.yaml"
        async with DiscardingUpstream.serve() as upstream:
            config.write_text(
                yaml.safe_dump(
                    {
                        "store": f"sqlite:///{folder / 'fences.db'}",
                        "limits": {
                            "body_buffer": body_buffer,
                            "body_temp_path": str(folder / "bodies"),
                        },
                        "routes": [
                            {"name": "objects", "path": "/objects/", "upstream": upstream.url,
                             "max_body": "2GiB", "timeout": "300s"}
                        ],
                    }
                )
            )  # fmt: skip
            proxy = ProxyProcess(config, free_port())
            try:
                await proxy.start()
                assert proxy.process is not None
                pid = proxy.process.pid
                idle, _ = memory_of(pid)
                started = time.monotonic()
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
                writer.write(
                    (
                        f"PUT /objects/big HTTP/1.1\r\nHost: bench\r\nFencing-Job: big\r\n"
                        f"Fencing-Token: 1\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n"
                    ).encode()
                )
                digest = hashlib.sha256()
                sent = 0
                while sent < size:
                    part = block[: size - sent]
                    digest.update(part)
                    writer.write(part)
                    sent += len(part)
                    await writer.drain()
                uploaded = time.monotonic()
                answer = await reader.read()
                writer.close()
                done = time.monotonic()
                now, peak = memory_of(pid)
                leftovers = sorted(os.listdir(folder / "bodies"))
            finally:
                await proxy.stop()
            status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "?"
            [got] = upstream.received
    ok = got.length == size and got.sha256 == digest.hexdigest() and status == "200"
    print(f"body:           {size / BLOCK:,.0f} MiB, kept on disk beyond {body_buffer}")
    print(f"answer:         {status}; upstream got {got.length:,} bytes, "
          f"SHA-256 {'equal' if ok else 'DIFFERENT'}")  # fmt: skip
    print(f"upload:         {uploaded - started:.1f} s in, {done - uploaded:.1f} s to forward")
    print(f"proxy idle RSS: {idle / 1024:.1f} MiB")
    above = (peak - idle) / 1024
    print(f"proxy peak RSS: {peak / 1024:.1f} MiB (VmHWM), {above:.1f} MiB above idle")
    print(f"proxy RSS now:  {now / 1024:.1f} MiB")
    print(f"files left:     {leftovers or 'none'}")
    return 0 if ok and not leftovers and peak - idle < 100 * 1024 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="the body's size (default 1GiB)")
    parser.add_argument("--body-buffer", default="1MiB", help="limits.body_buffer")
    args = parser.parse_args()
    return asyncio.run(run(parse_size(args.size), args.body_buffer))


if __name__ == "__main__":
    sys.exit(main())
