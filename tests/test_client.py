"""The Python lease client against the real lease API over loopback: it renews,
stops the worker's body the moment its lease is lost, and never trusts a lease
past its local deadline, whatever the wall clock says."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Any

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from fenceproxy.client import LeaseClient, LeaseLost, LeaseRefused, LeaseServiceError
from fenceproxy.client.core import Call
from fenceproxy.client.flow import Reply
from fenceproxy.server.lease_api import LeaseService
from fenceproxy.testing import FakeClock, RecordingUpstream

from .conftest import ProxyFactory

Client = TestClient[Any, Any]


@pytest.fixture
async def service(start_proxy: ProxyFactory) -> Client:
    return await start_proxy(leases={})


def url(service: Client) -> str:
    return str(service.make_url("")).rstrip("/")


async def test_hold_gives_headers_the_proxy_accepts_and_completes(
    service: Client, upstream: RecordingUpstream
) -> None:
    async with LeaseClient(url(service)) as leases:
        async with leases.hold("job", owner="w", ttl=30) as lease:
            assert lease.generation == 1
            headers = lease.headers()
            assert headers == {"Fencing-Job": "job", "Fencing-Token": "1"}
            assert (await service.post("/billing/x", json={}, headers=headers)).status == 200
            await lease.complete()
            with pytest.raises(LeaseLost):
                lease.headers()  # nothing may be written under a completed lease
        assert (await leases.show("job"))["state"] == "completed"
    assert upstream.received[0].generation == 1


async def test_body_is_cancelled_when_a_renewal_is_refused(
    service: Client, clock: FakeClock
) -> None:
    async with LeaseClient(url(service)) as leases:
        work_started = asyncio.Event()
        never = asyncio.Event()
        with pytest.raises(LeaseLost, match="renewal refused"):
            async with asyncio.timeout(10):
                async with leases.hold("job", owner="a", ttl=0.6, renew_every=0.05) as lease:
                    work_started.set()
                    # The store's clock runs past the lease; B takes the job over.
                    clock.advance(1)
                    taken = await leases.claim("job", "b", ttl=30)
                    assert taken.generation == 2
                    await never.wait()  # cancelled by the client, not by the timeout
        assert work_started.is_set()
        assert lease.lost
        with pytest.raises(LeaseLost):
            lease.headers()
        record = await leases.show("job")
        assert (record["owner"], record["generation"], record["state"]) == ("b", 2, "held")


async def test_unreachable_service_loses_the_lease_at_its_local_deadline(
    service: Client,
) -> None:
    async with LeaseClient(url(service)) as leases:
        started = time.monotonic()
        with pytest.raises(LeaseLost, match="local deadline"):
            async with asyncio.timeout(10):
                async with leases.hold("job", owner="a", ttl=0.5, renew_every=0.1) as lease:
                    await service.server.close()  # the lease service goes away
                    await asyncio.Event().wait()
        lost_after = time.monotonic() - started
        # Lost at ttl minus the margin (0.45 s), not a moment later than the deadline.
        assert 0.4 < lost_after < 2.0, lost_after
        assert lease.lost


async def test_headers_are_refused_past_the_local_deadline(service: Client) -> None:
    clock = FakeClock(100.0)
    # Leaving the block past the deadline says so too, even before the renewer ran.
    with pytest.raises(LeaseLost, match="no renewal was confirmed before the local deadline"):
        async with (
            LeaseClient(url(service), clock=clock, margin=0.1) as leases,
            leases.hold("job", owner="a", ttl=30) as lease,
        ):
            assert lease.deadline == pytest.approx(100.0 + 27.0)
            clock.advance(26.9)
            assert lease.headers()["Fencing-Token"] == "1"
            clock.advance(0.2)  # frozen past the deadline before the renewal ran
            assert lease.lost
            with pytest.raises(LeaseLost, match="local deadline"):
                lease.headers()


async def test_a_grant_answered_after_its_deadline_counts_as_lost(service: Client) -> None:
    readings = iter([0.0, 100.0])  # sent at 0, the answer arrives 100 s later

    async with LeaseClient(url(service), clock=lambda: next(readings)) as leases:
        with pytest.raises(LeaseLost, match="after its local deadline"):
            await leases.claim("job", "a", ttl=30)


async def test_wall_clock_hours_off_changes_nothing(
    service: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def run() -> tuple[bool, int]:
        async with LeaseClient(url(service)) as leases:
            job = f"job-{len(seen)}"
            before = time.monotonic()
            async with leases.hold(job, owner="a", ttl=0.6, renew_every=0.05) as lease:
                after = time.monotonic()
                # ttl minus the 10% margin, from a monotonic reading taken before sending.
                window = before + 0.54 - 1e-6 <= lease.deadline <= after + 0.54 + 1e-6
                deadline, renewed = lease.deadline, 0
                async with asyncio.timeout(5):
                    while renewed < 3:  # three renewals confirmed
                        if lease.deadline > deadline:
                            renewed, deadline = renewed + 1, lease.deadline
                        await asyncio.sleep(0.01)
                assert lease.headers()
                await lease.complete()
            return window, renewed

    seen: list[tuple[bool, int]] = []
    seen.append(await run())
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3 * 3600)
    seen.append(await run())
    monkeypatch.setattr(time, "time", lambda: real() - 5 * 3600)
    seen.append(await run())
    assert seen == [(True, 3)] * 3


async def test_leaving_without_completing_releases_the_job(service: Client) -> None:
    async with LeaseClient(url(service)) as leases:
        with pytest.raises(ZeroDivisionError):
            async with leases.hold("job", owner="a", ttl=30):
                _ = 1 / 0
        assert (await leases.show("job"))["state"] == "released"
        async with leases.hold("job", owner="b", ttl=30) as lease:
            assert lease.generation == 2


async def test_claim_of_a_held_job_is_refused_with_the_holder(service: Client) -> None:
    async with LeaseClient(url(service)) as leases, leases.hold("job", owner="a", ttl=30):
        with pytest.raises(LeaseRefused) as refused:
            async with leases.hold("job", owner="b", ttl=30):
                pytest.fail("a held job was claimed twice")
        assert refused.value.status == 409
        assert refused.value.slug == "lease-held"
        assert refused.value.problem["owner"] == "a"


async def test_unreachable_service_is_a_service_error(service: Client) -> None:
    address = url(service)
    await service.server.close()
    async with LeaseClient(address, request_timeout=2) as leases:
        with pytest.raises(LeaseServiceError):
            await leases.claim("job", "a")


async def test_cli_prints_the_reply_and_exits_non_zero_on_refusal(service: Client) -> None:
    async def cli(*args: str) -> tuple[int, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fenceproxy", "lease", *args, "--url", url(service),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await process.communicate()
        assert process.returncode is not None
        return process.returncode, out.decode()

    code, out = await cli("claim", "job-1", "--owner", "sh-worker", "--ttl", "30")
    assert code == 0, out
    assert '"generation": 1' in out
    assert '"token": "1"' in out
    code, out = await cli("claim", "job-1", "--owner", "other")
    assert code == 1
    assert "lease-held" in out
    code, out = await cli("complete", "job-1", "--owner", "sh-worker", "--generation", "1")
    assert code == 0, out
    assert '"state": "completed"' in out
    code, out = await cli("show", "job-1")
    assert code == 0
    assert '"state": "completed"' in out


async def test_an_outer_cancellation_at_exit_is_not_swallowed(service: Client) -> None:
    """_stop_renewing does `with suppress(CancelledError): await renewer`: a cancellation
    aimed at the worker's task while it waits for the renewer to die is eaten."""
    task = asyncio.current_task()
    assert task is not None
    ran_on = False
    async with LeaseClient(url(service)) as leases:
        try:
            async with leases.hold("job", owner="a", ttl=30):
                # shutdown / TaskGroup sibling failure / timeout landing in this iteration
                asyncio.get_running_loop().call_soon(task.cancel)
            ran_on = True  # must not be reached: the task was cancelled
        except asyncio.CancelledError:
            task.uncancel()
    assert not ran_on, f"cancellation swallowed; task.cancelling()={task.cancelling()}"


async def test_a_body_that_swallows_the_cancel_leaves_enclosing_timeouts_intact(
    service: Client, clock: FakeClock
) -> None:
    """When the body does not exit with CancelledError, __aexit__ raises LeaseLost but never
    uncancel()s the cancel it injected; an enclosing asyncio.timeout then raises
    CancelledError instead of TimeoutError."""
    async with LeaseClient(url(service)) as leases:
        outcome: BaseException | None = None
        try:
            async with asyncio.timeout(1.5):
                with pytest.raises(LeaseLost):
                    async with leases.hold("job", owner="a", ttl=0.6, renew_every=0.05):
                        clock.advance(1)
                        await leases.claim("job", "b", ttl=30)
                        # A library that turns cancellation into a return:
                        with contextlib.suppress(asyncio.CancelledError):
                            await asyncio.Event().wait()
                cancelling = asyncio.current_task().cancelling()  # type: ignore[union-attr]
                await asyncio.sleep(5)
        except BaseException as exc:
            outcome = exc
        if isinstance(outcome, asyncio.CancelledError):
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
        assert (cancelling, type(outcome)) == (0, TimeoutError), (cancelling, repr(outcome))


async def test_an_odd_renewal_answer_loses_the_lease_and_stops_the_body(
    start_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 200 without 'ttl' raises KeyError inside the renewer task: no LeaseServiceError,
    no LeaseLost, the body is never cancelled, and the KeyError pops out of __aexit__."""

    async def odd(self: LeaseService, request: web.Request, *_: object) -> web.Response:
        return web.json_response({"status": "ok"})  # e.g. a gateway's maintenance page

    monkeypatch.setattr(LeaseService, "renew", odd)
    service = await start_proxy(leases={})
    body_cancelled = False
    async with LeaseClient(url(service)) as leases:
        with pytest.raises(LeaseLost, match="local deadline"):
            async with asyncio.timeout(5):
                async with leases.hold("job", owner="a", ttl=0.5, renew_every=0.1):
                    try:
                        await asyncio.sleep(2)  # 4x past the 0.45 s local deadline
                    except asyncio.CancelledError:
                        body_cancelled = True
                        raise
    assert body_cancelled


class SlowCompleteReply(LeaseClient):
    async def _send(self, call: Call) -> Reply:
        answer = await super()._send(call)
        if call.url.endswith("/complete"):
            await asyncio.sleep(0.3)  # the reply takes a while to come back
        return answer


async def test_a_slow_completion_is_not_undone_by_a_racing_renewal(service: Client) -> None:
    """The renewer keeps running while complete() is in flight; its renewal is refused
    with job-completed, _lose() cancels the body, and a successful complete surfaces as
    LeaseLost."""
    async with SlowCompleteReply(url(service)) as leases:
        async with leases.hold("job", owner="a", ttl=0.6, renew_every=0.05) as lease:
            await lease.complete()
        assert (await leases.show("job"))["state"] == "completed"


async def test_a_renewal_answered_after_the_deadline_does_not_revive_the_lease(
    service: Client,
) -> None:
    """_grant checks the reply against the NEW deadline (sent + ttl*0.9), not the deadline
    of the lease being renewed: a renewal confirmed after the lease's local deadline
    revives it."""
    fc = FakeClock(0.0)

    async def sleep(delay: float) -> None:
        if fc() >= 10:
            await asyncio.Event().wait()  # one renewal is enough
        fc.advance(delay)
        await asyncio.sleep(0)

    class SlowRenewReply(LeaseClient):
        async def _send(self, call: Call) -> Reply:
            answer = await super()._send(call)
            if call.url.endswith("/renew"):
                fc.advance(18)  # sent at 10, answered at 28; the lease's deadline was 27
            return answer

    async with SlowRenewReply(url(service), clock=fc, sleep=sleep) as leases:
        with pytest.raises(LeaseLost):
            async with leases.hold("job", owner="a", ttl=30) as lease:
                assert lease.deadline == pytest.approx(27)
                while lease.deadline == pytest.approx(27):
                    await asyncio.sleep(0.01)
                assert fc() == 28
                lease.headers()  # should raise: nothing was confirmed before 27
                await asyncio.sleep(0.2)


async def test_release_on_exit_never_outlives_the_lease(
    start_proxy: ProxyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Release on exit waits the full request_timeout (10 s) on a hung service, long after
    the lease's own deadline made the release pointless (also on the cancellation path)."""

    async def hang(self: LeaseService, request: web.Request) -> web.Response:
        await asyncio.Event().wait()
        raise AssertionError

    monkeypatch.setattr(LeaseService, "release", hang)
    service = await start_proxy(leases={})
    async with LeaseClient(url(service)) as leases:
        async with leases.hold("job", owner="a", ttl=1) as lease:
            pass  # leave without completing: __aexit__ releases
        late = time.monotonic() - lease.deadline
    assert late < 1, f"exit blocked until {late:.1f}s past the lease's local deadline"


async def test_a_claim_answered_too_late_is_given_back(service: Client) -> None:
    """claim() answered after its local deadline raises LeaseLost but never releases:
    the same owner's retry is refused lease-held for the rest of the ttl."""
    readings = iter([0.0, 100.0])

    def clock() -> float:
        return next(readings, 200.0)

    async with LeaseClient(url(service), clock=clock) as leases:
        with pytest.raises(LeaseLost):
            async with leases.hold("job", owner="a", ttl=30):
                pass
    # It was given back: the same owner may claim it again at once.
    async with (
        LeaseClient(url(service)) as leases,
        leases.hold("job", owner="a", ttl=30) as lease,
    ):
        assert lease.generation == 2


async def test_a_write_retried_with_the_clients_credentials_keeps_its_key(
    service: Client, upstream: RecordingUpstream
) -> None:
    """The credentials of the client's own httpx session go with every attempt, so
    its retries are its own; another session's are not, and are not retried."""
    base = url(service)
    key = {"Idempotency-Key": "invoice-42-10"}
    async with (
        LeaseClient(base) as leases,
        httpx.AsyncClient(headers={"Authorization": "Bearer worker-a"}) as mine,
        httpx.AsyncClient(headers={"Authorization": "Bearer worker-b"}) as theirs,
        leases.hold("job", owner="w", ttl=30) as lease,
    ):
        first = await lease.request(mine, "POST", f"{base}/billing/x", json={}, headers=key)
        assert first.status_code == 200
        again = await lease.request(mine, "POST", f"{base}/billing/x", json={}, headers=key)
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.json() == first.json()
        other = await lease.request(theirs, "POST", f"{base}/billing/x", json={}, headers=key)
        assert other.status_code == 422
        assert other.json()["type"].endswith("idempotency-key-other-caller")
        await lease.complete()
    assert len(upstream.received) == 1
