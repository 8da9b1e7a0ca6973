from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import httpx
import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient
from hypothesis import settings

from fenceproxy.config import parse_config
from fenceproxy.errors import Refusal
from fenceproxy.fence.fencing import Admit, Busy, FencedWrite, Replay
from fenceproxy.server.app import FenceProxy
from fenceproxy.store import PostgresStore, Store
from fenceproxy.testing import (
    FakeClock,
    ProxyProcess,
    ProxyTestServer,
    RecordingUpstream,
    free_port,
)

from .nginx import NGINX, Nginx
from .postgres import PostgresServer, required_postgres_bin, sql

if TYPE_CHECKING:
    from .s3 import Moto

ProxyFactory = Callable[..., Awaitable[TestClient[Any, Any]]]


@pytest.fixture
async def upstream() -> AsyncIterator[RecordingUpstream]:
    async with RecordingUpstream.serve() as up:
        yield up


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session, for tests that drive a proxy process over HTTP."""
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture(scope="session")
def nginx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    """A real nginx echoing the path it resolved (``make test`` installs it where it
    can; elsewhere the tests that need it are skipped, saying so)."""
    if NGINX is None:
        if os.environ.get("CI"):
            pytest.fail("nginx is not installed, and CI must run every test")
        pytest.skip("nginx is not installed (make test installs it when run as root)")
    server = Nginx(tmp_path_factory.mktemp("nginx")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Moto]:
    """moto's S3 server for the module, checking signatures (tests/s3.py)."""
    from .s3 import serve_moto  # boto3 is imported by the modules that drive S3 only

    with serve_moto(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL cluster for the session, with the database ``fenceproxy``
    migrated (``make test`` installs PostgreSQL where it can; elsewhere the tests that
    need it are skipped, saying so)."""
    bin_dir = required_postgres_bin()
    # Not under pytest's temporary folder: the postgres user must reach it.
    directory = Path(tempfile.mkdtemp(prefix="fenceproxy-postgres-"))
    server = PostgresServer(directory, bin_dir).init().start()
    try:
        asyncio.run(sql(server.url(), "CREATE DATABASE fenceproxy"))
        asyncio.run(PostgresStore.migrate(server.url("fenceproxy")))
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(directory, ignore_errors=True)


STORES = ("sqlite", "postgresql")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``both_stores`` (or in a module so marked) runs once per store;
    any other runs on SQLite. The store is the subject of a few modules (the stores,
    leases, integrity, faults, the model); for the rest, HTTP is, and a PostgreSQL
    copy of each test would only double the suite."""
    if "store_url" not in metafunc.fixturenames:
        return
    if metafunc.definition.get_closest_marker("both_stores") is None:
        return
    chosen = {
        name.strip()
        for mark in metafunc.definition.iter_markers("parametrize")
        for name in (mark.args[0].split(",") if isinstance(mark.args[0], str) else mark.args[0])
    }
    if "store_url" not in chosen:
        metafunc.parametrize("store_url", STORES, indirect=True)


# The tests that take ten seconds or more (pytest --durations=20).
LONG = (
    "tests/test_chaos.py::test_the_same_run_without_the_fence_check_is_caught",
    "tests/test_model.py::test_the_store_follows_the_protocol_model",
    "tests/test_chaos.py::test_short_run_with_every_fault_has_no_violation",
    "tests/test_chaos.py::test_two_proxies_on_postgres_killed_independently_have_no_violation",
    "tests/test_failover.py::test_a_failover_under_traffic",
    "tests/test_packaging.py::test_the_wheel_and_sdist_build_and_run_in_fresh_venvs",
    "tests/test_bench.py::",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long tests first (:data:`LONG`, longest first, then those marked slow),
    the rest as they were: with ``--maxschedchunk 1`` pytest-xdist deals them out one
    by one, so they spread over its workers from the start and none of them begins
    near the end of the run and keeps it waiting."""

    def rank(item: pytest.Item) -> int:
        long = [n for n, prefix in enumerate(LONG) if item.nodeid.startswith(prefix)]
        return long[0] if long else len(LONG) + (item.get_closest_marker("slow") is None)

    items.sort(key=rank)


@pytest.fixture
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new SQLite file, or the session's PostgreSQL database emptied: SQLite unless
    the test is marked ``both_stores`` (then both) or asks for one by parameter."""
    if getattr(request, "param", "sqlite") == "sqlite":
        return f"sqlite:///{tmp_path / 'fences.db'}"
    server: PostgresServer = request.getfixturevalue("postgres")
    url = server.url("fenceproxy")
    asyncio.run(sql(url, "TRUNCATE fences, idempotency_keys, leases, inflight"))
    return url


@pytest.fixture
async def database(postgres: PostgresServer) -> str:
    """The session's PostgreSQL database, emptied: for proxies run as processes."""
    url = postgres.url("fenceproxy")
    await sql(url, "TRUNCATE fences, idempotency_keys, leases, inflight")
    return url


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "fences.db"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def proxy_config(upstream: RecordingUpstream, store_url: str) -> Callable[..., Any]:
    def build(routes: list[dict[str, Any]] | None = None, **top: Any) -> Any:
        data = {
            "store": store_url,
            "routes": routes
            if routes is not None
            else [{"name": "billing", "path": "/billing/", "upstream": upstream.url}],
            **top,
        }
        return parse_config(data, "test.yaml")

    return build


@pytest.fixture
def start_proxy(
    aiohttp_client: Any, proxy_config: Callable[..., Any], clock: FakeClock
) -> ProxyFactory:
    """Start the proxy on loopback; returns a client pointed at it. ``store`` goes to
    the proxy, ``server_kwargs`` to :class:`ProxyTestServer` (``handler_cancellation``),
    the rest to the config."""

    async def start(
        routes: list[dict[str, Any]] | None = None,
        *,
        store: Store | None = None,
        server_kwargs: dict[str, Any] | None = None,
        **top: Any,
    ) -> TestClient[Any, Any]:
        proxy = FenceProxy(proxy_config(routes, **top), store=store, clock=clock)
        client: TestClient[Any, Any] = await aiohttp_client(
            ProxyTestServer(proxy, **(server_kwargs or {}))
        )
        return client

    return start


@pytest.fixture
async def proxy(start_proxy: ProxyFactory) -> TestClient[Any, Any]:
    return await start_proxy()


async def admit(store: Store, write: FencedWrite) -> Admit | Replay | Refusal | Busy:
    """The store's decision on ``write``, without the instant it was dated."""
    decision, _ = await store.admit(write)
    return decision


def proxy_of(client: TestClient[Any, Any]) -> FenceProxy:
    server = client.server
    assert isinstance(server, ProxyTestServer)
    return server.proxy


def store_of(client: TestClient[Any, Any]) -> Store:
    return proxy_of(client).store


async def fenced(
    client: TestClient[Any, Any],
    job: str | None,
    generation: int | str | None,
    *,
    key: str | None = None,
    body: Any = None,
    path: str = "/billing/charges",
    method: str = "POST",
    headers: dict[str, str] | None = None,
) -> ClientResponse:
    h = dict(headers or {})
    if job is not None:
        h["Fencing-Job"] = job
    if generation is not None:
        h["Fencing-Token"] = str(generation)
    if key is not None:
        h["Idempotency-Key"] = key
    return await client.request(method, path, json=body if body is not None else {}, headers=h)


async def raw_request(port: int, data: bytes) -> bytes:
    """Send bytes as they are to 127.0.0.1:port; return everything answered until close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await reader.read()
    finally:
        writer.close()


@asynccontextmanager
async def running(
    config: str | os.PathLike[str],
    *args: str,
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> AsyncIterator[ProxyProcess]:
    """A proxy process serving ``config`` (``args`` added to its command line, ``env``
    to its environment) for the block, on ``port`` or a free one; killed as the block
    ends, even by a failure."""
    proxy = ProxyProcess(config, free_port() if port is None else port, *args, env=env)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


async def refused_start(config: str | os.PathLike[str]) -> str:
    """What a proxy process that does not start with ``config`` says as it exits (a
    start that succeeds fails the test)."""
    proxy = ProxyProcess(config, free_port())
    try:
        with pytest.raises(RuntimeError) as stopped:
            await proxy.start()
    finally:
        await proxy.stop()
    return str(stopped.value)


def write_decisions(proxy: ProxyProcess, job: str) -> list[dict[str, Any]]:
    """The decisions a proxy process took on a job's writes, oldest first, as its
    admin listener's ``/events`` tells them."""
    events = httpx.get(f"{proxy.admin_url}/events", params={"job": job, "limit": 2000})
    return [e for e in events.raise_for_status().json()["events"] if e["action"] == "write"]


def run_under_lease(
    proxy: ProxyProcess, job: str, script: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """The shell ``script`` under ``fenceproxy run JOB``, which claims the job from
    ``proxy`` and gives the script the lease in its environment (``env`` and more)."""
    runner = [sys.executable, "-m", "fenceproxy", "run", job, "--url", proxy.url]
    return subprocess.run(
        [*runner, "--", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=120
    )


# CI runs the property tests on a fixed seed so a landing is reproducible; locally
# each run explores new examples.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
