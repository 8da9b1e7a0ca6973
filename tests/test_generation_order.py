"""``fence: {order: generation}``: the holder's writes of one job in flight together,
a newer generation's only after every older one has settled, on both stores and
across two proxies sharing PostgreSQL."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient

from fenceproxy.testing import RecordingUpstream, eventually

from .conftest import ProxyFactory, fenced, store_of
from .test_ordering import _queued

pytestmark = pytest.mark.both_stores

Client = TestClient[Any, Any]


def routes(upstream: RecordingUpstream, order: str = "generation") -> list[dict[str, Any]]:
    return [
        {
            "name": "parts",
            "path": "/parts/",
            "upstream": upstream.url,
            "fence": {"order": order},
        },
        {"name": "billing", "path": "/billing/", "upstream": upstream.url},
    ]


def part(proxy: Client, generation: int, body: dict[str, Any]) -> asyncio.Future[ClientResponse]:
    """A write of job ``upload`` to the ``parts`` route, sent now and answered in the
    background: several are in flight at once."""
    return asyncio.ensure_future(fenced(proxy, "upload", generation, body=body, path="/parts/u"))


async def test_writes_of_one_generation_reach_the_upstream_together(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(routes(upstream))
    release = upstream.hold()
    writes = [part(proxy, 7, {"part": n}) for n in range(8)]
    # All eight are at the upstream at once, none answered yet.
    await upstream.wait_for(8)
    assert not any(w.done() for w in writes)
    view = await store_of(proxy).inspect("upload")
    assert view.in_flight is not None
    assert view.in_flight[1] == "in_flight"
    release()
    assert [(await w).status for w in writes] == [200] * 8
    assert sorted(b["part"] for b in upstream.bodies()) == list(range(8))  # type: ignore[index]
    assert (await store_of(proxy).inspect("upload")).in_flight is None


async def test_in_job_order_the_same_writes_go_one_at_a_time(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(routes(upstream, order="job"))
    release = upstream.hold()
    writes = [part(proxy, 7, {"part": n}) for n in range(3)]
    await upstream.wait_for(1)
    await eventually(lambda: _queued(proxy, "upload", 3))
    assert len(upstream.received) == 1
    release()
    assert [(await w).status for w in writes] == [200] * 3


async def test_a_newer_generation_waits_for_every_older_write_in_flight(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(routes(upstream))
    release = upstream.hold()
    older = [part(proxy, 7, {"g": 7, "n": n}) for n in range(3)]
    await upstream.wait_for(3)
    newer = part(proxy, 8, {"g": 8})
    # A write of 7 that comes after 8 queues behind it, though 7s are in flight:
    # first come, first served, so the newer generation is not starved.
    late = part(proxy, 7, {"g": 7, "n": 3})
    await eventually(lambda: _queued(proxy, "upload", 5))
    assert len(upstream.received) == 3  # neither 8 nor the late 7 has gone
    release()
    assert [(await w).status for w in older] == [200] * 3
    assert (await newer).status == 200
    assert (await late).status == 409  # stale by then: 8 was admitted
    assert [b["g"] for b in upstream.bodies()] == [7, 7, 7, 8]  # type: ignore[index]


async def test_a_write_in_job_order_waits_for_the_shared_ones_and_they_for_it(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(routes(upstream))
    release = upstream.hold()
    shared = part(proxy, 7, {"w": "s1"})
    await upstream.wait_for(1)
    alone = asyncio.ensure_future(fenced(proxy, "upload", 7, body={"w": "alone"}))
    shared2 = part(proxy, 7, {"w": "s2"})
    await eventually(lambda: _queued(proxy, "upload", 3))
    assert len(upstream.received) == 1
    release()
    assert [(await w).status for w in (shared, alone, shared2)] == [200] * 3
    assert upstream.bodies() == [{"w": "s1"}, {"w": "alone"}, {"w": "s2"}]


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
async def test_two_proxies_share_a_generation_and_order_the_next(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """The store's records are the order across proxies: A's and B's writes of 7 are
    in flight together; B's 8 waits for A's 7s, with B's own queue empty."""
    a = await start_proxy(routes(upstream))
    b = await start_proxy(routes(upstream))
    release = upstream.hold()
    sevens = [part(p, 7, {"g": 7}) for p in (a, b, a, b)]
    await upstream.wait_for(4)
    eight = part(b, 8, {"g": 8})
    # B polls the store: A's records and its own hold the job.
    await eventually(lambda: _queued(b, "upload", 3))
    assert len(upstream.received) == 4
    release()
    assert [(await w).status for w in sevens] == [200] * 4
    assert (await eight).status == 200
    assert [body["g"] for body in upstream.bodies()] == [7, 7, 7, 7, 8]  # type: ignore[index]
