"""Writes of one job reach the upstream one at a time and never out of generation
order; writes of different jobs do not wait for each other."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient

from fenceproxy.server.app import FenceProxy
from fenceproxy.testing import ProxyTestServer, RecordingUpstream, eventually

from .conftest import fenced, store_of

Client = TestClient[Any, Any]


async def test_200_concurrent_mixed_generations_arrive_in_order(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    rng = random.Random(7)
    generations = [rng.randint(1, 20) for _ in range(200)]

    # Without per-job ordering in the proxy, requests in flight together would
    # overtake each other inside this slow API.
    upstream.latency = lambda: rng.uniform(0, 0.003)
    answers = await asyncio.gather(
        *(fenced(proxy, "job", g, body={"i": i, "g": g}) for i, g in enumerate(generations))
    )
    statuses = [a.status for a in answers]
    assert set(statuses) <= {200, 409}
    forwarded = [r.generation for r in upstream.received]
    assert forwarded == sorted(forwarded), "a stale write reached the upstream after a newer one"
    assert len(forwarded) == statuses.count(200)
    # Every refusal was right: a higher generation had been accepted before it.
    for answer, g in zip(answers, generations, strict=True):
        if answer.status == 409:
            body = await answer.json()
            assert body["current_generation"] > g
    assert max(generations) in forwarded
    assert await store_of(proxy).generation("job") == max(generations)


async def test_queued_stale_write_is_refused_when_its_turn_comes(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    release = upstream.hold()
    first = asyncio.ensure_future(fenced(proxy, "j", 7, body={"w": "A1"}))
    await upstream.wait_for(1)
    # Both queue behind A1 while it is held at the upstream: A's next write (7)
    # arrives before B's (8), so 7 is forwarded, then 8, in arrival order.
    a2 = asyncio.ensure_future(fenced(proxy, "j", 7, body={"w": "A2"}))
    b1 = asyncio.ensure_future(fenced(proxy, "j", 8, body={"w": "B1"}))
    a3 = asyncio.ensure_future(fenced(proxy, "j", 7, body={"w": "A3"}))
    await eventually(lambda: _queued(proxy, "j", 4))
    release()
    assert [(await t).status for t in (first, a2, b1, a3)] == [200, 200, 200, 409]
    assert upstream.bodies() == [{"w": "A1"}, {"w": "A2"}, {"w": "B1"}]


async def test_other_jobs_are_not_blocked_by_a_slow_write(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    gate = asyncio.Event()

    async def hold_job_a(request: Any, received: Any) -> Any:
        if received.job == "a":
            await gate.wait()
        return web.Response(text="ok")

    upstream.respond = hold_job_a
    slow = asyncio.ensure_future(fenced(proxy, "a", 1))
    await upstream.wait_for(1)
    assert (await fenced(proxy, "b", 1)).status == 200
    assert not slow.done()
    gate.set()
    assert (await slow).status == 200
    assert [r.job for r in upstream.received] == ["a", "b"]


def _queued(client: Client, job: str, users: int) -> bool:
    """Whether ``users`` writes of ``job`` hold or wait for its lock."""
    return proxy_of(client).locks.users(job) >= users


def proxy_of(client: Client) -> FenceProxy:
    """The proxy the test client talks to."""
    server = client.server
    assert isinstance(server, ProxyTestServer)
    return server.proxy
