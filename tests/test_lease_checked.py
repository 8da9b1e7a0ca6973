"""Lease-checked routes against a real proxy on both stores, the store's clock moved by
hand: a write goes only while the lease of its job and generation is live; after the
lease expired, was released or completed it is refused with 409 ``lease-not-live``,
even though nobody has claimed the job since, and nothing of it reaches the upstream
or raises the job's fence. A route without the check still compares generations only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient

from fenceproxy.config import load_config
from fenceproxy.errors import ConfigError
from fenceproxy.testing import FakeClock, RecordingUpstream

from .conftest import ProxyFactory, fenced, store_of
from .test_proxy import problem

pytestmark = pytest.mark.both_stores

Client = TestClient[Any, Any]

TTL = 10.0


def routes(upstream: RecordingUpstream) -> list[dict[str, Any]]:
    return [
        {"name": "checked", "path": "/billing/", "upstream": upstream.url,
         "fence": {"check_lease": True}},
        {"name": "unchecked", "path": "/ledger/", "upstream": upstream.url},
    ]  # fmt: skip


@pytest.fixture
async def proxy(start_proxy: ProxyFactory, upstream: RecordingUpstream) -> Client:
    return await start_proxy(routes(upstream), leases={})


async def lease_call(client: Client, job: str, action: str, **body: Any) -> dict[str, Any]:
    response = await client.post(f"/_leases/{job}/{action}", json={"owner": "w1", **body})
    assert response.status == 200, await response.text()
    answer: dict[str, Any] = await response.json()
    return answer


async def claim(client: Client, job: str) -> int:
    generation: int = (await lease_call(client, job, "claim", ttl=TTL))["generation"]
    return generation


async def test_a_write_under_a_live_lease_is_forwarded(
    proxy: Client, upstream: RecordingUpstream, clock: FakeClock
) -> None:
    generation = await claim(proxy, "invoice-1")
    clock.advance(TTL * 0.8)
    assert (await fenced(proxy, "invoice-1", generation)).status == 200
    await lease_call(proxy, "invoice-1", "renew", generation=generation)
    clock.advance(TTL * 0.8)  # past the first term, within the renewed one
    assert (await fenced(proxy, "invoice-1", generation)).status == 200
    assert len(upstream.received) == 2


@pytest.mark.parametrize("end", ["expire", "release", "complete"])
async def test_a_write_after_its_lease_ended_is_refused_though_nobody_claimed_since(
    proxy: Client, upstream: RecordingUpstream, clock: FakeClock, end: str
) -> None:
    generation = await claim(proxy, "invoice-2")
    assert (await fenced(proxy, "invoice-2", generation)).status == 200
    if end == "expire":
        clock.advance(TTL)  # the lease ends at exactly lease_until
    else:
        await lease_call(proxy, "invoice-2", end, generation=generation)
    body = await problem(await fenced(proxy, "invoice-2", generation), 409, "lease-not-live")
    assert (body["job"], body["generation"]) == ("invoice-2", generation)
    assert len(upstream.received) == 1
    # A route without the check compares generations only: the same write goes there.
    assert (await fenced(proxy, "invoice-2", generation, path="/ledger/x")).status == 200


@pytest.mark.parametrize("token", [2, 999, 0], ids=["next", "far-ahead", "older"])
async def test_a_generation_no_lease_holds_is_refused_and_never_raises_the_fence(
    proxy: Client, upstream: RecordingUpstream, token: int
) -> None:
    generation = await claim(proxy, "invoice-3")
    assert generation == 1
    refused = await fenced(proxy, "invoice-3", token)
    await problem(refused, 409, "stale-generation" if token < generation else "lease-not-live")
    await problem(await fenced(proxy, "never-claimed", 1), 409, "lease-not-live")
    assert upstream.received == []
    assert await store_of(proxy).generation("invoice-3") == 1
    assert await store_of(proxy).generation("never-claimed") is None
    assert (await fenced(proxy, "invoice-3", generation)).status == 200  # the holder goes on


async def test_a_keyed_write_applied_under_the_lease_is_still_replayed_after_it(
    proxy: Client, upstream: RecordingUpstream, clock: FakeClock
) -> None:
    """A replay forwards nothing: the answer stored under the key is the truth about a
    write applied while the lease was live."""
    generation = await claim(proxy, "invoice-4")
    first = await fenced(proxy, "invoice-4", generation, key="k1", body={"n": 1})
    assert first.status == 200
    clock.advance(TTL + 1)
    again = await fenced(proxy, "invoice-4", generation, key="k1", body={"n": 1})
    assert again.status == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert await again.read() == await first.read()
    await problem(
        await fenced(proxy, "invoice-4", generation, key="k2", body={"n": 2}),
        409,
        "lease-not-live",
    )
    assert len(upstream.received) == 1


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
async def test_a_proxy_without_the_lease_api_checks_leases_taken_through_another(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, clock: FakeClock
) -> None:
    """On a shared PostgreSQL store, the lease API may be served by another proxy."""
    leases = await start_proxy(routes(upstream), leases={})
    writes = await start_proxy(routes(upstream))
    generation = await claim(leases, "invoice-5")
    assert (await fenced(writes, "invoice-5", generation)).status == 200
    clock.advance(TTL)
    await problem(await fenced(writes, "invoice-5", generation), 409, "lease-not-live")
    assert len(upstream.received) == 1


def test_a_checked_route_on_sqlite_needs_the_lease_api(tmp_path: Path) -> None:
    path = tmp_path / "proxy.yaml"
    route = {"name": "b", "path": "/b/", "upstream": "http://127.0.0.1:9",
             "fence": {"check_lease": True}}  # fmt: skip
    path.write_text(yaml.safe_dump({"routes": [route]}))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(path) in str(caught.value)
    assert "routes[0].fence.check_lease" in str(caught.value)
    path.write_text(yaml.safe_dump({"routes": [route], "leases": {}}))
    assert load_config(path).routes[0].fence is not None
    path.write_text(yaml.safe_dump({"routes": [route], "store": "postgresql://u@h/db"}))
    assert load_config(path).routes[0].fence is not None
