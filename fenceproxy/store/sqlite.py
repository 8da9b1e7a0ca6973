"""The embedded default store: one SQLite file, owned by one proxy process.

It holds the fences, the idempotency keys, the leases and the jobs' in-flight
records, so a claim and the fence it raises commit together, and so do a write's
admission and its in-flight record.

Durability: WAL mode. With ``synchronous=full`` (the default) a commit is on disk
when it returns, so a fence survives a process crash *and* a power loss; with
``synchronous=normal`` it survives a process crash, and a power loss may roll back
the last commits (so a stale write could be admitted once after it).

Writes from concurrent requests are grouped (:mod:`.batch`): every operation
waiting while a commit runs goes into the next transaction, so many fence updates
share one commit (and one fsync). An operation's caller resumes only after its
commit. A batch is undone as a whole when one of its operations fails.

The file is used through the standard library's ``sqlite3`` on one thread the store
owns, and a whole batch (its reads, its writes and its commit) runs there in one
hand-over from the event loop. A hand-over costs 40-60 µs; one per statement, as an
async wrapper per call would take, would cost more than the statements.

The file is opened in SQLite's exclusive locking mode: a second proxy on the same
file is refused at start (:class:`~fenceproxy.errors.StoreLocked`), so this
process's copy of the fences is the store's truth. The store's clock is this
host's wall clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar

from ..errors import Refusal, StoreError
from ..fence.fencing import Admit, FencedWrite, StoredResponse
from ..fence.write import Settlement
from ..leases.model import (
    InFlightSummary,
    Lease,
    LeaseChange,
    decide_lease,
    decide_write,
    in_the_way,
)
from ..log import store_log
from . import rows, sqlite_errors
from .base import Decision, JobView, Store, StoreGauges, key_not_held
from .batch import Batches
from .migrations import SCHEMAS, read_migrations

__all__ = ["SCHEMA_VERSION", "SQLiteStore"]

T = TypeVar("T")
_Op = Callable[["_Batch"], Any]

_FENCE_CACHE_MAX = 100_000
# Each version's statements (migrations/sqlite/NNN.sql), applied in order inside one
# transaction; a new file gets them all. Version 3 is the first released schema.
_MIGRATIONS = read_migrations(SCHEMAS / "sqlite")
SCHEMA_VERSION = max(_MIGRATIONS)
# A key past its time still counts while it is in flight for a write holding its
# job's in-flight record: that write may yet be applied.
_KEY_SQL = (
    "SELECT k.state, k.fingerprint, k.status, k.headers, k.body, EXISTS (SELECT 1 FROM"
    " inflight i WHERE i.job = k.job AND i.holder = k.holder AND i.expires_at > :now),"
    " k.scope FROM idempotency_keys k WHERE k.job = :job AND k.key = :key"
    " AND (k.expires_at > :now OR (k.state = 'in_flight' AND EXISTS (SELECT 1 FROM"
    " inflight i WHERE i.job = k.job AND i.holder = k.holder AND i.expires_at > :now)))"
)
_LEASE_SQL = "SELECT job, owner, generation, lease_until, ttl, state FROM leases WHERE job = ?"
_IN_FLIGHT_SQL = (
    "SELECT max(expires_at), max(generation) FROM inflight WHERE job = ? AND expires_at > ?"
)
# The jobs live in-flight records hold, by state.
_HELD_SQL = "SELECT state, count(DISTINCT job) FROM inflight WHERE expires_at > ? GROUP BY state"

Synchronous = Literal["full", "normal"]


class SQLiteStore(Store):
    """Fences, idempotency keys, leases and in-flight records in one SQLite file.
    Open with :meth:`open`."""

    backend = "SQLite"
    shared = False
    migrations = _MIGRATIONS
    to_migrate = "stop every proxy using it, then run: fenceproxy migrate -c FILE"

    def __init__(
        self,
        conn: sqlite3.Connection,
        thread: ThreadPoolExecutor,
        *,
        key_ttl: float,
        clock: Callable[[], float],
        purge_interval: float,
        where: str,
    ) -> None:
        super().__init__(key_ttl=key_ttl, where=where)
        self._conn = conn
        self._thread = thread
        self._clock = clock
        self.commits = 0
        """Transactions committed so far; fewer than operations under load."""
        self._fences: dict[str, int | None] = {}
        self._batches: Batches[_Op] = Batches(self._run_batch, name="fenceproxy-sqlite-writer")
        self._start_purging(purge_interval)

    @classmethod
    async def open(
        cls,
        path: str | Path,
        *,
        synchronous: Synchronous = "full",
        key_ttl: float = 24 * 3600.0,
        clock: Callable[[], float] = time.time,
        purge_interval: float = 60.0,
    ) -> SQLiteStore:
        """Open the store at ``path``; a file that does not exist yet is created with
        the current schema.

        Raises StoreLocked when another process has it open, StoreError when the file
        cannot be opened, is not a fenceproxy store, or has another schema version
        (an older one is brought up to date by :meth:`migrate`).
        """

        where = repr(str(path))

        def prepare(conn: sqlite3.Connection) -> None:
            version = _schema_version(conn, path)
            if version == 0:
                _apply_migrations(conn, 0)
            else:
                cls._check_version(where, version)
            conn.execute("COMMIT")

        thread, conn = await _open(path, synchronous, prepare)
        return cls(
            conn,
            thread,
            key_ttl=key_ttl,
            clock=clock,
            purge_interval=purge_interval,
            where=where,
        )

    @classmethod
    async def migrate(cls, path: str | Path) -> tuple[int, int]:
        """Bring the store at ``path`` (created if missing) to the current schema, in
        one transaction; returns the versions before and after. Raises as :meth:`open`."""
        versions: list[int] = []

        def upgrade(conn: sqlite3.Connection) -> None:
            version = _schema_version(conn, path)
            cls._check_version(repr(str(path)), version, migrating=True)
            _apply_migrations(conn, version)
            conn.execute("COMMIT")
            versions.append(version)

        thread, conn = await _open(path, "full", upgrade)
        await asyncio.get_running_loop().run_in_executor(thread, conn.close)
        thread.shutdown(wait=False)
        return versions[0], SCHEMA_VERSION

    # -- the interface --------------------------------------------------------

    def _admit(self, write: FencedWrite) -> asyncio.Future[Decision]:
        def op(tx: _Batch) -> Decision:
            recorded_at = time.monotonic()  # the record is dated after this
            now = self._clock()
            current = tx.fence(write.job)
            record = None
            if write.key is not None:
                key = {"now": now, "job": write.job, "key": write.key}
                record = rows.key_record(tx.one(_KEY_SQL, key))
            lease = (
                rows.lease_record(tx.one(_LEASE_SQL, (write.job,))) if write.check_lease else None
            )
            decision = decide_write(write, current, record, lease, now)
            if not isinstance(decision, Admit):
                return decision, recorded_at
            records = tx.all(
                "SELECT holder, state, expires_at, generation, shared FROM inflight"
                " WHERE job = ? AND expires_at > ?",
                (write.job, now),
            )
            busy = in_the_way(write, rows.in_flight_records(records), now)
            if busy is not None:
                return busy, recorded_at
            tx.write(
                "INSERT OR REPLACE INTO inflight (job, holder, state, expires_at, generation,"
                " shared) VALUES (?, ?, 'in_flight', ?, ?, ?)",
                (write.job, write.turn, now + write.hold, write.generation, write.shared),
            )
            if decision.raise_to is not None:
                tx.raise_fence(write.job, decision.raise_to, now)
            if write.key is not None:
                tx.write(
                    "INSERT OR REPLACE INTO idempotency_keys (route, job, key, state,"
                    " fingerprint, scope, generation, holder, created_at, expires_at)"
                    " VALUES (?, ?, ?, 'in_flight', ?, ?, ?, ?, ?, ?)",
                    rows.key_row(write, now, self._key_ttl),
                )
            return decision, recorded_at

        return self._enqueue(op)

    def _submit_end(self, write: FencedWrite, unknown_for: float | None) -> asyncio.Future[None]:
        def op(tx: _Batch) -> None:
            if unknown_for is None:
                tx.write(
                    "DELETE FROM inflight WHERE job = ? AND holder = ?", (write.job, write.turn)
                )
            else:
                tx.write(
                    "UPDATE inflight SET state = 'unknown', expires_at = max(expires_at, ?)"
                    " WHERE job = ? AND holder = ?",
                    (self._clock() + unknown_for, write.job, write.turn),
                )

        return self._enqueue(op)

    def _submit_key(self, write: FencedWrite, settlement: Settlement) -> asyncio.Future[None]:
        return self._enqueue(self._key_op(write, settlement))

    def _key_op(self, write: FencedWrite, settlement: Settlement) -> _Op:
        if isinstance(settlement, StoredResponse):
            headers = json.dumps(settlement.headers)
            return self._update_key(
                write,
                "state = 'completed', status = ?, headers = ?, body = ?",
                (settlement.status, headers, settlement.body),
            )
        if settlement == "unknown":
            return self._update_key(write, "state = 'unknown'", ())

        def forget(tx: _Batch) -> None:
            if not tx.write(
                "DELETE FROM idempotency_keys WHERE job = ? AND key = ?"
                " AND state = 'in_flight' AND holder = ?",
                (write.job, write.key, write.turn),
            ):
                key_not_held(write, "forget")

        return forget

    async def generation(self, job: str) -> int | None:
        def op(tx: _Batch) -> int | None:
            return tx.fence(job)

        return await self._submit(op)  # type: ignore[no-any-return]

    async def change_lease(self, job: str, change: LeaseChange) -> tuple[Lease | Refusal, float]:
        def op(tx: _Batch) -> tuple[Lease | Refusal, float]:
            now = self._clock()
            current = rows.lease_record(tx.one(_LEASE_SQL, (job,)))
            fence = tx.fence(job)
            in_flight = InFlightSummary(*tx.one(_IN_FLIGHT_SQL, (job, now)))
            result, raise_to = decide_lease(change, current, fence, in_flight, now)
            if raise_to is not None:
                tx.raise_fence(job, raise_to, now)
            if isinstance(result, Lease) and result != current:
                tx.write(
                    "INSERT OR REPLACE INTO leases (job, owner, generation, lease_until, ttl,"
                    " state, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    rows.lease_row(result, now),
                )
            return result, now

        result, now = await self._submit(op)
        self._woken_by(job, result)
        return result, now

    async def lease(self, job: str) -> tuple[Lease | None, float]:
        def op(tx: _Batch) -> tuple[Lease | None, float]:
            return rows.lease_record(tx.one(_LEASE_SQL, (job,))), self._clock()

        return await self._submit(op)  # type: ignore[no-any-return]

    async def inspect(self, job: str) -> JobView:
        def op(tx: _Batch) -> JobView:
            fence, lease, inflight = (tx.one(sql, (job,)) for sql in rows.JOB_VIEW_SQL[:3])
            keys = tx.conn.execute(rows.JOB_VIEW_SQL[3], (job,)).fetchall()
            return rows.job_view(job, self._clock(), fence, lease, inflight, keys)

        return await self._submit(op)  # type: ignore[no-any-return]

    async def jobs(self, prefix: str, after: str, limit: int) -> list[str]:
        def op(tx: _Batch) -> list[str]:
            page = (len(prefix), prefix, after)
            return [row[0] for row in tx.conn.execute(rows.JOBS_SQL, (*page, *page, limit))]

        return await self._submit(op)  # type: ignore[no-any-return]

    async def check(self) -> None:
        def op(tx: _Batch) -> int:
            return int(tx.one("PRAGMA user_version", ())[0])

        self._check_version(self._where, await self._submit(op))

    async def gauges(self) -> StoreGauges:
        def op(tx: _Batch) -> StoreGauges:
            held = tx.conn.execute(_HELD_SQL, (self._clock(),)).fetchall()
            return StoreGauges({str(state): int(jobs) for state, jobs in held})

        return await self._submit(op)  # type: ignore[no-any-return]

    async def purge_expired(self) -> int:
        def op(tx: _Batch) -> int:
            now = self._clock()
            turns = tx.write("DELETE FROM inflight WHERE expires_at <= ?", (now,))
            keys = tx.write(
                "DELETE FROM idempotency_keys WHERE expires_at <= ? AND NOT (state = 'in_flight'"
                " AND EXISTS (SELECT 1 FROM inflight i WHERE i.job = idempotency_keys.job"
                " AND i.holder = idempotency_keys.holder))",
                (now,),
            )
            return turns + keys

        return await self._submit(op)  # type: ignore[no-any-return]

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self.wakes.close()
        await self._stop_purging()
        await self._batches.close()
        await self._stop_retrying()
        await asyncio.get_running_loop().run_in_executor(self._thread, self._conn.close)
        self._thread.shutdown(wait=False)

    # -- grouped commits ------------------------------------------------------

    def _update_key(self, write: FencedWrite, assignments: str, params: tuple[Any, ...]) -> _Op:
        def op(tx: _Batch) -> None:
            # Remembered for the key's time from its outcome, however long it was in flight.
            if not tx.write(
                f"UPDATE idempotency_keys SET {assignments}, expires_at = max(expires_at, ?)"
                " WHERE job = ? AND key = ? AND state = 'in_flight' AND holder = ?",
                (
                    *params,
                    self._clock() + self._key_ttl,
                    write.job,
                    write.key,
                    write.turn,
                ),
            ):
                key_not_held(write, "settle")

        return op

    async def _submit(self, op: _Op) -> Any:
        return await self._enqueue(op)

    def _enqueue(self, op: _Op) -> asyncio.Future[Any]:
        if self._closing:
            raise StoreError("the store is closed")
        return self._batches.submit(op)

    async def _run_batch(self, ops: list[_Op]) -> list[Any]:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        results, failure = await loop.run_in_executor(self._thread, self._transaction, ops)
        if failure is None:
            self.on_commit(time.monotonic() - started, len(ops))
            return results
        # The failing operation's caller gets its error; the others, whose work was
        # undone with it, a StoreError.
        others = (
            failure
            if isinstance(failure, StoreError)
            else StoreError("SQLite store failed: the transaction was undone")
        )
        return [failure if n == len(results) else others for n in range(len(ops))]

    def _transaction(self, ops: list[_Op]) -> tuple[list[Any], BaseException | None]:
        """Run ``ops`` in one transaction, on the store's thread: their results, or
        as many as ran and the error that undid them all."""
        tx = _Batch(self._conn, self._fences)
        results: list[Any] = []
        try:
            for op in ops:
                results.append(op(tx))
            if tx.began:
                self._conn.execute("COMMIT")
                self.commits += 1
        except Exception as exc:
            if tx.began:
                with contextlib.suppress(*sqlite_errors.ERRORS):
                    self._conn.execute("ROLLBACK")
            if isinstance(exc, sqlite_errors.ERRORS):
                store_log.error("SQLite transaction of %d operations failed: %s", len(ops), exc)
                return results, sqlite_errors.failed(exc)
            return results, exc  # a bug in an operation: its caller sees it as it is
        if len(self._fences) > _FENCE_CACHE_MAX:
            self._fences.clear()
        self._fences.update(tx.fences)  # committed: now the store's truth
        return results, None


class _Batch:
    """One group of operations, committed together.

    Reads go straight to SQLite; the first write opens the transaction the batch
    commits once, so a batch that only reads costs no commit. The writer loop is
    the only user of the file (exclusive locking mode), so the operations of a batch
    are atomic whether or not a transaction is open yet. Fences are read through the
    store's cache, which the exclusive lock makes authoritative, and through the
    batch's own changes, which join the cache once committed.
    """

    __slots__ = ("_cache", "began", "conn", "fences")

    def __init__(self, conn: sqlite3.Connection, cache: dict[str, int | None]) -> None:
        self.conn = conn
        self._cache = cache
        self.fences: dict[str, int | None] = {}
        self.began = False

    def one(self, sql: str, params: tuple[Any, ...] | dict[str, Any]) -> Any:
        """The first row, or None."""
        return self.conn.execute(sql, params).fetchone()

    def all(self, sql: str, params: tuple[Any, ...]) -> list[Any]:
        """Every row."""
        return self.conn.execute(sql, params).fetchall()

    def write(self, sql: str, params: tuple[Any, ...] = ()) -> int:
        """Run a write in the batch's transaction; the number of rows it changed."""
        if not self.began:
            self.conn.execute("BEGIN IMMEDIATE")
            self.began = True
        return self.conn.execute(sql, params).rowcount

    def fence(self, job: str) -> int | None:
        if job in self.fences:
            return self.fences[job]
        if job in self._cache:
            return self._cache[job]
        row = self.one("SELECT generation FROM fences WHERE job = ?", (job,))
        generation = None if row is None else int(row[0])
        self._cache[job] = generation  # read from what is committed: true already
        return generation

    def raise_fence(self, job: str, generation: int, now: float) -> None:
        """Raise the job's fence to ``generation``; the statement itself never lowers it."""
        self.write(
            "INSERT INTO fences (job, generation, updated_at) VALUES (?, ?, ?)"
            " ON CONFLICT (job) DO UPDATE SET generation = max(generation, excluded.generation),"
            " updated_at = excluded.updated_at",
            (job, generation, now),
        )
        self.fences[job] = max(generation, self.fence(job) or 0)


async def _open(
    path: str | Path, synchronous: Synchronous, prepare: Callable[[sqlite3.Connection], None]
) -> tuple[ThreadPoolExecutor, sqlite3.Connection]:
    """A thread for the store and, made on it, a connection holding the file's
    exclusive lock, on which ``prepare`` ran. Raises as :meth:`SQLiteStore.open`."""
    thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fenceproxy-sqlite")

    def connect() -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(str(path), isolation_level=None, timeout=2.0)
        except sqlite_errors.ERRORS as exc:
            _raise_opening_error(path, exc)
        try:
            conn.execute("PRAGMA locking_mode = EXCLUSIVE")
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
            # Takes the exclusive lock now, not at the first request.
            conn.execute("BEGIN IMMEDIATE")
            prepare(conn)
        except BaseException as exc:
            conn.close()
            _raise_opening_error(path, exc)
        return conn

    try:
        conn = await asyncio.get_running_loop().run_in_executor(thread, connect)
    except BaseException:
        thread.shutdown(wait=False)
        raise
    return thread, conn


def _schema_version(conn: sqlite3.Connection, path: str | Path) -> int:
    """The file's schema version: 0 for a new, empty file. StoreError for a file
    that has tables but no version: it is not a fenceproxy store."""
    row = conn.execute("PRAGMA user_version").fetchone()
    version = int(row[0]) if row else 0
    if (
        version == 0
        and conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' LIMIT 1").fetchone()
    ):
        raise StoreError(f"{str(path)!r} is an SQLite file, but not a fenceproxy store")
    return version


def _apply_migrations(conn: sqlite3.Connection, version: int) -> None:
    for target, statements in SQLiteStore._migrations_after(version):
        for statement in filter(str.strip, statements.split(";")):
            conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {target}")


def _raise_opening_error(path: str | Path, exc: BaseException) -> NoReturn:
    """Raise an opening failure as StoreError (StoreLocked when another process holds
    the file); anything but an SQLite error as it is."""
    if not isinstance(exc, sqlite_errors.ERRORS):
        raise exc
    raise sqlite_errors.opening_failed(str(path), exc, folder_problem(path)) from exc


def folder_problem(path: str | Path) -> str | None:
    """Why a SQLite file could not be created at ``path``, if its folder says why."""
    folder = Path(path).parent
    if not folder.is_dir():
        return f"its folder {str(folder)!r} does not exist"
    if not os.access(folder, os.W_OK):
        return f"its folder {str(folder)!r} is not writable"
    return None
