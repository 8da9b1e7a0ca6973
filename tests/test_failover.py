"""The database's own failure: two proxy processes on a real Patroni cluster (one
etcd member, two PostgreSQL nodes, synchronous replication), workers claiming jobs,
writing with keys and completing through both proxies, and the primary's PostgreSQL
and Patroni killed with SIGKILL in the middle. Then the old primary comes back and
must rejoin as a standby. What the upstream applied and what the new primary holds
are checked against every answer the workers were given.

Patroni's settings (tests/patroni.py): ttl 10 s, loop_wait 2 s, retry_timeout 3 s,
synchronous_mode on; a standby is promoted once the dead leader's key expires."""

from __future__ import annotations

import asyncio
import collections
import inspect
import os
import random
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import pytest
from aiohttp import web

from fenceproxy.errors import Refusal, StoreError
from fenceproxy.fence.fencing import Admit, FencedWrite
from fenceproxy.store import migrate_store, open_store
from fenceproxy.store.postgres import SCHEMA_VERSION
from fenceproxy.testing import ProxyProcess, Received, RecordingUpstream, free_port

from .patroni import NODES, PatroniCluster, patroni_available
from .postgres import sql
from .test_admin import samples

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOBS = 3


@pytest.fixture
def cluster() -> Iterator[PatroniCluster]:
    yield from _cluster(synchronous=True)


def _cluster(*, synchronous: bool) -> Iterator[PatroniCluster]:
    missing = patroni_available()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"{missing}, and CI must run every test")
        pytest.skip(f"{missing} (make servers installs Debian's patroni and etcd-server)")
    # Not under pytest's temporary folder: the postgres user must reach it.
    with (
        tempfile.TemporaryDirectory(prefix="fenceproxy-patroni-") as directory,
        PatroniCluster(Path(directory), synchronous=synchronous) as running,
    ):
        running.start()
        yield running


@dataclass
class Ledger:
    """What the upstream applied, when, and what the workers were told."""

    applied: list[tuple[float, Received]] = field(default_factory=list)
    claims: list[tuple[float, str, int]] = field(default_factory=list)
    """(when the claim was answered, job, generation)"""
    accepted: list[tuple[float, str, int, str]] = field(default_factory=list)
    """(when the 2xx came, job, generation, key)"""
    answers: list[tuple[float, int, str]] = field(default_factory=list)
    """(when, status, problem kind) of every write's answer"""
    refused_claims: collections.Counter[str] = field(default_factory=collections.Counter)
    completed: list[int] = field(default_factory=lambda: [0] * JOBS)
    """Per slot, how many of its jobs were completed: the next job's number"""

    def __str__(self) -> str:
        kinds = collections.Counter(f"{status} {kind}" for _, status, kind in self.answers)
        return (
            f"{len(self.claims)} claims ({dict(self.refused_claims)} refused), "
            f"answers {dict(kinds)}, {len(self.applied)} applied"
        )

    def acks_after(self, at: float) -> int:
        return sum(1 for t, *_ in self.accepted if t > at)


async def _kind(response: aiohttp.ClientResponse) -> str:
    data = await response.json(content_type=None)
    return str(data.get("type", "")).rsplit(":", 1)[-1] if isinstance(data, dict) else ""


async def worker(
    n: int, proxies: list[ProxyProcess], http: aiohttp.ClientSession, ledger: Ledger,
    stop: asyncio.Event,
) -> None:  # fmt: skip
    """Claim one of the three jobs (a completed one is followed by a new one), write
    with keys (a write that got no answer, or 503, is sent again with its key),
    complete. One claim in four, the worker pauses past its lease first, as a
    stalled process does: its writes must then be refused."""
    rng = random.Random(n)
    sent = 0
    while not stop.is_set():
        proxy = proxies[rng.randrange(len(proxies))]
        slot = rng.randrange(JOBS)
        job = f"j{slot}.{ledger.completed[slot]}"
        try:
            async with http.post(
                f"{proxy.url}/_leases/{job}/claim", json={"owner": f"w{n}", "ttl": 2}
            ) as claim:
                if claim.status != 200:
                    ledger.refused_claims[f"{claim.status} {await _kind(claim)}"] += 1
                    await asyncio.sleep(0.05)
                    continue
                lease = await claim.json()
        except aiohttp.ClientError:
            continue
        generation = int(lease["generation"])
        ledger.claims.append((time.monotonic(), job, generation))
        if rng.random() < 0.25:
            await asyncio.sleep(2.5)  # the lease runs out meanwhile
        for _ in range(3):
            sent += 1
            key = f"w{n}-{sent}"
            headers = {
                "Fencing-Job": job,
                "Fencing-Token": str(lease["token"]),
                "Idempotency-Key": key,
            }
            status = 0
            while not stop.is_set():
                target = proxies[rng.randrange(len(proxies))]
                try:
                    async with http.post(
                        f"{target.url}/api/{job}", json={"n": sent}, headers=headers
                    ) as answer:
                        status, kind = answer.status, await _kind(answer)
                except aiohttp.ClientError:
                    continue  # no answer: the same key again
                ledger.answers.append((time.monotonic(), status, kind))
                if status == 200:
                    ledger.accepted.append((time.monotonic(), job, generation, key))
                if status != 503:
                    break
                await asyncio.sleep(0.05)
            if status != 200:
                break  # refused: the lease is gone, or the job is elsewhere
        try:
            async with http.post(
                f"{proxy.url}/_leases/{job}/complete",
                json={"owner": f"w{n}", "generation": generation},
            ) as completed:
                if completed.status == 200:  # a completed job is never claimed again
                    ledger.completed[slot] += 1
        except aiohttp.ClientError:
            pass


@pytest.fixture
def ledger(upstream: RecordingUpstream) -> Ledger:
    """A ledger in which the upstream notes every write it applies."""
    ledger = Ledger()

    async def applied(request: web.Request, received: Received) -> web.StreamResponse:
        ledger.applied.append((time.monotonic(), received))
        return web.json_response({"applied": True})

    upstream.respond = applied
    return ledger


async def readiness(http: aiohttp.ClientSession, proxy: ProxyProcess) -> dict[str, Any]:
    async with http.get(f"{proxy.admin_url}/readyz") as ready:
        body: dict[str, Any] = await ready.json(content_type=None)
        body["status_code"] = ready.status
        return body


async def synchronous_standby(http: aiohttp.ClientSession, proxy: ProxyProcess) -> float:
    """``fenceproxy_store_synchronous_standby`` as the proxy's metrics read it now."""
    async with http.get(f"{proxy.admin_url}/metrics") as page:
        return samples(await page.text())[("fenceproxy_store_synchronous_standby", ())]


async def until(
    condition: Callable[[], Any], within: float, what: str, details: Callable[[], str] = str
) -> None:
    """Poll ``condition`` (a function, or a coroutine function) until it is true."""
    try:
        async with asyncio.timeout(within):
            while not await _value(condition()):
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {within} s: {what}{details()}") from None


async def test_a_failover_under_traffic_loses_nothing_and_lets_nothing_stale_through(
    cluster: PatroniCluster,
    upstream: RecordingUpstream,
    ledger: Ledger,
    tmp_path: Path,
) -> None:
    url = cluster.url()
    assert await migrate_store(url) == (0, SCHEMA_VERSION)
    proxies = []
    for n in range(2):
        config = tmp_path / f"proxy{n}.yaml"
        config.write_text(
            f"store: '{url}?pool=4&require_sync=true'\nleases: {{}}\nshutdown_timeout: 2s\n"
            f"admin: 127.0.0.1:{free_port()}\nroutes:\n"
            f"  - {{name: api, path: /api, upstream: '{upstream.url}', timeout: 1s,"
            " quarantine: 1s}\n"
        )
        proxies.append(await ProxyProcess(config, free_port(), "--log-level", "WARNING").start())
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as http:
        workers = [asyncio.ensure_future(worker(n, proxies, http, ledger, stop)) for n in range(6)]
        try:
            old = cluster.leader()
            assert old is not None
            # require_sync needs to see the standbys' state: until the role may, the
            # proxies are not ready, and say what to do.
            unready = await readiness(http, proxies[0])
            assert "grant it pg_monitor" in unready["detail"], unready
            assert await synchronous_standby(http, proxies[0]) == 0  # what the alert reads
            await sql(cluster.node_url(old, "postgres", user="postgres"),
                      "GRANT pg_monitor TO fenceproxy")  # fmt: skip
            for proxy in proxies:
                ready = await readiness(http, proxy)
                assert ready["status_code"] == 200, ready
                assert ready["primary"] == f"127.0.0.1:{cluster.pg_port(old)}"
                assert await synchronous_standby(http, proxy) == 1

            await until(
                lambda: ledger.acks_after(0) >= 20,
                30,
                "20 writes before the kill",
                lambda: f": {ledger}",
            )
            standby = next(name for name in NODES if name != old)
            watching = await asyncpg.connect(cluster.node_url(standby, "postgres", "postgres"))
            killed = time.monotonic()
            await asyncio.to_thread(cluster.kill, old)
            in_recovery = killed  # until when the standby surely was one still
            try:
                async with asyncio.timeout(60):  # when the standby first takes writes
                    while True:
                        asked = time.monotonic()
                        if not await watching.fetchval("SELECT pg_is_in_recovery()"):
                            break
                        in_recovery = asked  # answered after it was asked: in recovery then
                        await asyncio.sleep(0.01)
                promoted = time.monotonic()
            finally:
                await watching.close()
            new, _ = await asyncio.to_thread(cluster.wait_leader, old, 60)
            assert new == standby
            await until(
                lambda: ledger.acks_after(promoted) >= 20,
                30,
                "writes resume",
                lambda: f": {ledger}",
            )
            resumed = min(t for t, *_ in ledger.accepted if t > killed + 1.0)

            # The old primary comes back: it must rejoin as a standby, and no proxy
            # may write to it.
            await asyncio.to_thread(cluster.restart, old)
            await asyncio.to_thread(cluster.wait_role, old, "replica", 90)
            rejoined = time.monotonic()
            await until(
                lambda: ledger.acks_after(rejoined) >= 20, 30, "writes go on", lambda: f": {ledger}"
            )
        finally:
            stop.set()
            await asyncio.gather(*workers)
        for proxy in proxies:
            ready = await readiness(http, proxy)
            assert ready["primary"] == f"127.0.0.1:{cluster.pg_port(new)}", ready
            assert ready["failovers"] >= 1
        # With the old primary back as a synchronous standby, require_sync is met.
        await until(lambda: _all_ready(http, proxies), 30, "ready again with a synchronous standby")
    for proxy in proxies:
        print(proxy.output())
        await proxy.stop()

    print(
        f"kill -> promoted {promoted - killed:.1f} s, -> first write applied "
        f"{resumed - killed:.1f} s; rejoined as a standby {rejoined - killed:.1f} s after; "
        f"{ledger}"
    )
    assert resumed - killed <= 15.0

    applied = [(t, r.job, r.generation, r.key) for t, r in ledger.applied]
    # No key applied twice.
    keys = [key for *_, key in applied]
    assert len(keys) == len(set(keys))
    # Per job, never an older generation after a newer one.
    for job in {j for _, j, _, _ in applied}:
        generations = [g for _, j, g, _ in applied if j == job]
        assert generations == sorted(generations), job
    # No holder's write applied after a newer claim of its job was answered.
    for t, job, generation, key in applied:
        newer = [c for c, j, g in ledger.claims if j == job and g > generation and c < t]  # type: ignore[operator]
        assert not newer, (job, generation, key)
    # Nothing forwarded while no primary answered: what was admitted before the kill
    # was sent within milliseconds of it, and the rest waited for the promotion (the
    # standby answered that it was in recovery to a poll asked at in_recovery, seen
    # from this process however late a loaded machine lets it read the answer).
    assert not [a for a in applied if killed + 1.0 < a[0] < in_recovery]
    assert any(kind == "store-unavailable" for t, _, kind in ledger.answers if t > killed)
    # Every write answered 2xx was applied, and the new primary holds its fence and
    # key; so does every write the upstream applied: none went without an admission
    # that outlived the old primary.
    assert {k for *_, k in ledger.accepted} <= set(keys)
    conn = await asyncpg.connect(cluster.node_url(new, "fenceproxy"))
    try:
        fences = dict(await conn.fetch("SELECT job, generation FROM fences"))
        stored = {k for (k,) in await conn.fetch("SELECT key FROM idempotency_keys")}
    finally:
        await conn.close()
    for _, job, generation, key in [*ledger.accepted, *applied]:
        assert fences[job] >= generation
        assert key in stored
    # The old primary is a standby that replays what the new one holds, and no proxy
    # keeps a connection to it (the driver looks at each host it lists, and leaves a
    # standby at once).
    old_conn = await asyncpg.connect(cluster.node_url(old, "fenceproxy"))
    try:
        assert await old_conn.fetchval("SELECT pg_is_in_recovery()")

        async def replayed() -> bool:
            return dict(await old_conn.fetch("SELECT job, generation FROM fences")) == fences

        await until(replayed, 10, "the old primary replays the new one's fences")
        assert not await old_conn.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'fenceproxy'"
            " AND backend_start < now() - interval '1 second'"
        )
    finally:
        await old_conn.close()


async def _value(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


async def _all_ready(http: aiohttp.ClientSession, proxies: list[ProxyProcess]) -> bool:
    return all([(await readiness(http, p))["status_code"] == 200 for p in proxies])


@pytest.fixture
def asynchronous() -> Iterator[PatroniCluster]:
    yield from _cluster(synchronous=False)


async def test_an_asynchronous_cluster_is_not_ready_and_can_lose_a_fence_in_a_failover(
    asynchronous: PatroniCluster,
) -> None:
    """Patroni with synchronous_mode off: a failover may promote a standby without
    the primary's last commits, so the last fences. ``require_sync`` says so; and
    without it, a fence acknowledged before the failover is lost, and the stale
    write it refused is admitted after."""
    url = asynchronous.url()
    await migrate_store(url)
    leader = asynchronous.leader()
    assert leader is not None
    await sql(asynchronous.node_url(leader, "postgres", user="postgres"),
              "GRANT pg_monitor TO fenceproxy")  # fmt: skip
    store = await open_store(f"{url}?require_sync=true", key_ttl=60.0)
    try:
        with pytest.raises(StoreError, match="synchronous_standby_names is empty"):
            await store.check()
        assert store.server.address == f"127.0.0.1:{asynchronous.pg_port(leader)}"
    finally:
        await store.close()
    # Without it the same cluster is ready, and this is what it risks: the primary
    # acknowledges a fence the standby does not have yet (its WAL sender is paused,
    # as a slow network or a busy standby would), and dies.
    standby = next(name for name in NODES if name != leader)
    unchecked = await open_store(url, key_ttl=60.0)
    try:
        await unchecked.check()
        first, second = FencedWrite("r", "j", 1), FencedWrite("r", "j", 2)
        assert isinstance((await unchecked.admit(first))[0], Admit)
        await unchecked.end_turn(first)
        replica = await asyncpg.connect(asynchronous.node_url(standby, "fenceproxy"))
        try:
            await until(
                lambda: replica.fetchval("SELECT generation = 1 FROM fences WHERE job = 'j'"),
                10, "the standby replays generation 1",
            )  # fmt: skip
        finally:
            await replica.close()
        senders = asynchronous.wal_senders(leader)
        assert senders
        for pid in senders:
            os.kill(pid, signal.SIGSTOP)
        assert isinstance((await unchecked.admit(second))[0], Admit)
        await unchecked.end_turn(second)
        refused = (await unchecked.admit(FencedWrite("r", "j", 1)))[0]
        assert isinstance(refused, Refusal)
        assert refused.slug == "stale-generation"
    finally:
        await unchecked.close()
    await asyncio.to_thread(asynchronous.kill, leader)
    assert (await asyncio.to_thread(asynchronous.wait_leader, leader, 60))[0] == standby
    promoted = await open_store(url, key_ttl=60.0)
    try:
        # Generation 2 was acknowledged, and is gone: the write of generation 1 that
        # the old primary refused is admitted, and would be forwarded.
        assert await promoted.generation("j") == 1
        assert isinstance((await promoted.admit(FencedWrite("r", "j", 1)))[0], Admit)
    finally:
        await promoted.close()
