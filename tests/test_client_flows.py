"""Every flow of the lease clients through both drivers: the synchronous client
(its calls made in a thread, as a worker makes them) and the async client, against
a lease API and a fenced route kept in memory behind httpx.MockTransport. Each
scenario is written once and asserts the same for both; where the two differ by
design (the async client cancels the body on a loss, a synchronous worker polls),
the scenario's body copes with either. Then the flows by hand, with no I/O at all,
and the httpx adapter against httpx's own exception hierarchy and surface.

tests/test_client.py and tests/test_sync_client.py run the clients against the
real lease API and proxy."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any
from urllib.parse import unquote

import httpx
import pytest

from fenceproxy.client import (
    LeaseClient,
    LeaseLost,
    LeaseRefused,
    LeaseServiceError,
    SyncLeaseClient,
)
from fenceproxy.client.adapter import ERRORS, error_for
from fenceproxy.client.core import EXPIRED, Call, Endpoint, Grant, Holding
from fenceproxy.client.flow import Flows, Renewer, Reply, Sleep, run
from fenceproxy.errors import (
    DuplicateInFlight,
    JobCompleted,
    JobQuarantined,
    LeaseExpired,
    LeaseHeld,
    LeaseNotFound,
    LeaseReleased,
    LeaseSuperseded,
    Refusal,
    StaleGeneration,
)
from fenceproxy.testing import FakeClock

URL = "http://leases.test"
WRITE = f"{URL}/billing/x"


def refusal(refused: Refusal) -> httpx.Response:
    """An answer of the proxy's refusing with ``refused``, as the proxy sends it."""
    headers = {"Content-Type": "application/problem+json"}
    if refused.retry_after is not None:
        headers["Retry-After"] = f"{refused.retry_after:g}"
    return httpx.Response(refused.status, json=refused.problem(), headers=headers)


class FakeAPI:
    """The lease API and one fenced route, kept in memory and answering as the real
    ones do in what the clients read. Its clock is the store's: real time plus what
    :meth:`advance` added. ``faults`` are the next answers (or errors) of an action;
    ``down`` the actions that cannot reach it at all."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.jobs: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, dict[str, Any] | None]] = []
        self.faults: dict[str, list[httpx.Response | Exception]] = {}
        self.down: set[str] = set()
        self.slow: dict[str, float] = {}
        self.writes: list[tuple[float, httpx.Request]] = []
        self.write_answers: list[httpx.Response] = []
        self._lock = threading.Lock()

    def delay(self, request: httpx.Request) -> float:
        """How long the answer to ``request`` takes to come back, once applied."""
        return self.slow.get(request.url.path.rpartition("/")[2], 0.0)

    def now(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds

    def take_over(self, job: str) -> None:
        """Another worker takes ``job`` over (as one would once the lease ran out)."""
        record = self.jobs[job]
        generation = record["generation"] + 1
        self.jobs[job] = {
            **record,
            "owner": "b",
            "generation": generation,
            "token": str(generation),
        }

    def actions(self) -> list[str]:
        return [action for action, _ in self.calls]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            if not request.url.path.startswith("/_leases/"):
                self.writes.append((time.monotonic(), request))
                return self.write_answers.pop(0) if self.write_answers else httpx.Response(200)
            path = request.url.raw_path.decode().partition("?")[0]  # job names %-quoted
            job, _, action = path.removeprefix("/_leases/").partition("/")
            body = json.loads(request.content) if request.content else None
            self.calls.append((action or "show", body))
            fault = self._fault(action or "show", request)
            if fault is not None:
                return fault
            answer: httpx.Response = getattr(self, action or "show")(unquote(job), body or {})
            return answer

    def _fault(self, action: str, request: httpx.Request) -> httpx.Response | None:
        if action in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        planned = self.faults.get(action)
        if not planned:
            return None
        fault = planned.pop(0)
        if isinstance(fault, Exception):
            raise fault
        return fault

    def _answer(self, record: dict[str, Any]) -> httpx.Response:
        expires_in = max(0.0, record["expires"] - self.now())
        shown = {k: v for k, v in record.items() if k != "expires"}
        return httpx.Response(200, json={**shown, "expires_in": expires_in})

    def claim(self, job: str, body: dict[str, Any]) -> httpx.Response:
        record = self.jobs.get(job)
        if record is not None and record["state"] == "completed":
            return refusal(JobCompleted("completed"))
        if record is not None and record["state"] == "held" and record["expires"] > self.now():
            left = record["expires"] - self.now()
            return refusal(LeaseHeld("held", owner=record["owner"], expires_in=left))
        generation = 1 if record is None else record["generation"] + 1
        ttl = body.get("ttl", 30)
        self.jobs[job] = {"job_id": job, "owner": body["owner"], "generation": generation,
                          "token": str(generation), "ttl": ttl, "state": "held",
                          "expires": self.now() + ttl}  # fmt: skip
        return self._answer(self.jobs[job])

    def renew(self, job: str, body: dict[str, Any]) -> httpx.Response:
        refused = self._not_the_holder(job, body)
        if refused is not None:
            return refused
        record = self.jobs[job]
        record["expires"] = self.now() + body.get("ttl", record["ttl"])
        return self._answer(record)

    def complete(self, job: str, body: dict[str, Any]) -> httpx.Response:
        return self._end(job, body, "completed")

    def release(self, job: str, body: dict[str, Any]) -> httpx.Response:
        return self._end(job, body, "released")

    def show(self, job: str, body: dict[str, Any]) -> httpx.Response:
        record = self.jobs.get(job)
        return refusal(LeaseNotFound("never")) if record is None else self._answer(record)

    def _end(self, job: str, body: dict[str, Any], state: str) -> httpx.Response:
        record = self.jobs.get(job)
        again = record is not None and record["state"] == state == "completed"
        refused = None if again else self._not_the_holder(job, body)
        if refused is not None:
            return refused
        self.jobs[job]["state"] = state
        return self._answer(self.jobs[job])

    def _not_the_holder(self, job: str, body: dict[str, Any]) -> httpx.Response | None:
        record = self.jobs.get(job)
        if record is None:
            return refusal(LeaseNotFound("never"))
        if (record["owner"], record["generation"]) != (body.get("owner"), body.get("generation")):
            return refusal(LeaseSuperseded("taken over"))
        if record["state"] != "held":
            kind = JobCompleted if record["state"] == "completed" else LeaseReleased
            return refusal(kind(record["state"]))
        if record["expires"] <= self.now():
            return refusal(LeaseExpired("expired"))
        return None


class _InThread:
    """A synchronous lease's ``with`` block, entered and left in a thread as a
    worker does, its body run here."""

    def __init__(self, held: Any) -> None:
        self.held = held

    async def __aenter__(self) -> Any:
        return await asyncio.to_thread(self.held.__enter__)

    async def __aexit__(self, *exc: Any) -> Any:
        return await asyncio.to_thread(self.held.__exit__, *exc)


class Driver:
    """One of the two clients on a :class:`FakeAPI`, each step of it awaitable here."""

    def __init__(self, name: str, api: Callable[[httpx.Request], httpx.Response]) -> None:
        self.name = name
        self.api = api
        self.opened: list[httpx.Client | httpx.AsyncClient] = []

    @property
    def sync(self) -> bool:
        return self.name == "sync"

    def http(self) -> Any:
        """An httpx client on the fake API: a worker's own, or the lease client's."""
        api, delay = self.api, getattr(self.api, "delay", lambda request: 0.0)

        def blocking(request: httpx.Request) -> httpx.Response:
            answer = api(request)
            time.sleep(delay(request))
            return answer

        async def awaiting(request: httpx.Request) -> httpx.Response:
            answer = api(request)
            await asyncio.sleep(delay(request))
            return answer

        transport = httpx.MockTransport(blocking if self.sync else awaiting)
        http = (
            httpx.Client(transport=transport)
            if self.sync
            else httpx.AsyncClient(transport=transport)
        )
        self.opened.append(http)
        return http

    def client(self, **options: Any) -> Any:
        kind = SyncLeaseClient if self.sync else LeaseClient
        return kind(URL, http=self.http(), **options)

    async def do(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``step`` made as its client makes it: in a thread, or awaited."""
        if self.sync:
            return await asyncio.to_thread(step, *args, **kwargs)
        return await step(*args, **kwargs)

    def hold(self, leases: Any, job: str, **options: Any) -> AbstractAsyncContextManager[Any]:
        held = leases.hold(job, **options)
        return _InThread(held) if self.sync else held

    async def close(self) -> None:
        for http in self.opened:
            if isinstance(http, httpx.Client):
                http.close()
            else:
                await http.aclose()


@pytest.fixture
def api() -> FakeAPI:
    return FakeAPI()


@pytest.fixture(params=["sync", "async"])
async def driver(request: pytest.FixtureRequest, api: FakeAPI) -> AsyncIterator[Driver]:
    driver = Driver(request.param, api)
    yield driver
    await driver.close()


async def until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    async with asyncio.timeout(within):
        while not predicate():
            await asyncio.sleep(0.01)


async def until_lost(lease: Any) -> None:
    """The body of a worker that works until its lease is lost: the async client
    cancels it then; a synchronous worker sees it at its next step."""
    await until(lambda: lease.lost)


# -- claim ---------------------------------------------------------------------------


async def test_a_claim_is_granted_until_its_local_deadline(driver: Driver, api: FakeAPI) -> None:
    leases = driver.client(clock=FakeClock(100.0), margin=0.1)
    grant = await driver.do(leases.claim, "job/1", "a", 30)
    assert (grant.job_id, grant.owner, grant.generation, grant.token) == ("job/1", "a", 1, "1")
    assert grant.deadline == pytest.approx(100.0 + 27.0)
    assert api.calls == [("claim", {"owner": "a", "ttl": 30})]


async def test_a_claim_answered_after_its_deadline_is_lost_and_given_back(
    driver: Driver, api: FakeAPI
) -> None:
    readings = iter([0.0, 100.0])  # sent at 0, answered 100 s later
    leases = driver.client(clock=lambda: next(readings, 200.0))
    with pytest.raises(LeaseLost, match="after its local deadline"):
        await driver.do(leases.claim, "job", "a", 30)
    assert api.actions() == ["claim", "release"]
    assert api.jobs["job"]["state"] == "released"


async def test_a_claim_of_a_held_job_waits_until_it_is_free(driver: Driver, api: FakeAPI) -> None:
    api.claim("job", {"owner": "old", "ttl": 0.4})
    ends = api.jobs["job"]["expires"]  # by the store's clock, as the grant below
    leases = driver.client()
    async with driver.hold(leases, "job", owner="new", ttl=30, wait=10) as lease:
        granted = api.jobs["job"]["expires"] - 30
        assert lease.generation == 2
    assert ends <= granted < ends + 3, granted - ends  # not before the end, nor long after
    claims = [body for action, body in api.calls if action == "claim"]
    assert len(claims) >= 3  # refused while held, backing off, then granted


async def test_a_wait_runs_out_with_the_refusal(driver: Driver, api: FakeAPI) -> None:
    api.claim("job", {"owner": "old", "ttl": 30})
    leases = driver.client()
    started = time.monotonic()
    with pytest.raises(LeaseRefused, match="lease-held"):
        async with driver.hold(leases, "job", owner="new", wait=0.3):
            pytest.fail("a held job was claimed")
    assert 0.3 <= time.monotonic() - started < 3


async def test_a_refusal_that_does_not_end_by_itself_is_not_waited_for(
    driver: Driver, api: FakeAPI
) -> None:
    api.claim("job", {"owner": "old"})
    api.complete("job", {"owner": "old", "generation": 1})
    leases = driver.client()
    with pytest.raises(LeaseRefused, match="job-completed"):
        async with driver.hold(leases, "job", owner="new", wait=30):
            pytest.fail("a completed job was claimed")
    assert api.actions() == ["claim"]


# -- renew, and losing the lease ----------------------------------------------------


async def test_the_lease_is_renewed_while_held(driver: Driver, api: FakeAPI) -> None:
    leases = driver.client()
    async with driver.hold(leases, "job", owner="a", ttl=3, renew_every=0.05) as lease:
        deadlines = [lease.deadline]

        def renewed_thrice() -> bool:
            if lease.deadline != deadlines[-1]:
                deadlines.append(lease.deadline)
            return len(deadlines) > 3

        await until(renewed_thrice)
        await driver.do(lease.complete)
    renewals = [body for action, body in api.calls if action == "renew"]
    assert renewals[0] == {"owner": "a", "generation": 1, "ttl": 3}
    assert api.jobs["job"]["state"] == "completed"


async def test_a_renewal_that_cannot_reach_the_service_is_tried_again(
    driver: Driver, api: FakeAPI
) -> None:
    request = httpx.Request("POST", URL)
    api.faults["renew"] = [httpx.ConnectError("refused", request=request)] * 2
    leases = driver.client()
    async with driver.hold(leases, "job", owner="a", ttl=3, renew_every=0.05) as lease:
        first = lease.deadline
        await until(lambda: lease.deadline > first)
        assert not lease.lost
        assert api.actions().count("renew") >= 3
        await driver.do(lease.complete)


async def test_a_refused_renewal_loses_the_lease(driver: Driver, api: FakeAPI) -> None:
    leases = driver.client()
    with pytest.raises(LeaseLost, match="renewal refused: 409 lease-superseded"):
        async with driver.hold(leases, "job", owner="a", ttl=3, renew_every=0.05) as lease:
            api.take_over("job")
            await until_lost(lease)
    assert lease.lost
    with pytest.raises(LeaseLost, match="renewal refused"):
        lease.headers()
    assert (api.jobs["job"]["owner"], api.jobs["job"]["state"]) == ("b", "held")
    assert "release" not in api.actions()  # a lost lease is not the worker's to give


async def test_no_confirmed_renewal_loses_the_lease_at_its_local_deadline(
    driver: Driver, api: FakeAPI
) -> None:
    leases = driver.client()
    started = time.monotonic()
    with pytest.raises(LeaseLost, match=EXPIRED):
        async with driver.hold(leases, "job", owner="a", ttl=0.5, renew_every=0.1) as lease:
            api.down.add("renew")
            await until_lost(lease)
    assert 0.4 < time.monotonic() - started < 2.0  # ttl less the margin: 0.45 s
    with pytest.raises(LeaseLost):
        lease.check()


# -- writes ----------------------------------------------------------------------------


async def test_a_write_refused_as_not_applied_is_sent_again(driver: Driver, api: FakeAPI) -> None:
    api.write_answers = [
        refusal(JobQuarantined("unknown", retry_after=0.05)),
        refusal(DuplicateInFlight("in flight", retry_after=0.05)),
        httpx.Response(200, text="applied"),
    ]
    leases, http = driver.client(), driver.http()
    async with driver.hold(leases, "job", owner="a", ttl=30) as lease:
        key = {"Idempotency-Key": "k-1"}
        answer = await driver.do(lease.request, http, "POST", WRITE, json={"n": 1}, headers=key)
    assert (answer.status_code, answer.text) == (200, "applied")
    sent = [request for _, request in api.writes]
    assert [(r.headers["Fencing-Job"], r.headers["Fencing-Token"]) for r in sent] == [
        ("job", "1")
    ] * 3
    assert {r.headers["Idempotency-Key"] for r in sent} == {"k-1"}
    assert {r.content for r in sent} == {b'{"n":1}'}
    times = [at for at, _ in api.writes]
    assert all(b - a >= 0.045 for a, b in itertools.pairwise(times))  # its Retry-After


@pytest.mark.parametrize(
    ("refused", "times", "sent"),
    [
        pytest.param(StaleGeneration("stale", retry_after=0.01), 1, 1, id="for-good"),
        pytest.param(JobQuarantined("unknown", retry_after=0.01), 7, 6, id="five-times-at-most"),
        pytest.param(JobQuarantined("unknown", retry_after=60), 1, 1, id="not-past-the-lease"),
    ],
)
async def test_a_refused_write_is_otherwise_returned_as_it_is(
    driver: Driver, api: FakeAPI, refused: Refusal, times: int, sent: int
) -> None:
    """Never after a refusal that does not say nothing was applied, never more than
    five times again, never when its Retry-After is past the lease."""
    api.write_answers = [refusal(refused) for _ in range(times)]
    leases, http = driver.client(), driver.http()
    async with driver.hold(leases, "job", owner="a", ttl=30) as lease:
        answer = await driver.do(lease.request, http, "POST", WRITE)
    assert answer.status_code == refused.status
    assert len(api.writes) == sent


# -- complete, release -----------------------------------------------------------------


async def test_complete_ends_the_lease(driver: Driver, api: FakeAPI) -> None:
    leases = driver.client()
    async with driver.hold(leases, "job", owner="a", ttl=30) as lease:
        await driver.do(lease.complete)
        with pytest.raises(LeaseLost, match="completed or released"):
            lease.headers()
    assert api.jobs["job"]["state"] == "completed"
    assert api.actions() == ["claim", "complete"]


async def test_a_refused_completion_loses_the_lease(driver: Driver, api: FakeAPI) -> None:
    leases = driver.client()
    with pytest.raises(LeaseLost, match="refused: 409 lease-superseded"):
        async with driver.hold(leases, "job", owner="a", ttl=30) as lease:
            api.take_over("job")  # behind its back
            await driver.do(lease.complete)
    assert lease.lost
    assert api.actions() == ["claim", "complete"]


async def test_a_completion_that_cannot_reach_the_service_keeps_the_lease(
    driver: Driver, api: FakeAPI
) -> None:
    leases = driver.client()
    async with driver.hold(leases, "job", owner="a", ttl=3, renew_every=0.05) as lease:
        api.down.add("complete")
        with pytest.raises(LeaseServiceError, match="ConnectError"):
            await driver.do(lease.complete)
        assert not lease.lost
        renewals = api.actions().count("renew")
        await until(lambda: api.actions().count("renew") > renewals)  # renewed again
        api.down.clear()
        await driver.do(lease.complete)  # calling again is safe
    assert api.jobs["job"]["state"] == "completed"


async def test_a_slow_completion_is_not_undone_by_a_racing_renewal(
    driver: Driver, api: FakeAPI
) -> None:
    """No renewal is sent while the completion is on the wire: it would be refused
    as completed, and the lease taken for lost."""
    api.slow["complete"] = 0.3
    leases = driver.client()
    async with driver.hold(leases, "job", owner="a", ttl=3, renew_every=0.05) as lease:
        await until(lambda: "renew" in api.actions())
        await driver.do(lease.complete)
    assert api.jobs["job"]["state"] == "completed"
    assert api.actions()[-1] == "complete"


async def test_release_lets_the_next_worker_claim(driver: Driver, api: FakeAPI) -> None:
    leases = driver.client()
    async with driver.hold(leases, "job", owner="a", ttl=30) as lease:
        await driver.do(lease.release)
        assert api.jobs["job"]["state"] == "released"
    async with driver.hold(leases, "job", owner="b", ttl=30) as lease:
        assert lease.generation == 2
    assert api.actions() == ["claim", "release", "claim", "release"]


# -- leaving the block -----------------------------------------------------------------


async def test_leaving_without_completing_releases_the_job(driver: Driver, api: FakeAPI) -> None:
    leases = driver.client()
    async with driver.hold(leases, "job", owner="a", ttl=30):
        pass
    assert api.jobs["job"]["state"] == "released"
    assert api.calls[-1] == ("release", {"owner": "a", "generation": 1})


async def test_leaving_on_an_error_releases_the_job(driver: Driver, api: FakeAPI) -> None:
    leases = driver.client()
    with pytest.raises(ZeroDivisionError):
        async with driver.hold(leases, "job", owner="a", ttl=30):
            _ = 1 / 0
    assert api.jobs["job"]["state"] == "released"


async def test_an_error_after_a_loss_is_told_as_the_loss(driver: Driver, api: FakeAPI) -> None:
    """The body fails because its lease was lost (a write refused as stale, say):
    the worker is told the lease was lost, with the body's error as its cause."""
    leases = driver.client()
    with pytest.raises(LeaseLost, match="renewal refused") as lost:
        async with driver.hold(leases, "job", owner="a", ttl=3, renew_every=0.05) as lease:
            api.jobs["job"].update(generation=2)
            with contextlib.suppress(asyncio.CancelledError):  # the async client's cancel
                await until_lost(lease)
            raise ValueError("409 stale-generation")
    assert isinstance(lost.value.__cause__, ValueError)


class Interrupt(BaseException):
    """As KeyboardInterrupt or SystemExit, which an event loop would not survive."""


async def test_an_interrupt_after_a_loss_goes_on_as_it_is(driver: Driver, api: FakeAPI) -> None:
    leases = driver.client()
    with pytest.raises(Interrupt):
        async with driver.hold(leases, "job", owner="a", ttl=3, renew_every=0.05) as lease:
            api.jobs["job"].update(generation=2)
            with contextlib.suppress(asyncio.CancelledError):
                await until_lost(lease)
            raise Interrupt


async def test_leaving_normally_after_a_loss_raises_lease_lost(
    driver: Driver, api: FakeAPI
) -> None:
    """A body that saw no error (or swallowed the async client's cancel) is told."""
    leases = driver.client()
    with pytest.raises(LeaseLost, match="renewal refused"):
        async with driver.hold(leases, "job", owner="a", ttl=3, renew_every=0.05) as lease:
            api.jobs["job"].update(generation=2)
            with contextlib.suppress(asyncio.CancelledError):
                await until_lost(lease)


# -- the flows by hand, with no I/O -------------------------------------------------------


def flows(clock: Callable[[], float] = lambda: 0.0) -> Flows:
    return Flows(Endpoint(URL, "/_leases", "s3cret", 0.1, 10.0), clock)


def held(lost: str | None = None) -> Holding:
    """A lease held at generation 1 on a clock stopped at 0 (its deadline: 27)."""
    holding = Holding("job", "a", 30, None, 0.1, lambda: 0.0)
    holding.taken(Grant("job", "a", 1, "1", 30.0, 27.0, {}))
    if lost is not None:
        holding.lose(lost)
    return holding


class Answering:
    """Answers every call with ``record`` and records the ops."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record
        self.ops: list[Any] = []

    def send(self, call: Call) -> Reply:
        self.ops.append(call)
        return Reply(200, json.dumps(self.record).encode())

    def sleep(self, seconds: float) -> None:
        self.ops.append(Sleep(seconds))

    def pause(self) -> bool:
        self.ops.append(Renewer.PAUSE)
        return True

    def resume(self) -> None:
        self.ops.append(Renewer.RESUME)


def test_a_claim_is_one_call_and_its_grant() -> None:
    readings = iter([5.0, 6.0])
    flow = flows(lambda: next(readings)).claim("job 1", None, 30)
    call = next(flow)
    assert call == Call("POST", f"{URL}/_leases/job%201/claim", {"ttl": 30},
                        {"Authorization": "Bearer s3cret"}, 10.0)  # fmt: skip
    record = {"job_id": "job 1", "owner": "svc", "generation": 3, "token": "t", "ttl": 30}
    with pytest.raises(StopIteration) as done:
        flow.send(Reply(200, json.dumps(record).encode()))
    assert (done.value.value.generation, done.value.value.deadline) == (3, 5.0 + 27.0)


def test_leaving_a_lost_lease_lets_an_interrupt_through() -> None:
    for error in (KeyboardInterrupt(), SystemExit(1), asyncio.CancelledError(), LeaseLost("x")):
        assert run(flows().leave(held(lost="gone"), error), Answering({})) is None
    with pytest.raises(LeaseLost, match="gone") as lost:
        run(flows().leave(held(lost="gone"), ValueError("the body's")), Answering({}))
    assert isinstance(lost.value.__cause__, ValueError)


def test_a_failed_completion_resumes_the_renewer() -> None:
    """What doing an op raised is thrown into the flow, which cleans up."""

    class Unreachable(Answering):
        def send(self, call: Call) -> Reply:
            self.ops.append(call)
            raise LeaseServiceError("unreachable")

    io = Unreachable({})
    with pytest.raises(LeaseServiceError):
        run(flows().end(held(), "complete"), io)
    assert [getattr(op, "url", op) for op in io.ops] == [
        Renewer.PAUSE, f"{URL}/_leases/job/complete", Renewer.RESUME,
    ]  # fmt: skip


def test_a_renewer_that_could_not_be_paused_in_time_loses_the_lease() -> None:
    class Late(Answering):
        def pause(self) -> bool:
            return False  # a renewal still on the wire at the deadline

    holding = held()
    with pytest.raises(LeaseLost, match=EXPIRED):
        run(flows().end(holding, "complete"), Late({}))
    assert holding.lost_why == EXPIRED


# -- the httpx adapter ---------------------------------------------------------------------


def httpx_exceptions() -> list[type[Exception]]:
    """Every exception class httpx exports: what the clients can meet from it."""
    return [value for value in vars(httpx).values()
            if isinstance(value, type) and issubclass(value, Exception)]  # fmt: skip


def test_every_httpx_exception_is_in_the_table() -> None:
    """As httpx checks its own map of httpcore's: an exception httpx adds is decided
    here (a project error, or raised as it is), never passed over unseen."""
    classes = httpx_exceptions()
    assert len(classes) > 25
    unmapped = [cls for cls in classes if not any(base in ERRORS for base in cls.__mro__)]
    assert unmapped == []
    assert error_for(httpx.ReadTimeout) is LeaseServiceError
    assert error_for(httpx.StreamConsumed) is None
    assert error_for(RuntimeError) is None  # not httpx's: raised as it is


def an_instance(cls: type[Exception], request: httpx.Request) -> Exception:
    if issubclass(cls, httpx.HTTPStatusError):
        return cls("boom", request=request, response=httpx.Response(500, request=request))
    if issubclass(cls, httpx.RequestError):
        return cls("boom", request=request)
    with contextlib.suppress(TypeError):
        return cls("boom")
    return cls()


async def test_each_httpx_exception_reaches_the_worker_as_the_table_says(driver: Driver) -> None:
    raising: list[type[Exception]] = []

    def failing(request: httpx.Request) -> httpx.Response:
        raise an_instance(raising[-1], request)

    driver.api = failing
    leases = driver.client()
    for kind in httpx_exceptions():
        raising.append(kind)
        expected = error_for(kind) or kind
        with pytest.raises(expected) as raised:
            await driver.do(leases.show, "job")
        assert type(raised.value) is expected, kind
        if expected is LeaseServiceError:
            assert type(raised.value.__cause__) is kind
            assert f"lease service at {URL}/_leases: {kind.__name__}" in str(raised.value)


async def test_a_call_is_over_within_its_time_as_a_whole(driver: Driver) -> None:
    """An answer that trickles in, each piece within httpx's read timeout."""

    def trickle() -> Iterator[bytes]:
        for _ in range(30):
            time.sleep(0.05)
            yield b" "
        yield b"{}"

    async def atrickle() -> AsyncIterator[bytes]:
        for _ in range(30):
            await asyncio.sleep(0.05)
            yield b" "
        yield b"{}"

    def slow(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=trickle() if driver.sync else atrickle())

    driver.api = slow
    leases = driver.client(request_timeout=0.3)
    started = time.monotonic()
    with pytest.raises(LeaseServiceError, match="TimeoutError"):
        await driver.do(leases.show, "job")
    assert time.monotonic() - started < 1.2


def test_the_httpx_surface_the_clients_use_is_there() -> None:
    """What the adapter and lease.request call of httpx, with the arguments they pass."""
    passed = {"method", "url", "json", "headers", "timeout"}
    for method in (httpx.Client.stream, httpx.Client.request, httpx.AsyncClient.request):
        assert passed <= set(inspect.signature(method).parameters), method
    assert inspect.iscoroutinefunction(httpx.AsyncClient.request)
    assert inspect.iscoroutinefunction(httpx.AsyncClient.aclose)
    assert callable(httpx.Client.close)
    answer = httpx.Response(200, headers={"Retry-After": "1"}, content=b"{}")
    assert (answer.status_code, answer.content, answer.headers["retry-after"]) == (200, b"{}", "1")
    assert list(answer.iter_bytes()) == [b"{}"]
    timeout = httpx.Timeout(2.5)
    assert (timeout.connect, timeout.read, timeout.write, timeout.pool) == (2.5, 2.5, 2.5, 2.5)
    for cls in ERRORS:
        assert cls is TimeoutError or getattr(httpx, cls.__name__) is cls
