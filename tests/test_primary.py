"""Following the primary on a real PostgreSQL server: a store URL of several hosts
(the one that takes writes is used), a server that stops taking writes under a
running proxy (its connections are left, writes get 503 and are never forwarded,
and they resume by themselves), and ``require_sync`` (not ready while the primary
has no synchronous standby). The failover of a real Patroni cluster is
tests/test_failover.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from fenceproxy.store import migrate_store, open_store
from fenceproxy.store.base import Store
from fenceproxy.store.postgres import SCHEMA_VERSION, _unsafe
from fenceproxy.testing import RecordingUpstream, free_port

from .conftest import ProxyFactory, fenced
from .postgres import PostgresServer, sql
from .test_admin import scrape
from .test_proxy import problem

Client = TestClient[Any, Any]


@pytest.fixture
async def url(postgres: PostgresServer) -> str:
    """The session's database, behind a host where nothing listens."""
    database = postgres.url("fenceproxy")
    await sql(database, "TRUNCATE fences, idempotency_keys, leases, inflight")
    return database.replace("@127.0.0.1:", f"@127.0.0.1:{free_port()},127.0.0.1:")


@pytest.fixture
async def store(url: str) -> AsyncIterator[Store]:
    opened = await open_store(url, key_ttl=60.0)
    yield opened
    await opened.close()


async def admin_of(proxy: Client, aiohttp_client: Any) -> Client:
    client: Client = await aiohttp_client(proxy.server.proxy.admin())  # type: ignore[union-attr]
    return client


async def test_a_url_of_several_hosts_migrates_and_serves_on_the_one_that_takes_writes(
    url: str, postgres: PostgresServer, start_proxy: ProxyFactory, aiohttp_client: Any
) -> None:
    # The first host refuses: the second is used.
    assert await migrate_store(url) == (SCHEMA_VERSION, SCHEMA_VERSION)
    store = await open_store(url, key_ttl=60.0)
    try:
        proxy = await start_proxy(store=store)
        assert (await fenced(proxy, "j", 1)).status == 200
        admin = await admin_of(proxy, aiohttp_client)
        ready = await (await admin.get("/readyz")).json()
        primary = f"127.0.0.1:{postgres.port}"
        assert ready["status"] == "ready"
        assert ready["primary"] == primary
        assert ready["failovers"] == 0
        got = await scrape(admin)
        assert got[("fenceproxy_store_primary", (("server", primary),))] == 1
        assert got[("fenceproxy_store_connections_total", ())] >= 1
        page = await (await admin.get("/", headers={"Accept": "text/html"})).text()
        assert f"primary {primary}" in page
    finally:
        await store.close()


async def test_a_server_that_stops_taking_writes_is_left_and_writes_wait_with_503(
    store: Store,
    postgres: PostgresServer,
    start_proxy: ProxyFactory,
    upstream: RecordingUpstream,
) -> None:
    proxy = await start_proxy(store=store, leases={})
    assert (await fenced(proxy, "j", 1, key="a")).status == 200
    opened = store.server.connections
    admin = postgres.url()
    await sql(
        admin, "ALTER SYSTEM SET default_transaction_read_only = on", "SELECT pg_reload_conf()"
    )
    try:
        # What a demoted primary, or one an operator made read-only, does to a
        # connection already open: its next write fails, and the connection goes.
        await problem(await fenced(proxy, "j", 2, key="b"), 503, "store-unavailable")
        # New connections find no host that takes writes.
        await problem(await fenced(proxy, "j", 2, key="b"), 503, "store-unavailable")
        # Nothing is decided there, a claim included: it is not refused, it waits.
        claim = await proxy.post("/_leases/k/claim", json={"owner": "w1"})
        await problem(claim, 503, "store-unavailable")
    finally:
        await sql(
            admin, "ALTER SYSTEM RESET default_transaction_read_only", "SELECT pg_reload_conf()"
        )
    async with asyncio.timeout(10):  # the reload reaches the server's processes soon
        while (answer := await fenced(proxy, "j", 2, key="b")).status == 503:
            await asyncio.sleep(0.05)
    assert answer.status == 200
    assert [(r.generation, r.headers["Idempotency-Key"]) for r in upstream.received] == [
        (1, "a"),
        (2, "b"),
    ]
    assert store.server.connections > opened  # the connection that was refused was left
    assert store.server.changes == 0  # the same server all along: no failover


async def test_a_connection_that_was_told_its_server_is_read_only_decides_nothing(
    store: Store, postgres: PostgresServer, start_proxy: ProxyFactory
) -> None:
    """A server reports a change of ``default_transaction_read_only`` (as of
    ``in_hot_standby``) to a session after its next statement. A read succeeds
    there; the connection that heard it is then left before any lease is decided on
    it: a claim that would be refused as held waits with 503 instead."""
    proxy = await start_proxy(store=store, leases={})
    assert (await proxy.post("/_leases/k/claim", json={"owner": "w0"})).status == 200
    admin = postgres.url()
    await sql(
        admin, "ALTER SYSTEM SET default_transaction_read_only = on", "SELECT pg_reload_conf()"
    )
    try:
        # A read on the one connection the claim used: it succeeds, and the server's
        # report comes with its answer.
        assert store.server.connections == 1
        await store.lease("k")
        claim = await proxy.post("/_leases/k/claim", json={"owner": "w1"})
        await problem(claim, 503, "store-unavailable")
    finally:
        await sql(
            admin, "ALTER SYSTEM RESET default_transaction_read_only", "SELECT pg_reload_conf()"
        )


async def test_require_sync_keeps_a_proxy_unready_on_a_primary_with_no_synchronous_standby(
    url: str, start_proxy: ProxyFactory, aiohttp_client: Any
) -> None:
    store = await open_store(url + "?require_sync=true", key_ttl=60.0)
    try:
        proxy = await start_proxy(store=store)
        body = await problem(
            await (await admin_of(proxy, aiohttp_client)).get("/readyz"), 503, "store-not-ready"
        )
        assert "synchronous_standby_names is empty" in body["detail"]
        assert "synchronous_mode: true" in body["detail"]
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("names", "commit", "standbys", "hidden", "why"),
    [
        ("", "on", [], 0, "synchronous_standby_names is empty"),
        ("node1", "local", ["node1"], 0, "synchronous_commit is local"),
        ("node1", "off", ["node1"], 0, "synchronous_commit is off"),
        ("node1", "remote_write", ["node1"], 0, "synchronous_commit is remote_write"),
        ("node1", "on", [], 0, "no standby is synchronous now"),
        ("node1", "on", [], 1, "grant it pg_monitor"),
        ("node1", "on", ["node1"], 0, None),
        ("ANY 1 (a, b)", "remote_apply", ["b"], 0, None),
    ],
)
def test_what_makes_a_primary_unsafe_to_decide_on(
    names: str, commit: str, standbys: list[str], hidden: int, why: str | None
) -> None:
    found = _unsafe((names, commit, standbys, hidden))  # type: ignore[arg-type]
    assert found == why if why is None else why in str(found)
