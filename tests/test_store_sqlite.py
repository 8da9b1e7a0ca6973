"""The SQLite store on a real file: durable fences, key states across a restart,
grouped commits, expiry."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Literal

import pytest

from fenceproxy.errors import StaleGeneration, StoreError, StoreLocked
from fenceproxy.fence.fencing import Admit, FencedWrite, KeyState, Replay, StoredResponse
from fenceproxy.store import SQLiteStore
from fenceproxy.store import sqlite as sqlite_store
from fenceproxy.testing import FakeClock

from .conftest import admit


def keyed(job: str, generation: int, key: str) -> FencedWrite:
    return FencedWrite("r", job, generation, key=key, fingerprint=b"fp-" + key.encode())


async def test_fence_survives_reopen(store_path: Path) -> None:
    store = await SQLiteStore.open(store_path)
    assert await admit(store, FencedWrite("r", "j", 8)) == Admit(raise_to=8)
    await store.close()
    store = await SQLiteStore.open(store_path)
    try:
        assert await store.generation("j") == 8
        assert isinstance(await admit(store, FencedWrite("r", "j", 7)), StaleGeneration)
    finally:
        await store.close()


async def test_key_in_flight_at_a_stop_reads_as_unknown_once_its_record_expires(
    store_path: Path,
) -> None:
    clock = FakeClock()
    store = await SQLiteStore.open(store_path, clock=clock)
    write = keyed("j", 1, "k")
    assert isinstance(await admit(store, write), Admit)
    await store.close()  # as if the process died before the answer came
    store = await SQLiteStore.open(store_path, clock=clock)
    try:
        retry = keyed("j", 1, "k")  # another attempt, by another proxy or process
        decision = await admit(store, retry)
        assert decision.slug == "duplicate-in-flight"  # type: ignore[union-attr]
        clock.advance(write.hold)
        decision = await admit(store, retry)
        assert decision.slug == "duplicate-outcome-unknown"  # type: ignore[union-attr]
    finally:
        await store.close()


async def test_completed_key_replays_after_reopen(store_path: Path) -> None:
    store = await SQLiteStore.open(store_path)
    write = keyed("j", 1, "k")
    await admit(store, write)
    stored = StoredResponse(201, (("Content-Type", "text/plain"), ("X-A", "1")), b"made")
    await store.settle_key(write, stored)
    await store.close()
    store = await SQLiteStore.open(store_path)
    try:
        assert await admit(store, write) == Replay(stored)
    finally:
        await store.close()


async def test_forgotten_key_can_be_admitted_again(store_path: Path) -> None:
    store = await SQLiteStore.open(store_path)
    try:
        write = keyed("j", 1, "k")
        await admit(store, write)
        await store.settle_key(write, "forget")
        assert isinstance(await admit(store, write), Admit)
    finally:
        await store.close()


async def test_concurrent_operations_share_commits(store_path: Path) -> None:
    store = await SQLiteStore.open(store_path)
    try:
        writes = [FencedWrite("r", f"job-{i}", i) for i in range(200)]
        before = store.commits
        decisions = await asyncio.gather(*(admit(store, w) for w in writes))
        assert all(isinstance(d, Admit) for d in decisions)
        commits = store.commits - before
        assert 1 <= commits < 50, commits
        for w in writes[::37]:
            assert await store.generation(w.job) == w.generation
    finally:
        await store.close()


async def test_expired_keys_are_absent_then_purged(store_path: Path) -> None:
    clock = FakeClock()
    store = await SQLiteStore.open(store_path, key_ttl=60, clock=clock)
    try:
        done = keyed("j", 1, "done")
        await admit(store, done)
        await store.settle_key(done, StoredResponse(200, (), b""))
        await store.end_turn(done)
        running = FencedWrite("r", "j", 1, key="running", fingerprint=b"fp", hold=600)
        await admit(store, running)
        clock.advance(61)
        # The completed key goes; the key in flight stays while its write holds the
        # job's in-flight record.
        assert await store.purge_expired() == 1
        await store.end_turn(running)
        assert isinstance(await admit(store, keyed("j", 1, "done")), Admit)
    finally:
        await store.close()


async def test_second_opener_of_a_file_is_refused(store_path: Path) -> None:
    store = await SQLiteStore.open(store_path)
    try:
        with pytest.raises(StoreLocked, match="one proxy per SQLite file"):
            await SQLiteStore.open(store_path)
    finally:
        await store.close()


async def test_a_file_that_is_not_a_store_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "not.db"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="cannot open"):
        await SQLiteStore.open(path)


async def test_closed_store_refuses_work(store_path: Path) -> None:
    store = await SQLiteStore.open(store_path)
    await store.close()
    with pytest.raises(StoreError):
        await admit(store, FencedWrite("r", "j", 1))


async def test_key_state_names_are_stable() -> None:
    # They are stored on disk: renaming one would misread existing stores.
    assert [s.value for s in KeyState] == ["in_flight", "completed", "unknown"]


async def test_concurrent_writes_of_many_jobs_share_commits(store_path: Path) -> None:
    store = await SQLiteStore.open(store_path)
    try:
        await admit(store, FencedWrite("r", "warm-up", 1))
        before = store.commits
        writes = [FencedWrite("r", f"j{n}", 5) for n in range(50)]
        decisions = await asyncio.gather(*(admit(store, w) for w in writes))
        assert all(d == Admit(raise_to=5) for d in decisions)
        assert store.commits - before <= 10  # each commit carries several admissions
        await asyncio.gather(*(store.end_turn(w) for w in writes))
    finally:
        await store.close()
    store = await SQLiteStore.open(store_path)
    try:
        assert [await store.generation(f"j{n}") for n in range(50)] == [5] * 50
    finally:
        await store.close()


async def test_work_waiting_on_a_writer_that_stopped_fails_at_once(store_path: Path) -> None:
    store = await SQLiteStore.open(store_path)
    try:
        await store._batches.cancel()  # as when the event loop shuts down under it
        async with asyncio.timeout(5):
            with pytest.raises(StoreError):
                await admit(store, FencedWrite("r", "j", 1))
    finally:
        await store.close()


@pytest.mark.parametrize(("option", "expected"), [("full", 2), ("normal", 1)])
async def test_the_durability_setting_is_the_one_asked_for(
    store_path: Path, option: Literal["full", "normal"], expected: int
) -> None:
    store = await SQLiteStore.open(store_path, synchronous=option)
    try:

        def pragmas() -> list[tuple[object, ...]]:
            return [
                store._conn.execute(f"PRAGMA {name}").fetchone()
                for name in ("synchronous", "journal_mode")
            ]

        on_its_thread = asyncio.get_running_loop().run_in_executor(store._thread, pragmas)
        assert await on_its_thread == [(expected,), ("wal",)]
    finally:
        await store.close()


async def test_the_fence_cache_stays_bounded(
    store_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_store, "_FENCE_CACHE_MAX", 10)
    store = await SQLiteStore.open(store_path)
    try:
        for n in range(25):
            write = FencedWrite("r", f"j{n}", 1)
            await admit(store, write)
            await store.end_turn(write)
            assert len(store._fences) <= 11
        assert await store.generation("j3") == 1  # evicted, read again from the file
    finally:
        await store.close()
