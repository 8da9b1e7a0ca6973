"""The shared store: PostgreSQL, for any number of proxies on one database.

Everything the guarantees rest on is a row here, never a connection or a session:
the fences, the keys, the leases, and each job's in-flight record, which orders
one job's writes across every proxy and outlives a proxy that dies mid-write. The
database's clock (``clock_timestamp()``) decides every expiry.

How a write is admitted, in one transaction:

1. take the job's in-flight record: an ``INSERT ... ON CONFLICT DO UPDATE`` that
   succeeds only when the record is absent, expired or already this write's. Two
   proxies admitting one job meet on that row: the second waits for the first's
   commit, then finds the record live and gets :class:`~fenceproxy.fence.fencing.Busy`;
2. read the fence and the key, in a new statement, so with a fresh snapshot taken
   after the record was won: no admission of the job can commit in between;
3. decide in Python (:func:`fenceproxy.fence.fencing.decide`) and write: the fence only
   ever rises (``GREATEST``), the key goes in flight. A refusal rolls back, record
   and all.

Errors of the driver and the network become :class:`~fenceproxy.errors.StoreError`
as :mod:`.asyncpg_errors` says: in :meth:`PostgresStore._run` for every operation,
and where :meth:`~PostgresStore.open` and :meth:`~PostgresStore.migrate` connect.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import asyncpg

from ..errors import Refusal, StoreError
from ..fence.fencing import Admit, Busy, FencedWrite, StoredResponse
from ..leases.model import Lease, LeaseChange, decide_lease, decide_write
from ..log import store_log
from . import rows
from .asyncpg_errors import ERRORS, failed
from .base import Decision, JobView, Store, key_not_held, to_completion

__all__ = ["SCHEMA_VERSION", "PostgresStore"]

T = TypeVar("T")

if TYPE_CHECKING:  # subscriptable in the type stubs only
    from asyncpg.pool import PoolConnectionProxy

    _Conn = PoolConnectionProxy[asyncpg.Record]

_MIGRATIONS: dict[int, str] = {
    1: """
CREATE TABLE fences (
    job         text PRIMARY KEY,
    generation  bigint NOT NULL,
    updated_at  double precision NOT NULL
);
CREATE TABLE idempotency_keys (
    route       text NOT NULL,
    job         text NOT NULL,
    key         text NOT NULL,
    state       text NOT NULL CHECK (state IN ('in_flight', 'completed', 'unknown')),
    fingerprint bytea NOT NULL,
    generation  bigint NOT NULL,
    holder      text,
    status      integer,
    headers     text,
    body        bytea,
    created_at  double precision NOT NULL,
    expires_at  double precision NOT NULL,
    PRIMARY KEY (route, job, key)
);
CREATE INDEX idempotency_keys_expiry ON idempotency_keys (expires_at);
CREATE TABLE leases (
    job         text PRIMARY KEY,
    owner       text NOT NULL,
    generation  bigint NOT NULL,
    lease_until double precision NOT NULL,
    ttl         double precision NOT NULL,
    state       text NOT NULL CHECK (state IN ('held', 'released', 'completed')),
    updated_at  double precision NOT NULL
);
CREATE TABLE inflight (
    job         text PRIMARY KEY,
    holder      text NOT NULL,
    state       text NOT NULL CHECK (state IN ('in_flight', 'unknown')),
    expires_at  double precision NOT NULL
);
CREATE INDEX inflight_expiry ON inflight (expires_at);
""",
    # A key is its job's, whatever route it came by: renaming a route (a reload, say)
    # must not let a retried write through as new. Where one key of a job was used on
    # two routes, the newest stays.
    2: """
DELETE FROM idempotency_keys k USING idempotency_keys o
WHERE o.job = k.job AND o.key = k.key
  AND (o.created_at > k.created_at OR (o.created_at = k.created_at AND o.route > k.route));
ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_pkey;
ALTER TABLE idempotency_keys ADD PRIMARY KEY (job, key);
""",
    # No table changes: admissions now take the job's advisory lock, shared, which
    # lease changes take alone. A proxy that does not would admit a write while a
    # claim of the job commits, so proxies from before never share a database with
    # these: the version tells them apart (an old proxy refuses to start on it, and
    # a running one fails its readiness probe).
    3: """
COMMENT ON TABLE inflight IS
    'admissions and lease changes of a job serialize on its advisory lock (schema 3)';
""",
    # A key is its caller's (fenceproxy.fence.fencing.scope). Keys stored before have no
    # caller: the empty scope matches none, so their answers are replayed to nobody.
    # A proxy from before would store keys without one: the version keeps it out.
    4: """
ALTER TABLE idempotency_keys ADD COLUMN scope bytea NOT NULL DEFAULT ''::bytea;
""",
}
SCHEMA_VERSION = max(_MIGRATIONS)
_VERSION_TABLE = "fenceproxy_schema"
# Any constant: migrations of one database take this advisory lock, one at a time.
_MIGRATION_LOCK = 0x66656E6365

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


# The job's advisory lock, shared: admissions of a job do not wait for each other
# (its in-flight record orders them), but a lease change, which holds the lock
# alone, waits for them, and they for it.
_TAKE_TURN = _sql(
    f"""
WITH now AS (SELECT {_NOW} AS t, pg_advisory_xact_lock_shared(hashtextextended($1, 0))),
taken AS (
    INSERT INTO inflight AS i (job, holder, state, expires_at)
    SELECT $1, $2, 'in_flight', now.t + $3 FROM now
    ON CONFLICT (job) DO UPDATE
        SET holder = excluded.holder, state = 'in_flight', expires_at = excluded.expires_at
        WHERE i.expires_at <= (SELECT t FROM now) OR i.holder = excluded.holder
    RETURNING 1
)
SELECT (SELECT t FROM now), EXISTS (SELECT 1 FROM taken),
       (SELECT state FROM inflight WHERE job = $1), (SELECT expires_at FROM inflight WHERE job = $1)
"""
)
_READ = _sql(
    f"""
SELECT {_NOW}, (SELECT generation FROM fences WHERE job = $1)
"""
)
# What a lease change decides on besides the lease: the store's clock, the fence
# and the in-flight record, read under the job's lock.
_READ_FOR_LEASE = _sql(
    f"""
SELECT {_NOW}, (SELECT generation FROM fences WHERE job = $1),
       (SELECT expires_at FROM inflight WHERE job = $1)
"""
)
_READ_KEY = _sql(
    f"""
SELECT k.state, k.fingerprint, k.status, k.headers, k.body,
       EXISTS (SELECT 1 FROM inflight i WHERE i.job = k.job AND i.holder = k.holder
               AND i.expires_at > {_NOW}),
       k.scope
FROM idempotency_keys k
WHERE k.job = $1 AND k.key = $2
  AND (k.expires_at > {_NOW}
       OR EXISTS (SELECT 1 FROM inflight i WHERE i.job = k.job AND i.holder = k.holder
                  AND k.state = 'in_flight' AND i.expires_at > {_NOW}))
"""
)
_RAISE_FENCE = """
INSERT INTO fences AS f (job, generation, updated_at) VALUES ($1, $2, $3)
ON CONFLICT (job) DO UPDATE
    SET generation = GREATEST(f.generation, excluded.generation), updated_at = excluded.updated_at
RETURNING generation
"""
_LEASE = "SELECT job, owner, generation, lease_until, ttl, state FROM leases WHERE job = $1"


async def _one(conn: _Conn, statement: str, *args: Any) -> asyncpg.Record:
    """The one row a statement that always returns one returns."""
    row = await conn.fetchrow(statement, *args)
    assert row is not None
    return row


class PostgresStore(Store):
    """Fences, idempotency keys, leases and in-flight records in PostgreSQL.
    Open with :meth:`open`; the database must have been migrated first."""

    backend = "PostgreSQL"
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
    ) -> None:
        super().__init__()
        self._pool = pool
        self._key_ttl = key_ttl
        self._clock = clock
        self._where = where
        self._acquire_timeout = acquire_timeout
        self._closing = False
        self._start_purging(purge_interval)

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
    ) -> PostgresStore:
        """Connect a pool of up to ``pool_size`` connections. Raises StoreError when the
        database cannot be reached or is not migrated to this fenceproxy's schema."""
        where = _where(dsn)
        try:
            pool = await asyncpg.create_pool(
                dsn,
                password=password,
                min_size=1,
                max_size=pool_size,
                timeout=connect_timeout,
                command_timeout=connect_timeout * 2,
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

    def _admit(self, write: FencedWrite) -> Awaitable[Decision]:
        async def tx(conn: _Conn) -> Decision:
            clock = self._clock()
            recorded_at = time.monotonic()  # the record is dated after this
            _, got, state, expires = await _one(
                conn, _TAKE_TURN, write.job, write.turn, write.hold, clock
            )
            now, current = await _one(conn, _READ, write.job, clock)
            record = None
            if write.key is not None:
                record = rows.key_record(
                    await conn.fetchrow(_READ_KEY, write.job, write.key, clock)
                )
            lease = None
            if write.check_lease:
                lease = rows.lease_record(await conn.fetchrow(_LEASE, write.job))
            decision = decide_write(write, current, record, lease, now)
            if not isinstance(decision, Admit):
                raise _Undo((decision, recorded_at))
            if not got:
                busy = Busy(
                    retry_after=max(0.0, (expires or now) - now), unknown=state == "unknown"
                )
                raise _Undo((busy, recorded_at))
            if decision.raise_to is not None:
                await conn.execute(_RAISE_FENCE, write.job, decision.raise_to, now)
            if write.key is not None:
                await conn.execute(
                    "INSERT INTO idempotency_keys (route, job, key, state, fingerprint,"
                    " scope, generation, holder, created_at, expires_at)"
                    " VALUES ($1, $2, $3, 'in_flight', $4, $5, $6, $7, $8, $9)"
                    " ON CONFLICT (job, key) DO UPDATE SET route = excluded.route,"
                    " state = 'in_flight', fingerprint = excluded.fingerprint,"
                    " scope = excluded.scope,"
                    " generation = excluded.generation, holder = excluded.holder,"
                    " status = NULL, headers = NULL, body = NULL,"
                    " created_at = excluded.created_at, expires_at = excluded.expires_at",
                    *rows.key_row(write, now, self._key_ttl),
                )
            return decision, recorded_at

        return self._run(tx)

    async def end_turn(self, write: FencedWrite, *, unknown_for: float | None = None) -> None:
        async def tx(conn: _Conn) -> None:
            if unknown_for is None:
                await conn.execute(
                    "DELETE FROM inflight WHERE job = $1 AND holder = $2", write.job, write.turn
                )
            else:
                await conn.execute(
                    _sql(
                        "UPDATE inflight SET state = 'unknown',"
                        f" expires_at = GREATEST(expires_at, {_NOW} + $3)"
                        " WHERE job = $1 AND holder = $2"
                    ),
                    write.job,
                    write.turn,
                    unknown_for,
                    self._clock(),
                )

        await to_completion(self._run(tx, transaction=False))

    async def complete_key(self, write: FencedWrite, response: StoredResponse) -> None:
        await self._update_key(
            write,
            "state = 'completed', status = $5, headers = $6, body = $7",
            response.status,
            json.dumps(response.headers),
            response.body,
        )

    async def mark_unknown(self, write: FencedWrite) -> None:
        await self._update_key(write, "state = 'unknown'")

    async def forget_key(self, write: FencedWrite) -> None:
        async def tx(conn: _Conn) -> None:
            status = await conn.execute(
                "DELETE FROM idempotency_keys WHERE job = $1 AND key = $2"
                " AND state = 'in_flight' AND holder = $3",
                write.job,
                write.key,
                write.turn,
            )
            if not _count(status):
                key_not_held(write, "forget")

        await to_completion(self._run(tx, transaction=False))

    async def generation(self, job: str) -> int | None:
        async def tx(conn: _Conn) -> int | None:
            value = await conn.fetchval("SELECT generation FROM fences WHERE job = $1", job)
            return None if value is None else int(value)

        return await self._run(tx, transaction=False)

    async def change_lease(self, job: str, change: LeaseChange) -> tuple[Lease | Refusal, float]:
        async def tx(conn: _Conn) -> tuple[Lease | Refusal, float]:
            # The job's lock, alone: no other lease change and no admission of the job
            # (they take it shared) runs until this commits, on any proxy.
            await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", job)
            current = rows.lease_record(await conn.fetchrow(_LEASE, job))
            now, fence, in_flight_until = await _one(conn, _READ_FOR_LEASE, job, self._clock())
            fence = None if fence is None else int(fence)
            result = decide_lease(change, current, fence, in_flight_until, now)
            if isinstance(result, Lease) and result != current:
                if fence is None or result.generation > fence:
                    await conn.execute(_RAISE_FENCE, job, result.generation, now)
                await conn.execute(
                    "INSERT INTO leases (job, owner, generation, lease_until, ttl, state,"
                    " updated_at) VALUES ($1, $2, $3, $4, $5, $6, $7)"
                    " ON CONFLICT (job) DO UPDATE SET owner = excluded.owner,"
                    " generation = excluded.generation, lease_until = excluded.lease_until,"
                    " ttl = excluded.ttl, state = excluded.state, updated_at = excluded.updated_at",
                    *rows.lease_row(result, now),
                )
            return result, float(now)

        return await self._run(tx)

    async def lease(self, job: str) -> tuple[Lease | None, float]:
        async def tx(conn: _Conn) -> tuple[Lease | None, float]:
            lease = rows.lease_record(await conn.fetchrow(_LEASE, job))
            now = await conn.fetchval(_sql(f"SELECT {_NOW}"), self._clock())
            return lease, float(now)

        return await self._run(tx, transaction=False)

    async def inspect(self, job: str) -> JobView:
        async def tx(conn: _Conn) -> JobView:
            fence, lease, inflight = [
                await conn.fetchrow(_numbered(sql), job) for sql in rows.JOB_VIEW_SQL[:3]
            ]
            keys = await conn.fetch(_numbered(rows.JOB_VIEW_SQL[3]), job)
            now = await conn.fetchval(_sql(f"SELECT {_NOW}"), self._clock())
            return rows.job_view(job, now, fence, lease, inflight, keys)

        return await self._run(tx)

    async def jobs(self, prefix: str, after: str, limit: int) -> list[str]:
        async def tx(conn: _Conn) -> list[str]:
            page = (len(prefix), prefix, after)
            found = await conn.fetch(_numbered(rows.JOBS_SQL), *page, *page, limit)
            return [str(row[0]) for row in found]

        return await self._run(tx, transaction=False)

    async def check(self) -> None:
        self._check_version(self._where, await self._run(_schema_version, transaction=False))

    async def purge_expired(self) -> int:
        async def tx(conn: _Conn) -> int:
            clock = self._clock()
            turns = await conn.execute(
                _sql(f"DELETE FROM inflight WHERE expires_at <= {_NOW}"), clock
            )
            keys = await conn.execute(
                _sql(
                    f"DELETE FROM idempotency_keys k WHERE k.expires_at <= {_NOW}"
                    " AND NOT (k.state = 'in_flight' AND EXISTS (SELECT 1 FROM inflight i"
                    " WHERE i.job = k.job AND i.holder = k.holder))"
                ),
                clock,
            )
            return _count(turns) + _count(keys)

        return await self._run(tx)

    async def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        await self._stop_purging()
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
            async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
                if not transaction:
                    return await work(conn)
                started = time.monotonic()
                try:
                    async with conn.transaction():
                        result = await work(conn)
                except _Undo as undo:
                    return undo.outcome  # type: ignore[no-any-return]
                self.on_commit(time.monotonic() - started, 1)
                return result
        except ERRORS as exc:
            store_log.error("PostgreSQL store %s failed: %s", self._where, exc)
            raise failed(f"PostgreSQL store failed: {type(exc).__name__}", exc) from exc

    async def _update_key(self, write: FencedWrite, assignments: str, *values: Any) -> None:
        async def tx(conn: _Conn) -> None:
            # Remembered for the key's time from its outcome, however long it was in flight.
            status = await conn.execute(
                _sql(
                    f"UPDATE idempotency_keys SET {assignments},"
                    f" expires_at = GREATEST(expires_at, {_NOW} + $4)"
                    " WHERE job = $1 AND key = $2 AND state = 'in_flight' AND holder = $3"
                ),
                write.job,
                write.key,
                write.turn,
                self._key_ttl,
                *values,
                self._clock(),
            )
            if not _count(status):
                key_not_held(write, "settle")

        await to_completion(self._run(tx, transaction=False))


class _Undo(Exception):
    """Roll the transaction back and answer ``outcome``."""

    def __init__(self, outcome: Any) -> None:
        super().__init__()
        self.outcome = outcome


async def _schema_version(conn: _Conn | asyncpg.Connection) -> int:
    exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", _VERSION_TABLE)
    if not exists:
        return 0
    return int(await conn.fetchval(f"SELECT coalesce(max(version), 0) FROM {_VERSION_TABLE}"))


def _where(dsn: str) -> str:
    """Host, port and database of a DSN, for messages: never the password."""
    parts = urlsplit(dsn)
    host = parts.hostname or "localhost"
    port = f":{parts.port}" if parts.port else ""
    return f"{host}{port}{parts.path or '/'}"


def _count(status: str) -> int:
    """The row count of a command status such as ``DELETE 3``."""
    return int(status.rsplit(" ", 1)[-1]) if status else 0
