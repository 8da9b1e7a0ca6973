"""The embedded default store: one SQLite file, owned by one proxy process.

It holds the fences, the idempotency keys and the leases, so a claim and the
fence it raises commit together.

Durability: WAL mode. With ``synchronous=full`` (the default) a commit is on disk
when it returns, so a fence survives a process crash *and* a power loss; with
``synchronous=normal`` it survives a process crash, and a power loss may roll back
the last commits (so a stale write could be admitted once after it).

Writes from concurrent requests are grouped: every operation waiting while a
commit runs goes into the next transaction, so many fence updates share one
commit (and one fsync). An operation's caller resumes only after its commit.

The file is opened in SQLite's exclusive locking mode: per-job ordering is kept
by in-process locks, so a second proxy on the same file is refused at start
(:class:`~fenceproxy.errors.StoreLocked`) rather than allowed to break it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Literal, TypeVar

import aiosqlite

from ..errors import Refusal, StoreError, StoreLocked
from ..fencing import Admit, FencedWrite, KeyRecord, KeyState, Replay, StoredResponse, decide
from ..leasing import Lease, LeaseState
from ..log import store_log
from .base import JobLocks, LeaseChange, Store

__all__ = ["SQLiteStore"]

T = TypeVar("T")
_Op = Callable[["_Batch"], Awaitable[Any]]

_SCHEMA_VERSION = 3
_FENCE_CACHE_MAX = 100_000
_SCHEMA = """
CREATE TABLE IF NOT EXISTS fences (
    job         TEXT PRIMARY KEY,
    generation  INTEGER NOT NULL,
    updated_at  REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS idempotency_keys (
    route       TEXT NOT NULL,
    job         TEXT NOT NULL,
    key         TEXT NOT NULL,
    state       TEXT NOT NULL CHECK (state IN ('in_flight', 'completed', 'unknown')),
    fingerprint BLOB NOT NULL,
    generation  INTEGER NOT NULL,
    status      INTEGER,
    headers     TEXT,
    body        BLOB,
    created_at  REAL NOT NULL,
    expires_at  REAL NOT NULL,
    PRIMARY KEY (route, job, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_keys_expiry ON idempotency_keys (expires_at);
CREATE TABLE IF NOT EXISTS leases (
    job         TEXT PRIMARY KEY,
    owner       TEXT NOT NULL,
    generation  INTEGER NOT NULL,
    lease_until REAL NOT NULL,
    ttl         REAL NOT NULL,
    state       TEXT NOT NULL CHECK (state IN ('held', 'released', 'completed')),
    updated_at  REAL NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (
    key         TEXT PRIMARY KEY,
    value       REAL NOT NULL
) WITHOUT ROWID;
"""

Synchronous = Literal["full", "normal"]


class SQLiteStore(Store):
    """Fences and idempotency keys in one SQLite file. Open with :meth:`open`."""

    def __init__(
        self,
        conn: aiosqlite.Connection,
        *,
        key_ttl: float,
        clock: Callable[[], float],
        purge_interval: float,
    ) -> None:
        self._conn = conn
        self._key_ttl = key_ttl
        self._clock = clock
        self._pending: list[tuple[_Op, asyncio.Future[Any]]] = []
        self._wake = asyncio.Event()
        self._closing = False
        self.commits = 0
        """Transactions committed so far; fewer than operations under load."""
        self._fences: dict[str, int | None] = {}
        self.locks = JobLocks()
        """The per-job locks behind :meth:`job_lock`."""
        self._writer = asyncio.create_task(self._write_loop(), name="fenceproxy-sqlite-writer")
        self._purger = asyncio.create_task(
            self._purge_loop(purge_interval), name="fenceproxy-sqlite-purge"
        )

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
        """Open (and create or migrate) the store at ``path``.

        Raises StoreLocked when another process has it open, StoreError when the
        file cannot be opened or is not a fenceproxy store.
        """
        try:
            conn = await aiosqlite.connect(str(path), isolation_level=None, timeout=2.0)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open SQLite store {str(path)!r}: {exc}") from exc
        try:
            await conn.execute("PRAGMA locking_mode = EXCLUSIVE")
            await conn.execute("PRAGMA journal_mode = WAL")
            await conn.execute(f"PRAGMA synchronous = {synchronous.upper()}")
            # Takes the exclusive lock now, not at the first request.
            await conn.execute("BEGIN IMMEDIATE")
            version = (await (await conn.execute("PRAGMA user_version")).fetchone() or (0,))[0]
            if version > _SCHEMA_VERSION:
                raise StoreError(
                    f"SQLite store {str(path)!r} has schema version {version}; "
                    f"this fenceproxy knows up to {_SCHEMA_VERSION}"
                )
            for statement in filter(str.strip, _SCHEMA.split(";")):
                await conn.execute(statement)
            await conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
            # A keyed write in flight when the previous process died may have reached
            # the upstream: its outcome is unknown, and a retry must be told so.
            cursor = await conn.execute(
                "UPDATE idempotency_keys SET state = 'unknown' WHERE state = 'in_flight'"
            )
            if cursor.rowcount:
                store_log.warning(
                    "%d idempotency keys were in flight at the last stop; marked unknown",
                    cursor.rowcount,
                )
            meta: dict[str, float] = {
                str(k): float(v)
                for k, v in await conn.execute_fetchall("SELECT key, value FROM meta")
            }
            crashed = meta.get("running") == 1
            quiet_until = float(meta.get("quiet_until", 0.0))
            await conn.execute("INSERT OR REPLACE INTO meta VALUES ('running', 1)")
            await conn.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            await conn.close()
            if "locked" in str(exc):
                raise StoreLocked(
                    f"SQLite store {str(path)!r} is in use by another process; "
                    "one proxy per SQLite file"
                ) from exc
            raise StoreError(f"cannot open SQLite store {str(path)!r}: {exc}") from exc
        except sqlite3.Error as exc:
            await conn.close()
            raise StoreError(f"cannot open SQLite store {str(path)!r}: {exc}") from exc
        except BaseException:
            await conn.close()
            raise
        if crashed:
            store_log.warning("the previous process using this store did not stop cleanly")
        store = cls(
            conn,
            key_ttl=key_ttl,
            clock=clock,
            purge_interval=purge_interval,
        )
        store.crashed, store.quiet_until = crashed, quiet_until
        return store

    # -- the interface --------------------------------------------------------

    async def admit(self, write: FencedWrite) -> Admit | Replay | Refusal:
        async def op(tx: _Batch) -> Admit | Replay | Refusal:
            now = self._clock()
            current = await tx.fence(write.job)
            record = None
            if write.key is not None:
                record = _record(
                    await tx.one(
                        "SELECT state, fingerprint, status, headers, body FROM idempotency_keys"
                        " WHERE route = ? AND job = ? AND key = ? AND expires_at > ?",
                        (write.route, write.job, write.key, now),
                    )
                )
            decision = decide(write, current, record)
            if isinstance(decision, Admit):
                if decision.raise_to is not None:
                    await tx.set_fence(write.job, decision.raise_to, now)
                if write.key is not None:
                    await tx.write(
                        "INSERT OR REPLACE INTO idempotency_keys (route, job, key, state,"
                        " fingerprint, generation, created_at, expires_at)"
                        " VALUES (?, ?, ?, 'in_flight', ?, ?, ?, ?)",
                        (
                            write.route,
                            write.job,
                            write.key,
                            write.fingerprint,
                            write.generation,
                            now,
                            now + self._key_ttl,
                        ),
                    )
            return decision

        return await self._submit(op)  # type: ignore[no-any-return]

    async def complete_key(self, write: FencedWrite, response: StoredResponse) -> None:
        headers = json.dumps(response.headers)
        await self._update_key(
            write,
            "state = 'completed', status = ?, headers = ?, body = ?",
            (response.status, headers, response.body),
        )

    async def mark_unknown(self, write: FencedWrite) -> None:
        await self._update_key(write, "state = 'unknown'", ())

    async def forget_key(self, write: FencedWrite) -> None:
        async def op(tx: _Batch) -> None:
            await tx.write(
                "DELETE FROM idempotency_keys WHERE route = ? AND job = ? AND key = ?"
                " AND state = 'in_flight'",
                (write.route, write.job, write.key),
            )

        await self._submit(op)

    async def generation(self, job: str) -> int | None:
        async def op(tx: _Batch) -> int | None:
            return await tx.fence(job)

        return await self._submit(op)  # type: ignore[no-any-return]

    async def change_lease(self, job: str, change: LeaseChange) -> Lease | Refusal:
        async def op(tx: _Batch) -> Lease | Refusal:
            now = self._clock()
            current = _lease(
                await tx.one(
                    "SELECT job, owner, generation, lease_until, ttl, state FROM leases"
                    " WHERE job = ?",
                    (job,),
                )
            )
            fence = await tx.fence(job)
            result = change(current, fence, now)
            if isinstance(result, Lease) and result != current:
                await tx.write(
                    "INSERT OR REPLACE INTO leases (job, owner, generation, lease_until, ttl,"
                    " state, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        job,
                        result.owner,
                        result.generation,
                        result.lease_until,
                        result.ttl,
                        result.state.value,
                        now,
                    ),
                )
                if fence is None or result.generation > fence:
                    await tx.set_fence(job, result.generation, now)
            return result

        return await self._submit(op)  # type: ignore[no-any-return]

    async def lease(self, job: str) -> Lease | None:
        async def op(tx: _Batch) -> Lease | None:
            return _lease(
                await tx.one(
                    "SELECT job, owner, generation, lease_until, ttl, state FROM leases"
                    " WHERE job = ?",
                    (job,),
                )
            )

        return await self._submit(op)  # type: ignore[no-any-return]

    def now(self) -> float:
        return self._clock()

    def job_lock(self, job: str) -> AbstractAsyncContextManager[None]:
        return self.locks(job)

    async def purge_expired(self) -> int:
        """Delete idempotency keys past their ttl; returns how many."""

        async def op(tx: _Batch) -> int:
            return await tx.write(
                "DELETE FROM idempotency_keys WHERE expires_at <= ? AND state != 'in_flight'",
                (self._clock(),),
            )

        return await self._submit(op)  # type: ignore[no-any-return]

    async def stop_cleanly(self, quiet_until: float) -> None:
        async def op(tx: _Batch) -> None:
            await tx.write("INSERT OR REPLACE INTO meta VALUES ('running', 0)")
            await tx.write("INSERT OR REPLACE INTO meta VALUES ('quiet_until', ?)", (quiet_until,))

        await self._submit(op)

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._purger.cancel()
        self._wake.set()
        with contextlib.suppress(asyncio.CancelledError):
            await self._purger
        await self._writer
        await self._conn.close()

    # -- grouped commits ------------------------------------------------------

    async def _update_key(
        self, write: FencedWrite, assignments: str, params: tuple[Any, ...]
    ) -> None:
        async def op(tx: _Batch) -> None:
            await tx.write(
                f"UPDATE idempotency_keys SET {assignments}"
                " WHERE route = ? AND job = ? AND key = ? AND state = 'in_flight'",
                (*params, write.route, write.job, write.key),
            )

        await self._submit(op)

    async def _submit(self, op: _Op) -> Any:
        if self._closing or self._writer.done():
            raise StoreError("the store is closed")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.append((op, future))
        self._wake.set()
        return await future

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch, self._pending = self._pending, []
                await self._run_batch(batch)
            if self._closing:
                return

    async def _run_batch(self, batch: list[tuple[_Op, asyncio.Future[Any]]]) -> None:
        tx = _Batch(self._conn, self._fences)
        results: list[Any] = []
        try:
            for op, _ in batch:
                results.append(await op(tx))
            if tx.began:
                await self._conn.execute("COMMIT")
                self.commits += 1
        except Exception as exc:  # an op that fails fails its whole batch, closed
            store_log.error("SQLite transaction of %d operations failed: %s", len(batch), exc)
            if tx.began:
                with contextlib.suppress(Exception):
                    await self._conn.execute("ROLLBACK")
            error = StoreError(f"SQLite store failed: {exc}")
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        if len(self._fences) > _FENCE_CACHE_MAX:
            self._fences.clear()
        self._fences.update(tx.fences)  # committed: now the store's truth
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)

    async def _purge_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                removed = await self.purge_expired()
            except StoreError:
                continue
            if removed:
                store_log.info("purged %d expired idempotency keys", removed)


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

    def __init__(self, conn: aiosqlite.Connection, cache: dict[str, int | None]) -> None:
        self.conn = conn
        self._cache = cache
        self.fences: dict[str, int | None] = {}
        self.began = False

    async def one(self, sql: str, params: tuple[Any, ...]) -> Any:
        """The first row, in one trip to the SQLite thread (a cursor would take three)."""
        rows = await self.conn.execute_fetchall(sql, params)
        return next(iter(rows), None)

    async def write(self, sql: str, params: tuple[Any, ...] = ()) -> int:
        """Run a write in the batch's transaction; the number of rows it changed."""
        if not self.began:
            await self.conn.execute("BEGIN IMMEDIATE")
            self.began = True
        cursor = await self.conn.execute(sql, params)
        return cursor.rowcount

    async def fence(self, job: str) -> int | None:
        if job in self.fences:
            return self.fences[job]
        if job in self._cache:
            return self._cache[job]
        row = await self.one("SELECT generation FROM fences WHERE job = ?", (job,))
        generation = None if row is None else int(row[0])
        self._cache[job] = generation  # read from what is committed: true already
        return generation

    async def set_fence(self, job: str, generation: int, now: float) -> None:
        await self.write(
            "INSERT INTO fences (job, generation, updated_at) VALUES (?, ?, ?)"
            " ON CONFLICT (job) DO UPDATE SET generation = excluded.generation,"
            " updated_at = excluded.updated_at",
            (job, generation, now),
        )
        self.fences[job] = generation


def _lease(row: Any) -> Lease | None:
    if row is None:
        return None
    job, owner, generation, lease_until, ttl, state = row
    return Lease(
        str(job), str(owner), int(generation), float(lease_until), float(ttl), LeaseState(state)
    )


def _record(row: Any) -> KeyRecord | None:
    if row is None:
        return None
    state, fp, status, headers, body = row
    response = None
    if state == KeyState.COMPLETED:
        pairs = tuple((str(k), str(v)) for k, v in json.loads(headers))
        response = StoredResponse(status=int(status), headers=pairs, body=body)
    return KeyRecord(state=KeyState(state), fingerprint=bytes(fp), response=response)
