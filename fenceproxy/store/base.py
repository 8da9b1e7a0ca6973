"""The store interface: the one durable home for fences, idempotency keys, leases
and in-flight records, shared by every proxy that uses it.

A backend keeps, per job, the highest generation it has accepted and its in-flight
record (which write may be at the upstream now, until when); per (job, key), by
whatever route it came, what became of a keyed write; per job its lease. Every
decision is taken inside one transaction by
:func:`~fenceproxy.leases.model.decide_write` (the fence, the key and, on a
lease-checked route, the lease), and committed before the proxy forwards anything.
Whatever the guarantees rest on lives here, not in a proxy's memory: a proxy's own
caches (the SQLite store's fences, the proxy's key records) are either
authoritative because one process owns the store, or only ever refuse or replay,
never admit.

Backends: :mod:`.sqlite` (one proxy process per file) and :mod:`.postgres` (any
number of proxies on one database).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from ..errors import Refusal, StoreError
from ..fence.fencing import (
    Admit,
    Busy,
    FencedWrite,
    Replay,
)
from ..fence.write import Settlement
from ..leases.model import Lease, LeaseChange, LeaseState
from ..log import store_log
from .wakes import JobWakes

__all__ = [
    "JobView",
    "KeyView",
    "LeaseChange",
    "Store",
    "StoreGauges",
    "StoreServer",
    "key_not_held",
    "to_completion",
]

T = TypeVar("T")
_END_RETRY = 1.0
"""Seconds between submissions of a record's end that failed."""
Decision = tuple[Admit | Replay | Refusal | Busy, float]
"""What :meth:`Store.admit` returns: the decision, and when the store's clock was read."""


class Store(abc.ABC):
    """Durable fences, idempotency keys, leases and in-flight records.

    Every method raises :class:`~fenceproxy.errors.StoreError` when the backend fails;
    callers fail closed on it. Anything else raised is a bug, and is left to surface.

    What is the same on every backend is here: an admission's give-back when its
    caller is cancelled (:meth:`admit` around the backend's :meth:`_admit`), the
    purge loop, the order migrations are applied in, and what a store at another
    schema version is told. A backend reads and writes its rows.
    """

    backend: ClassVar[str]
    """The backend's name in messages: ``SQLite``, ``PostgreSQL``."""
    migrations: ClassVar[Mapping[int, str]]
    """Each schema version's statements, applied in order in one transaction; the
    highest version is this build's."""
    to_migrate: ClassVar[str]
    """What an operator does to bring a store at an older schema version up to date."""
    shared: ClassVar[bool]
    """Whether other processes write to it: their in-flight records are cleared without
    a wake in this one."""

    def __init__(self, *, key_ttl: float, where: str) -> None:
        self._key_ttl = key_ttl
        """How long an idempotency key is kept, in seconds."""
        self._where = where
        """The store as messages name it: the SQLite file, or PostgreSQL's hosts and
        database (never a password)."""
        self._closing = False
        """Set as :meth:`close` begins: what is submitted after is refused."""
        self.on_commit: Callable[[float, int], object] = lambda seconds, operations: None
        """Told of each commit: how long it took and how many operations it held."""
        self.server = StoreServer()
        """The database server the store's decisions go to, as last connected."""
        self._ending: dict[str, asyncio.Future[None]] = {}
        """Per job, the latest end of a record submitted and left, until it commits."""
        self._retrying: set[asyncio.Task[None]] = set()
        """The ends of in-flight records that failed, submitted again every second."""
        self.wakes = JobWakes()
        """The claims waiting for a job, woken when it may be free: a release or a
        completion committed, an in-flight record cleared (on PostgreSQL, a release or
        completion through another proxy too)."""

    def _woken_by(self, job: str, result: Lease | Refusal) -> None:
        """Wake the job's waiting claims once ``result`` (a lease change, committed)
        released or completed it."""
        if isinstance(result, Lease) and result.state is not LeaseState.HELD:
            self.wakes.wake(job)

    def _end_unwaited(self, job: str, submit: Callable[[], asyncio.Future[None]]) -> None:
        """Submit the end of a record of ``job`` and leave it: an answer need not wait
        for its commit, which this process's next operations come after. Once it has
        committed, the job's waiting claims are woken. Should it fail, it is submitted
        again every second until it commits or the store closes; meanwhile the
        record holds its job (nothing worse), and it expires by itself."""
        ending = self._ending[job] = submit()
        ending.add_done_callback(lambda done: self._ended(job, submit, done))

    async def _ends_committed(self, job: str | None = None) -> None:
        """Wait until the ends of ``job``'s records (of every job's, without one) this
        process submitted and left have committed (or failed), so that what follows
        comes after them, as it does on a backend whose every operation goes through
        one queue."""
        if job is None:
            endings = list(self._ending.values())
        else:
            endings = [ending] if (ending := self._ending.get(job)) is not None else []
        if endings:
            await asyncio.wait(endings)

    def _ended(
        self, job: str, submit: Callable[[], asyncio.Future[None]], done: asyncio.Future[None]
    ) -> None:
        if self._ending.get(job) is done:
            del self._ending[job]  # the latest: those before it are in its batch or earlier
        if done.cancelled():
            return
        if (exc := done.exception()) is None:
            self.wakes.wake(job)
            return
        if self._closing:
            store_log.error("could not end job %r's in-flight record (it expires): %s", job, exc)
            return
        store_log.error("could not end job %r's in-flight record, retrying: %s", job, exc)
        retry = asyncio.get_running_loop().create_task(self._end_again(job, submit))
        self._retrying.add(retry)
        retry.add_done_callback(self._retrying.discard)

    def _wake_on_commit(self, job: str, ended: asyncio.Future[None]) -> None:
        """Wake the job's waiting claims once ``ended`` (a record's end) has committed."""

        def woken(done: asyncio.Future[None]) -> None:
            if not done.cancelled() and done.exception() is None:
                self.wakes.wake(job)

        ended.add_done_callback(woken)

    async def _end_again(self, job: str, submit: Callable[[], asyncio.Future[None]]) -> None:
        while not self._closing:
            await asyncio.sleep(_END_RETRY)
            try:
                await submit()
            except StoreError:
                continue
            self.wakes.wake(job)
            return

    async def _stop_retrying(self) -> None:
        """Stop retrying the ends of records (the store closes): those left expire."""
        for retry in list(self._retrying):
            retry.cancel()
        await asyncio.gather(*self._retrying, return_exceptions=True)

    async def admit(self, write: FencedWrite) -> Decision:
        """Decide ``write``. Admitted, it takes the job's in-flight record for
        ``write.hold`` seconds, raises the job's fence and marks its key in flight,
        in one transaction that has committed when this returns. A write that would
        be admitted while another write holds the record gets :class:`Busy`, and
        nothing changes.

        Also returns a ``time.monotonic()`` reading taken at or before the moment
        the store's clock was read for this decision: the record lasts ``write.hold``
        from no earlier than then. Time spent waiting for a connection or a batch
        comes before it, so the proxy can tell a stall after the record was taken
        (which must not send the write) from a queue before it (which is harmless).

        Cancelling the caller does not cut the admission short: it completes, and
        what it took is given back (:meth:`give_back`), since nothing was sent, before
        the cancellation reaches the caller. A second cancellation meanwhile changes
        nothing of that."""
        admitting = asyncio.ensure_future(self._admit(write))
        try:
            return await asyncio.shield(admitting)
        except asyncio.CancelledError:
            await to_completion(self._give_back_admitted(admitting, write))
            raise

    @abc.abstractmethod
    def _admit(self, write: FencedWrite) -> Awaitable[Decision]:
        """The admission itself, as :meth:`admit` describes it, minus the care for a
        cancelled caller: :meth:`admit` never cancels what this returns."""

    async def _give_back_admitted(
        self, admitting: asyncio.Future[Decision], write: FencedWrite
    ) -> None:
        """Once the admission of a write whose caller was cancelled is over, give back
        what it took, if it was admitted: the write will not be sent."""
        try:
            decision, _ = await admitting
        except Exception:
            return  # it failed: it took nothing
        if isinstance(decision, Admit):
            try:
                await self.give_back(write)
            except Exception as exc:
                store_log.error(
                    "could not clear an in-flight record (it expires by itself): %s", exc
                )

    async def end_turn(
        self,
        write: FencedWrite,
        *,
        unknown_for: float | None = None,
        key: Settlement | None = None,
    ) -> None:
        """Give the job's in-flight record back: the upstream answered ``write``, or it
        was never sent. With ``unknown_for``, it was sent and its outcome is unknown:
        the record stays, marked unknown, for that many seconds from now, so no newer
        write of the job can overtake it at the upstream. A record this write no
        longer holds is left alone. Cancelling the caller does not stop it.

        With ``key``, what a keyed write's key became (:meth:`settle_key`) is
        recorded first, in the same batch: one transaction and commit for both, on
        disk when this returns, and nobody ever sees the record gone while the key is
        still in flight. Without, it returns once the change is submitted, not
        committed (:meth:`_end_unwaited`): the record only ever holds its job back,
        and every later operation of this process comes after it."""

        def ended() -> asyncio.Future[None]:
            return self._submit_end(write, unknown_for)

        if key is None:
            self._end_unwaited(write.job, ended)
            return
        # Submitted together, so in one batch, the key first.
        settled = self._submit_key(write, key)
        self._wake_on_commit(write.job, ended())
        await to_completion(settled)

    async def settle_key(self, write: FencedWrite, settlement: Settlement) -> None:
        """Record what became of an admitted keyed write: its answer, for replay;
        ``"unknown"``, sent without an answer; ``"forget"``, never sent, so the key
        may come again as new. It runs to its end even if the caller is cancelled,
        since the write's fate does not change with the request's. A key no longer
        this write's, in flight, is left alone."""
        await to_completion(self._submit_key(write, settlement))

    @abc.abstractmethod
    def _submit_end(self, write: FencedWrite, unknown_for: float | None) -> asyncio.Future[None]:
        """Queue the end (or, with ``unknown_for``, the hold) of ``write``'s in-flight
        record for the next batch; its outcome once that batch is over."""

    @abc.abstractmethod
    def _submit_key(self, write: FencedWrite, settlement: Settlement) -> asyncio.Future[None]:
        """Queue what ``write``'s key became for the next batch; its outcome once that
        batch is over."""

    async def give_back(self, write: FencedWrite) -> None:
        """Undo the admission of a write that was never sent: its key is released, its
        in-flight record given back. Either one it no longer holds is left alone."""
        await self.end_turn(write, key=None if write.key is None else "forget")

    @abc.abstractmethod
    async def generation(self, job: str) -> int | None:
        """The highest generation accepted for ``job``, or None if none was."""

    @abc.abstractmethod
    async def change_lease(self, job: str, change: LeaseChange) -> tuple[Lease | Refusal, float]:
        """Apply ``change`` to the job's lease in one transaction, with the job's fence
        and the store's clock (:func:`~fenceproxy.leases.model.decide_lease`); returns
        the outcome and that clock's reading. A new lease is written, and the job's
        fence raised to its generation, so a late write of an older holder is refused
        by the proxy even before the new holder has written anything. A new generation
        is not handed out while the job's in-flight record is live; no admission runs
        between the record's reading and the commit. A release or completion wakes the
        job's waiting claims (:attr:`wakes`), on every proxy of the store, once
        committed."""

    @abc.abstractmethod
    async def lease(self, job: str) -> tuple[Lease | None, float]:
        """The job's lease record, if a lease was ever taken on it, and the store's now."""

    @abc.abstractmethod
    async def inspect(self, job: str) -> JobView:
        """What the store holds of ``job``, read while the proxy runs (the admin
        listener's ``/jobs/{job}``)."""

    @abc.abstractmethod
    async def jobs(self, prefix: str, after: str, limit: int) -> list[str]:
        """Up to ``limit`` job ids with a fence or a lease, starting with ``prefix``,
        after ``after``, in the store's order."""

    @abc.abstractmethod
    async def check(self) -> None:
        """Whether the store answers and its schema is this fenceproxy's: StoreError
        saying why not (for a readiness probe)."""

    @abc.abstractmethod
    async def gauges(self) -> StoreGauges:
        """What the metrics show of the store now, read when they are scraped:
        StoreError when it fails."""

    @abc.abstractmethod
    async def purge_expired(self) -> int:
        """Delete idempotency keys and in-flight records past their time; how many."""

    def _start_purging(self, interval: float) -> None:
        """Purge every ``interval`` seconds until :meth:`_stop_purging`; a purge that
        fails is tried again at the next one."""
        self._purger = asyncio.create_task(
            self._purge_loop(interval), name=f"fenceproxy-{self.backend.lower()}-purge"
        )

    async def _stop_purging(self) -> None:
        self._purger.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._purger

    async def _purge_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                removed = await self.purge_expired()
            except StoreError:
                continue
            if removed:
                store_log.info("purged %d expired idempotency keys and in-flight records", removed)

    # -- the schema -----------------------------------------------------------

    @classmethod
    def _migrations_after(cls, version: int) -> Iterator[tuple[int, str]]:
        """Each version above ``version`` and its statements, in order, for the caller
        to apply in its transaction; each is logged once the caller asks for the next."""
        for target in sorted(v for v in cls.migrations if v > version):
            yield target, cls.migrations[target]
            store_log.info("%s store migrated to schema version %d", cls.backend, target)

    @classmethod
    def _check_version(cls, where: str, version: int, *, migrating: bool = False) -> None:
        """StoreError unless a store (``where``, as messages name it) at ``version`` is
        at this build's schema, or, ``migrating``, not above it."""
        latest = max(cls.migrations)
        if version == latest or (migrating and version < latest):
            return
        store = f"{cls.backend} store {where}"
        if version > latest:
            raise StoreError(
                f"{store} has schema version {version}; this fenceproxy knows up to {latest}: "
                "run a newer fenceproxy"
            )
        if version == 0:
            raise StoreError(f"{store} is not migrated: {cls.to_migrate}")
        raise StoreError(
            f"{store} has schema version {version}, and this fenceproxy needs {latest}: "
            f"{cls.to_migrate}"
        )

    @abc.abstractmethod
    async def close(self) -> None:
        """Finish pending work and release the backend."""


@dataclass(frozen=True, slots=True)
class KeyView:
    """One idempotency key of a job, as an operator sees it (never its answer)."""

    route: str
    key: str
    state: str
    generation: int
    status: int | None
    created_at: float
    expires_at: float


@dataclass(frozen=True, slots=True)
class StoreGauges:
    """What the metrics read of the store on each scrape."""

    held: Mapping[str, int]
    """Jobs a live in-flight record holds, by the record's state: ``in_flight`` (a
    write at the upstream now) and ``unknown`` (a write whose outcome is unknown: the
    job is quarantined). A job with records in both states counts in both."""
    synchronous: bool | None = None
    """PostgreSQL with ``?require_sync=true``: whether every commit waits for a
    synchronous standby's flush, as that option checks it; None otherwise (SQLite, or
    a store not asked to have a standby: a single server is not alerted on)."""


@dataclass(slots=True)
class StoreServer:
    """Which server a store reaches, for ``/readyz``, ``/metrics`` and the operator
    page. An embedded store has none: ``address`` stays None."""

    address: str | None = None
    """``host:port`` of the server the last connection reached: the primary."""
    connections: int = 0
    """Connections opened to the database since the store opened."""
    changes: int = 0
    """Times a new connection reached another server than the one before: each
    failover this proxy saw (a restart of the same primary is not one)."""

    def connected(self, address: str) -> None:
        self.connections += 1
        if self.address is not None and address != self.address:
            self.changes += 1
        self.address = address


@dataclass(frozen=True, slots=True)
class JobView:
    """What the store holds of one job, on the store's clock (``now``)."""

    job: str
    now: float
    generation: int | None
    generation_set_at: float | None
    lease: Lease | None
    in_flight: tuple[str, str, float] | None
    """The job's in-flight record: (holder, state, expires_at)."""
    keys: tuple[KeyView, ...]
    """The most recent keys first, at most :data:`RECENT_KEYS`."""

    @property
    def known(self) -> bool:
        return (
            self.generation is not None
            or self.lease is not None
            or self.in_flight is not None
            or bool(self.keys)
        )


async def to_completion(work: Awaitable[T]) -> T:
    """Await ``work``, which runs to its end even if the caller is cancelled meanwhile
    (the caller still sees the cancellation, once ``work`` is done), however many
    times it is cancelled meanwhile."""
    task = asyncio.ensure_future(work)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait((task,))  # a cancelled wait leaves the task alone
        except asyncio.CancelledError as exc:
            cancelled = cancelled or exc
    if cancelled is not None:
        if not task.cancelled():
            task.exception()  # seen: nobody waits for its outcome any more
        raise cancelled
    return task.result()


def key_not_held(write: FencedWrite, what: str) -> None:
    """Log that settling a key changed nothing: it was no longer this write's, in
    flight (it expired and was purged, or another write took it over)."""
    store_log.warning(
        "could not %s key %r of job %r: it is no longer in flight for this write",
        what,
        write.key,
        write.job,
    )
