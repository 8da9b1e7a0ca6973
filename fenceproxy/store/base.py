"""The store interface: one durable home for fences, idempotency keys and leases.

A backend keeps, per job, the highest generation it has accepted, and per
(route, job, key) what became of a keyed write. Every decision is taken inside one
transaction by :func:`fenceproxy.fencing.decide`, and committed before the proxy
forwards anything. Backends: :mod:`.sqlite` (one proxy process per file).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from ..errors import Refusal
from ..fencing import Admit, FencedWrite, Replay, StoredResponse
from ..leasing import Lease

__all__ = ["JobLocks", "LeaseChange", "Store"]

LeaseChange = Callable[[Lease | None, int | None, float], Lease | Refusal]
"""A lease decision: (the job's lease, its fence, the store's now) -> new lease or refusal."""


class Store(abc.ABC):
    """Durable fences and idempotency keys.

    Every method raises :class:`~fenceproxy.errors.StoreError` when the backend fails;
    callers fail closed on it.
    """

    crashed: bool = False
    """The previous process using the store did not stop cleanly: writes it had in
    flight at an upstream may still be applied there."""
    quiet_until: float = 0.0
    """On the store's clock: until when the previous process, stopped cleanly, had
    jobs quarantined."""

    @abc.abstractmethod
    async def stop_cleanly(self, quiet_until: float) -> None:
        """Record a clean stop, with the end of the last quarantine it leaves behind."""

    @abc.abstractmethod
    async def admit(self, write: FencedWrite) -> Admit | Replay | Refusal:
        """Decide ``write`` and, when admitted, durably raise the job's fence and mark
        its key in flight, in one transaction that has committed when this returns."""

    @abc.abstractmethod
    async def complete_key(self, write: FencedWrite, response: StoredResponse) -> None:
        """Record the upstream's answer to an admitted keyed write, for replay."""

    @abc.abstractmethod
    async def forget_key(self, write: FencedWrite) -> None:
        """Drop the key of an admitted write that never left the proxy, so it may be retried."""

    @abc.abstractmethod
    async def mark_unknown(self, write: FencedWrite) -> None:
        """Record that an admitted keyed write was sent and its outcome is unknown."""

    @abc.abstractmethod
    async def generation(self, job: str) -> int | None:
        """The highest generation accepted for ``job``, or None if none was."""

    @abc.abstractmethod
    async def change_lease(self, job: str, change: LeaseChange) -> Lease | Refusal:
        """Apply ``change`` to the job's lease in one transaction, with the job's fence
        and the store's clock. A new lease is written, and the job's fence raised to
        its generation, so a late write of an older holder is refused by the proxy
        even before the new holder has written anything."""

    @abc.abstractmethod
    async def lease(self, job: str) -> Lease | None:
        """The job's lease record, if a lease was ever taken on it."""

    @abc.abstractmethod
    def now(self) -> float:
        """The store's clock, which decides lease expiry."""

    @abc.abstractmethod
    def job_lock(self, job: str) -> AbstractAsyncContextManager[None]:
        """An async context manager that serialises the writes of one job, first come
        first served. Held from the fence check until the upstream has answered."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Finish pending work and release the backend."""


class JobLocks:
    """In-process FIFO locks per job, dropped when nobody holds or waits for them.

    Enough for a backend that only one proxy process uses at a time (SQLite); a
    shared backend serialises across processes in the database instead.
    """

    __slots__ = ("_locks",)

    class Held:
        __slots__ = ("_job", "_owner")

        def __init__(self, owner: JobLocks, job: str) -> None:
            self._owner = owner
            self._job = job

        async def __aenter__(self) -> None:
            await self._owner._acquire(self._job)

        async def __aexit__(self, *exc: object) -> None:
            self._owner._release(self._job)

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def __call__(self, job: str) -> JobLocks.Held:
        return JobLocks.Held(self, job)

    def __len__(self) -> int:
        return len(self._locks)

    def users(self, job: str) -> int:
        """How many writes of ``job`` hold or wait for its lock."""
        entry = self._locks.get(job)
        return 0 if entry is None else entry[1]

    async def _acquire(self, job: str) -> None:
        lock, users = self._locks.get(job) or (asyncio.Lock(), 0)
        self._locks[job] = (lock, users + 1)
        try:
            await lock.acquire()
        except BaseException:
            self._drop(job)
            raise

    def _release(self, job: str) -> None:
        self._locks[job][0].release()
        self._drop(job)

    def _drop(self, job: str) -> None:
        lock, users = self._locks[job]
        if users == 1:
            del self._locks[job]
        else:
            self._locks[job] = (lock, users - 1)
