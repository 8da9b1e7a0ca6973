"""A write cut at its deadline is cut on the wire: no more of it reaches the upstream,
and the deadline covers the whole exchange the job's turn waits for.

The upstream reads bodies at about 100 KB/s (an overloaded API, or one that streams
uploads onward), so a body of a few MiB is still on the proxy's side of the wire
when the route's timeout ends. A graceful close would flush the rest and the
upstream would apply the write later, after a newer generation's. The proxy
aborts instead (its buffer dropped, the kernel's discarded, the connection reset)
and gives the job's turn back only once the socket is gone: the upstream sees the
body end short and applies nothing of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import signal
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fenceproxy.store import open_store
from fenceproxy.testing import (
    FakeClock,
    ProxyProcess,
    Received,
    RecordingUpstream,
    SlowUpstream,
    eventually,
    free_port,
    status,
)

from .conftest import ProxyFactory, fenced

pytestmark = pytest.mark.both_stores

MiB = 1024 * 1024
RATE = 100_000  # bytes a second
QUARANTINE = 2.0
# How long an admitted write's record holds the job, on the store's clock: the
# route's connect_timeout, timeout and quarantine, and the proxy's turn slack.
HOLD = 1.0 + 1.0 + QUARANTINE + 1.0


@pytest.fixture
async def slow() -> AsyncIterator[SlowUpstream]:
    async with SlowUpstream.serve(RATE) as upstream:
        yield upstream


def slow_route(upstream: SlowUpstream, timeout: str = "1s") -> list[dict[str, Any]]:
    return [
        {"name": "uploads", "path": "/uploads/", "upstream": upstream.url, "timeout": timeout,
         "connect_timeout": "1s", "quarantine": f"{QUARANTINE}s", "max_body": "16MiB"},
    ]  # fmt: skip


def headers(job: str, generation: int) -> dict[str, str]:
    return {"Fencing-Job": job, "Fencing-Token": str(generation)}


async def settled(upstream: SlowUpstream, count: int) -> None:
    """Until ``count`` requests have ended at the upstream, applied or cut. A write
    that was cut ends at once; one whose body was flushed on would end only once the
    upstream had read it all, tens of seconds later."""
    await eventually(lambda: len(upstream.ended()) >= count, within=5.0)


@pytest.mark.parametrize("size", [3 * MiB, 9 * MiB], ids=["3MiB", "9MiB"])
async def test_a_write_cut_at_its_timeout_never_lands_after_a_newer_one(
    start_proxy: ProxyFactory, slow: SlowUpstream, clock: FakeClock, size: int
) -> None:
    proxy = await start_proxy(slow_route(slow))
    old = await proxy.post("/uploads/a", data=io.BytesIO(b"o" * size), headers=headers("job-1", 5))
    assert old.status == 504
    # The newer write waits out the old one's quarantine, then goes.
    refused = await proxy.post("/uploads/a", data=b"n", headers=headers("job-1", 6))
    assert refused.status == 503
    clock.advance(HOLD + 0.1)
    new = await proxy.post("/uploads/a", data=b"n", headers=headers("job-1", 6))
    assert new.status == 200
    await settled(slow, 2)
    assert [a.generation for a in slow.applied] == [6]
    [cut] = slow.cut
    assert cut.generation == 5
    assert cut.received < size


async def test_an_old_holders_cut_write_never_lands_after_the_next_holders(
    start_proxy: ProxyFactory, slow: SlowUpstream, clock: FakeClock
) -> None:
    proxy = await start_proxy(slow_route(slow), leases={})

    async def claim(owner: str) -> aiohttp.ClientResponse:
        return await proxy.post("/_leases/job-2/claim", json={"owner": owner, "ttl": 3})

    first = await (await claim("worker-a")).json()
    body = io.BytesIO(b"a" * (3 * MiB))
    old = await proxy.post("/uploads/b", data=body, headers=headers("job-2", first["generation"]))
    assert old.status == 504
    clock.advance(3)  # worker A's lease runs out while it is paused
    # While A's write may still reach the upstream, nobody is handed the job.
    held = await claim("worker-b")
    assert held.status == 409
    assert (await held.json())["type"].endswith("write-in-flight")
    clock.advance(HOLD + 0.1)
    claimed = await claim("worker-b")
    assert claimed.status == 200
    second = (await claimed.json())["generation"]
    new = await proxy.post("/uploads/b", data=b"b", headers=headers("job-2", second))
    assert new.status == 200
    await settled(slow, 2)
    assert [a.generation for a in slow.applied] == [second]
    assert [a.generation for a in slow.cut] == [first["generation"]]


def process_config(directory: Path, upstream: SlowUpstream) -> Path:
    path = directory / "fenceproxy.yaml"
    path.write_text(
        f"store: sqlite:///{directory / 'fences.db'}\n"
        "shutdown_timeout: 300ms\n"
        "routes:\n"
        f"  - {{name: uploads, path: /uploads/, upstream: '{upstream.url}', timeout: 60s,"
        " max_body: 16MiB}\n"
    )
    return path


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
async def test_a_write_cut_by_the_proxys_end_never_lands(
    tmp_path: Path, slow: SlowUpstream, signum: signal.Signals
) -> None:
    """SIGTERM: the shutdown's drain time runs out mid-write; SIGKILL: the process is
    gone mid-write. Either way the kernel resets the upstream connection rather than
    sending on what it held."""
    proxy = await ProxyProcess(process_config(tmp_path, slow), free_port()).start()
    try:
        async with aiohttp.ClientSession() as http:
            body = io.BytesIO(b"c" * (3 * MiB))
            writing = asyncio.ensure_future(
                http.post(proxy.url + "/uploads/c", data=body, headers=headers("j", 1))
            )
            await eventually(lambda: len(slow.receiving) == 1)
            proxy.signal(signum)
            await proxy.wait()
            with contextlib.suppress(aiohttp.ClientError):
                (await writing).release()
        await settled(slow, 1)
        assert slow.applied == []
        assert [a.generation for a in slow.cut] == [1]
    finally:
        await proxy.stop()


async def trickle(request: web.Request, received: Received) -> web.StreamResponse:
    """Status and headers at once, then a 40-byte answer at a byte every half second."""
    response = web.StreamResponse(headers={"Content-Length": "40"})
    await response.prepare(request)
    for _ in range(40):
        await response.write(b"x")
        await asyncio.sleep(0.5)
    return response


async def test_an_answer_trickled_past_the_timeout_does_not_hold_the_job(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, clock: FakeClock
) -> None:
    """A keyed write's answer is read (to be kept for replays) in the job's turn: the
    route's timeout bounds it as a whole, not each pause between two bytes. Past it
    the outcome is unknown, the key says so, and the job waits only its quarantine."""
    upstream.respond = trickle
    proxy = await start_proxy(
        [{"name": "billing", "path": "/billing/", "upstream": upstream.url, "timeout": "1s",
          "connect_timeout": "1s", "quarantine": f"{QUARANTINE}s"}]
    )  # fmt: skip
    first = await fenced(proxy, "job-3", 1, key="k-1")
    assert first.status == 504
    retried = await fenced(proxy, "job-3", 1, key="k-1")
    assert (await retried.json())["type"].endswith("duplicate-outcome-unknown")
    clock.advance(HOLD + 0.1)
    upstream.respond = status(200)
    assert (await fenced(proxy, "job-3", 2, key="k-2")).status == 200
    assert [r.generation for r in upstream.received] == [1, 2]


async def test_a_write_whose_client_left_is_cut_and_held_when_the_proxy_stops(
    start_proxy: ProxyFactory, slow: SlowUpstream, clock: FakeClock, store_url: str
) -> None:
    """A client sent a write and left while its body was still going to the upstream;
    then the proxy stops. After its drain time the write is cut, so no more of it
    reaches the upstream, and before the store closes the job's record is marked
    unknown, held for the quarantine: whoever uses the store next waits for a write
    the upstream may still have."""
    proxy = await start_proxy(slow_route(slow, timeout="60s"), shutdown_timeout="300ms")
    _, client = await asyncio.open_connection("127.0.0.1", proxy.port)
    size = 3 * MiB
    client.write(
        b"POST /uploads/d HTTP/1.1\r\nHost: api\r\nFencing-Job: job-4\r\nFencing-Token: 1\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (size, b"d" * size)
    )
    await client.drain()
    await eventually(lambda: len(slow.receiving) == 1)
    # Read whole already, the write goes on without its client, which resets its
    # connection (a close would leave it half open, its answer still owed).
    client.get_extra_info("socket").setsockopt(
        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
    )
    client.transport.abort()
    plane = proxy.server.runner.server  # type: ignore[union-attr]
    await eventually(lambda: plane.open_connections == 0)
    await proxy.close()
    await settled(slow, 1)
    assert slow.applied == []
    assert [a.generation for a in slow.cut] == [1]
    store = await open_store(store_url, key_ttl=60, clock=clock)
    try:
        record = (await store.inspect("job-4")).in_flight
    finally:
        await store.close()
    assert record is not None
    assert record[1] == "unknown"
