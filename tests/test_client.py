"""The Python lease client against the real lease API over loopback: it renews,
stops the worker's body the moment its lease is lost, and never trusts a lease
past its local deadline, whatever the wall clock says."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from fenceproxy.client import LeaseClient, LeaseLost, LeaseRefused, LeaseServiceError
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
