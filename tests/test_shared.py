"""Several proxies, one truth: real proxy processes on one PostgreSQL database, a
proxy killed with SIGKILL mid-write, the database restarted under traffic."""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fenceproxy.testing import ProxyProcess, Received, RecordingUpstream, free_port

from .postgres import PostgresServer

pytestmark = pytest.mark.slow


@pytest.fixture
async def spawn(
    tmp_path: Path, database: str, upstream: RecordingUpstream
) -> AsyncIterator[Callable[..., ProxyProcess]]:
    started: list[ProxyProcess] = []

    def make(route: str = "") -> ProxyProcess:
        config = tmp_path / f"proxy{len(started)}.yaml"
        config.write_text(
            f"store: '{database}?pool=4'\nleases: {{}}\nshutdown_timeout: 2s\nroutes:\n"
            f"  - {{name: billing, path: /billing, upstream: '{upstream.url}'{route}}}\n"
        )
        process = ProxyProcess(config, free_port(), "--log-level", "WARNING")
        started.append(process)
        return process

    yield make
    for process in started:
        print(process.output())  # shown when a test fails
        await process.stop()


async def write(
    http: aiohttp.ClientSession, proxy: ProxyProcess, job: str, generation: int, **body: Any
) -> tuple[int, str]:
    """The status and the problem type's last word (or "" for a success)."""
    headers = {"Fencing-Job": job, "Fencing-Token": str(generation)}
    async with http.post(
        proxy.url + "/billing/x", json={"g": generation, **body}, headers=headers
    ) as response:
        data = await response.json(content_type=None)
        return response.status, str(data.get("type", "")).rsplit(":", 1)[-1]


async def test_a_generation_accepted_by_one_proxy_fences_the_other(
    spawn: Callable[..., ProxyProcess], http: aiohttp.ClientSession, upstream: RecordingUpstream
) -> None:
    a, b = await spawn().start(), await spawn().start()
    assert await write(http, a, "j", 8) == (200, "")
    assert await write(http, b, "j", 7) == (409, "stale-generation")
    assert await write(http, b, "j", 8) == (200, "")
    assert [r.generation for r in upstream.received] == [8, 8]


async def test_a_lease_held_through_one_proxy_is_refused_through_the_other(
    spawn: Callable[..., ProxyProcess], http: aiohttp.ClientSession
) -> None:
    a, b = await spawn().start(), await spawn().start()
    async with http.post(a.url + "/_leases/j/claim", json={"owner": "w1", "ttl": 30}) as r:
        lease = await r.json()
        assert r.status == 200
    async with http.post(b.url + "/_leases/j/claim", json={"owner": "w2"}) as r:
        assert (r.status, (await r.json())["type"]) == (409, "urn:fenceproxy:problem:lease-held")
    renew = {"owner": "w1", "generation": lease["generation"]}
    async with http.post(b.url + "/_leases/j/renew", json=renew) as r:
        assert r.status == 200
    # The claim raised the fence on the shared store: a write below it is refused
    # by either proxy.
    assert await write(http, a, "j", lease["generation"] - 1) == (409, "stale-generation")


async def test_300_racing_writes_split_between_two_proxies_arrive_in_order(
    spawn: Callable[..., ProxyProcess], http: aiohttp.ClientSession, upstream: RecordingUpstream
) -> None:
    rng = random.Random(11)
    upstream.latency = lambda: rng.uniform(0, 0.003)  # writes can overtake each other
    proxies = [await spawn().start(), await spawn().start()]
    answers: list[tuple[int, int, str]] = []

    async def one(n: int, generation: int) -> None:
        status, kind = await write(http, proxies[n % 2], "hot", generation, n=n)
        answers.append((generation, status, kind))

    sends = [one(n, n // 10 + rng.randint(0, 6)) for n in range(300)]
    await asyncio.gather(*sends)
    arrived = [r.generation for r in upstream.received]
    assert arrived == sorted(arrived), arrived
    accepted = [g for g, status, _ in answers if status == 200]
    assert sorted(accepted) == arrived  # every 2xx was applied, nothing else was
    assert {kind for _, status, kind in answers if status != 200} <= {
        "stale-generation",
        "job-quarantined",
    }
    assert len(accepted) > 30


async def test_a_proxy_killed_mid_write_holds_that_job_only_on_the_other_proxy(
    spawn: Callable[..., ProxyProcess], http: aiohttp.ClientSession, upstream: RecordingUpstream
) -> None:
    route = ", timeout: 1s, quarantine: 1s"
    a, b = await spawn(route).start(), await spawn(route).start()
    gate = asyncio.Event()

    async def slow_for_x(request: web.Request, received: Received) -> web.StreamResponse:
        if received.job == "x":
            await gate.wait()
        return web.json_response({})

    upstream.respond = slow_for_x
    in_flight = asyncio.ensure_future(write(http, a, "x", 1))
    await upstream.wait_for(1)
    a.signal(signal.SIGKILL)
    await a.wait()
    with pytest.raises(aiohttp.ClientError):
        await in_flight
    # B holds job x, whose write may still land, and nothing else.
    assert (await write(http, b, "x", 2))[1] == "job-quarantined"
    assert await write(http, b, "y", 1) == (200, "")
    gate.set()  # the old write lands late, as a slow upstream's would
    async with asyncio.timeout(15):
        while (answer := await write(http, b, "x", 2))[1] == "job-quarantined":
            await asyncio.sleep(0.1)
    assert answer == (200, "")
    assert [(r.job, r.generation) for r in upstream.received] == [("x", 1), ("y", 1), ("x", 2)]


async def test_a_database_restart_under_traffic_loses_nothing_and_lets_nothing_stale_through(
    spawn: Callable[..., ProxyProcess],
    http: aiohttp.ClientSession,
    upstream: RecordingUpstream,
    postgres: PostgresServer,
) -> None:
    proxy = await spawn(", timeout: 1s, quarantine: 1s").start()
    answers: list[tuple[str, int, int, str]] = []
    stop = asyncio.Event()

    async def traffic(job: str) -> None:
        generation = 1
        while not stop.is_set():
            try:
                status, kind = await write(http, proxy, job, generation)
            except aiohttp.ClientError:
                continue
            answers.append((job, generation, status, kind))
            if status == 200:
                generation += 1
            await asyncio.sleep(0.005)

    workers = [asyncio.ensure_future(traffic(f"job{n}")) for n in range(4)]
    try:
        async with asyncio.timeout(30):
            while sum(1 for a in answers if a[2] == 200) < 20:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(postgres.stop, "fast")
            while not any(a[3] == "store-unavailable" for a in answers):
                await asyncio.sleep(0.01)
            await asyncio.to_thread(postgres.start)
            down = len(answers)
            while sum(1 for a in answers[down:] if a[2] == 200) < 20:  # it recovers by itself
                await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.gather(*workers)
    assert {a[3] for a in answers if a[2] != 200} <= {"store-unavailable", "job-quarantined"}
    applied = [(r.job, r.generation) for r in upstream.received]
    accepted = [(job, g) for job, g, status, _ in answers if status == 200]
    assert set(accepted) <= set(applied)  # nothing answered 2xx is lost
    for n in range(4):
        generations = [g for job, g in applied if job == f"job{n}"]
        assert generations == sorted(generations)  # nothing stale after a newer one
