"""The shared store: PostgreSQL, for any number of proxies on one database.

Everything the guarantees rest on is a row here, never a connection or a session:
the fences, the keys, the leases, and each job's in-flight record, which orders
one job's writes across every proxy and outlives a proxy that dies mid-write. The
database's clock (``clock_timestamp()``) decides every expiry.

Admissions and settlements (a key completed, marked unknown or forgotten; a record
cleared or held) that arrive together go to the database as one batch
(:mod:`.batch`), in one transaction with one commit:

1. one call of ``fenceproxy_batch`` (a server-side function, schema 6) goes through
   the batch job by job, in the one order every proxy uses (by job id). A settlement
   is applied. A take holds the job's advisory lock until the commit, then reads
   the job's live in-flight records (one per write that may be at the upstream) and
   adds its own unless one of them is in its way
   (:func:`~fenceproxy.leases.model.in_the_way`). Two proxies admitting one job
   meet on that lock: the second waits for the first's commit, then finds the
   first's record and gets :class:`~fenceproxy.fence.fencing.Busy` (unless both are
   shared writes of one generation). Then a statement of its own reads the take's
   fence, key and lease, each by its primary key, with a snapshot taken after the
   lock was won: no admission or lease change of the job can commit in between;
2. each take is decided on its own, in Python (:func:`~fenceproxy.leases.model.decide_write`);
3. one statement writes what the admitted ones need (the fence only ever rises,
   ``GREATEST``; the key goes in flight) and puts back the records that refused
   writes took, as they were. Then the commit.

One write's refusal never undoes another's; a failure anywhere undoes the whole
batch, and every caller in it gets the StoreError. Since every lock a batch waits
for is taken in job order, two batches never wait for each other in a circle; the
purge skips rows a batch holds. A batch of settlements alone is the one call.

Errors of the driver and the network become :class:`~fenceproxy.errors.StoreError`
as :mod:`.asyncpg_errors` says: in :meth:`PostgresStore._run` and
:meth:`PostgresStore._run_batch` for every operation (logged once, and the connection
they happened on closed, in :meth:`PostgresStore._connection`),
and where :meth:`~PostgresStore.open` and :meth:`~PostgresStore.migrate` connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import asyncpg

from ..errors import Refusal, StoreError
from ..fence.fencing import Admit, Busy, FencedWrite, Replay, StoredResponse
from ..fence.write import Settlement
from ..leases.model import (
    InFlightSummary,
    Lease,
    LeaseChange,
    LeaseState,
    decide_lease,
    decide_write,
)
from ..log import store_log
from . import rows
from .asyncpg_errors import ERRORS, failed, first, reconnects_in_one_line
from .base import (
    Decision,
    JobView,
    Store,
    StoreGauges,
    StoreServer,
    key_not_held,
)
from .batch import Batches
from .migrations import SCHEMAS, read_migrations
from .wakes import JobWakes

__all__ = ["SCHEMA_VERSION", "PostgresStore"]

T = TypeVar("T")

if TYPE_CHECKING:  # subscriptable in the type stubs only
    from asyncpg.pool import PoolConnectionProxy

    _Conn = PoolConnectionProxy[asyncpg.Record]

# Each version's statements (migrations/postgresql/NNN.sql), applied in order inside
# one transaction; fenceproxy_batch, the batch's first step in one call (see
# PostgresStore._run_batch), is made by 005.sql and replaced by 006.sql.
_MIGRATIONS = read_migrations(SCHEMAS / "postgresql")
SCHEMA_VERSION = max(_MIGRATIONS)
_VERSION_TABLE = "fenceproxy_schema"
# Where a release or completion of a job is told to every proxy (the payload: the job).
_CHANNEL = "fenceproxy_jobs"
# How often the listening connection is asked whether it is still there: a server gone
# without a word (a partition) would leave it waiting for notifications that never come.
_LISTEN_CHECK = 10.0
# Any constant: migrations of one database take this advisory lock, one at a time.
_MIGRATION_LOCK = 0x66656E6365

# One generic plan per statement, made once per session: once the tables were
# analyzed (the in-flight table all but empty, as autovacuum finds it), the plan cache
# chose to plan an admission's reads again at every call, which cost more than running
# them (docs/postgresql.md, "The in-flight table"). The batch's function reads by key
# alone (schema 7 sets it no sequential scan).
_SESSION = {"plan_cache_mode": "force_generic_plan"}

# The database's clock, in seconds since the epoch, unless a test gives its own.
_NOW = "coalesce($clock::double precision, extract(epoch FROM clock_timestamp())::double precision)"


def _numbered(statement: str) -> str:
    """``?`` placeholders (shared with SQLite) as ``$1``, ``$2``, ..."""
    parts = statement.split("?")
    return "".join(f"{part}${n}" for n, part in enumerate(parts[:-1], 1)) + parts[-1]


def _sql(statement: str) -> str:
    """``$clock`` becomes the statement's last parameter."""
    count = max((n for n in range(1, 10) if f"${n}" in statement), default=0)
    return statement.replace("$clock", f"${count + 1}")


# What a lease change decides on besides the lease: the store's clock, the fence
# and the job's live in-flight records (when the last expires, their highest
# generation), read under the job's lock.
_READ_FOR_LEASE = _sql(
    f"""
WITH clock AS (SELECT {_NOW} AS now)
SELECT clock.now, (SELECT generation FROM fences WHERE job = $1), live.until, live.top
FROM clock, LATERAL (SELECT max(expires_at) AS until, max(generation) AS top
                     FROM inflight WHERE job = $1 AND expires_at > clock.now) AS live
"""
)
_RAISE_FENCE = """
INSERT INTO fences AS f (job, generation, updated_at) VALUES ($1, $2, $3)
ON CONFLICT (job) DO UPDATE
    SET generation = GREATEST(f.generation, excluded.generation), updated_at = excluded.updated_at
RETURNING generation
"""
_LEASE = "SELECT job, owner, generation, lease_until, ttl, state FROM leases WHERE job = $1"
_BATCH = "SELECT * FROM fenceproxy_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)"
# A batch's second step, for the takes it admitted and refused: the fences only ever
# rise, the keys go in flight, the records of refused writes are given back. Every row
# it touches belongs to a job whose advisory lock this transaction holds, so it waits
# for no other batch.
_WRITES = """
WITH raised AS (
    INSERT INTO fences AS f (job, generation, updated_at)
    SELECT * FROM unnest($1::text[], $2::bigint[], $3::double precision[])
    ON CONFLICT (job) DO UPDATE
        SET generation = GREATEST(f.generation, excluded.generation),
            updated_at = excluded.updated_at
), keyed AS (
    INSERT INTO idempotency_keys (route, job, key, state, fingerprint, scope, generation,
                                  holder, created_at, expires_at)
    SELECT route, job, key, 'in_flight', fingerprint, scope, generation, holder,
           created_at, expires_at
    FROM unnest($4::text[], $5::text[], $6::text[], $7::bytea[], $8::bytea[], $9::bigint[],
                $10::text[], $11::double precision[], $12::double precision[])
        AS u(route, job, key, fingerprint, scope, generation, holder, created_at, expires_at)
    ON CONFLICT (job, key) DO UPDATE SET route = excluded.route, state = 'in_flight',
        fingerprint = excluded.fingerprint, scope = excluded.scope,
        generation = excluded.generation, holder = excluded.holder,
        status = NULL, headers = NULL, body = NULL,
        created_at = excluded.created_at, expires_at = excluded.expires_at
"""
_APPLY = _WRITES + ")\nSELECT 1"
# The same, and the records of refused writes put back: apart, since a plan that joins
# the in-flight table reads it whole once autovacuum has found it all but empty.
_APPLY_AND_PUT_BACK = (
    _WRITES
    + """), put_back AS (
    SELECT * FROM unnest($13::text[], $14::text[], $15::text[], $16::text[],
                         $17::double precision[]) AS u(job, turn, holder, state, expires_at)
), restored AS (
    UPDATE inflight i SET holder = u.holder, state = u.state, expires_at = u.expires_at
    FROM put_back u WHERE i.job = u.job AND i.holder = u.turn AND u.holder IS NOT NULL
), removed AS (
    DELETE FROM inflight i USING put_back u
    WHERE i.job = u.job AND i.holder = u.turn AND u.holder IS NULL
)
SELECT 1"""
)


async def _kept(conn: asyncpg.Connection) -> None:
    """What a connection given back to the pool needs reset: nothing. The store sets
    no session state: every lock it takes is its transaction's, it listens to
    nothing and opens no cursor, and an open transaction is rolled back by the pool
    first. asyncpg's default reset (``RESET ALL``, ``UNLISTEN *``, ``CLOSE ALL``,
    the advisory locks unlocked) would cost a round trip per use. Nor is it what
    finds a broken connection: one on which anything failed is never given back
    (:meth:`PostgresStore._connection` closes it)."""


def _drop(conn: _Conn) -> None:
    """Close ``conn`` for good. One whose socket closed already was let go by the pool
    as it closed, and its proxy refuses every call (InterfaceError)."""
    with contextlib.suppress(asyncpg.InterfaceError):
        conn.terminate()


def _failed(exc: Exception) -> StoreError:
    """What every caller of a failed operation gets, saying why it failed."""
    cause = first(exc)
    return failed(f"PostgreSQL store failed: {type(cause).__name__}", cause)


async def _one(conn: _Conn, statement: str, *args: Any) -> asyncpg.Record:
    """The one row a statement that always returns one returns."""
    row = await conn.fetchrow(statement, *args)
    assert row is not None
    return row


class PostgresStore(Store):
    """Fences, idempotency keys, leases and in-flight records in PostgreSQL.
    Open with :meth:`open`; the database must have been migrated first."""

    backend = "PostgreSQL"
    shared = True
    migrations = _MIGRATIONS
    to_migrate = "run fenceproxy migrate -c FILE"

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        key_ttl: float,
        clock: Callable[[], float | None],
        purge_interval: float,
        where: str,
        acquire_timeout: float = 5.0,
        server: StoreServer | None = None,
        require_sync: bool = False,
        listen: Callable[[], Awaitable[asyncpg.Connection]] | None = None,
    ) -> None:
        """``listen`` opens the connection that listens for releases and completions
        on other proxies (:class:`_Listener`), once a claim first waits; without it,
        only this proxy's wake its waiting claims."""
        super().__init__(key_ttl=key_ttl, where=where)
        self.server = server or self.server
        self._require_sync = require_sync
        self._pool = pool
        self._clock = clock
        self._acquire_timeout = acquire_timeout
        self._batches: Batches[_Op] = Batches(self._run_batch, name="fenceproxy-postgres-batches")
        self._start_purging(purge_interval)
        self._listener: _Listener | None = None
        if listen is not None:

            def start_listening() -> None:
                self._listener = _Listener(listen, self.wakes, where)

            self.wakes.first_watch = start_listening

    @classmethod
    async def open(
        cls,
        dsn: str,
        *,
        pool_size: int = 10,
        password: str | None = None,
        key_ttl: float = 24 * 3600.0,
        clock: Callable[[], float | None] = lambda: None,
        purge_interval: float = 60.0,
        connect_timeout: float = 5.0,
        require_sync: bool = False,
    ) -> PostgresStore:
        """Connect a pool of up to ``pool_size`` connections, each to a primary (the
        URL's ``target_session_attrs``). Raises StoreError when the database cannot
        be reached or is not migrated to this fenceproxy's schema. ``require_sync``:
        :meth:`check` also requires a synchronous standby."""
        where = _where(dsn)
        server = StoreServer()
        reconnects_in_one_line()

        async def connected(conn: asyncpg.Connection) -> None:
            server.connected(_address(await conn.fetchrow(_SERVER)))

        try:
            pool = await asyncpg.create_pool(
                dsn,
                password=password,
                min_size=1,
                max_size=pool_size,
                timeout=connect_timeout,
                command_timeout=connect_timeout * 2,
                init=connected,
                reset=_kept,
                server_settings=_SESSION,
            )
        except ERRORS as exc:
            raise failed(f"cannot connect to the PostgreSQL store {where}", exc) from exc
        try:
            async with pool.acquire() as conn:
                version = await _schema_version(conn)
        except ERRORS as exc:
            await pool.close()
            raise failed(f"cannot read the PostgreSQL store {where}", exc) from exc
        try:
            cls._check_version(where, version)
        except StoreError:
            await pool.close()
            raise
        return cls(
            pool,
            key_ttl=key_ttl,
            clock=clock,
            purge_interval=purge_interval,
            where=where,
            acquire_timeout=connect_timeout,
            server=server,
            require_sync=require_sync,
            listen=lambda: asyncpg.connect(dsn, password=password, timeout=connect_timeout),
        )

    @classmethod
    async def migrate(
        cls, dsn: str, *, password: str | None = None, connect_timeout: float = 5.0
    ) -> tuple[int, int]:
        """Bring the database to the current schema, in one transaction that holds an
        advisory lock (two migrations at once take turns); the versions before and
        after. Raises StoreError."""
        where = _where(dsn)
        try:
            conn = await asyncpg.connect(dsn, password=password, timeout=connect_timeout)
        except ERRORS as exc:
            raise failed(f"cannot connect to the PostgreSQL store {where}", exc) from exc
        try:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
                await conn.execute(
                    f"CREATE TABLE IF NOT EXISTS {_VERSION_TABLE} (version integer NOT NULL)"
                )
                version = await _schema_version(conn)
                cls._check_version(where, version, migrating=True)
                for _, statements in cls._migrations_after(version):
                    await conn.execute(statements)
                await conn.execute(f"DELETE FROM {_VERSION_TABLE}")
                await conn.execute(
                    f"INSERT INTO {_VERSION_TABLE} (version) VALUES ($1)", SCHEMA_VERSION
                )
        except ERRORS as exc:
            raise failed(f"migrating the PostgreSQL store {where} failed", exc) from exc
        finally:
            await conn.close()
        return version, SCHEMA_VERSION

    # -- the interface --------------------------------------------------------

    def _admit(self, write: FencedWrite) -> asyncio.Future[Decision]:
        return self._submit(_Op("take", write, write.hold))

    def _submit_end(self, write: FencedWrite, unknown_for: float | None) -> asyncio.Future[None]:
        if unknown_for is None:
            return self._submit(_Op("end", write))
        return self._submit(_Op("hold", write, unknown_for))

    def _submit_key(self, write: FencedWrite, settlement: Settlement) -> asyncio.Future[None]:
        if isinstance(settlement, StoredResponse):
            return self._submit(_Op("complete", write, response=settlement))
        return self._submit(_Op(settlement, write))

    async def generation(self, job: str) -> int | None:
        async def tx(conn: _Conn) -> int | None:
            value = await conn.fetchval("SELECT generation FROM fences WHERE job = $1", job)
            return None if value is None else int(value)

        await self._ends_committed(job)  # this process's writes of it come first
        return await self._run(tx, transaction=False)

    async def change_lease(self, job: str, change: LeaseChange) -> tuple[Lease | Refusal, float]:
        async def tx(conn: _Conn) -> tuple[Lease | Refusal, float]:
            # The job's lock: no other lease change and no admission of the job runs
            # until this commits, on any proxy.
            await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", job)
            current = rows.lease_record(await conn.fetchrow(_LEASE, job))
            now, fence, until, top = await _one(conn, _READ_FOR_LEASE, job, self._clock())
            fence = None if fence is None else int(fence)
            in_flight = InFlightSummary(until, None if top is None else int(top))
            result, raise_to = decide_lease(change, current, fence, in_flight, now)
            if raise_to is not None:
                await conn.execute(_RAISE_FENCE, job, raise_to, now)
            if isinstance(result, Lease) and result != current:
                await conn.execute(
                    "INSERT INTO leases (job, owner, generation, lease_until, ttl, state,"
                    " updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7)"
                    " ON CONFLICT (job) DO UPDATE SET owner = excluded.owner,"
                    " generation = excluded.generation, lease_until = excluded.lease_until,"
                    " ttl = excluded.ttl, state = excluded.state, updated_at = excluded.updated_at",
                    *rows.lease_row(result, now),
                )
                if result.state is not LeaseState.HELD:  # delivered at the commit
                    await conn.execute("SELECT pg_notify($1, $2)", _CHANNEL, job)
            return result, float(now)

        await self._ends_committed(job)  # this process's writes of it come first
        result, now = await self._run(tx)
        self._woken_by(job, result)
        return result, now

    async def lease(self, job: str) -> tuple[Lease | None, float]:
        async def tx(conn: _Conn) -> tuple[Lease | None, float]:
            lease = rows.lease_record(await conn.fetchrow(_LEASE, job))
            now = await conn.fetchval(_sql(f"SELECT {_NOW}"), self._clock())
            return lease, float(now)

        await self._ends_committed(job)  # this process's writes of it come first
        return await self._run(tx, transaction=False)

    async def inspect(self, job: str) -> JobView:
        async def tx(conn: _Conn) -> JobView:
            fence, lease, inflight = [
                await conn.fetchrow(_numbered(sql), job) for sql in rows.JOB_VIEW_SQL[:3]
            ]
            keys = await conn.fetch(_numbered(rows.JOB_VIEW_SQL[3]), job)
            now = await conn.fetchval(_sql(f"SELECT {_NOW}"), self._clock())
            return rows.job_view(job, now, fence, lease, inflight, keys)

        await self._ends_committed(job)  # this process's writes of it come first
        return await self._run(tx)

    async def jobs(self, prefix: str, after: str, limit: int) -> list[str]:
        async def tx(conn: _Conn) -> list[str]:
            page = (len(prefix), prefix, after)
            found = await conn.fetch(_numbered(rows.JOBS_SQL), *page, *page, limit)
            return [str(row[0]) for row in found]

        return await self._run(tx, transaction=False)

    async def check(self) -> None:
        async def read(conn: _Conn) -> tuple[int, asyncpg.Record | None]:
            sync = await conn.fetchrow(_SYNC) if self._require_sync else None
            return await _schema_version(conn), sync

        version, sync = await self._run(read, transaction=False)
        self._check_version(self._where, version)
        if sync is not None and (unsafe := _unsafe(sync)) is not None:
            raise StoreError(f"the PostgreSQL store {self._where} is not safe: {unsafe}")

    async def gauges(self) -> StoreGauges:
        async def read(conn: _Conn) -> StoreGauges:
            held = await conn.fetch(_HELD, self._clock())
            jobs = {str(state): int(jobs) for state, jobs in held}
            if not self._require_sync:  # not asked for: no gauge, so no alert
                return StoreGauges(jobs)
            sync = await conn.fetchrow(_SYNC)
            return StoreGauges(jobs, synchronous=sync is not None and _unsafe(sync) is None)

        await self._ends_committed()  # a write this process answered holds nothing
        return await self._run(read, transaction=False)

    async def purge_expired(self) -> int:
        async def tx(conn: _Conn) -> int:
            clock = self._clock()
            # Rows a batch has locked are left for the next purge (SKIP LOCKED): a
            # purge never waits for a batch, so it can never wait in a circle with one.
            turns = await conn.execute(
                _sql(
                    "DELETE FROM inflight WHERE ctid = ANY (ARRAY (SELECT ctid FROM inflight"
                    f" WHERE expires_at <= {_NOW} FOR UPDATE SKIP LOCKED))"
                ),
                clock,
            )
            keys = await conn.execute(
                _sql(
                    "DELETE FROM idempotency_keys WHERE ctid = ANY (ARRAY (SELECT k.ctid"
                    f" FROM idempotency_keys k WHERE k.expires_at <= {_NOW}"
                    " AND NOT (k.state = 'in_flight' AND EXISTS (SELECT 1 FROM inflight i"
                    " WHERE i.job = k.job AND i.holder = k.holder))"
                    " FOR UPDATE OF k SKIP LOCKED))"
                ),
                clock,
            )
            return _count(turns) + _count(keys)

        return await self._run(tx)

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self.wakes.close()
        if self._listener is not None:
            await self._listener.close()
        await self._stop_purging()
        await self._batches.close()
        await self._stop_retrying()
        await self._pool.close()

    # -- the one boundary ----------------------------------------------------

    async def _run(self, work: Callable[[_Conn], Awaitable[T]], *, transaction: bool = True) -> T:
        """Run ``work`` on a pooled connection, in a transaction unless told otherwise.
        The driver's and the network's errors become StoreError here: a connection
        lost mid-transaction leaves nothing half-applied, since the server rolls
        back what was not committed."""
        if self._closing:
            raise StoreError("the store is closed")
        try:
            async with self._connection() as conn:
                if not transaction:
                    return await work(conn)
                started = time.monotonic()
                async with conn.transaction():
                    result = await work(conn)
                self.on_commit(time.monotonic() - started, 1)
                return result
        except ERRORS as exc:
            raise _failed(exc) from exc

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[_Conn]:
        """A pooled connection to a primary. What fails here is logged here, once, as a
        warning naming the connection's server process when there was one; the
        connection it failed on is closed, never given back to the pool, which cannot
        tell it from a sound one: one the server ended may not know it yet (the
        server's last word has come, the end of its socket not), and :func:`_kept`
        makes no round trip that would find out. One whose server no longer takes
        writes (a standby, or read-only: as the server last reported, without a
        round trip) is closed unused. The pool opens the next one where the URL's
        ``target_session_attrs`` says, on whichever host is primary then."""
        backend: int | None = None
        try:
            async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
                backend = conn.get_server_pid()
                try:
                    self._takes_writes(conn)
                    yield conn
                except ERRORS:
                    _drop(conn)
                    raise
        except ERRORS as exc:
            cause = first(exc)
            if backend is None:
                store_log.warning(
                    "PostgreSQL store %s failed: %s: %s", self._where, type(cause).__name__, cause
                )
            else:
                store_log.warning(
                    "PostgreSQL store %s dropped its connection to backend %d: %s: %s",
                    self._where,
                    backend,
                    type(cause).__name__,
                    cause,
                )
            raise

    def _takes_writes(self, conn: _Conn) -> None:
        """TargetServerAttributeNotMatched when ``conn``'s server no longer takes writes,
        as it last reported: a standby, or read-only."""
        settings = conn.get_settings()
        if "on" in (
            getattr(settings, "in_hot_standby", "off"),
            getattr(settings, "default_transaction_read_only", "off"),
        ):
            raise asyncpg.exceptions.TargetServerAttributeNotMatched(
                f"{self.server.address} no longer takes writes (a standby, or read-only)"
            )

    # -- batches ---------------------------------------------------------------

    def _submit(self, op: _Op) -> asyncio.Future[Any]:
        if self._closing:
            raise StoreError("the store is closed")
        return self._batches.submit(op)

    async def _run_batch(self, ops: list[_Op]) -> list[Any]:
        """One batch: the takes and settlements in one call, job by job; each take
        decided on what it read; the admitted ones applied and the refused ones'
        records put back as they were in one more statement; one commit. A batch of settlements
        alone is the one call, its own transaction. Any failure undoes the whole
        batch, and every caller in it gets the StoreError."""
        order = sorted(range(len(ops)), key=lambda n: ops[n].write.job)
        batch = [ops[n] for n in order]
        recorded_at = time.monotonic()  # every record of the batch is dated after this
        started = time.monotonic()
        try:
            async with self._connection() as conn:
                if all(op.kind != "take" for op in batch):
                    found = await conn.fetch(_BATCH, *self._arguments(batch))
                    outcomes = self._settled(batch, found)
                else:
                    async with conn.transaction():
                        found = await conn.fetch(_BATCH, *self._arguments(batch))
                        outcomes, applied = self._decided(batch, found, recorded_at)
                        if applied.needed:
                            await conn.execute(*applied.statement())
        except ERRORS as exc:
            return [_failed(exc)] * len(ops)
        self.on_commit(time.monotonic() - started, len(ops))
        result: list[Any] = [None] * len(ops)
        for n, outcome in zip(order, outcomes, strict=True):
            result[n] = outcome
        return result

    def _arguments(self, batch: list[_Op]) -> tuple[Any, ...]:
        """The batch as the arrays ``fenceproxy_batch`` takes, one entry per operation."""
        responses = [op.response for op in batch]
        return (
            [op.kind for op in batch],
            [op.write.job for op in batch],
            [op.write.turn for op in batch],
            [op.seconds for op in batch],
            [op.write.key for op in batch],
            [op.write.check_lease for op in batch],
            [None if r is None else r.status for r in responses],
            [None if r is None else json.dumps(r.headers) for r in responses],
            [None if r is None else r.body for r in responses],
            self._clock(),
            self._key_ttl,
            [op.write.generation for op in batch],
            [op.write.shared for op in batch],
        )

    @staticmethod
    def _settled(batch: list[_Op], found: list[asyncpg.Record]) -> list[Any]:
        """What each settlement came to (None); a key no longer held is logged."""
        for row in found:
            op = batch[row["r_n"] - 1]
            if op.kind in _KEY_SETTLEMENTS and not row["r_changed"]:
                key_not_held(op.write, _KEY_SETTLEMENTS[op.kind])
        return [None] * len(batch)

    def _decided(
        self, batch: list[_Op], found: list[asyncpg.Record], recorded_at: float
    ) -> tuple[list[Any], _Applied]:
        """Each take decided on what it read (:func:`decide_write`), and what the batch
        is to write for those admitted and put back for those refused."""
        takes = [row for row in found if batch[row["r_n"] - 1].kind == "take"]
        outcomes = self._settled(batch, [row for row in found if row["r_changed"] is not None])
        applied = _Applied()
        for row in takes:
            write, now = batch[row["r_n"] - 1].write, row["r_now"]
            fence = row["r_fence"]
            decision: Admit | Replay | Refusal | Busy = decide_write(
                write,
                None if fence is None else int(fence),
                rows.key_record(row[_KEY_COLUMNS] if row["r_key_state"] is not None else None),
                rows.lease_record(row[_LEASE_COLUMNS] if row["r_lease_job"] is not None else None),
                now,
            )
            if not isinstance(decision, Admit):
                if row["r_got"]:
                    applied.put_back(write, row)
            elif not row["r_got"]:
                expires = row["r_record_expires"]
                decision = Busy(
                    retry_after=max(0.0, (now if expires is None else expires) - now),
                    unknown=row["r_record_state"] == "unknown",
                )
            else:
                applied.admit(write, decision, now, self._key_ttl)
            outcomes[row["r_n"] - 1] = (decision, recorded_at)
        return outcomes, applied


@dataclass(slots=True)
class _Op:
    """One operation of a batch: ``take`` (an admission, holding its record
    ``seconds``), ``end`` (clear the record), ``hold`` (keep it, unknown, ``seconds``),
    or a key settled: ``complete`` (with ``response``), ``unknown``, ``forget``."""

    kind: str
    write: FencedWrite
    seconds: float | None = None
    response: StoredResponse | None = None


_KEY_SETTLEMENTS = {"complete": "settle", "unknown": "settle", "forget": "forget"}
# A take's row from fenceproxy_batch: the key's columns as rows.key_record reads them,
# the lease's as rows.lease_record does.
_KEY_COLUMNS = slice(10, 17)
_LEASE_COLUMNS = slice(17, 23)


@dataclass(slots=True)
class _Applied:
    """What a batch writes once its takes are decided: the fences raised, the keys
    put in flight, and the records taken by writes that were refused, given back."""

    fences: dict[str, tuple[str, int, float]] = field(default_factory=dict)
    """Per job, once: writes of one generation may be admitted together."""
    keys: list[tuple[Any, ...]] = field(default_factory=list)
    records: list[tuple[Any, ...]] = field(default_factory=list)

    @property
    def needed(self) -> bool:
        return bool(self.fences or self.keys or self.records)

    def admit(self, write: FencedWrite, decision: Admit, now: float, key_ttl: float) -> None:
        if decision.raise_to is not None:
            raised = self.fences.get(write.job)
            if raised is None or raised[1] < decision.raise_to:
                self.fences[write.job] = (write.job, decision.raise_to, now)
        if write.key is not None:
            self.keys.append(rows.key_row(write, now, key_ttl))

    def put_back(self, write: FencedWrite, row: asyncpg.Record) -> None:
        """The job's record as it was before the refused ``write`` took it (none, or
        one that had expired)."""
        prior = (row["r_prior_holder"], row["r_prior_state"], row["r_prior_expires"])
        self.records.append((write.job, write.turn, *prior))

    def statement(self) -> tuple[Any, ...]:
        """The statement and its arrays, one per column: the fences', the keys', and
        the records' when there are records to put back (:data:`_APPLY_AND_PUT_BACK`)."""
        tables = [(list(self.fences.values()), 3), (self.keys, 9)]
        if self.records:
            tables.append((self.records, 5))
        columns: list[list[Any]] = []
        for entries, width in tables:
            columns.extend(list(column) for column in zip(*entries, strict=True))
            if not entries:
                columns.extend([] for _ in range(width))
        return (_APPLY_AND_PUT_BACK if self.records else _APPLY), *columns


async def _schema_version(conn: _Conn | asyncpg.Connection) -> int:
    exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", _VERSION_TABLE)
    if not exists:
        return 0
    return int(await conn.fetchval(f"SELECT coalesce(max(version), 0) FROM {_VERSION_TABLE}"))


def _where(dsn: str) -> str:
    """Hosts, ports and database of a DSN, for messages: never the password."""
    parts = urlsplit(dsn)
    return f"{parts.netloc.rpartition('@')[2] or 'localhost'}{parts.path or '/'}"


# Where a new connection landed: the server's address and port as this connection
# reached it (no address over a Unix socket).
_SERVER = "SELECT host(inet_server_addr()), inet_server_port(), current_setting('port')"


def _address(row: asyncpg.Record | None) -> str:
    assert row is not None
    host, port, setting = row
    if host is None:
        return f"local socket, port {setting}"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# The jobs live in-flight records hold, by state, on the store's clock.
_HELD = _sql(
    f"WITH clock AS (SELECT {_NOW} AS now) SELECT state, count(DISTINCT job)"
    " FROM inflight, clock WHERE expires_at > clock.now GROUP BY state"
)

# What makes a commit wait for a standby. pg_stat_replication shows each standby's
# state only to roles with pg_read_all_stats (pg_monitor has it).
_SYNC = """
SELECT current_setting('synchronous_standby_names'), current_setting('synchronous_commit'),
       coalesce(array_agg(application_name) FILTER (WHERE sync_state IN ('sync', 'quorum')),
                '{}'),
       count(*) FILTER (WHERE sync_state IS NULL)
FROM pg_stat_replication
"""


def _unsafe(sync: asyncpg.Record) -> str | None:
    """Why a commit acknowledged by this primary might exist nowhere else (a
    failover could then lose it); None when every commit waits for a synchronous
    standby's flush."""
    names, commit, standbys, hidden = sync
    if not names:
        return (
            "it has no synchronous standby (synchronous_standby_names is empty): a failover "
            "could promote a standby without the last fences; in Patroni set "
            "synchronous_mode: true, and keep a standby up (Patroni empties it while none is)"
        )
    if commit not in ("on", "remote_apply"):
        return (
            f"synchronous_commit is {commit}: a commit does not wait for the standby's "
            "flush; set it to on"
        )
    if not standbys:
        if hidden:
            return (
                "the store's role cannot see the standbys' state in pg_stat_replication: "
                "grant it pg_monitor"
            )
        return "no standby is synchronous now (pg_stat_replication)"
    return None


def _count(status: str) -> int:
    """The row count of a command status such as ``DELETE 3``."""
    return int(status.rsplit(" ", 1)[-1]) if status else 0


class _Listener:
    """The connection on which a proxy hears of releases and completions on the others
    (LISTEN/NOTIFY), and wakes its own claims waiting for those jobs: opened when a
    claim first waits, so a proxy whose claims never wait holds no more than its pool.
    Lost, it is opened again (with a growing pause, up to 5 s), and every waiting claim
    is woken once it listens again, since what it missed while away cannot be known.
    It is a connection of its own, never the pool's: LISTEN is session state."""

    def __init__(
        self, connect: Callable[[], Awaitable[asyncpg.Connection]], wakes: JobWakes, where: str
    ) -> None:
        self._connect = connect
        self._wakes = wakes
        self._where = where
        self._task = asyncio.create_task(self._listen(), name="fenceproxy-postgres-listen")

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def _notified(
        self, conn: _Conn | asyncpg.Connection, pid: int, channel: str, job: object
    ) -> None:
        self._wakes.wake(str(job))

    async def _listen(self) -> None:
        pause = 0.1
        while True:
            conn: asyncpg.Connection | None = None
            try:
                conn = await self._connect()
                lost = asyncio.Event()
                conn.add_termination_listener(lambda _, lost=lost: lost.set())
                await conn.add_listener(_CHANNEL, self._notified)
                self._wakes.wake_all()
                pause = 0.1
                while not lost.is_set():  # closed by the server, or silent: asked
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(lost.wait(), _LISTEN_CHECK)
                    if not lost.is_set():
                        await conn.execute("SELECT 1", timeout=_LISTEN_CHECK)
                raise ConnectionResetError("the server closed the connection")
            except Exception as exc:  # whatever it was: never a listener gone silent
                store_log.warning(
                    "PostgreSQL store %s: not listening for other proxies' releases (%s: %s);"
                    " trying again in %.1fs",
                    self._where,
                    type(exc).__name__,
                    exc,
                    pause,
                )
            finally:
                if conn is not None:
                    await _closed(conn)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 5.0)


async def _closed(conn: asyncpg.Connection) -> None:
    """Close ``conn``, however it is: one that does not close at once is terminated."""
    try:
        await asyncio.wait_for(conn.close(), timeout=1.0)
    except asyncio.CancelledError:
        conn.terminate()
        raise
    except Exception:
        conn.terminate()
