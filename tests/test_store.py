"""The store's own behaviour on both backends: faults inside a transaction undo it
and tell every caller, the fence only rises under racing writers, schemas are
versioned and migrated, a closed store refuses work."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import signal
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import closing
from pathlib import Path

import asyncpg
import pytest

from fenceproxy import cli
from fenceproxy.errors import Refusal, StaleGeneration, StoreError, WriteInFlight
from fenceproxy.fence.fencing import (
    SHARED_SCOPE,
    Admit,
    Busy,
    FencedWrite,
    Replay,
    StoredResponse,
    scope,
)
from fenceproxy.leases import model as leasing
from fenceproxy.leases.model import Lease
from fenceproxy.ops.metrics import Metrics
from fenceproxy.store import PostgresStore, SQLiteStore, Store, migrate_store, open_store
from fenceproxy.store import postgres as postgres_store
from fenceproxy.store import sqlite as sqlite_store
from fenceproxy.store.migrations import read_migrations
from fenceproxy.testing import FakeClock

from .conftest import admit
from .postgres import PostgresServer, sql
from .test_admin import samples

pytestmark = pytest.mark.both_stores

SQLITE_TRIGGER = (
    "CREATE TRIGGER boom BEFORE INSERT ON idempotency_keys WHEN NEW.key = 'boom'"
    " BEGIN SELECT RAISE(ABORT, 'disk I/O error (injected)'); END"
)
POSTGRES_TRIGGER = [
    "CREATE FUNCTION boom() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
    " IF NEW.key = 'boom' THEN RAISE EXCEPTION 'disk I/O error (injected)'; END IF;"
    " RETURN NEW; END $$",
    "CREATE TRIGGER boom BEFORE INSERT ON idempotency_keys FOR EACH ROW EXECUTE FUNCTION boom()",
]


@pytest.fixture
async def store(store_url: str, clock: FakeClock) -> AsyncIterator[Store]:
    opened = await open_store(store_url, key_ttl=60, clock=clock)
    yield opened
    await opened.close()


@pytest.fixture
async def fresh_postgres(postgres: PostgresServer) -> AsyncIterator[str]:
    """A new, empty database of its own."""
    name = f"fresh_{random.randrange(1 << 30)}"
    await sql(postgres.url(), f"CREATE DATABASE {name}")
    yield postgres.url(name)
    await sql(postgres.url(), f"DROP DATABASE {name} WITH (FORCE)")


ALICE = scope([("authorization", ["Bearer alice"]), ("cookie", [])])
BOB = scope([("authorization", ["Bearer bob"]), ("cookie", [])])


async def inject(store_url: str, sqlite: str, postgres: list[str]) -> None:
    """Put a fault in the store at ``store_url`` before it is opened: a trigger, in
    ``sqlite``'s or ``postgres``'s statements."""
    if store_url.startswith("sqlite"):
        path = store_url.removeprefix("sqlite:///")
        await SQLiteStore.migrate(path)
        with closing(sqlite3.connect(path)) as conn:
            conn.execute(sqlite)
            conn.commit()
    else:
        await sql(store_url, *postgres)


def keyed(job: str, generation: int, key: str) -> FencedWrite:
    return FencedWrite("r", job, generation, key=key, fingerprint=key.encode())


async def test_a_fault_inside_a_transaction_undoes_it_and_tells_its_callers(
    store_url: str, clock: FakeClock
) -> None:
    await inject(store_url, SQLITE_TRIGGER, POSTGRES_TRIGGER)
    store = await open_store(store_url, key_ttl=60, clock=clock)
    try:
        good, bad, other = keyed("a", 5, "k"), keyed("b", 5, "boom"), keyed("c", 5, "k")
        outcomes = await asyncio.gather(
            admit(store, good), admit(store, bad), admit(store, other), return_exceptions=True
        )
        assert isinstance(outcomes[1], StoreError)
        assert "injected" in str(outcomes[1])
        # Nothing of the failed write stays: no fence, no in-flight record.
        assert await store.generation("b") is None
        assert isinstance(await admit(store, keyed("b", 5, "retry")), Admit)
        # One batch, one transaction: its other writes were undone with it, and their
        # callers were told; nothing of them stays either.
        assert all(isinstance(o, StoreError) for o in outcomes)
        assert await store.generation("a") is None
        assert (await store.inspect("c")).known is False
        assert isinstance(await admit(store, keyed("a", 5, "k")), Admit)
        assert isinstance(await admit(store, FencedWrite("r", "d", 1)), Admit)  # then on
    finally:
        await store.close()
        if not store_url.startswith("sqlite"):
            await sql(store_url, "DROP TRIGGER boom ON idempotency_keys", "DROP FUNCTION boom")


async def test_in_one_batch_each_write_is_decided_on_its_own(
    store: Store, clock: FakeClock
) -> None:
    """A stale write, a busy one, a replayed key and a new write go in one batch with a
    settlement: each gets its own answer, and what the refused ones took is given back
    as it was, while the admitted one's record and fence stay."""
    fenced, done = FencedWrite("r", "s", 5), keyed("d", 3, "k")
    for first in (fenced, done):
        assert isinstance(await admit(store, first), Admit)
    await store.settle_key(done, StoredResponse(201, {}, b"created"))
    for first in (fenced, done):
        await store.end_turn(first)
    held = FencedWrite("r", "h", 1, hold=30)
    assert isinstance(await admit(store, held), Admit)
    ending = FencedWrite("r", "e", 1, hold=30)
    assert isinstance(await admit(store, ending), Admit)

    stale, busy, replay = FencedWrite("r", "s", 4), FencedWrite("r", "h", 2), keyed("d", 3, "k")
    new = keyed("n", 1, "k")
    commits: list[int] = []
    store.on_commit = lambda seconds, operations: commits.append(operations)
    outcomes = await asyncio.gather(
        admit(store, stale), admit(store, busy), admit(store, replay), admit(store, new),
        store.end_turn(ending),
    )  # fmt: skip
    assert commits == [5]  # one batch
    assert isinstance(outcomes[0], StaleGeneration)
    assert isinstance(outcomes[1], Busy)
    assert isinstance(outcomes[2], Replay)
    assert outcomes[2].response.body == b"created"
    assert outcomes[3] == Admit(raise_to=1)
    views = {job: await store.inspect(job) for job in "shdne"}
    # The refused writes left nothing: no record on "s" or "d", "h" still held by its own.
    assert views["s"].in_flight is None
    assert views["s"].generation == 5
    assert views["d"].in_flight is None
    assert views["h"].in_flight is not None
    assert views["h"].in_flight[0] == held.turn
    assert views["e"].in_flight is None  # the settlement landed beside them
    # The admitted one holds its record, its fence and its key in flight.
    assert views["n"].in_flight is not None
    assert views["n"].in_flight[0] == new.turn
    assert views["n"].generation == 1
    assert [k.state for k in views["n"].keys] == ["in_flight"]


STUCK_SQLITE = (
    "CREATE TRIGGER stuck BEFORE DELETE ON inflight WHEN OLD.job = 'stuck' AND NOT EXISTS"
    " (SELECT 1 FROM fences WHERE job = 'unstick')"
    " BEGIN SELECT RAISE(ABORT, 'disk I/O error (injected)'); END"
)
STUCK_POSTGRES = [
    "CREATE FUNCTION stuck() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
    " IF OLD.job = 'stuck' AND NOT EXISTS (SELECT 1 FROM fences WHERE job = 'unstick') THEN"
    " RAISE EXCEPTION 'disk I/O error (injected)'; END IF; RETURN OLD; END $$",
    "CREATE TRIGGER stuck BEFORE DELETE ON inflight FOR EACH ROW EXECUTE FUNCTION stuck()",
]


async def test_a_records_end_that_fails_is_retried_until_it_commits(
    store_url: str, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """An answer does not wait for the end of its write's in-flight record, and an end
    that fails is not lost: it is submitted again every second. Meanwhile the record
    holds its job, nothing worse; once the store takes the end, the job's next write
    goes, with no write of the job having come to clear it."""
    await inject(store_url, STUCK_SQLITE, STUCK_POSTGRES)
    store = await open_store(store_url, key_ttl=60, clock=clock)
    try:
        written = FencedWrite("r", "stuck", 1)
        assert isinstance(await admit(store, written), Admit)
        await store.end_turn(written)  # the upstream answered: the record may go
        async with asyncio.timeout(5):
            while "could not end job 'stuck'" not in caplog.text:
                await asyncio.sleep(0.01)
        assert isinstance(await admit(store, FencedWrite("r", "stuck", 1)), Busy)
        # The store takes it again (here: the injected fault is lifted by a write).
        assert isinstance(await admit(store, FencedWrite("r", "unstick", 1)), Admit)
        async with asyncio.timeout(5):
            while (await store.inspect("stuck")).in_flight is not None:
                await asyncio.sleep(0.05)
        assert isinstance(await admit(store, FencedWrite("r", "stuck", 1)), Admit)
    finally:
        await store.close()
        if not store_url.startswith("sqlite"):
            await sql(store_url, "DROP TRIGGER stuck ON inflight", "DROP FUNCTION stuck")


async def test_a_keyed_answer_and_its_records_end_are_one_commit(store: Store) -> None:
    """A keyed write settles as the proxy settles it: its answer under its key and the
    end of the job's in-flight record go in one transaction, one commit (and one round
    trip on PostgreSQL), and both are there once it returns; the next write of the
    job goes at once, and a duplicate is replayed."""
    write, unknown = keyed("j", 1, "k"), keyed("u", 1, "k")
    for first in (write, unknown):
        assert isinstance(await admit(store, first), Admit)
    commits: list[int] = []
    store.on_commit = lambda seconds, operations: commits.append(operations)
    await store.end_turn(write, key=StoredResponse(201, (), b"made"))
    assert commits == [2]  # the key's settlement and the record's end, together
    view = await store.inspect("j")
    assert view.in_flight is None
    assert [(k.key, k.state) for k in view.keys] == [("k", "completed")]
    assert await admit(store, keyed("j", 1, "k")) == Replay(StoredResponse(201, (), b"made"))
    assert isinstance(await admit(store, FencedWrite("r", "j", 1)), Admit)
    # Sent without an answer: the key is unknown and the record held, in one commit too.
    commits.clear()
    await store.end_turn(unknown, unknown_for=30, key="unknown")
    assert commits == [2]
    view = await store.inspect("u")
    assert view.in_flight is not None
    assert view.in_flight[1] == "unknown"
    assert [(k.key, k.state) for k in view.keys] == [("k", "unknown")]


async def test_a_closed_store_refuses_work_at_once(store: Store) -> None:
    await store.close()
    async with asyncio.timeout(5):
        with pytest.raises(StoreError):
            await admit(store, FencedWrite("r", "j", 1))


async def test_a_write_of_a_job_whose_record_is_held_is_busy_until_it_ends(
    store: Store, clock: FakeClock
) -> None:
    first = FencedWrite("r", "j", 1, hold=30)
    assert await admit(store, first) == Admit(raise_to=1)
    busy = await admit(store, FencedWrite("r", "j", 2))
    assert isinstance(busy, Busy)
    assert (busy.unknown, busy.retry_after) == (False, pytest.approx(30, abs=1))
    # A stale write is refused as stale even while the record is held.
    assert (await admit(store, FencedWrite("r", "j", 0))).slug == "stale-generation"  # type: ignore[union-attr]
    await store.end_turn(first, unknown_for=40)
    busy = await admit(store, FencedWrite("r", "j", 2))
    assert isinstance(busy, Busy)
    assert (busy.unknown, busy.retry_after) == (True, pytest.approx(40, abs=1))
    clock.advance(41)
    assert await admit(store, FencedWrite("r", "j", 2)) == Admit(raise_to=2)
    assert await store.generation("j") == 2


async def test_racing_writers_on_two_stores_never_lower_the_fence_nor_reorder(
    postgres: PostgresServer,
) -> None:
    """Two proxies' stores on one database, 200 writes of one job with random
    generations: the admitted ones, in the order their records were held, never go
    down, and the fence ends at the highest admitted."""
    url = postgres.url("fenceproxy")
    await sql(url, "TRUNCATE fences, idempotency_keys, leases, inflight")
    stores = [await open_store(url, key_ttl=60) for _ in range(2)]
    rng = random.Random(3)
    admitted: list[int] = []

    async def one(n: int, wave: int) -> None:
        store = stores[n % 2]
        write = FencedWrite("r", "hot", wave * 5 + rng.randint(0, 9), hold=10)
        while isinstance(decision := await admit(store, write), Busy):
            await asyncio.sleep(0.001)
        if isinstance(decision, Admit):
            admitted.append(write.generation)
            await asyncio.sleep(0)  # as if forwarding
            await store.end_turn(write)

    try:
        for wave in range(20):  # rising on the whole, racing within a wave
            await asyncio.gather(*(one(n, wave) for n in range(10)))
        assert admitted == sorted(admitted)
        assert await stores[0].generation("hot") == admitted[-1]
        assert len(admitted) >= 20
    finally:
        for store in stores:
            await store.close()


# -- schemas and migrations -----------------------------------------------------------

V3_FILE = [
    "CREATE TABLE fences (job TEXT PRIMARY KEY, generation INTEGER NOT NULL,"
    " updated_at REAL NOT NULL) WITHOUT ROWID",
    "CREATE TABLE idempotency_keys (route TEXT NOT NULL, job TEXT NOT NULL, key TEXT NOT NULL,"
    " state TEXT NOT NULL, fingerprint BLOB NOT NULL, generation INTEGER NOT NULL,"
    " status INTEGER, headers TEXT, body BLOB, created_at REAL NOT NULL,"
    " expires_at REAL NOT NULL, PRIMARY KEY (route, job, key)) WITHOUT ROWID",
    "CREATE TABLE leases (job TEXT PRIMARY KEY, owner TEXT NOT NULL,"
    " generation INTEGER NOT NULL, lease_until REAL NOT NULL, ttl REAL NOT NULL,"
    " state TEXT NOT NULL, updated_at REAL NOT NULL) WITHOUT ROWID",
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value REAL NOT NULL) WITHOUT ROWID",
    "INSERT INTO fences VALUES ('j', 7, 0)",
    "INSERT INTO idempotency_keys VALUES ('r', 'j', 'k', 'in_flight', x'6b', 7, NULL, NULL,"
    " NULL, 0, 1e12)",
    # The same key of the same job on another route, older: a key is its job's now.
    "INSERT INTO idempotency_keys VALUES ('r0', 'j', 'k', 'completed', x'6b', 6, 200, '[]',"
    " x'', -1, 1e12)",
    "INSERT INTO meta VALUES ('running', 1)",
    "PRAGMA user_version = 3",
]


def write_config(directory: Path, store: str) -> Path:
    path = directory / "fenceproxy.yaml"
    path.write_text(
        f"store: '{store}'\nroutes:\n  - {{name: r, path: /r, upstream: 'http://127.0.0.1:9'}}\n"
    )
    return path


async def migrated_by_the_cli(
    directory: Path, store: str, capsys: pytest.CaptureFixture[str]
) -> str:
    """What ``fenceproxy migrate -c FILE`` printed for a config naming ``store``, once
    it exited 0."""
    config = write_config(directory, store)
    assert await asyncio.to_thread(cli.main, ["migrate", "-c", str(config)]) == 0
    return capsys.readouterr().out


async def test_a_sqlite_file_of_the_previous_version_is_migrated_by_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "old.db"
    with closing(sqlite3.connect(path)) as conn:
        for statement in V3_FILE:
            conn.execute(statement)
        conn.commit()
    with pytest.raises(StoreError, match="run: fenceproxy migrate -c FILE"):
        await SQLiteStore.open(path)
    url = f"sqlite:///{path}"
    assert f"SQLite file {path}: schema version 3 -> 7" in await migrated_by_the_cli(
        tmp_path, url, capsys
    )
    with closing(sqlite3.connect(path)) as conn:
        rows = conn.execute("SELECT route, job, key, state, scope FROM idempotency_keys")
        # Left in flight by a proxy of the old version: no record ties it to a write,
        # so it is unknown; and no caller, so it answers none.
        assert rows.fetchall() == [("r", "j", "k", "unknown", b"")]
    store = await SQLiteStore.open(path)
    try:
        assert await store.generation("j") == 7
        retry = keyed("j", 7, "k")
        decision = await admit(store, retry)
        assert decision.slug == "idempotency-key-other-caller"  # type: ignore[union-attr]
    finally:
        await store.close()
    assert "schema version 7, up to date" in await migrated_by_the_cli(tmp_path, url, capsys)


# Keys a proxy stored before keys had callers: answered, with a secret in the answer.
OLD_KEY_CALLERS = [ALICE, BOB, scope([("authorization", []), ("cookie", [])]), SHARED_SCOPE]


async def old_keys_answer_nobody(opening: Awaitable[Store]) -> None:
    """What a store migrated from before callers answers for its keys, once open:
    nothing, to anyone; new keys answer their own caller. The store is closed after."""
    store = await opening
    try:
        for caller in OLD_KEY_CALLERS:
            retry = FencedWrite("r", "j", 7, key="k", fingerprint=b"k", scope=caller)
            assert (await admit(store, retry)).slug == "idempotency-key-other-caller"  # type: ignore[union-attr]
        new = FencedWrite("r", "j", 7, key="new", fingerprint=b"n", scope=ALICE)
        assert isinstance(await admit(store, new), Admit)
        await store.settle_key(new, StoredResponse(200, (), b"ok"))
        await store.end_turn(new)
        assert isinstance(await admit(store, new), Replay)
        other = dataclasses.replace(new, scope=BOB)
        assert (await admit(store, other)).slug == "idempotency-key-other-caller"  # type: ignore[union-attr]
    finally:
        await store.close()


async def test_a_sqlite_file_of_the_previous_version_keeps_its_keys_from_every_caller(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "v5.db"
    with closing(sqlite3.connect(path)) as conn:
        for version in (3, 4, 5):
            conn.executescript(sqlite_store._MIGRATIONS[version])
        conn.execute(
            "INSERT INTO idempotency_keys (job, key, route, state, fingerprint, generation,"
            " status, headers, body, created_at, expires_at) VALUES ('j', 'k', 'r',"
            " 'completed', x'6b', 7, 201, '[]', CAST('{\"card\": \"4242\"}' AS BLOB), 0, 1e12)"
        )
        conn.execute("INSERT INTO fences VALUES ('j', 7, 0)")
        conn.execute("PRAGMA user_version = 5")
        conn.commit()
    with pytest.raises(StoreError, match="has schema version 5, and this fenceproxy needs 7"):
        await SQLiteStore.open(path)
    out = await migrated_by_the_cli(tmp_path, f"sqlite:///{path}", capsys)
    assert f"SQLite file {path}: schema version 5 -> 7" in out
    with closing(sqlite3.connect(path)) as conn:
        rows = conn.execute("SELECT key, state, body, scope FROM idempotency_keys").fetchall()
    assert rows == [("k", "completed", b'{"card": "4242"}', b"")]
    await old_keys_answer_nobody(SQLiteStore.open(path))


async def test_a_new_sqlite_file_is_created_at_the_current_version(tmp_path: Path) -> None:
    assert await migrate_store(f"sqlite:///{tmp_path / 'a.db'}") == (0, 7)
    store = await SQLiteStore.open(tmp_path / "b.db")  # serve needs no migrate step
    await store.close()
    with closing(sqlite3.connect(tmp_path / "b.db")) as conn:
        assert conn.execute("PRAGMA user_version").fetchone() == (7,)
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)


async def test_a_newer_sqlite_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    await SQLiteStore.migrate(path)
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA user_version = 99")
    for attempt in (SQLiteStore.open(path), SQLiteStore.migrate(path)):
        with pytest.raises(StoreError, match="schema version 99; this fenceproxy knows up to 7"):
            await attempt


async def test_postgres_must_be_migrated_before_it_serves(
    fresh_postgres: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(StoreError, match="is not migrated: run fenceproxy migrate -c FILE"):
        await PostgresStore.open(fresh_postgres)
    latest = postgres_store.SCHEMA_VERSION
    said = await migrated_by_the_cli(tmp_path, fresh_postgres, capsys)
    assert f"schema version 0 -> {latest}" in said
    said = await migrated_by_the_cli(tmp_path, fresh_postgres, capsys)
    assert f"schema version {latest}, up to date" in said
    store = await PostgresStore.open(fresh_postgres)
    await store.close()
    await sql(fresh_postgres, "UPDATE fenceproxy_schema SET version = 99")
    newer = f"schema version 99; this fenceproxy knows up to {latest}"
    with pytest.raises(StoreError, match=newer):
        await PostgresStore.open(fresh_postgres)


async def test_a_postgres_store_of_the_first_version_keeps_one_key_per_job(
    fresh_postgres: str,
) -> None:
    await sql(
        fresh_postgres,
        postgres_store._MIGRATIONS[1],
        "CREATE TABLE fenceproxy_schema (version integer NOT NULL)",
        "INSERT INTO fenceproxy_schema VALUES (1)",
        # One key of one job on two routes: the newer stays.
        "INSERT INTO idempotency_keys (route, job, key, state, fingerprint, generation,"
        " created_at, expires_at) VALUES ('old', 'j', 'k', 'completed', '\\x6b', 1, 1, 1e12),"
        " ('new', 'j', 'k', 'completed', '\\x6b', 2, 2, 1e12),"
        " ('old', 'i', 'k', 'completed', '\\x6b', 1, 1, 1e12)",
    )
    assert await PostgresStore.migrate(fresh_postgres) == (1, postgres_store.SCHEMA_VERSION)
    conn = await asyncpg.connect(fresh_postgres)
    try:
        rows = await conn.fetch("SELECT route, job, key FROM idempotency_keys ORDER BY job")
    finally:
        await conn.close()
    assert [tuple(r) for r in rows] == [("old", "i", "k"), ("new", "j", "k")]


async def test_a_postgres_store_of_the_previous_version_keeps_its_keys_from_every_caller(
    fresh_postgres: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await sql(
        fresh_postgres,
        *(postgres_store._MIGRATIONS[version] for version in (1, 2, 3)),
        "CREATE TABLE fenceproxy_schema (version integer NOT NULL)",
        "INSERT INTO fenceproxy_schema VALUES (3)",
        "INSERT INTO fences VALUES ('j', 7, 0)",
        "INSERT INTO idempotency_keys (route, job, key, state, fingerprint, generation, status,"
        " headers, body, created_at, expires_at) VALUES ('r', 'j', 'k', 'completed', '\\x6b',"
        " 7, 201, '[]', convert_to('{\"card\": \"4242\"}', 'UTF8'), 0, 1e12)",
    )
    with pytest.raises(StoreError, match="schema version 3"):
        await PostgresStore.open(fresh_postgres)
    said = await migrated_by_the_cli(tmp_path, fresh_postgres, capsys)
    assert f"schema version 3 -> {postgres_store.SCHEMA_VERSION}" in said
    conn = await asyncpg.connect(fresh_postgres)
    try:
        rows = await conn.fetch("SELECT key, state, body, scope FROM idempotency_keys")
    finally:
        await conn.close()
    assert [tuple(r) for r in rows] == [("k", "completed", b'{"card": "4242"}', b"")]
    await old_keys_answer_nobody(PostgresStore.open(fresh_postgres))


async def test_two_migrations_at_once_take_turns(fresh_postgres: str) -> None:
    results = await asyncio.gather(*(PostgresStore.migrate(fresh_postgres) for _ in range(4)))
    latest = postgres_store.SCHEMA_VERSION
    assert sorted(results) == [(0, latest)] + [(latest, latest)] * 3


STORES = {"postgresql": postgres_store, "sqlite": sqlite_store}


@pytest.mark.parametrize("backend", sorted(STORES))
def test_each_schema_version_is_one_sql_file_of_the_package(backend: str) -> None:
    """A store's schema is its folder of SQL files, one per version, none missing
    between its first and its last: what it migrates with, the last being the version
    it runs at."""
    store = STORES[backend]
    folder = Path(store.__file__).parent / "migrations" / backend
    files = {int(file.stem): file.read_text(encoding="utf-8") for file in folder.glob("*.sql")}
    assert sorted(files) == list(range(min(files), max(files) + 1))
    assert files == store._MIGRATIONS
    assert max(files) == store.SCHEMA_VERSION


def test_a_migration_file_not_named_by_its_version_is_refused(tmp_path: Path) -> None:
    """A file the store would never apply (``2.sql``, ``002-more.sql``) stops the store
    from loading, rather than leaving a step of its schema out."""
    (tmp_path / "001.sql").write_text("CREATE TABLE a (x integer);\n")
    (tmp_path / "README").write_text("not a migration")
    assert read_migrations(tmp_path) == {1: "CREATE TABLE a (x integer);\n"}
    for name in ("2.sql", "002-more.sql"):
        (tmp_path / name).write_text("CREATE TABLE b (x integer);\n")
        with pytest.raises(ValueError, match=f"the migration '{name}' is not named by its version"):
            read_migrations(tmp_path)
        (tmp_path / name).unlink()


async def applies_each_file_in_order(url: str, caplog: pytest.LogCaptureFixture) -> None:
    """Migrating the new store at ``url`` applies every version's file, each once, from
    the first to the last, and says so version by version."""
    backend = url.partition(":")[0]
    store, name = STORES[backend], {"postgresql": "PostgreSQL", "sqlite": "SQLite"}[backend]
    with caplog.at_level(logging.INFO, logger="fenceproxy.store"):
        assert await migrate_store(url) == (0, store.SCHEMA_VERSION)
    said = [r.getMessage() for r in caplog.records if "migrated to schema" in r.getMessage()]
    versions = sorted(store._MIGRATIONS)
    assert said == [f"{name} store migrated to schema version {v}" for v in versions]


async def test_migrating_a_new_sqlite_file_applies_each_versions_file_in_order(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A new SQLite file goes through every version's file, in order, once each."""
    await applies_each_file_in_order(f"sqlite:///{tmp_path / 'new.db'}", caplog)


async def test_migrating_a_new_postgres_database_applies_each_versions_file_in_order(
    fresh_postgres: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A new PostgreSQL database goes through every version's file, in order, once
    each."""
    await applies_each_file_in_order(fresh_postgres, caplog)


async def test_an_unreachable_postgres_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(
        StoreError, match=r"cannot connect to the PostgreSQL store 127\.0\.0\.1:9/x"
    ):
        await PostgresStore.open("postgresql://u@127.0.0.1:9/x", connect_timeout=2)
    config = write_config(tmp_path, "postgresql://u@127.0.0.1:9/x")
    assert await asyncio.to_thread(cli.main, ["migrate", "-c", str(config)]) == 1
    err = capsys.readouterr().err
    assert "cannot connect to the PostgreSQL store 127.0.0.1:9/x" in err
    assert "Traceback" not in err


def _claim(job: str, owner: str = "w") -> Callable[..., Lease | Refusal]:
    return lambda cur, fence, now: leasing.claim(cur, fence, job, owner, 5.0, now)


async def test_a_claim_racing_an_admission_on_another_store_never_lowers_the_fence(
    postgres: PostgresServer,
) -> None:
    """A claim and an admission of one job, on two proxies, at once. Whatever order
    they commit in, the fence never goes down, and a claim that comes second waits
    for the admitted write: it is refused `write-in-flight`, never granted while a
    write of an older generation may still reach the upstream, and raises the fence
    past that write's generation meanwhile."""
    url = postgres.url("fenceproxy")
    await sql(url, "TRUNCATE fences, idempotency_keys, leases, inflight")
    admitting, claiming = await open_store(url, key_ttl=60), await open_store(url, key_ttl=60)
    try:

        async def race(job: str) -> Lease | Refusal:
            _, (claimed, _) = await asyncio.gather(
                admit(admitting, FencedWrite("r", job, 100)),
                claiming.change_lease(job, _claim(job)),
            )
            return claimed

        jobs = [f"job-{n}" for n in range(60)]
        claims = await asyncio.gather(*(race(job) for job in jobs))
        for job, claimed in zip(jobs, claims, strict=True):
            fence = await admitting.generation(job)
            if isinstance(claimed, Lease):  # claimed first: the admission raised it after
                assert (claimed.generation, fence) == (1, 100)
            else:  # admitted first: the claim waits for the write
                assert isinstance(claimed, WriteInFlight), claimed
                assert fence == 101
                assert (await claiming.lease(job))[0] is None
    finally:
        await admitting.close()
        await claiming.close()


async def test_a_key_in_flight_outlives_its_own_time(store: Store, clock: FakeClock) -> None:
    """A key kept 60 s whose write holds its job for longer: a duplicate sent after
    the key's time is still a duplicate of a write that may be applied."""
    original = FencedWrite("r", "j", 1, key="k", fingerprint=b"k", hold=300)
    assert isinstance(await admit(store, original), Admit)
    clock.advance(120)  # past the key's 60 s, inside the write's hold
    assert await store.purge_expired() == 0
    duplicate = keyed("j", 1, "k")
    assert (await admit(store, duplicate)).slug == "duplicate-in-flight"  # type: ignore[union-attr]
    await store.settle_key(original, StoredResponse(201, (), b"{}"))
    await store.end_turn(original)
    assert isinstance(await admit(store, duplicate), Replay)


async def test_a_key_is_its_jobs_whatever_route_it_came_by(store: Store) -> None:
    """A route renamed by a reload (or a restart) must not let a retry through as new."""
    original = FencedWrite("orders", "j", 1, key="k", fingerprint=b"charge $10")
    assert isinstance(await admit(store, original), Admit)
    renamed = FencedWrite("orders-v2", "j", 1, key="k", fingerprint=b"charge $10")
    assert (await admit(store, renamed)).slug == "duplicate-in-flight"  # type: ignore[union-attr]
    await store.settle_key(original, StoredResponse(201, (), b"{}"))
    await store.end_turn(original)
    replay = await admit(store, renamed)
    assert isinstance(replay, Replay)
    assert replay.response.status == 201
    other = FencedWrite("refunds", "j", 1, key="k", fingerprint=b"refund $10")
    assert (await admit(store, other)).slug == "idempotency-key-reused"  # type: ignore[union-attr]
    another_job = FencedWrite("refunds", "i", 1, key="k", fingerprint=b"refund $10")
    assert isinstance(await admit(store, another_job), Admit)


async def test_a_key_answers_its_own_caller_only(store: Store, clock: FakeClock) -> None:
    """In flight, unknown or answered, and after a restart of the proxy: the store
    keeps whose a key is."""
    alice = FencedWrite("r", "j", 1, key="k", fingerprint=b"charge $10", scope=ALICE, hold=30)
    bob = dataclasses.replace(alice, scope=BOB)
    assert isinstance(await admit(store, alice), Admit)
    assert (await admit(store, bob)).slug == "idempotency-key-other-caller"  # type: ignore[union-attr]
    await store.settle_key(alice, StoredResponse(201, (), b'{"card": "4242"}'))
    await store.end_turn(alice)
    assert (await admit(store, bob)).slug == "idempotency-key-other-caller"  # type: ignore[union-attr]
    assert await admit(store, alice) == Replay(StoredResponse(201, (), b'{"card": "4242"}'))
    unknown = FencedWrite("r", "j", 1, key="u", fingerprint=b"x", scope=ALICE)
    assert isinstance(await admit(store, unknown), Admit)
    await store.settle_key(unknown, "unknown")
    await store.end_turn(unknown)
    other = dataclasses.replace(unknown, scope=BOB)
    assert (await admit(store, other)).slug == "idempotency-key-other-caller"  # type: ignore[union-attr]
    assert (await admit(store, unknown)).slug == "duplicate-outcome-unknown"  # type: ignore[union-attr]


async def test_an_unknown_outcome_never_shortens_a_record(store: Store) -> None:
    write = FencedWrite("r", "j", 1, hold=300)
    await admit(store, write)
    await store.end_turn(write, unknown_for=5)
    busy = await admit(store, FencedWrite("r", "j", 2))
    assert isinstance(busy, Busy)
    assert (busy.unknown, busy.retry_after) == (True, pytest.approx(300, abs=1))


async def test_a_claim_racing_the_first_write_of_a_job_still_raises_its_fence(
    store_url: str, clock: FakeClock
) -> None:
    """The job has no fence row yet; an admission inserting generation 100 holds the
    job's lock (shared, as every admission does) while the claim starts. The claim
    waits for it and must hand out 101, not a generation its holder's writes would be
    refused with."""
    if not store_url.startswith("postgresql"):
        pytest.skip("one SQLite process decides one operation at a time")
    store = await open_store(store_url, key_ttl=60, clock=clock)
    other = await asyncpg.connect(store_url)
    try:
        writing = other.transaction()
        await writing.start()
        await other.execute("SELECT pg_advisory_xact_lock_shared(hashtextextended('fresh', 0))")
        await other.execute(
            "INSERT INTO fences (job, generation, updated_at) VALUES ('fresh', 100, 0)"
        )
        claim = asyncio.ensure_future(
            store.change_lease(
                "fresh", lambda cur, fence, now: leasing.claim(cur, fence, "fresh", "w", 30, now)
            )
        )
        # Until the claim waits for the admission.
        waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        watcher = await asyncpg.connect(store_url)
        try:
            while not await watcher.fetchval(waiting):
                assert not claim.done()
                await asyncio.sleep(0.01)
        finally:
            await watcher.close()
        await writing.commit()
        lease, _ = await claim
        assert isinstance(lease, leasing.Lease)
        assert lease.generation == 101
        assert await store.generation("fresh") == 101
    finally:
        await other.close()
        await store.close()


async def test_a_claim_waits_for_a_write_in_flight(store: Store, clock: FakeClock) -> None:
    """Generation 1's holder has a write at the upstream when its lease runs out. A
    claim then is refused `write-in-flight` with the record's time left, and raises
    the fence past generation 1 at once: the old holder's next write is refused as
    stale rather than taking a record the claim would wait for. Asked again, the
    claim raises nothing more; it takes generation 3 (2 is the fence it raised) once
    the write's record is gone: after a write whose outcome is unknown, once the
    record expires; after a write answered, at once."""
    first = await store.change_lease("j", _claim("j", "a"))
    assert isinstance(first[0], Lease)
    write = FencedWrite("r", "j", 1, hold=30)
    assert isinstance(await admit(store, write), Admit)
    clock.advance(6)  # the lease has expired; the write is still in flight
    refused, _ = await store.change_lease("j", _claim("j", "b"))
    assert isinstance(refused, WriteInFlight)
    assert refused.retry_after == pytest.approx(24)
    assert refused.extensions["expires_in"] == pytest.approx(24)
    assert await store.generation("j") == 2
    late = await admit(store, FencedWrite("r", "j", 1, hold=30))
    assert isinstance(late, StaleGeneration), late
    await store.end_turn(write, unknown_for=40)  # sent, no answer: held 40 s more
    refused, _ = await store.change_lease("j", _claim("j", "b"))
    assert isinstance(refused, WriteInFlight)
    assert refused.retry_after == pytest.approx(40)
    assert await store.generation("j") == 2
    clock.advance(40)
    claimed, _ = await store.change_lease("j", _claim("j", "b"))
    assert isinstance(claimed, Lease)
    assert claimed.generation == 3
    assert await store.generation("j") == 3
    # A write answered gives the job back at once, and a claim that never had to
    # wait takes the next generation.
    clock.advance(6)
    write = FencedWrite("r", "j", 3, hold=30)
    assert isinstance(await admit(store, write), Admit)
    await store.end_turn(write)
    claimed, _ = await store.change_lease("j", _claim("j", "c"))
    assert isinstance(claimed, Lease)
    assert claimed.generation == 4


async def test_a_lease_behind_its_fence_renews_and_completes(store: Store) -> None:
    """A write with a generation from elsewhere (no lease of this store's gave it)
    raised the job's fence past its lease. Its holder still renews and completes:
    its own writes are refused, which is the fence's business, not the lease's."""
    claimed, _ = await store.change_lease("j", _claim("j"))
    assert isinstance(claimed, Lease)
    assert isinstance(await admit(store, FencedWrite("r", "j", 5, hold=0)), Admit)
    async with asyncio.timeout(10):
        renewed, _ = await store.change_lease(
            "j", lambda cur, fence, now: leasing.renew(cur, "j", "w", 1, None, now)
        )
        done, _ = await store.change_lease(
            "j", lambda cur, fence, now: leasing.complete(cur, "j", "w", 1, now)
        )
    assert isinstance(renewed, Lease)
    assert isinstance(done, Lease)
    assert done.state == "completed"
    assert await store.generation("j") == 5


async def test_an_admission_waits_for_a_lease_change_on_another_proxy(
    postgres: PostgresServer,
) -> None:
    """A claim in progress on another proxy holds the job's lock. An admission of
    the old generation waits for it, then reads the fence the claim raised and is
    refused: it is never decided on the fence from before the claim and committed
    after it, which would let an old holder's write reach the upstream after the
    claim was acknowledged."""
    url = postgres.url("fenceproxy")
    await sql(url, "TRUNCATE fences, idempotency_keys, leases, inflight")
    store = await open_store(url, key_ttl=60)
    other = await asyncpg.connect(url)
    watcher = await asyncpg.connect(url)
    try:
        assert isinstance(await admit(store, FencedWrite("r", "j", 1, hold=0.01)), Admit)
        claiming = other.transaction()
        await claiming.start()
        await other.execute("SELECT pg_advisory_xact_lock(hashtextextended('j', 0))")
        admitting = asyncio.ensure_future(admit(store, FencedWrite("r", "j", 1)))
        waiting = (
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'"
        )
        while not await watcher.fetchval(waiting):
            assert not admitting.done(), admitting.result()
            await asyncio.sleep(0.01)
        await other.execute("UPDATE fences SET generation = 2 WHERE job = 'j'")
        await claiming.commit()
        refused = await admitting
        assert isinstance(refused, StaleGeneration), refused
    finally:
        await watcher.close()
        await other.close()
        await store.close()


@pytest.mark.parametrize("again", [0, 3], ids=["once", "again-meanwhile"])
async def test_an_admission_whose_caller_is_cancelled_is_given_back(
    store: Store, again: int
) -> None:
    """A request cut off while the store admits its write never sends it: whatever the
    admission took, at whichever point it was cut off, neither the job nor the key
    waits out the write's record. Cancelled again while that is given back, the
    caller still goes on only once it has been."""
    cancelled = 0
    for n, delay in enumerate([0.0, 0.0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02]):
        job = f"cut-{n}"
        task = asyncio.create_task(admit(store, keyed(job, 5, "k")))
        for _ in range(n if delay == 0.0 else 0):
            await asyncio.sleep(0)
        await asyncio.sleep(delay)
        task.cancel()
        for _ in range(again):
            await asyncio.sleep(0)
            task.cancel()
        try:
            assert isinstance(await task, Admit)  # finished before the cut: nothing to undo
            await store.give_back(keyed(job, 5, "k"))  # not sent either, as a caller would
            continue
        except asyncio.CancelledError:
            cancelled += 1
        retry = keyed(job, 5, "k")
        assert isinstance(await admit(store, retry), Admit), f"cut after {delay}s"
        await store.end_turn(retry)
    assert cancelled, "no admission was cut off: the test proves nothing"


async def test_a_settlement_whose_caller_is_cancelled_still_lands(store: Store) -> None:
    """What became of a keyed write does not change when its request is cut off: the
    answer is recorded, and a retry of the key is replayed, never sent again."""
    write = keyed("settled", 5, "k")
    assert isinstance(await admit(store, write), Admit)
    task = asyncio.create_task(store.settle_key(write, StoredResponse(201, (), b"made")))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await store.end_turn(write)
    replay = await admit(store, keyed("settled", 5, "k"))
    assert isinstance(replay, Replay)
    assert (replay.response.status, replay.response.body) == (201, b"made")


async def test_a_cancelled_duplicate_gives_back_nothing_of_the_write_it_duplicates(
    store: Store,
) -> None:
    """A duplicate is refused, and its caller cut off: what the cut gives back is the
    duplicate's own, which is nothing. The original keeps its key and its job."""
    original = keyed("j", 1, "k")
    assert isinstance(await admit(store, original), Admit)
    duplicate = keyed("j", 1, "k")
    task = asyncio.create_task(store.admit(duplicate))
    await asyncio.sleep(0)  # the admission is queued
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await admit(store, duplicate)).slug == "duplicate-in-flight"  # type: ignore[union-attr]
    assert isinstance(await admit(store, FencedWrite("r", "j", 1)), Busy)
    await store.settle_key(original, StoredResponse(201, (), b"made"))
    await store.end_turn(original)
    assert await admit(store, keyed("j", 1, "k")) == Replay(StoredResponse(201, (), b"made"))


async def test_a_key_reused_after_its_time_but_before_the_purge_keeps_its_new_answer(
    store_url: str, clock: FakeClock
) -> None:
    """The expired row is still in the table: the key's new write must take it over,
    or the new answer is recorded nowhere and a retry of it is sent again."""
    store = await open_store(store_url, key_ttl=10, clock=clock)
    try:
        first = keyed("j", 1, "k")
        assert isinstance(await admit(store, first), Admit)
        await store.settle_key(first, StoredResponse(201, (), b"first"))
        await store.end_turn(first)
        clock.advance(11)  # past the key's 10 s; nothing purged it
        again = keyed("j", 1, "k")
        assert isinstance(await admit(store, again), Admit)
        await store.settle_key(again, StoredResponse(201, (), b"again"))
        await store.end_turn(again)
        clock.advance(1)
        assert await admit(store, keyed("j", 1, "k")) == Replay(StoredResponse(201, (), b"again"))
    finally:
        await store.close()


async def test_a_write_that_lost_its_key_cannot_forget_its_successors(
    store: Store, clock: FakeClock
) -> None:
    """A's record and key ran out and B took the key over; A forgetting the key
    afterwards (it never sent, say) leaves B's alone, so B's answer is replayed."""
    a = FencedWrite("r", "j", 1, key="k", fingerprint=b"k", hold=30)
    assert isinstance(await admit(store, a), Admit)
    clock.advance(61)  # past A's 30 s record and the key's 60 s
    b = keyed("j", 1, "k")
    assert isinstance(await admit(store, b), Admit)
    await store.settle_key(a, "forget")
    await store.settle_key(b, StoredResponse(201, (), b"by b"))
    await store.end_turn(b)
    assert await admit(store, keyed("j", 1, "k")) == Replay(StoredResponse(201, (), b"by b"))


async def test_an_in_flight_record_ends_at_exactly_its_hold(store: Store, clock: FakeClock) -> None:
    assert isinstance(await admit(store, FencedWrite("r", "j", 1, hold=10)), Admit)
    clock.advance(9.5)
    assert isinstance(await admit(store, FencedWrite("r", "j", 1)), Busy)
    clock.advance(0.5)
    assert isinstance(await admit(store, FencedWrite("r", "j", 1)), Admit)


async def test_a_renewal_does_not_move_when_the_generation_was_set(
    store: Store, clock: FakeClock
) -> None:
    claimed_at = clock.now
    claimed, _ = await store.change_lease("j", _claim("j"))
    assert isinstance(claimed, Lease)
    clock.advance(3)
    renewed, _ = await store.change_lease(
        "j", lambda cur, fence, now: leasing.renew(cur, "j", "w", 1, None, now)
    )
    assert isinstance(renewed, Lease)
    assert renewed.lease_until == clock.now + 5.0  # the renewal did land
    view = await store.inspect("j")
    assert (view.generation, view.generation_set_at) == (1, claimed_at)


# -- one batch, and what it reports ---------------------------------------------------


async def test_a_late_write_sent_with_the_claim_that_superseded_it_is_refused(
    store: Store, clock: FakeClock
) -> None:
    """Generation 3's holder, paused past its lease, writes just as another worker
    claims the job, both at once. On SQLite they share one batch, the claim first: the
    write is decided on the fence the claim raised in that batch, not on the one
    committed before it. On PostgreSQL a claim is a transaction of its own, and they
    commit in either order: a write admitted first holds the claim back. Either way
    the old holder's write never goes behind a granted claim, and the fence ends at 4."""
    elsewhere = FencedWrite("r", "j", 2)  # a generation from elsewhere: the fence is at 2
    assert isinstance(await admit(store, elsewhere), Admit)
    await store.end_turn(elsewhere)
    first, _ = await store.change_lease("j", _claim("j", "a"))
    assert isinstance(first, Lease)
    assert first.generation == 3
    clock.advance(6)  # a's lease (5 s) has run out
    batches: list[int] = []
    store.on_commit = lambda seconds, operations: batches.append(operations)
    (claimed, _), late = await asyncio.gather(
        store.change_lease("j", _claim("j", "b")), admit(store, FencedWrite("r", "j", 3))
    )
    if isinstance(store, SQLiteStore):
        assert batches == [2]  # one batch
        assert isinstance(late, StaleGeneration)
    if isinstance(late, Admit):
        assert isinstance(claimed, WriteInFlight)
    else:
        assert isinstance(late, StaleGeneration)
        assert isinstance(claimed, Lease)
        assert claimed.generation == 4
    assert await store.generation("j") == 4
    assert isinstance(await admit(store, FencedWrite("r", "j", 3)), StaleGeneration)


async def test_each_batch_is_reported_with_its_time_and_its_size(store: Store) -> None:
    """What the store commit metrics show an operator: one sample per batch, with the
    time its commit took and how many operations shared it."""
    metrics = Metrics()
    store.on_commit = metrics.committed
    writes = [FencedWrite("r", f"m{n}", 1) for n in range(5)]
    started = time.monotonic()
    decisions = await asyncio.gather(*(admit(store, w) for w in writes))
    took = time.monotonic() - started
    assert all(isinstance(d, Admit) for d in decisions)
    got = samples(metrics.render().decode())
    assert got[("fenceproxy_store_batch_operations_count", ())] == 1
    assert got[("fenceproxy_store_batch_operations_sum", ())] == 5
    assert got[("fenceproxy_store_commit_seconds_count", ())] == 1
    assert 0 < got[("fenceproxy_store_commit_seconds_sum", ())] <= took


async def test_a_scrape_reads_the_jobs_held_and_whether_the_store_answers(
    store: Store, clock: FakeClock
) -> None:
    """What the held-job and store-down alerts read, on every scrape: the jobs a live
    in-flight record holds, each once, by state (a write at the upstream, or one whose
    outcome is unknown: quarantined) until the record ends; the store answering, and
    no standby gauge for a store not asked to have one (no ``?require_sync=true``: a
    single server is not alerted on); and once the store fails, only that it does
    not answer."""
    metrics = Metrics()

    async def scraped() -> dict[str, float]:
        await metrics.store.read(store)
        got = samples(metrics.render().decode())
        read = ("fenceproxy_store_up", "fenceproxy_store_synchronous_standby")
        return {
            dict(labels).get("state", name): value
            for (name, labels), value in got.items()
            if name in read or name == "fenceproxy_store_jobs_held"
        }

    assert await scraped() == {"fenceproxy_store_up": 1, "in_flight": 0, "unknown": 0}
    # Job a: two writes of one generation in flight together; b: sent, its outcome
    # unknown (held 40 s from now); c: answered, so not held.
    a1, a2 = (FencedWrite("r", "a", 1, hold=30, shared=True) for _ in range(2))
    b, c = FencedWrite("r", "b", 1, hold=30), FencedWrite("r", "c", 1, hold=30)
    for write in (a1, a2, b, c):
        assert isinstance(await admit(store, write), Admit)
    await store.end_turn(b, unknown_for=40)
    await store.end_turn(c)
    assert await scraped() == {"fenceproxy_store_up": 1, "in_flight": 1, "unknown": 1}
    clock.advance(30)
    assert await scraped() == {"fenceproxy_store_up": 1, "in_flight": 0, "unknown": 1}
    clock.advance(10)
    assert await scraped() == {"fenceproxy_store_up": 1, "in_flight": 0, "unknown": 0}
    await store.close()
    assert await scraped() == {"fenceproxy_store_up": 0}


async def _a_session_waits_for_a_lock(conn: asyncpg.Connection) -> None:
    """Poll until one of the server's sessions waits for a lock."""
    waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    async with asyncio.timeout(10):
        while not await conn.fetchval(waiting):
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
async def test_scrapes_that_come_together_on_a_slow_store_take_one_connection(
    store_url: str,
) -> None:
    """However many scrapes come at once while the store is slow (here, a lock its
    read waits for), they share one read, on one connection of the pool: the writes
    and the probes keep the rest, and are not held up behind the scrapes."""
    store = await open_store(f"{store_url}?pool=3", key_ttl=60)
    metrics = Metrics()
    blocker = await asyncpg.connect(store_url)
    try:
        async with blocker.transaction():
            await blocker.execute("LOCK TABLE inflight IN ACCESS EXCLUSIVE MODE")
            scrapes = [asyncio.create_task(metrics.store.read(store)) for _ in range(10)]
            await _a_session_waits_for_a_lock(blocker)
            async with asyncio.timeout(1.0):  # the scrapes wait 2 s for their read
                await store.check()
        await asyncio.gather(*scrapes)
        assert samples(metrics.render().decode())[("fenceproxy_store_up", ())] == 1
    finally:
        await blocker.close()
        await store.close()


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
async def test_a_scrape_of_a_hung_store_says_it_is_down_within_two_seconds(
    store_url: str,
) -> None:
    """A store whose server hangs (its process stopped, as a host that stops
    answering) is down for the scrape after 2 s, not after the seconds that cutting
    the read takes: Prometheus, whose scrape would time out, reads
    fenceproxy_store_up 0 and the store-down alert fires."""
    store = await open_store(f"{store_url}?pool=1&application_name=hung", key_ttl=60)
    metrics = Metrics()
    await metrics.store.read(store)  # the pool's one connection, open
    conn = await asyncpg.connect(store_url)
    try:
        backends = await conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'hung'"
        )
    finally:
        await conn.close()
    ((pid,),) = backends
    os.kill(pid, signal.SIGSTOP)
    try:
        async with asyncio.timeout(2.5):
            await metrics.store.read(store)
        assert samples(metrics.render().decode())[("fenceproxy_store_up", ())] == 0
    finally:
        os.kill(pid, signal.SIGCONT)
        await store.close()
