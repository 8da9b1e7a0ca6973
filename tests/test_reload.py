"""SIGHUP reloads the config of a real proxy process: routes, limits and log settings
change for the next request while a write already at the upstream finishes as it
started; a config that is not valid is refused in one line naming its file and key,
and the running one goes on; what takes a restart is said."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from fenceproxy.testing import ProxyProcess, RecordingUpstream, eventually, free_port

from .conftest import running


@dataclass(frozen=True)
class ConfigFile:
    """The config file a proxy process serves, and the SQLite store it names."""

    path: Path
    store: str

    def write(self, **config: Any) -> None:
        """Write ``config`` over the file, as YAML, with this store unless it names one."""
        self.path.write_text(yaml.safe_dump({"store": self.store, **config}))


@pytest.fixture
def config(tmp_path: Path) -> ConfigFile:
    return ConfigFile(tmp_path / "proxy.yaml", f"sqlite:///{tmp_path / 'fences.db'}")


def fence(job: str, generation: int) -> dict[str, str]:
    return {"Fencing-Job": job, "Fencing-Token": str(generation)}


@pytest.fixture
async def second() -> AsyncIterator[RecordingUpstream]:
    async with RecordingUpstream.serve() as up:
        yield up


async def reload(proxy: ProxyProcess, word: str) -> str:
    """SIGHUP, then wait for the line that says how it went; that line."""
    seen = proxy.output().count(word)
    proxy.signal(signal.SIGHUP)
    await eventually(lambda: proxy.output().count(word) > seen)
    return [line for line in proxy.output().splitlines() if word in line][-1]


async def test_a_reload_changes_routes_limits_and_logs_while_a_write_is_in_flight(
    config: ConfigFile,
    upstream: RecordingUpstream,
    second: RecordingUpstream,
    http: aiohttp.ClientSession,
) -> None:
    config.write(routes=[{"name": "billing", "path": "/billing/", "upstream": upstream.url}])
    async with running(config.path) as proxy, contextlib.AsyncExitStack() as stack:
        url = proxy.url
        assert (await http.post(f"{url}/billing/a", headers=fence("j1", 2))).status == 200
        assert (await http.post(f"{url}/ledger/a", headers=fence("j2", 1))).status == 404
        # A write held at the first upstream while the config changes under it.
        release = upstream.hold()
        stack.callback(release)  # even when an assertion fails before its turn
        in_flight = asyncio.ensure_future(
            http.post(f"{url}/billing/b", headers=fence("j1", 2), data=b"held")
        )
        await upstream.wait_for(2)
        config.write(
            log_format="json",
            routes=[
                {"name": "billing", "path": "/billing/", "upstream": second.url, "max_body": 8},
                {"name": "ledger", "path": "/ledger/", "upstream": second.url},
            ],
        )
        line = await reload(proxy, "reloaded")
        assert json.loads(line)["message"] == f"reloaded {config.path}: 2 route(s)"

        # The new routes serve the next request (of another job: j1 has a write in
        # flight), on a connection opened before.
        answer = await http.post(f"{url}/billing/c", headers=fence("j3", 1), data=b"new")
        assert answer.status == 200
        assert (await http.post(f"{url}/ledger/a", headers=fence("j2", 1))).status == 200
        assert [r.path_qs for r in second.received] == ["/billing/c", "/ledger/a"]
        too_big = await http.post(f"{url}/billing/d", headers=fence("j3", 1), data=b"9 bytes!!")
        assert too_big.status == 413
        # The held write finishes at the upstream it was sent to, answered whole.
        release()
        held = await in_flight
        assert held.status == 200
        assert [r.body for r in upstream.received] == [b"", b"held"]
        # The fence is the same store's: what it knew before the reload still holds.
        stale = await http.post(f"{url}/billing/e", headers=fence("j1", 1))
        assert stale.status == 409
        # Log lines after the reload are JSON, the decision's included.
        await eventually(lambda: "stale-generation" in proxy.output())
        last = proxy.output().splitlines()[-1]
        assert json.loads(last)["decision"] == "stale-generation"


async def test_a_config_that_is_not_valid_is_refused_and_the_running_one_serves(
    tmp_path: Path, config: ConfigFile, upstream: RecordingUpstream, http: aiohttp.ClientSession
) -> None:
    path = config.path
    route = {"name": "billing", "path": "/billing/", "upstream": upstream.url}
    config.write(routes=[route])
    async with running(path) as proxy:
        url = proxy.url

        config.write(routes=[{**route, "upstreem": upstream.url}])
        line = await reload(proxy, "reload refused")
        assert line.endswith(
            f"reload refused, the running config stays: {path}: routes[0].upstreem: "
            "unknown key; did you mean 'upstream'?"
        )
        assert (await http.post(f"{url}/billing/a", headers=fence("j", 1))).status == 200

        path.write_text("routes: [\n")
        line = await reload(proxy, "reload refused")
        assert f"{path}: line 2, column 1: invalid YAML" in line

        path.unlink()
        line = await reload(proxy, "reload refused")
        assert f"{path}: cannot read" in line
        assert (await http.post(f"{url}/billing/b", headers=fence("j", 1))).status == 200
        assert len(upstream.received) == 2

        # The store and the key lifetime take a restart: the reload says so, and the
        # rest of the file is taken.
        other = f"sqlite:///{tmp_path / 'other.db'}"
        config.write(store=other, idempotency={"ttl": "1h"}, routes=[{**route, "max_body": 4}])
        line = await reload(proxy, "reloaded")
        assert line.endswith(
            f"reloaded {path}: 1 route(s); not changed until a restart: store (still "
            f"SQLite file {tmp_path / 'fences.db'}), idempotency.ttl (still 86400s)"
        )
        assert "WARNING" in line
        too_big = await http.post(f"{url}/billing/c", headers=fence("j", 1), data=b"12345")
        assert too_big.status == 413
        stale = await http.post(f"{url}/billing/c", headers=fence("j", 0))
        assert stale.status == 409  # the running store, which saw generation 1
        assert not (tmp_path / "other.db").exists()
        assert "Traceback" not in proxy.output()


async def test_a_file_valid_alone_is_refused_when_it_is_not_with_the_running_store(
    config: ConfigFile, upstream: RecordingUpstream, http: aiohttp.ClientSession
) -> None:
    route = {"name": "billing", "path": "/billing/", "upstream": upstream.url,
             "fence": {"check_lease": True}}  # fmt: skip
    config.write(leases={}, routes=[route])
    async with running(config.path) as proxy:
        # Valid on PostgreSQL, where another proxy may serve the lease API; but the
        # store stays SQLite until a restart, and there nothing could hold a lease.
        config.write(store="postgresql://fp@127.0.0.1:1/fp", routes=[route])
        line = await reload(proxy, "reload refused")
        assert "routes[0].fence.check_lease is on, and no lease API shares" in line
        assert line.endswith("(checked with store as running: a restart changes those)")
        claim = await http.post(f"{proxy.url}/_leases/j/claim", json={"owner": "w"})
        assert claim.status == 200  # the lease API is still there


async def test_a_reload_that_opens_the_lease_api_beyond_loopback_warns(
    config: ConfigFile, upstream: RecordingUpstream
) -> None:
    port = free_port()
    route = {"name": "billing", "path": "/billing/", "upstream": upstream.url}
    config.write(routes=[route])
    async with running(config.path, "--listen", f"0.0.0.0:{port}", port=port) as proxy:
        assert "takes no credentials" not in proxy.output()
        config.write(leases={}, routes=[route])
        await reload(proxy, "reloaded")
        await eventually(lambda: "takes no credentials" in proxy.output())


async def test_systemd_is_told_once_the_proxy_listens(
    tmp_path: Path, config: ConfigFile, upstream: RecordingUpstream
) -> None:
    config.write(routes=[{"name": "billing", "path": "/billing/", "upstream": upstream.url}])
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.setblocking(False)
    port = free_port()
    proxy = ProxyProcess(config.path, port, env={"NOTIFY_SOCKET": str(tmp_path / "notify")})
    try:
        process = asyncio.ensure_future(proxy.start())
        loop = asyncio.get_running_loop()
        message = await asyncio.wait_for(loop.sock_recv(notify, 64), 20)
        assert message == b"READY=1"
        # Ready means listening: a connection is taken at once.
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        await process
    finally:
        notify.close()
        await proxy.stop()


async def test_a_write_retried_after_its_route_was_renamed_is_replayed_not_applied_again(
    config: ConfigFile, upstream: RecordingUpstream, http: aiohttp.ClientSession
) -> None:
    route = {"name": "orders", "path": "/orders/", "upstream": upstream.url}
    config.write(routes=[route])
    async with running(config.path) as proxy, contextlib.AsyncExitStack() as stack:
        release = upstream.hold()
        stack.callback(release)  # even when an assertion fails before its turn
        headers = {**fence("j", 3), "Idempotency-Key": "charge-1"}
        url = f"{proxy.url}/orders/charges"
        first = asyncio.ensure_future(http.post(url, headers=headers, data=b"charge $10"))
        await upstream.wait_for(1)
        config.write(routes=[{**route, "name": "orders-v2"}])
        await reload(proxy, "reloaded")
        release()
        assert (await first).status == 200
        retry = await http.post(url, headers=headers, data=b"charge $10")
        assert retry.status == 200
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert len(upstream.received) == 1
