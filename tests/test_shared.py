"""Several proxies, one truth: real proxy processes on one PostgreSQL database, a
proxy killed with SIGKILL mid-write, the database restarted under traffic, and the
proxies' sessions ended by the server mid-batch."""

from __future__ import annotations

import asyncio
import random
import re
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
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


async def inflight_scans(conn: asyncpg.Connection) -> tuple[int, int, int]:
    """The in-flight table's sequential scans, scans of its primary key, and scans of
    any other index, as every session has reported them so far."""
    await conn.execute("SELECT pg_stat_force_next_flush()")  # this session's own
    row = await conn.fetchrow(
        "SELECT t.seq_scan,"
        " coalesce(sum(i.idx_scan) FILTER (WHERE i.indexrelname = 'inflight_pkey'), 0),"
        " coalesce(sum(i.idx_scan) FILTER (WHERE i.indexrelname <> 'inflight_pkey'), 0)"
        " FROM pg_stat_user_tables t LEFT JOIN pg_stat_user_indexes i USING (relid)"
        " WHERE t.relname = 'inflight' GROUP BY t.seq_scan"
    )
    return int(row[0]), int(row[1]), int(row[2])


async def test_admissions_read_the_in_flight_table_by_key_after_autovacuum(
    spawn: Callable[..., ProxyProcess], http: aiohttp.ClientSession, database: str
) -> None:
    """Autovacuum finds the in-flight table all but empty, its few live rows (the
    writes at the upstream) soon to expire, and plans made then would read the whole
    table, or every entry of an index by expiry, dead rows included, for each
    admission until the next vacuum. Here as autovacuum leaves it: analyzed with a
    few rows since expired, vacuumed; the plans made; 20,000 records ended (dead rows,
    not vacuumed); then 50 writes, each of which must find its job's records by the
    primary key alone."""
    conn = await asyncpg.connect(database)
    try:
        await conn.execute("ALTER TABLE inflight SET (autovacuum_enabled = false)")
        now = "extract(epoch FROM clock_timestamp())"
        await conn.execute(
            "INSERT INTO inflight (job, holder, state, expires_at)"
            f" SELECT 'gone-' || n, 'h', 'in_flight', {now} FROM generate_series(1, 30) AS n"
        )
        await conn.execute("ANALYZE inflight")
        await conn.execute("DELETE FROM inflight WHERE job LIKE 'gone-%'")
        await conn.execute("VACUUM inflight")
        proxy = await spawn().start()
        for n in range(20):  # the plans, made on those statistics
            assert await write(http, proxy, f"warm-{n}", 1) == (200, "")
        await conn.execute(
            "INSERT INTO inflight (job, holder, state, expires_at) SELECT 'ended-' || n,"
            f" 'h', 'in_flight', {now} + 3600 FROM generate_series(1, 20000) AS n"
        )
        await conn.execute("DELETE FROM inflight WHERE job LIKE 'ended-%'")
        seq, key, other = await inflight_scans(conn)
        for n in range(50):
            assert await write(http, proxy, f"job-{n}", 1) == (200, "")
        # A session reports its counts at the end of a transaction a second or more
        # after its last report (or after 10 s idle): one more write every half second
        # until all 50 are in. Those more are held to the same rule.
        for n in range(60):
            if (await inflight_scans(conn))[1] - key >= 50:
                break
            await asyncio.sleep(0.5)
            assert await write(http, proxy, f"more-{n}", 1) == (200, "")
        scans = await inflight_scans(conn)
        assert scans[1] - key >= 50
        assert (scans[0] - seq, scans[2] - other) == (0, 0)
    finally:
        await conn.execute("ALTER TABLE inflight RESET (autovacuum_enabled)")
        await conn.close()


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


# The server processes of the proxies' store connections waiting on an advisory lock:
# a batch whose admission waits for a job the test holds.
_WAITING = (
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
    " AND wait_event_type = 'Lock' AND wait_event = 'advisory'"
)
_HOLD = "SELECT pg_advisory_lock(hashtextextended($1, 0))"
# What a proxy logs of each store connection it drops: the backend's process id, and why.
_DROPPED = re.compile(
    r" WARNING fenceproxy\.store .* dropped its connection to backend (\d+): (.*)"
)


async def waiting(conn: asyncpg.Connection, count: int) -> list[int]:
    """The ``count`` backends waiting on an advisory lock, once that many are."""
    async with asyncio.timeout(10):
        while len(pids := [pid for (pid,) in await conn.fetch(_WAITING)]) < count:
            await asyncio.sleep(0.01)
    return pids


def dropped(proxy: ProxyProcess) -> list[tuple[int, str]]:
    """The store connections ``proxy`` logged as dropped: (backend, why)."""
    return [(int(m[1]), m[2]) for m in _DROPPED.finditer(proxy.output())]


async def claim(http: aiohttp.ClientSession, proxy: ProxyProcess, job: str) -> int:
    async with http.post(f"{proxy.url}/_leases/{job}/claim", json={"owner": "w"}) as answer:
        return answer.status


async def test_sessions_ended_mid_batch_fail_once_and_the_next_write_on_each_proxy_succeeds(
    spawn: Callable[..., ProxyProcess],
    http: aiohttp.ClientSession,
    upstream: RecordingUpstream,
    database: str,
) -> None:
    """The server ends every session of two proxies (``pg_terminate_backend``, as an
    operator, a pooler or a server shutting down does) while each proxy's batch waits
    in it, with writes queued behind and claims coming through both. A write whose
    batch was cut gets 503 ``store-unavailable`` and is never forwarded. A connection
    lost costs at most its one operation: it is never used again, and its proxy logs
    it once, a warning naming the server's process and why, never a traceback. A
    claim right after is granted, and the next write on each proxy is forwarded."""
    proxies = [await spawn().start(), await spawn().start()]
    for n, proxy in enumerate(proxies):  # each pool holds connections
        assert await write(http, proxy, f"warm{n}", 1) == (200, "")
    stop = asyncio.Event()
    writes: list[tuple[int, str]] = []
    claims: list[int] = []

    async def writing(n: int) -> None:
        generation = 0
        while not stop.is_set():
            generation += 1
            writes.append(await write(http, proxies[n % 2], f"job{n}", generation))

    async def claiming(n: int) -> None:
        while not stop.is_set():
            claims.append(await claim(http, proxies[n % 2], f"lease{n}.{len(claims)}"))

    holder = await asyncpg.connect(database)
    workers = []
    try:
        await holder.execute(_HOLD, "held")
        cut = [asyncio.ensure_future(write(http, proxy, "held", 1)) for proxy in proxies]
        cut_pids = await waiting(holder, 2)  # one batch per proxy, each on its connection
        workers = [asyncio.ensure_future(w(n)) for n in range(4) for w in (writing, claiming)]
        async with asyncio.timeout(10):
            while len(claims) < 10:  # lease calls run beside the batches
                await asyncio.sleep(0.01)
        # Every session but this one; each call waits until its process has ended.
        ended = await holder.fetch(
            "SELECT pid, pg_terminate_backend(pid, 10000) AS gone FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        assert all(row["gone"] for row in ended), ended
        terminated = {row["pid"] for row in ended}
        assert set(cut_pids) <= terminated
        after = [await claim(http, proxy, f"after{n}") for n, proxy in enumerate(proxies)]
        assert after == [200, 200]
        assert [await c for c in cut] == [(503, "store-unavailable")] * 2
    finally:
        stop.set()
        await asyncio.gather(*workers)
        await holder.close()
    assert {kind for status, kind in writes if status != 200} <= {"store-unavailable"}, writes
    assert set(claims) <= {200, 503}, claims
    for n, proxy in enumerate(proxies):
        assert await write(http, proxy, "next", n + 1) == (200, "")
    received = [(r.job, r.generation) for r in upstream.received]
    assert received[-2:] == [("next", 1), ("next", 2)]
    assert "held" not in {job for job, _ in received}
    for proxy in proxies:
        output = proxy.output()
        assert "Traceback" not in output
        lost = dropped(proxy)
        warnings = [line for line in output.splitlines() if " WARNING " in line]
        assert len(warnings) == len(lost), warnings  # every warning is a lost connection
        assert len({pid for pid, _ in lost}) == len(lost), lost  # each logged once
        assert {pid for pid, _ in lost} <= terminated, (lost, terminated)
        cut_lines = [why for pid, why in lost if pid in cut_pids]
        assert len(cut_lines) == 1, f"its cut batch's connection, logged once: {warnings}"
        assert "terminating connection due to administrator command" in cut_lines[0], cut_lines


async def test_a_connection_whose_statement_failed_is_closed_not_used_again(
    spawn: Callable[..., ProxyProcess],
    http: aiohttp.ClientSession,
    upstream: RecordingUpstream,
    database: str,
) -> None:
    """A statement of a batch fails (an operator cancels it with ``pg_cancel_backend``
    while it waits): the batch's write gets 503 ``store-unavailable``, nothing is
    forwarded, and the connection it ran on is closed rather than given back to the
    pool. The proxy cannot tell a failed connection that still works from one whose
    server is ending it (the server's last word has come, the socket's end not yet),
    and the next caller on that one would fail too. The next write runs on a new
    connection, and the proxy logs the one it dropped once."""
    proxy = await spawn().start()
    gone = "SELECT NOT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)"
    holder = await asyncpg.connect(database)
    try:
        await holder.execute(_HOLD, "held")
        cut = asyncio.ensure_future(write(http, proxy, "held", 1))
        (pid,) = await waiting(holder, 1)
        assert await holder.fetchval("SELECT pg_cancel_backend($1)", pid)
        assert await cut == (503, "store-unavailable")
        try:
            async with asyncio.timeout(10):  # its process ends once the proxy hangs up
                while not await holder.fetchval(gone, pid):
                    await asyncio.sleep(0.01)
        except TimeoutError:
            pytest.fail(f"the connection to backend {pid} was kept after its statement failed")
    finally:
        await holder.close()
    assert await write(http, proxy, "next", 1) == (200, "")
    assert [(r.job, r.generation) for r in upstream.received] == [("next", 1)]
    ((logged, why),) = dropped(proxy)
    assert logged == pid
    assert why.startswith("QueryCanceledError: canceling statement due to user request"), why
