"""A new holder always gets in: a holder whose lease ran out and which keeps writing
cannot keep the next holder out.

The story fencing exists for, tried as workers would: worker A claims with a lease of
1 s and writes one write after another, each taking 0.3 s at the upstream, past its
lease (a worker paused and woken up that never checks); worker B asks for the job
every 100 ms from the moment A's lease ends. Real proxy processes on both stores (on
PostgreSQL, two: A writes through one, B claims through the other), on a route in job
order and one in generation order (where A writes two at a time)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fenceproxy.testing import ProxyProcess, Received, RecordingUpstream, free_port

pytestmark = [pytest.mark.slow, pytest.mark.both_stores]

ROUTE_TIMEOUT = 2.0
AT_THE_UPSTREAM = 0.3  # each write's time at the upstream, after it is recorded there
RETRY = 0.1  # B asks again this often


@dataclass
class Sent:
    number: int
    started: float  # monotonic
    status: int = 0
    refusal: str = ""


@pytest.fixture
async def proxies(
    tmp_path: Path, store_url: str, upstream: RecordingUpstream
) -> AsyncIterator[Callable[[str], Any]]:
    """``start(order)``: A's proxy and B's: one process on SQLite (it holds its file),
    two on PostgreSQL."""
    started: list[ProxyProcess] = []

    async def start(order: str) -> tuple[ProxyProcess, ProxyProcess]:
        config = tmp_path / "proxy.yaml"
        config.write_text(
            f"store: '{store_url}'\nleases: {{}}\nshutdown_timeout: 2s\nroutes:\n"
            f"  - {{name: billing, path: /billing, upstream: '{upstream.url}',"
            f" timeout: {ROUTE_TIMEOUT}s, fence: {{order: {order}}}}}\n"
        )
        count = 1 if store_url.startswith("sqlite") else 2
        for _ in range(count):
            process = ProxyProcess(config, free_port(), "--log-level", "WARNING")
            started.append(await process.start())
        return started[0], started[-1]

    yield start
    for process in started:
        print(process.output())  # shown when a test fails
        await process.stop()


WAITING = "fenceproxy_lease_claims_waiting"


async def text(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url) as response:
        return await response.text()


async def call(http: aiohttp.ClientSession, url: str, body: Any, **headers: str) -> tuple[int, Any]:
    async with http.post(url, json=body, headers=headers) as response:
        return response.status, await response.json(content_type=None)


@pytest.mark.parametrize("order", ["job", "generation"])
async def test_a_holder_writing_past_its_lease_cannot_keep_the_next_one_out(
    proxies: Callable[[str], Any],
    upstream: RecordingUpstream,
    http: aiohttp.ClientSession,
    order: str,
) -> None:
    """B is granted the job within the route's timeout + 2 s of A's lease's end, and
    every write A sends after B first asked is refused (409, stale) and never reaches
    the upstream; B's own write then goes through."""

    async def slow(request: web.Request, received: Received) -> web.StreamResponse:
        await asyncio.sleep(AT_THE_UPSTREAM)
        return web.json_response({"applied": True})

    upstream.respond = slow
    a_proxy, b_proxy = await proxies(order)
    status, lease = await call(http, a_proxy.url + "/_leases/job/claim", {"owner": "a", "ttl": 1})
    assert status == 200, lease
    # The store granted the lease before its answer arrived, so by this time on the
    # test's clock the lease has surely ended (and by no more than the claim's latency).
    lease_ends = time.monotonic() + lease["expires_in"]
    sent: list[Sent] = []
    numbers = iter(range(1, 10_000))
    stop = asyncio.Event()

    async def keep_writing() -> None:
        """A: one write after another, whatever it is told, until the test is done."""
        while not stop.is_set():
            write = Sent(next(numbers), time.monotonic())
            sent.append(write)
            write.status, answer = await call(
                http,
                a_proxy.url + "/billing/x",
                {"n": write.number},
                **{"Fencing-Job": "job", "Fencing-Token": lease["token"]},
            )
            write.refusal = str(answer.get("type", "")).rsplit(":", 1)[-1]

    writers = [
        asyncio.create_task(keep_writing()) for _ in range(2 if order == "generation" else 1)
    ]
    try:
        # From the end of A's lease, B's first ask while one of A's writes is surely
        # at the upstream (held there until B has been answered).
        await asyncio.sleep(max(0.0, lease_ends - time.monotonic()))
        release = upstream.hold()
        await upstream.wait_for(len(upstream.received) + 1)
        first_answered: float | None = None
        refusals: list[str] = []
        async with asyncio.timeout(ROUTE_TIMEOUT + 2):
            while True:
                status, claim = await call(
                    http, b_proxy.url + "/_leases/job/claim", {"owner": "b", "ttl": 30}
                )
                if first_answered is None:
                    first_answered = time.monotonic()
                    release()
                if status == 200:
                    break
                refusals.append(claim["type"].rsplit(":", 1)[-1])
                await asyncio.sleep(RETRY)
        granted = time.monotonic()
    finally:
        stop.set()
        await asyncio.gather(*writers)
    assert granted - lease_ends <= ROUTE_TIMEOUT + 2
    assert refusals, "B's first ask found no write in flight"
    assert set(refusals) == {"write-in-flight"}, refusals
    assert first_answered is not None
    assert claim["generation"] > lease["generation"]
    late = [w for w in sent if w.started > first_answered]
    assert late, "A sent nothing after B first asked"
    assert {(w.status, w.refusal) for w in late} == {(409, "stale-generation")}
    applied = {body["n"] for body in upstream.bodies() if isinstance(body, dict)}
    assert not applied & {w.number for w in late}
    status, answer = await call(
        http,
        b_proxy.url + "/billing/x",
        {"n": 0},
        **{"Fencing-Job": "job", "Fencing-Token": claim["token"]},
    )
    assert status == 200, answer
    assert upstream.received[-1].generation == claim["generation"]


async def test_a_waiting_claim_gets_the_job_when_its_lease_runs_out(
    proxies: Callable[[str], Any], http: aiohttp.ClientSession
) -> None:
    """The proxy holds B's claim and asks again when A's lease runs out, not on a
    poll of its own (it asks again by itself only after 5 s)."""
    a_proxy, b_proxy = await proxies("job")
    status, lease = await call(http, a_proxy.url + "/_leases/job/claim", {"owner": "a", "ttl": 0.5})
    assert status == 200, lease
    async with asyncio.timeout(4):
        status, claim = await call(
            http, b_proxy.url + "/_leases/job/claim", {"owner": "b", "wait": 30}
        )
    assert status == 200, claim
    assert claim["generation"] == lease["generation"] + 1
    assert claim["waited"] > 0


async def test_a_waiting_claim_is_answered_at_once_when_its_proxy_stops(
    proxies: Callable[[str], Any], http: aiohttp.ClientSession
) -> None:
    """A claim held waiting does not hold the proxy's shutdown: it is answered with
    what it was last told, and the proxy exits cleanly."""
    a_proxy, b_proxy = await proxies("job")
    status, _ = await call(http, a_proxy.url + "/_leases/job/claim", {"owner": "a", "ttl": 30})
    assert status == 200
    body = {"owner": "b", "wait": 30}
    claim = asyncio.create_task(call(http, b_proxy.url + "/_leases/job/claim", body))
    async with asyncio.timeout(10):  # until the proxy holds it
        while f"{WAITING} 1.0" not in await text(http, b_proxy.admin_url + "/metrics"):
            assert not claim.done()
            await asyncio.sleep(0.01)
    b_proxy.signal(signal.SIGTERM)
    async with asyncio.timeout(4):
        status, refused = await claim
    assert (status, refused["type"]) == (409, "urn:fenceproxy:problem:lease-held")
    assert await b_proxy.wait() == 0
