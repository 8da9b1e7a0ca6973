"""The SQLite store on a real file: durable fences, key states across a restart,
grouped commits, expiry."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fenceproxy.errors import StaleGeneration, StoreError, StoreLocked
from fenceproxy.fencing import Admit, FencedWrite, KeyState, Replay, StoredResponse
from fenceproxy.store import SQLiteStore
from fenceproxy.testing import FakeClock


def keyed(job: str, generation: int, key: str) -> FencedWrite:
    return FencedWrite("r", job, generation, key=key, fingerprint=b"fp-" + key.encode())


async def test_fence_survives_reopen(store_path: Path) -> None:
    store = await SQLiteStore.open(store_path)
    assert await store.admit(FencedWrite("r", "j", 8)) == Admit(raise_to=8)
    await store.close()
    store = await SQLiteStore.open(store_path)
    try:
        assert await store.generation("j") == 8
        assert isinstance(await store.admit(FencedWrite("r", "j", 7)), StaleGeneration)
    finally:
        await store.close()


async def test_key_in_flight_at_a_stop_reads_as_unknown_after(store_path: Path) -> None:
    store = await SQLiteStore.open(store_path)
    write = keyed("j", 1, "k")
    assert isinstance(await store.admit(write), Admit)
    await store.close()  # as if the process died before the answer came
    store = await SQLiteStore.open(store_path)
    try:
        decision = await store.admit(write)
        assert decision.slug == "duplicate-outcome-unknown"  # type: ignore[union-attr]
    finally:
        await store.close()


async def test_completed_key_replays_after_reopen(store_path: Path) -> None:
    store = await SQLiteStore.open(store_path)
    write = keyed("j", 1, "k")
    await store.admit(write)
    stored = StoredResponse(201, (("Content-Type", "text/plain"), ("X-A", "1")), b"made")
    await store.complete_key(write, stored)
    await store.close()
    store = await SQLiteStore.open(store_path)
    try:
        assert await store.admit(write) == Replay(stored)
    finally:
        await store.close()


async def test_forgotten_key_can_be_admitted_again(store_path: Path) -> None:
    store = await SQLiteStore.open(store_path)
    try:
        write = keyed("j", 1, "k")
        await store.admit(write)
        await store.forget_key(write)
        assert isinstance(await store.admit(write), Admit)
    finally:
        await store.close()


async def test_concurrent_operations_share_commits(store_path: Path) -> None:
    store = await SQLiteStore.open(store_path)
    try:
        writes = [FencedWrite("r", f"job-{i}", i) for i in range(200)]
        before = store.commits
        decisions = await asyncio.gather(*(store.admit(w) for w in writes))
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
        done, running = keyed("j", 1, "done"), keyed("j", 1, "running")
        for write in (done, running):
            await store.admit(write)
        await store.complete_key(done, StoredResponse(200, (), b""))
        clock.advance(61)
        assert await store.purge_expired() == 1  # the in-flight key stays until settled
        assert isinstance(await store.admit(done), Admit)
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
        await store.admit(FencedWrite("r", "j", 1))


async def test_key_state_names_are_stable() -> None:
    # They are stored on disk: renaming one would misread existing stores.
    assert [s.value for s in KeyState] == ["in_flight", "completed", "unknown"]


async def test_an_unclean_stop_is_known_to_the_next_opener(store_path: Path) -> None:
    store = await SQLiteStore.open(store_path)
    assert not store.crashed  # a new store
    await store.close()  # closed without a clean stop: as after kill -9
    store = await SQLiteStore.open(store_path)
    assert store.crashed
    await store.stop_cleanly(quiet_until=1234.5)
    await store.close()
    store = await SQLiteStore.open(store_path)
    try:
        assert not store.crashed
        assert store.quiet_until == 1234.5
    finally:
        await store.close()


async def test_writes_that_change_nothing_cost_no_commit(store_path: Path) -> None:
    store = await SQLiteStore.open(store_path)
    try:
        await store.admit(FencedWrite("r", "j", 5))
        before = store.commits
        # The same holder's further writes: the fence does not move, nothing to commit.
        decisions = await asyncio.gather(
            *(store.admit(FencedWrite("r", "j", 5)) for _ in range(20))
        )
        assert all(d == Admit(raise_to=None) for d in decisions)
        assert store.commits == before
        assert isinstance(await store.admit(FencedWrite("r", "j", 4)), StaleGeneration)
        assert await store.admit(FencedWrite("r", "j", 6)) == Admit(raise_to=6)
        assert store.commits == before + 1
    finally:
        await store.close()
    store = await SQLiteStore.open(store_path)
    try:
        assert await store.generation("j") == 6
    finally:
        await store.close()
