"""A fenced write's turn at its job: queued, admitted, settled, handed back.

``async with turns.take(write, route) as turn:`` is the turn. Entering it:

1. a keyed write whose key this process is still settling is refused or replayed
   at once (``turn.replay``), never queued behind the original;
2. it waits for this process's earlier writes of the job (:class:`JobLocks`, first
   come, first served), up to the route's timeout;
3. the store admits it (:class:`~fenceproxy.fence.write.Attempt`), or refuses it;
   while another write of any proxy holds the job's in-flight record, it asks again
   until the route's timeout, then gets JobQuarantined, at once when that write's
   outcome is unknown.

Leaving it, whatever ended it, a cancellation included, in this order: an exchange
whose outcome is unknown is cut (:meth:`UpstreamResponse.cut`, its socket closed,
so no more of it reaches the upstream); the key is settled as the attempt's
:class:`~fenceproxy.fence.write.Ending` says; then the job's in-flight record is
cleared, or held for the route's quarantine; then the job's next write may go. No
other write ever reads the key as orphaned. A store that fails meanwhile leaves
the record and the key to be retried in the background; until then this process
answers the key's duplicates from memory.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from ..errors import JobQuarantined, Refusal, StoreError, StoreUnavailable
from ..fence.fencing import (
    Admit,
    Busy,
    FencedWrite,
    KeyRecord,
    KeyState,
    Replay,
    StoredResponse,
    decide,
)
from ..fence.write import Attempt, Ending, Settlement
from ..http.http1 import UpstreamResponse
from ..http.routes import Route
from ..log import proxy_log
from ..store import Store

if TYPE_CHECKING:
    from ..ops.tracing import Tracing

__all__ = ["JobLocks", "Turn", "Turns"]

_SETTLE_RETRY = 1.0
# How long close() lets the writes it cuts settle (abort, key, record) in the store.
_SETTLE_AT_CLOSE = 5.0
_BUSY_POLL_FIRST = 0.002
_BUSY_POLL_MAX = 0.05
_Slot = tuple[str, str]  # (job, key): a key is its job's, whatever route it came by
_T = TypeVar("_T")


class _Gate:
    """One job's gate: how many hold it, the generation they share (None: one
    holder alone), and who waits, in order."""

    __slots__ = ("holders", "share", "waiting")

    def __init__(self) -> None:
        self.holders = 0
        self.share: int | None = None
        self.waiting: deque[tuple[int | None, asyncio.Future[None]]] = deque()

    def open_to(self, share: int | None) -> bool:
        """Whether a newcomer of ``share`` may go in at once."""
        if self.waiting:
            return False
        return self.holders == 0 or (share is not None and share == self.share)


class JobLocks:
    """In-process gates per job, first come first served, dropped when nobody holds
    or waits for them.

    A write in job order holds its job's gate alone. Writes of a route in generation
    order (``share``: their generation) hold it together with the others of their
    generation that come while it is open to them, that is, before anyone waits. The
    gates order one process's writes of a job and spare the store their contention;
    the order across processes is the store's in-flight records.
    """

    __slots__ = ("_gates",)

    def __init__(self) -> None:
        self._gates: dict[str, _Gate] = {}

    def __len__(self) -> int:
        return len(self._gates)

    def users(self, job: str) -> int:
        """How many writes of ``job`` hold or wait for its gate."""
        gate = self._gates.get(job)
        return 0 if gate is None else gate.holders + len(gate.waiting)

    def take_now(self, job: str, share: int | None = None) -> bool:
        """Take the job's gate if a write of ``share`` may go in at once; whether it
        did (then it is given back once, with :meth:`release`)."""
        gate = self._gates.get(job)
        if gate is None:
            gate = self._gates[job] = _Gate()
        if not gate.open_to(share):
            return False
        gate.holders += 1
        gate.share = share
        return True

    async def acquire(self, job: str, share: int | None = None) -> None:
        """Take the job's gate, waiting for it: first come, first served. Cancelled
        while waiting, it has taken nothing."""
        if self.take_now(job, share):
            return
        gate = self._gates[job]
        entry = (share, asyncio.get_running_loop().create_future())
        gate.waiting.append(entry)
        try:
            await entry[1]
        except BaseException:
            if entry[1].done() and not entry[1].cancelled():
                self.release(job)  # let in just as it was cancelled
            else:
                if entry in gate.waiting:  # unless a release already passed over it
                    gate.waiting.remove(entry)
                self._drop_if_unused(job, gate)
            raise

    def release(self, job: str) -> None:
        """Give back the gate taken with :meth:`take_now` or :meth:`acquire`."""
        gate = self._gates[job]
        gate.holders -= 1
        if gate.holders == 0:
            # The first in line goes in, and with it those behind it that share with it.
            while gate.waiting:
                share, waiter = gate.waiting[0]
                if gate.holders and (share is None or share != gate.share):
                    break
                gate.waiting.popleft()
                if waiter.done():
                    continue
                waiter.set_result(None)
                gate.holders += 1
                gate.share = share
                if share is None:
                    break
        self._drop_if_unused(job, gate)

    def _drop_if_unused(self, job: str, gate: _Gate) -> None:
        if gate.holders == 0 and not gate.waiting and self._gates.get(job) is gate:
            del self._gates[job]


class Turns:
    """This process's turns at its jobs, on ``store``: the per-job queue, the keyed
    writes not yet settled in the store, and the store writes retried meanwhile."""

    def __init__(
        self,
        store: Store,
        locks: JobLocks,
        timed: Callable[[float], object] = lambda s: None,
        *,
        tracing: Tracing | None = None,
    ) -> None:
        """``timed`` is told each write's store part, in seconds, as its turn ends: its
        admission (every ask) and its settlement. With ``tracing``, each admission is
        noted on its write's span. Made on the event loop its writes run on."""
        # Looked up once: asyncio.get_running_loop() is a getpid() system call each time.
        self.loop = asyncio.get_running_loop()
        self.store = store
        self.locks = locks
        self.timed = timed
        self.tracing = tracing
        # Keyed writes of this process from arrival until the store has their final
        # state: a duplicate is answered at once rather than queued behind the
        # original, and a state the store could not take yet is still honoured.
        # Only ever refuses or replays, never admits: the store holds the truth for every
        # proxy, and another proxy reading a key this one could not settle refuses it.
        self.keys: dict[_Slot, KeyRecord] = {}
        self._background: set[asyncio.Task[None]] = set()
        # The handlers of fenced writes in their job's turn, cut at close.
        self.writing: set[asyncio.Task[object]] = set()

    def take(self, write: FencedWrite, route: Route) -> Turn:
        """``write``'s turn at its job (``async with``); its fingerprint is known."""
        return Turn(self, write, route)

    async def close(self) -> None:
        """Cut the fenced writes still in their turn (shutdown's drain time is over)
        and let each settle while the store is still open: its upstream connection
        aborted, its key and record marked unknown, held for the route's quarantine
        on every proxy. Then stop retrying key settlements: a key in flight whose
        in-flight record is gone reads as unknown to every proxy. A write that could
        not settle in time leaves its record to expire."""
        writing = [task for task in self.writing if not task.done()]
        for task in writing:
            task.cancel()
        if writing:
            await asyncio.wait(writing, timeout=_SETTLE_AT_CLOSE)
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    async def settle(self, write: FencedWrite, route: Route, ending: Ending) -> None:
        """Record what the key became, and clear or hold the job's record, in one
        store transaction. Survives cancellation. If the store fails, the record
        stays (the job waits, nothing worse), the key's state is kept in memory (so
        retries are answered by it), and both are retried in the background."""
        if ending.unknown_for is not None and route.quarantine > 0:
            proxy_log.warning(
                "job %r held for %.1fs: a write's outcome is unknown", write.job, route.quarantine
            )
        slot = None if write.key is None else (write.job, write.key)
        settled = functools.partial(
            self.store.end_turn, write, unknown_for=ending.unknown_for, key=ending.key
        )
        try:
            await settled()
        except StoreError as exc:
            proxy_log.error("could not settle a write of job %r, retrying: %s", write.job, exc)
            if slot is not None and ending.key is not None:
                self.keys[slot] = _record(write, ending.key)
            self.retry_later(settled, lambda: self._forget(slot))
        else:
            self._forget(slot)

    def _forget(self, slot: _Slot | None) -> None:
        """The store has the key's state: this process no longer answers for it."""
        if slot is not None:
            self.keys.pop(slot, None)

    def retry_later(
        self,
        attempt: Callable[[], Awaitable[None]],
        then: Callable[[], object] = lambda: None,
        *,
        first: float = _SETTLE_RETRY,
    ) -> None:
        """Retry a store write in the background, after ``first`` seconds and then
        every second, until it succeeds."""

        async def retry() -> None:
            delay = first
            while True:
                await asyncio.sleep(delay)
                delay = _SETTLE_RETRY
                try:
                    await attempt()
                except StoreError:
                    continue
                then()
                return

        task = asyncio.create_task(retry())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class Turn:
    """One write's turn (see the module's docstring). Inside it, ``replay`` is the
    stored answer to give instead, when there is one; otherwise ``attempt`` is the
    admitted write, and ``upstream`` is to be set to its exchange once it has one."""

    __slots__ = (
        "_held",
        "_in_store",
        "_reserved",
        "_route",
        "_task",
        "_turns",
        "_write",
        "attempt",
        "replay",
        "upstream",
    )

    def __init__(self, turns: Turns, write: FencedWrite, route: Route) -> None:
        self._turns = turns
        self._write = write
        self._route = route
        self._task: asyncio.Task[object] | None = None  # counted among the writes close() cuts
        self._reserved: _Slot | None = None  # the key this process marked in flight
        self._held = False  # the job's gate in this process
        self._in_store = 0.0  # seconds spent admitting and settling it
        self.replay: StoredResponse | None = None
        self.attempt: Attempt | None = None
        self.upstream: UpstreamResponse | None = None

    async def __aenter__(self) -> Turn:
        try:
            self._writing()
            self.replay = self._reserve()
            if self.replay is None:
                await self._queue()
                self.replay = await self._timed(self._admit())
        except BaseException:
            self._leave()
            raise
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        answered = False
        try:
            if self.attempt is not None:
                await self._hand_back(self.attempt.end(exc))
            answered = exc is None
        finally:
            if not answered and self.upstream is not None:
                self.upstream.release()  # the driver relays an answer, else nobody
            self._leave()

    def _leave(self) -> None:
        """Undo what entering took, in the reverse order: the job's gate, the key's
        mark in this process, the count among the writes close() cuts; then its store
        part is told."""
        turns = self._turns
        if self._held:
            self._held = False
            turns.locks.release(self._write.job)
        if self._reserved is not None:
            _unreserve(turns.keys, self._reserved)
            self._reserved = None
        if self._task is not None:
            turns.writing.discard(self._task)
            self._task = None
        if self._in_store:
            turns.timed(self._in_store)
            self._in_store = 0.0

    async def _hand_back(self, ending: Ending) -> None:
        """Cut an exchange in doubt before anything else, then settle the key and end
        the turn, even if cancelled meanwhile (the cancellation is seen after)."""
        try:
            if ending.cut and self.upstream is not None:
                await self.upstream.cut()
        finally:
            await self._timed(self._turns.settle(self._write, self._route, ending))

    async def _timed(self, step: Awaitable[_T]) -> _T:
        """``step``, its time counted in this write's store part."""
        started = time.monotonic()
        try:
            return await step
        finally:
            self._in_store += time.monotonic() - started

    def _writing(self) -> None:
        """Count this task among the writes close() cuts, until the turn ends."""
        task = asyncio.current_task(self._turns.loop)
        assert task is not None
        self._turns.writing.add(task)
        self._task = task

    def _reserve(self) -> StoredResponse | None:
        """A keyed write: a duplicate of one this process is still settling is refused
        or replayed at once; otherwise it is marked in flight here until it ends."""
        write, keys = self._write, self._turns.keys
        if write.key is None:
            return None
        assert write.fingerprint is not None
        slot = (write.job, write.key)
        if (record := keys.get(slot)) is not None:
            decision = decide(write, None, record)
            if isinstance(decision, Refusal):
                raise decision
            assert isinstance(decision, Replay)
            return decision.response
        keys[slot] = KeyRecord(KeyState.IN_FLIGHT, write.fingerprint, scope=write.scope)
        self._reserved = slot
        return None

    async def _queue(self) -> None:
        """Wait behind this process's earlier writes of the job, up to the route's
        timeout; a write of a route in generation order goes along with those of its
        generation."""
        write, locks = self._write, self._turns.locks
        share = write.generation if write.shared else None
        if locks.take_now(write.job, share):
            self._held = True
            return
        try:
            async with asyncio.timeout(self._route.timeout):
                await locks.acquire(write.job, share)
        except TimeoutError:
            raise _waited_too_long(self._write, retry_after=1.0) from None
        self._held = True

    async def _admit(self) -> StoredResponse | None:
        """Admitted (``attempt`` set), or the stored answer to replay. While another
        write holds the job's record, ask again until the route's timeout; then, or at
        once when that write's outcome is unknown, refuse with JobQuarantined."""
        write, deadline, delay = (
            self._write,
            time.monotonic() + self._route.timeout,
            _BUSY_POLL_FIRST,
        )
        while True:
            decision, recorded_at = await self._store_admit()
            if isinstance(decision, Replay):
                return decision.response
            if isinstance(decision, Admit):
                self.attempt = Attempt(write, self._route, recorded_at)
                return None
            if decision.unknown:
                raise _behind_unknown(write, retry_after=decision.retry_after)
            if time.monotonic() + delay > deadline:
                raise _waited_too_long(write, retry_after=decision.retry_after)
            await asyncio.sleep(delay)
            delay = min(delay * 2, _BUSY_POLL_MAX)

    async def _store_admit(self) -> tuple[Admit | Replay | Busy, float]:
        """One admission, and the monotonic instant at or before which its in-flight
        record was dated; a refusal is raised. If the request is cancelled meanwhile,
        the store gives back what it took: nothing was sent."""
        store, write, tracing = self._turns.store, self._write, self._turns.tracing
        admission = store.admit(write)
        if tracing is not None:
            admission = tracing.admitting(admission)
        try:
            decision, recorded_at = await admission
        except StoreError as exc:
            proxy_log.error("store failed, refusing the write: %s", exc)
            # The store may have committed what it could not confirm (a lost reply):
            # give back whatever this write took, so neither its job nor its key waits
            # out the record. Nothing was sent.
            self._turns.retry_later(lambda: store.give_back(write), first=0.0)
            raise StoreUnavailable(
                "the fencing store could not record this write; nothing was forwarded"
            ) from exc
        if isinstance(decision, Refusal):
            raise decision
        return decision, recorded_at


def _unreserve(keys: dict[_Slot, KeyRecord], slot: _Slot) -> None:
    record = keys.get(slot)
    if record is not None and record.state is KeyState.IN_FLIGHT:
        del keys[slot]  # settled in the store, or never reserved there


def _record(write: FencedWrite, settlement: Settlement) -> KeyRecord:
    """The in-memory stand-in for a settlement the store has not taken yet, its
    caller's only. A key not sent but still reserved in the store reads as unknown
    until then: never let a duplicate through on a guess."""
    assert write.fingerprint is not None
    if isinstance(settlement, StoredResponse):
        return KeyRecord(KeyState.COMPLETED, write.fingerprint, settlement, write.scope)
    return KeyRecord(KeyState.UNKNOWN, write.fingerprint, scope=write.scope)


def _waited_too_long(write: FencedWrite, *, retry_after: float) -> JobQuarantined:
    return JobQuarantined(
        "another write of this job is in flight at the upstream (sent by this or another "
        "proxy, or by one that stopped); its later writes wait for it, and this one "
        "waited as long as the route's timeout",
        retry_after=retry_after,
        job=write.job,
    )


def _behind_unknown(write: FencedWrite, *, retry_after: float) -> JobQuarantined:
    return JobQuarantined(
        "an earlier write of this job got no answer and may still be applied by the "
        "upstream; its later writes are refused until then so none can overtake it",
        retry_after=retry_after,
        job=write.job,
    )
