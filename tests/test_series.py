"""What the operator page's charts draw (:mod:`fenceproxy.ops.series`): the last hour
in 10-second buckets, on a clock the test moves; and, through a real proxy, a fenced
write's time with its store and upstream parts."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from typing import Any

import asyncpg
import pytest
from aiohttp import web

from fenceproxy.ops.series import BOUNDS, KEPT, STEP, Hour, Series
from fenceproxy.testing import FakeClock, Received, RecordingUpstream, Responder

from .conftest import ProxyFactory, fenced, proxy_of

START = 1_800_000_000.0  # on a bucket's boundary
BIN = 2 ** (1 / 3)  # a histogram bin's upper bound over its lower


def last(drawn: dict[str, Any], *path: str, n: int = 1) -> list[Any]:
    """The last ``n`` values of one of the drawn series."""
    found: Any = drawn
    for name in path:
        found = found[name]
    return list(found[-n:])


def count(drawn: dict[str, Any], *path: str) -> float:
    """How many there were over the hour: each rate by the seconds it is over."""
    rates = last(drawn, *path, n=KEPT)
    return round(sum(r * s for r, s in zip(rates, drawn["seen"], strict=True) if r is not None))


def test_percentiles_are_read_within_an_eighth_of_the_true_ones() -> None:
    """An operator reads p50 and p99 off a histogram of fixed bins, not the requests
    themselves: over four decades of times they stay within an eighth of the truth."""
    rng = random.Random(7)
    clock = FakeClock(START)
    series = Series(clock)
    times = [10 ** rng.uniform(-4, 0) for _ in range(5000)]
    for seconds in times:
        series.decision("forwarded", seconds)
        series.store(seconds / 10)
        series.upstream(seconds * 3)
    drawn = series.hour().drawn(START + 5)
    quantiles = statistics.quantiles(times, n=100)
    for part, scale in (("total", 1), ("store", 0.1), ("upstream", 3)):
        for name, true in (("p50", quantiles[49]), ("p99", quantiles[98])):
            [read] = last(drawn, "seconds", part, name)
            assert abs(read / (true * scale) - 1) < 1 / 8, (part, name, read, true * scale)
    assert drawn["seconds"]["total"]["p50"][-2] is None  # nothing timed before


def test_decisions_are_per_second_of_the_bucket_seen() -> None:
    """A rate is over the seconds a bucket was seen: the first began before the proxy
    started and the last is under way; before the start there is nothing to draw."""
    clock = FakeClock(START + 6)  # 4 s of the first bucket seen
    series = Series(clock)
    for _ in range(8):
        series.decision("forwarded", 0.002)
    clock.advance(4)  # the next bucket, 10 writes in 10 s
    for outcome in ["forwarded"] * 6 + ["replayed"] * 2 + ["stale-generation"] * 2:
        series.decision(outcome, 0.002)
    clock.advance(12)  # 2 s into the bucket after it
    series.decision("job-quarantined", 0.002)
    series.decision("would-stale-generation", 0.002)  # a report-only route forwarded it
    drawn = series.hour().drawn(clock())
    assert last(drawn, "at", n=3) == [START, START + STEP, START + 2 * STEP]
    assert last(drawn, "seen", n=4) == [None, 4.0, 10.0, 2.0]
    assert last(drawn, "decisions", "forwarded", n=4) == [None, 2.0, 0.6, 0.5]
    assert last(drawn, "decisions", "replayed", n=3) == [0.0, 0.2, 0.0]
    assert last(drawn, "decisions", "refused", n=3) == [0.0, 0.2, 0.5]
    # By kind, most first; what a report-only route would have refused among them.
    assert list(drawn["refusals"]) == [
        "stale-generation", "job-quarantined", "would-stale-generation"
    ]  # fmt: skip
    assert last(drawn, "refusals", "stale-generation", n=3) == [0.0, 0.2, 0.0]
    assert last(drawn, "refusals", "would-stale-generation", n=3) == [0.0, 0.0, 0.5]
    assert len(drawn["at"]) == KEPT


def test_store_batches_are_drawn_by_their_mean_and_largest() -> None:
    """How full the store's commits are: the operations per commit, on average and
    at most, per bucket."""
    clock = FakeClock(START)
    series = Series(clock)
    for operations in (9, 2, 1):
        series.batch(operations)
    clock.advance(STEP)
    drawn = series.hour().drawn(clock())
    assert last(drawn, "batches", "mean", n=2) == [4.0, None]
    assert last(drawn, "batches", "largest", n=2) == [9, None]


def test_only_the_last_hour_is_kept_and_drawn() -> None:
    """Memory stays bounded however long the proxy runs: a bucket a step, an hour of
    them; what is older is neither kept nor drawn."""
    clock = FakeClock(START)
    series = Series(clock)
    series.decision("stale-generation", 0.001)
    for _ in range(KEPT + 20):
        clock.advance(STEP)
        series.decision("forwarded", 0.001)
    assert len(series.hour().buckets) == KEPT
    drawn = series.hour().drawn(clock())
    assert drawn["refusals"] == {}
    assert drawn["at"][0] == clock() - (KEPT - 1) * STEP
    assert drawn["decisions"]["forwarded"][:-1] == [0.1] * (KEPT - 1)


def test_the_hours_of_several_processes_add_up() -> None:
    """Under ``workers:`` the page draws every worker's hour as one: counts add up,
    the percentiles are read from the histograms added up, the largest batch is the
    largest of any, and the hour starts with the first worker's; each hour crosses
    a worker's socket as JSON."""
    clock = FakeClock(START)
    first, second = Series(clock), Series(FakeClock(START + 3))
    for _ in range(3):
        first.decision("forwarded", 0.001)
    for _ in range(97):
        second.decision("forwarded", 0.1)
    second.decision("stale-generation", 0.1)
    first.batch(7)
    second.batch(2)
    second.batch(1)
    hours = [Hour.from_json(json.loads(json.dumps(s.hour().json()))) for s in (first, second)]
    drawn = Hour.merged(hours).drawn(START + STEP - 1)
    assert drawn["seen"][-1] == STEP - 1
    assert count(drawn, "decisions", "forwarded") == 100
    assert count(drawn, "refusals", "stale-generation") == 1
    # 98 writes of 0.1 s and 3 of 1 ms: both read in 0.1 s's bin.
    [p50] = last(drawn, "seconds", "total", "p50")
    [p99] = last(drawn, "seconds", "total", "p99")
    assert 0.1 / BIN < p50 < 0.1 * BIN
    assert 0.1 / BIN < p99 < 0.1 * BIN
    assert last(drawn, "batches", "mean") == [round(10 / 3, 2)]
    assert last(drawn, "batches", "largest") == [7]
    # Merging reads the hours given, never changes them.
    assert count(hours[0].drawn(START + STEP - 1), "decisions", "forwarded") == 3


def test_a_clock_stepping_back_adds_into_the_bucket_it_comes_back_to() -> None:
    """A process whose wall clock steps back (NTP, a VM resumed) records into a bucket
    it had left: the page draws that interval once, its counts added up, whether
    drawn here or after crossing a worker's socket."""
    clock = FakeClock(START)
    series = Series(clock)
    series.decision("forwarded", 0.001)
    clock.advance(STEP)
    series.decision("forwarded", 0.001)
    clock.advance(-STEP)  # back into the first bucket
    series.decision("stale-generation", 0.1)
    series.batch(4)
    for hour in (series.hour(), Hour.from_json(json.loads(json.dumps(series.hour().json())))):
        drawn = hour.drawn(START + 2 * STEP - 1)
        first = drawn["at"].index(START)

        assert counted(drawn, "decisions", "forwarded", first) == 1
        assert counted(drawn, "refusals", "stale-generation", first) == 1
        assert drawn["batches"]["largest"][first] == 4
        assert counted(drawn, "decisions", "forwarded", first + 1) == 1
        assert counted(drawn, "decisions", "refused", first + 1) == 0


def counted(drawn: dict[str, Any], kind: str, outcome: str, i: int) -> int:
    """How many ``outcome`` bucket ``i`` holds: its rate times the seconds seen."""
    return round(drawn[kind][outcome][i] * drawn["seen"][i])


def timed(hour: Hour, part: str) -> list[float]:
    """Each time recorded of ``part`` as its bin's upper bound, the longest last."""
    return sorted(
        BOUNDS[min(i, len(BOUNDS) - 1)]
        for bucket in hour.buckets
        for i, n in enumerate(getattr(bucket, part))
        for _ in range(n)
    )


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
async def test_a_fenced_writes_time_is_drawn_with_its_store_and_upstream_parts(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, store_url: str
) -> None:
    """Through a real proxy on a real store: a write the upstream takes 0.2 s to
    answer has an upstream part of 0.2 s; a write whose answer waits 1 s to be kept
    under its key (another connection holds the keys meanwhile) has a store part of
    1 s; each one's time through the proxy takes in its part; a refused write has
    a store part and no upstream part. (Each part is read to within a bin, 26%, and
    what the machine adds: the proxy runs in the test's process.)"""
    proxy = await start_proxy()
    upstream.latency = lambda: 0.2
    assert (await fenced(proxy, "j", 1, key="k-1")).status == 200
    upstream.latency = None
    releases: set[asyncio.Task[None]] = set()
    # Connected before the write: a connection's start is not the upstream's time.
    conn = await asyncpg.connect(store_url)
    upstream.respond = holding(conn, 1.0, releases)
    assert (await fenced(proxy, "j", 1, key="k-2")).status == 200
    assert (await fenced(proxy, "j", 0)).status == 409
    await asyncio.gather(*releases)
    hour = proxy_of(proxy).metrics.series.hour()
    ups, store, total = (timed(hour, part) for part in ("upstream", "store", "total"))
    assert len(ups) == 2  # the refused one never went
    assert 0.2 <= ups[-1] < 1.0
    assert len(store) == 3
    assert store[-1] >= 1.0 > store[-2]
    assert len(total) == 3
    assert total[-2] >= 0.2
    assert total[-1] >= 1.0


def holding(
    conn: asyncpg.Connection, seconds: float, releases: set[asyncio.Task[None]]
) -> Responder:
    """An answer given at once, after locking the idempotency keys of the PostgreSQL
    database ``conn`` is open on against writes for ``seconds`` (the task that lets
    go, and closes ``conn``, goes in ``releases``): the proxy's store waits that long
    to keep the answer."""

    async def respond(request: web.Request, received: Received) -> web.StreamResponse:
        held = conn.transaction()
        await held.start()
        await conn.execute("LOCK TABLE idempotency_keys IN EXCLUSIVE MODE")

        async def release() -> None:
            await asyncio.sleep(seconds)
            await held.commit()
            await conn.close()

        releases.add(asyncio.create_task(release()))
        return web.json_response({"applied": True})

    return respond
