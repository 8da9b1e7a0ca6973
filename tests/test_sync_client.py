"""The synchronous lease client against the real lease API and proxy over loopback,
run in a thread as a worker runs it: it holds, renews, waits for a busy job, retries
a write only when the refusal says it is safe, and stops the worker once its lease
is lost. The same rules as the async client's (fenceproxy.client.core)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from fenceproxy.client import (
    LeaseClient,
    LeaseLost,
    LeaseRefused,
    LeaseServiceError,
    SyncLeaseClient,
    refusal_kind,
)
from fenceproxy.testing import FakeClock, Received, RecordingUpstream, eventually

from .conftest import ProxyFactory, fenced, store_of

Client = TestClient[Any, Any]
T = TypeVar("T")


@pytest.fixture
async def service(start_proxy: ProxyFactory) -> Client:
    return await start_proxy(leases={})


def url(service: Client) -> str:
    return str(service.make_url("")).rstrip("/")


async def in_thread(work: Callable[[], T]) -> T:
    """Run a worker's synchronous code off the loop that serves the proxy."""
    return await asyncio.to_thread(work)


async def test_a_worker_holds_writes_through_the_proxy_and_completes(
    service: Client, upstream: RecordingUpstream
) -> None:
    base = url(service)

    def worker() -> tuple[int, list[int]]:
        with SyncLeaseClient(base) as leases, httpx.Client() as http:
            with leases.hold("job/1", owner="w", ttl=30) as lease:
                statuses = [
                    lease.request(http, "POST", f"{base}/billing/x", json={"n": n}).status_code
                    for n in range(2)
                ]
                generation = lease.generation
                lease.complete()
            return generation, statuses

    generation, statuses = await in_thread(worker)
    assert (generation, statuses) == (1, [200, 200])
    assert [(r.job, r.headers["Fencing-Token"]) for r in upstream.received] == [
        ("job/1", "1"),
        ("job/1", "1"),
    ]
    shown = await (await service.get("/_leases/job%2F1")).json()
    assert shown["state"] == "completed"


async def test_leaving_without_completing_releases_for_the_next_worker(service: Client) -> None:
    base = url(service)

    def worker() -> int:
        with SyncLeaseClient(base) as leases:
            with leases.hold("job", owner="a", ttl=30):
                pass  # gave up
            with leases.hold("job", owner="b", ttl=30) as lease:  # no wait needed
                return lease.generation

    assert await in_thread(worker) == 2


async def test_a_lost_lease_stops_the_worker_at_its_next_step(service: Client) -> None:
    """The job is completed behind the holder's back: its next renewal is refused,
    and check(), headers() and the end of the block say so."""
    base = url(service)
    taken = threading.Event()
    gone = threading.Event()
    seen: list[str] = []

    def worker() -> None:
        with (
            SyncLeaseClient(base) as leases,
            leases.hold("job", owner="w", ttl=3, renew_every=0.05) as lease,
        ):
            taken.set()
            while not lease.lost:  # the worker's steps
                time.sleep(0.01)
            gone.set()
            for step in (lease.check, lease.headers):
                try:
                    step()
                except LeaseLost as exc:
                    seen.append(str(exc))

    running = asyncio.ensure_future(in_thread(worker))
    await asyncio.to_thread(taken.wait, 10)
    done = await service.post("/_leases/job/complete", json={"owner": "w", "generation": 1})
    assert done.status == 200
    with pytest.raises(LeaseLost, match="renewal refused: 409 job-completed"):
        await running
    assert gone.is_set()
    assert len(seen) == 2
    assert all("renewal refused: 409 job-completed" in why for why in seen)


async def test_hold_waits_for_a_busy_job_and_gets_it_when_it_is_released(
    service: Client,
) -> None:
    """A worker waiting in hold() sends one claim, which the proxy holds while the job
    is held and grants once its holder releases it: no claim after claim."""
    base = url(service)
    held = await (await service.post("/_leases/job/claim", json={"owner": "old", "ttl": 30})).json()
    attempts: list[float] = []

    def sleep(seconds: float) -> None:
        attempts.append(seconds)
        time.sleep(seconds)

    def worker(wait: float) -> int:
        with (
            SyncLeaseClient(base, sleep=sleep) as leases,
            leases.hold("job", owner="new", ttl=30, wait=wait) as lease,
        ):
            return lease.generation

    with pytest.raises(LeaseRefused, match="lease-held"):
        await in_thread(lambda: worker(0))  # no waiting: refused at once
    waiting = asyncio.ensure_future(in_thread(lambda: worker(30)))
    await eventually(lambda: store_of(service).wakes.watched("job"))  # held by the proxy
    old = {"owner": "old", "generation": held["generation"]}
    assert (await service.post("/_leases/job/release", json=old)).status == 200
    async with asyncio.timeout(4):  # well before the proxy would ask again by itself
        assert await waiting == 2
    assert attempts == []


async def test_a_claim_waits_until_the_old_holders_write_is_answered(
    service: Client, upstream: RecordingUpstream, clock: FakeClock
) -> None:
    """Generation 1's write is at the upstream when its lease runs out. A claim then
    is refused `write-in-flight` (raising the fence to 2 meanwhile), and a worker
    waiting in hold() takes generation 3 only once the upstream has answered: never
    while the old write could still land after it was told it holds the job."""
    base = url(service)
    assert (await service.post("/_leases/job/claim", json={"owner": "a", "ttl": 30})).ok
    release = upstream.hold()
    old_write = asyncio.ensure_future(fenced(service, "job", 1, path="/billing/x"))
    await upstream.wait_for(1)
    clock.advance(31)  # the lease has run out; its write has not been answered
    refused = await service.post("/_leases/job/claim", json={"owner": "b"})
    assert refused.status == 409
    assert (await refused.json())["type"] == "urn:fenceproxy:problem:write-in-flight"
    assert int(refused.headers["Retry-After"]) > 0
    attempts: list[float] = []

    def sleep(seconds: float) -> None:
        attempts.append(seconds)
        time.sleep(seconds)

    def worker() -> int:
        with (
            SyncLeaseClient(base, sleep=sleep) as leases,
            leases.hold("job", owner="b", ttl=30, wait=30) as lease,
        ):
            return lease.generation

    waiting = asyncio.ensure_future(in_thread(worker))
    await eventually(lambda: store_of(service).wakes.watched("job"))  # held by the proxy
    assert not waiting.done()
    release()
    assert (await old_write).status == 200
    assert await waiting == 3
    assert attempts == []


async def test_a_wait_runs_out_with_the_refusal(service: Client) -> None:
    base = url(service)
    assert (await service.post("/_leases/job/claim", json={"owner": "old"})).status == 200

    def worker() -> None:
        with SyncLeaseClient(base) as leases, leases.hold("job", owner="new", wait=0.3):
            pass

    started = time.monotonic()
    with pytest.raises(LeaseRefused, match="lease-held"):
        await in_thread(worker)
    assert 0.3 <= time.monotonic() - started < 3


async def test_a_write_is_sent_again_only_when_the_refusal_says_nothing_was_applied(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, clock: FakeClock
) -> None:
    """A timeout leaves the job quarantined (503, Retry-After): the next write is sent
    again once it has passed. A stale write is never sent again."""
    service = await start_proxy(
        [{"name": "billing", "path": "/billing/", "upstream": upstream.url,
          "timeout": "200ms", "quarantine": "300ms"}],
        leases={},
    )  # fmt: skip
    base = url(service)

    async def hang_first(request: web.Request, received: Received) -> web.StreamResponse:
        if len(upstream.received) == 1:
            await asyncio.sleep(1)
        return web.Response(text="applied")

    upstream.respond = hang_first
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        clock.advance(seconds)  # the store's clock: its quarantine runs out

    def worker() -> list[tuple[int, str | None]]:
        answers = []
        with (
            SyncLeaseClient(base, sleep=sleep) as leases,
            httpx.Client() as http,
            leases.hold("job", owner="w", ttl=30) as lease,
        ):
            for key in ("k-1", "k-2"):
                answer = lease.request(
                    http, "POST", f"{base}/billing/x", headers={"Idempotency-Key": key}
                )
                kind = refusal_kind(answer.status_code, answer.headers, answer.content)
                answers.append((answer.status_code, kind))
            stale = http.post(
                f"{base}/billing/x", headers={"Fencing-Job": "job", "Fencing-Token": "0"}
            )
            answers.append((stale.status_code, None))
            lease.complete()
        return answers

    answers = await in_thread(worker)
    assert answers[0] == (504, "upstream-timeout")  # outcome unknown: never sent again
    assert answers[1] == (200, None)  # quarantined first, then sent again and applied
    assert answers[2][0] == 409
    keys = [r.headers.get("Idempotency-Key") for r in upstream.received]
    assert keys == ["k-1", "k-2"]
    # Each wait was the refusal's Retry-After (the record of the write whose outcome
    # is unknown: connect_timeout + timeout + quarantine + 1 s), within the lease.
    assert waits == [7.0]


async def test_both_clients_wait_alike(service: Client) -> None:
    """The async client takes the same rules: it waits for the job too, and times a
    lease granted after a wait longer than its ttl from the grant, not from when it
    sent the claim (which would be past its deadline at once)."""
    held = await (await service.post("/_leases/job/claim", json={"owner": "old", "ttl": 30})).json()
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        await asyncio.sleep(seconds)

    async def release_later() -> None:
        await eventually(lambda: store_of(service).wakes.watched("job"))
        await asyncio.sleep(0.5)  # longer than the new lease's ttl, on the worker's clock
        old = {"owner": "old", "generation": held["generation"]}
        assert (await service.post("/_leases/job/release", json=old)).status == 200

    releasing = asyncio.create_task(release_later())
    async with (
        LeaseClient(url(service), sleep=sleep) as leases,
        leases.hold("job", owner="new", ttl=0.4, wait=30) as lease,
    ):
        assert lease.generation == 2
        lease.check()  # not lost: its deadline counts from the grant, ...
        assert lease.deadline <= time.monotonic() + 0.4  # ... which came before now
    await releasing
    assert slept == []


def test_a_url_without_a_scheme_is_refused_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match=r"needs a scheme, such as http://127\.0\.0\.1:8080"):
        SyncLeaseClient("127.0.0.1:8080")


async def test_leaving_past_the_deadline_is_never_silent(service: Client) -> None:
    """A worker paused past its lease reaches the end of its block before the renewer
    had a turn: it is told all the same."""
    base = url(service)
    clock = FakeClock(100.0)

    def worker() -> None:
        with (
            SyncLeaseClient(base, clock=clock) as leases,
            leases.hold("job", owner="w", ttl=30, renew_every=20) as lease,
        ):
            clock.advance(28)  # past 100 + 27 before any renewal was due
            assert lease.lost

    with pytest.raises(LeaseLost, match="no renewal was confirmed before the local deadline"):
        await in_thread(worker)


async def test_a_call_is_over_within_its_time_even_when_its_answer_trickles(
    aiohttp_server: Any,
) -> None:
    """httpx bounds each read; the whole call is bounded too."""

    async def trickle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        for _ in range(40):
            await response.write(b" ")
            await asyncio.sleep(0.05)
        await response.write(b"{}")
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", trickle)
    server = await aiohttp_server(app)
    base = str(server.make_url("")).rstrip("/")

    def call() -> float:
        with SyncLeaseClient(base, request_timeout=0.5) as leases:
            started = time.monotonic()  # the call's time, not the making of its client
            try:
                leases.show("job")
            except LeaseServiceError:
                return time.monotonic() - started
        raise AssertionError("a 2 s answer was taken within a 0.5 s call")

    assert await in_thread(call) < 1.5
