"""A job's turn without sockets: this process's gates per job (:class:`JobLocks`),
and :class:`Turns` on a real SQLite store: how a write behind another of its job
asks the store again, and that a finished write is let go."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fenceproxy.config import RouteSpec
from fenceproxy.errors import JobQuarantined, StaleGeneration
from fenceproxy.fence.fencing import Admit, FencedWrite
from fenceproxy.http.routes import Route
from fenceproxy.server.turn import JobLocks, Turns
from fenceproxy.store import SQLiteStore
from fenceproxy.store.base import Decision
from fenceproxy.testing import FakeClock, eventually

from .conftest import admit


def route(timeout: float) -> Route:
    return Route.compile(
        RouteSpec(name="r", path="/", upstream="http://127.0.0.1:9", timeout=timeout)
    )


# -- the gates per job -----------------------------------------------------------


async def waiting(locks: JobLocks, job: str, users: int) -> None:
    """Until ``users`` writes hold or wait for ``job``'s gate."""
    await eventually(lambda: locks.users(job) == users, within=5.0)


async def test_a_release_lets_in_the_first_in_line_with_only_its_own_generation() -> None:
    """Writes of one job in job order reach the upstream one at a time; those of a route
    in generation order go together with the writes of their generation right behind
    them, never beside another generation's or a write in job order."""
    locks = JobLocks()
    assert locks.take_now("j")
    entered: list[str] = []

    async def write(name: str, share: int | None) -> None:
        await locks.acquire("j", share)
        entered.append(name)

    line = [("a", 5), ("b", 5), ("c", 6), ("d", None), ("e", None)]
    writes = {name: asyncio.create_task(write(name, share)) for name, share in line}
    await waiting(locks, "j", 1 + len(line))
    holders = 1
    for group in (["a", "b"], ["c"], ["d"], ["e"]):
        for _ in range(holders):
            locks.release("j")
        async with asyncio.timeout(5):
            await asyncio.gather(*(writes[name] for name in group))
        # Any other let in by the same releases would have run by now, beside them.
        assert entered[-len(group) :] == group
        assert len(entered) == len(set(entered)) == "abcde".index(group[-1]) + 1
        holders = len(group)
    locks.release("j")
    assert len(locks) == 0  # dropped once nobody holds or waits for it


@pytest.mark.parametrize("cut", ["before", "after"], ids=["cut-then-released", "released-then-cut"])
async def test_a_waiter_cut_off_as_the_gate_is_given_back_passes_it_on(cut: str) -> None:
    """A waiting write whose client leaves (or whose timeout fires) in the same turn of
    the event loop as the holder gives the gate back, before the release or just after
    it let the write in: the next in line gets the gate. Neither the holder's exit
    fails after its answer was sent nor the gate stays taken, either of which would
    leave every later write of the job waiting until a restart."""
    locks = JobLocks()
    assert locks.take_now("j")
    gone = asyncio.create_task(locks.acquire("j"))
    next_in_line = asyncio.create_task(locks.acquire("j"))
    await waiting(locks, "j", 3)
    if cut == "before":
        gone.cancel()  # its wait is over at once, though it has not run yet
    locks.release("j")
    if cut == "after":
        gone.cancel()
    async with asyncio.timeout(5):
        with pytest.raises(asyncio.CancelledError):
            await gone
        await next_in_line
    assert locks.users("j") == 1
    locks.release("j")
    assert len(locks) == 0
    assert locks.take_now("j")  # the job goes on


# -- turns on a store ------------------------------------------------------------


class CountingStore(SQLiteStore):
    """The SQLite store, counting the admissions it is asked for."""

    admissions = 0

    def _admit(self, write: FencedWrite) -> asyncio.Future[Decision]:
        self.admissions += 1
        return super()._admit(write)


@pytest.fixture
async def store(store_path: Path, clock: FakeClock) -> AsyncIterator[CountingStore]:
    opened = await CountingStore.open(store_path, clock=clock)
    assert isinstance(opened, CountingStore)
    yield opened
    await opened.close()


async def held_by_another(store: CountingStore, job: str, unknown: bool = False) -> FencedWrite:
    """A write of ``job`` at the upstream (from another proxy, say), its record held
    30 s on the store's clock; its outcome unknown if ``unknown``."""
    other = FencedWrite("other", job, 1, hold=30)
    assert isinstance(await admit(store, other), Admit)
    if unknown:
        await store.end_turn(other, unknown_for=30)
    return other


async def take(turns: Turns, write: FencedWrite, within: Route) -> None:
    """``write``'s turn, entered and left at once (given back, never sent)."""
    async with turns.take(write, within) as turn:
        assert turn.attempt is not None


async def test_a_write_behind_a_live_record_asks_again_until_its_timeout(
    store: CountingStore,
) -> None:
    """While another write of its job is at the upstream, a write asks the store again,
    from a few milliseconds on and at most 50 ms apart: often enough to go soon after
    the job is given back, never so often it loads the store. It is refused only once
    it has waited the route's timeout, saying when the record ends."""
    await held_by_another(store, "j")
    turns, before, started = Turns(store, JobLocks()), store.admissions, time.monotonic()
    with pytest.raises(JobQuarantined) as refused:
        async with asyncio.timeout(10):
            await take(turns, FencedWrite("r", "j", 1), route(timeout=1.0))
    waited, asked = time.monotonic() - started, store.admissions - before
    assert waited >= 0.8, waited  # the timeout, less one pause of at most 50 ms
    # ~24 in that second, fewer on a loaded machine; thousands if it spun on the store.
    assert 5 <= asked <= 100, asked
    assert refused.value.retry_after == 30  # the record's end, on the store's clock


async def test_a_write_behind_a_record_given_back_before_its_timeout_gets_in(
    store: CountingStore,
) -> None:
    """The other write is answered 0.6 s into a 1 s timeout: the write goes, rather
    than be refused for a pause that outlasts what was left of its wait."""
    other = await held_by_another(store, "j")

    async def answered_later() -> None:
        await asyncio.sleep(0.6)  # the other write's exchange, as long as it takes
        await store.end_turn(other)

    answered = asyncio.create_task(answered_later())
    await take(Turns(store, JobLocks()), FencedWrite("r", "j", 1), route(timeout=1.0))
    await answered


async def test_a_write_behind_a_write_of_unknown_outcome_is_refused_at_once(
    store: CountingStore,
) -> None:
    """The other write got no answer: the upstream may still apply it, and its record
    holds the job for its quarantine. Asking again before then is in vain, so the
    write is refused on the first answer, not after waiting out its timeout."""
    await held_by_another(store, "j", unknown=True)
    before = store.admissions
    with pytest.raises(JobQuarantined) as refused:
        await take(Turns(store, JobLocks()), FencedWrite("r", "j", 1), route(timeout=30.0))
    assert store.admissions - before == 1
    assert refused.value.retry_after == 30


async def test_a_finished_write_is_let_go_whatever_ended_it(store: CountingStore) -> None:
    """A write's task is among those shutdown cuts only while it is in its turn:
    answered, refused or cut off, it is let go, or each fenced write would stay
    referenced for the life of the process."""
    turns = Turns(store, JobLocks())
    one_second = route(timeout=1.0)

    async def answered() -> None:
        async with turns.take(FencedWrite("r", "j", 2), one_second) as turn:
            assert turn.attempt is not None
            assert turns.writing == {asyncio.current_task()}
            turn.attempt.send(time.monotonic())
            turn.attempt.answered(200)

    async def stale() -> None:
        with pytest.raises(StaleGeneration):
            await take(turns, FencedWrite("r", "j", 1), one_second)

    inside = asyncio.Event()

    async def cut_off() -> None:
        async with turns.take(FencedWrite("r", "j", 2), one_second):
            inside.set()
            await asyncio.Event().wait()  # its client leaves meanwhile

    # Each in a task of its own, as the proxy runs each request.
    for work in (answered, stale):
        await asyncio.create_task(work())
        assert turns.writing == set(), work.__name__
    task = asyncio.create_task(cut_off())
    async with asyncio.timeout(5):
        await inside.wait()
    assert turns.writing == {task}
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert turns.writing == set()
    await take(turns, FencedWrite("r", "j", 2), one_second)  # the job was given back
