"""Faults around a fenced write: stalled clients, unknown outcomes, a store that
fails or stalls at the worst moment, a handler cancelled mid-decision."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from fenceproxy.errors import StoreError
from fenceproxy.fence.fencing import FencedWrite, Replay, StoredResponse, fingerprint, scope
from fenceproxy.store import SQLiteStore
from fenceproxy.testing import FakeClock, Received, RecordingUpstream

from .conftest import ProxyFactory, admit, fenced
from .test_proxy import problem

pytestmark = pytest.mark.both_stores


class FaultyStore(SQLiteStore):
    """A real SQLite store whose chosen operations fail or wait on a gate."""

    fail_complete = 0
    stall_after_admit = 0.0
    lose_admit_reply = 0
    gate: asyncio.Event | None = None
    gated: str = ""
    entered: asyncio.Event

    async def _maybe_wait(self, name: str) -> None:
        if self.gated == name and self.gate is not None:
            self.entered.set()
            await self.gate.wait()

    async def admit(self, write: FencedWrite) -> Any:
        await self._maybe_wait("admit")
        admitted = await super().admit(write)
        await asyncio.sleep(self.stall_after_admit)
        if self.lose_admit_reply:
            self.lose_admit_reply -= 1
            raise StoreError("connection lost waiting for COMMIT's reply (injected)")
        return admitted

    async def end_turn(
        self, write: FencedWrite, *, unknown_for: float | None = None, key: Any = None
    ) -> None:
        if isinstance(key, StoredResponse):  # a keyed write's answer, and its record's end
            await self._maybe_wait("complete_key")
            if self.fail_complete:
                self.fail_complete -= 1
                raise StoreError("disk I/O error (injected)")
        await super().end_turn(write, unknown_for=unknown_for, key=key)


@pytest.fixture
async def faulty(store_path: Path) -> Any:
    store = await FaultyStore.open(store_path)
    store.entered = asyncio.Event()
    yield store
    await store.close()


def gate(store: FaultyStore, operation: str) -> asyncio.Event:
    store.gate = asyncio.Event()
    store.gated = operation
    return store.gate


async def test_stalled_upload_does_not_hold_up_the_job(
    proxy: Any, upstream: RecordingUpstream
) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(
        b"POST /billing/x HTTP/1.1\r\nHost: a\r\nFencing-Job: j\r\nFencing-Token: 1\r\n"
        b'Content-Length: 10\r\n\r\n{"a":'
    )
    await writer.drain()
    async with asyncio.timeout(5):
        assert (await fenced(proxy, "j", 2, body={"b": 1})).status == 200
    writer.close()
    assert upstream.bodies() == [{"b": 1}]


async def test_unknown_outcome_quarantines_the_job(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, clock: FakeClock
) -> None:
    proxy = await start_proxy(
        [
            {
                "name": "billing",
                "path": "/billing/",
                "upstream": upstream.url,
                "timeout": "200ms",
                "quarantine": "30s",
            }
        ]
    )
    slow = asyncio.Event()

    async def slow_for_j(request: web.Request, received: Received) -> web.StreamResponse:
        if received.job == "j":
            await slow.wait()
        return web.Response(text="ok")

    upstream.respond = slow_for_j
    await problem(await fenced(proxy, "j", 7, body={"w": 7}), 504, "upstream-timeout")
    # Generation 8 must not overtake 7, which the upstream may still apply.
    refused = await fenced(proxy, "j", 8, body={"w": 8})
    body = await problem(refused, 503, "job-quarantined")
    assert body["job"] == "j"
    # The quarantine, or what is left of the write's own record if that is longer.
    assert 30 <= int(refused.headers["Retry-After"]) <= 37
    assert (await fenced(proxy, "other", 1, body={"w": "other"})).status == 200
    slow.set()
    clock.advance(37)  # the store's clock: the job's in-flight record expires
    assert (await fenced(proxy, "j", 8, body={"w": 8})).status == 200
    assert [r.body for r in upstream.received if r.job == "j"] == [b'{"w": 7}', b'{"w": 8}']


async def test_answer_is_recorded_before_the_client_gets_it(
    start_proxy: ProxyFactory, faulty: FaultyStore, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(store=faulty)
    recorded = gate(faulty, "complete_key")
    answer = asyncio.ensure_future(fenced(proxy, "j", 1, key="k"))
    await asyncio.wait_for(faulty.entered.wait(), 5)
    await asyncio.sleep(0.05)  # room for an answer that must not come: nothing to poll
    assert not answer.done()
    recorded.set()
    assert (await answer).status == 200


async def test_failed_key_record_is_kept_in_memory_and_retried(
    start_proxy: ProxyFactory, faulty: FaultyStore, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(store=faulty)
    faulty.fail_complete = 1
    first = await fenced(proxy, "j", 1, key="k", body={"a": 1})
    assert first.status == 200
    retry = await fenced(proxy, "j", 1, key="k", body={"a": 1})
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert await retry.json() == await first.json()
    # The record reaches the store on a later try, and is then answered from there.
    got = upstream.received[0]
    write = FencedWrite(
        "billing",
        "j",
        1,
        key="k",
        fingerprint=fingerprint(got.method, got.path_qs, got.body),
        scope=scope([("Authorization", []), ("Cookie", [])]),  # a caller without either
    )
    async with asyncio.timeout(10):
        while not isinstance(await admit(faulty, write), Replay):
            await asyncio.sleep(0.1)
    assert len(upstream.received) == 1


async def test_a_write_stalled_after_its_record_was_taken_is_not_sent(
    start_proxy: ProxyFactory, faulty: FaultyStore, upstream: RecordingUpstream
) -> None:
    """Sent after such a stall, the write could still be at the upstream when its
    in-flight record expires and a newer write goes."""
    proxy = await start_proxy(store=faulty)
    faulty.stall_after_admit = 1.2  # over the 1 s the record allows for it
    await problem(await fenced(proxy, "j", 1, body={"a": 1}), 503, "job-quarantined")
    assert upstream.received == []
    faulty.stall_after_admit = 0.0
    assert (await fenced(proxy, "j", 1, body={"a": 2})).status == 200  # the record is back


async def test_waiting_for_the_store_before_it_decides_is_no_stall(
    start_proxy: ProxyFactory, faulty: FaultyStore, upstream: RecordingUpstream
) -> None:
    """Time spent queued for a commit or a pool connection comes before the record
    is dated: under load it must not count against the write."""
    proxy = await start_proxy(store=faulty)
    queued = gate(faulty, "admit")
    attempt = asyncio.ensure_future(fenced(proxy, "j", 1, body={"a": 1}))
    await asyncio.wait_for(faulty.entered.wait(), 5)
    await asyncio.sleep(1.2)  # the queue ahead of it
    queued.set()
    assert (await attempt).status == 200
    assert upstream.bodies() == [{"a": 1}]


async def test_an_admission_committed_but_unconfirmed_is_given_back(
    start_proxy: ProxyFactory, faulty: FaultyStore, upstream: RecordingUpstream
) -> None:
    """The store took the record and the key, and its reply was lost: the write is
    refused (nothing was sent) and what it took is given back at once, so its retry
    neither waits out the record nor finds its key in an unknown state."""
    proxy = await start_proxy(store=faulty)
    faulty.lose_admit_reply = 1
    await problem(await fenced(proxy, "j", 1, key="k", body={"a": 1}), 503, "store-unavailable")
    assert upstream.received == []
    async with asyncio.timeout(5):
        while (retry := await fenced(proxy, "j", 1, key="k", body={"a": 1})).status != 200:
            await problem(retry, 409, "duplicate-in-flight")
            await asyncio.sleep(0.01)
    assert upstream.bodies() == [{"a": 1}]


async def test_cancelled_admission_releases_the_key(
    start_proxy: ProxyFactory, faulty: FaultyStore, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(store=faulty, server_kwargs={"handler_cancellation": True})
    admitting = gate(faulty, "admit")
    attempt = asyncio.ensure_future(fenced(proxy, "j", 1, key="k", body={"a": 1}))
    await asyncio.wait_for(faulty.entered.wait(), 5)
    attempt.cancel()  # the client gives up; the server cancels its handler
    with pytest.raises(asyncio.CancelledError):
        await attempt
    faulty.gated = ""
    admitting.set()
    # The key is released, not stranded in flight: a retry soon goes through.
    async with asyncio.timeout(5):
        while (retry := await fenced(proxy, "j", 1, key="k", body={"a": 1})).status != 200:
            await problem(retry, 409, "duplicate-in-flight")
            await asyncio.sleep(0.05)
    assert len(upstream.received) == 1


async def test_a_handler_cancelled_while_its_key_settles_still_gives_the_job_back(
    start_proxy: ProxyFactory, faulty: FaultyStore, upstream: RecordingUpstream
) -> None:
    """The upstream answered; the client gives up while the answer is stored under
    its key. The key settles, then the job's in-flight record is given back: the
    job is not held (nor its claims refused) for the record's whole time."""
    proxy = await start_proxy(store=faulty, server_kwargs={"handler_cancellation": True})
    settling = gate(faulty, "complete_key")
    attempt = asyncio.ensure_future(fenced(proxy, "j", 1, key="k", body={"a": 1}))
    await asyncio.wait_for(faulty.entered.wait(), 5)
    attempt.cancel()
    with pytest.raises(asyncio.CancelledError):
        await attempt
    faulty.gated = ""
    settling.set()
    async with asyncio.timeout(5):
        while (await faulty.inspect("j")).in_flight is not None:
            await asyncio.sleep(0.01)
    view = await faulty.inspect("j")
    assert [(key.key, key.state) for key in view.keys] == [("k", "completed")]
    assert (await fenced(proxy, "j", 1, body={"b": 2})).status == 200
    assert len(upstream.received) == 2


async def test_an_upstream_that_trickles_its_answer_is_cut_off_within_the_record(
    start_proxy: ProxyFactory,
) -> None:
    """sock_read alone never fires on an answer that arrives a byte at a time; the
    whole send is bounded by connect_timeout + timeout, which the job's in-flight
    record covers, so the write cannot outlive its record."""
    trickling: list[asyncio.Task[None]] = []

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 100:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.05)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        trickling.append(asyncio.ensure_future(trickle(reader, writer)))

    server = await asyncio.start_server(connected, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    route = {
        "name": "billing",
        "path": "/billing/",
        "upstream": f"http://127.0.0.1:{port}",
        "timeout": "300ms",
        "connect_timeout": "200ms",
        "quarantine": "30s",
    }
    try:
        proxy = await start_proxy([route])
        loop = asyncio.get_running_loop()
        started = loop.time()
        await problem(await fenced(proxy, "j", 1), 504, "upstream-timeout")
        assert loop.time() - started < 2.0  # not the 5 s the trickle would take
        await problem(await fenced(proxy, "j", 2), 503, "job-quarantined")
    finally:
        for task in trickling:
            task.cancel()
        await asyncio.gather(*trickling, return_exceptions=True)
        server.close()
        await server.wait_closed()
