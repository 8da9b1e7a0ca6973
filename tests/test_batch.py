"""The queue both stores batch their operations in, with a runner of the test's own:
whatever stops the runner, no caller waits for ever, and none is answered twice."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from fenceproxy.errors import StoreError
from fenceproxy.store.batch import Batches


class Runner:
    """Runs each batch as its operations say: ``"wait"`` holds the batch until
    ``go`` is set, ``"fail"`` raises; every other operation's outcome is itself."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.running = asyncio.Event()
        self.go = asyncio.Event()

    async def __call__(self, ops: list[str]) -> list[Any]:
        self.batches.append(ops)
        if "wait" in ops:
            self.running.set()
            await self.go.wait()
        if "fail" in ops:
            raise RuntimeError("a bug in the runner")
        return list(ops)


async def answered(futures: list[asyncio.Future[Any]]) -> list[Any]:
    """What each caller got, within 5 s: its outcome or its exception."""
    async with asyncio.timeout(5):
        return await asyncio.gather(*futures, return_exceptions=True)


async def test_callers_of_a_batch_are_answered_in_order_and_one_gone_is_passed_over() -> None:
    """Operations that come while a batch runs go together into the next; each caller
    gets its own outcome, and one whose caller left meanwhile is not answered."""
    runner = Runner()
    batches: Batches[str] = Batches(runner, name="test")
    first = batches.submit("wait")
    await asyncio.wait_for(runner.running.wait(), 5)
    left, stays = batches.submit("a"), batches.submit("b")
    left.cancel()
    runner.go.set()
    assert await answered([first, stays]) == ["wait", "b"]
    assert left.cancelled()
    assert runner.batches == [["wait"], ["a", "b"]]
    await batches.close()


async def test_a_runner_that_fails_fails_every_caller_waiting_at_once() -> None:
    """The runner raises in the middle of a batch, with callers queued behind it and one
    of the batch's callers gone: each of the others gets StoreError at once, none
    waits for ever; a caller already answered keeps its answer; the queue then
    refuses new work at once."""
    runner = Runner()
    batches: Batches[str] = Batches(runner, name="test")
    done = batches.submit("a")
    assert await answered([done]) == ["a"]
    gone, failing = batches.submit("wait"), batches.submit("fail")
    await asyncio.wait_for(runner.running.wait(), 5)
    queued = batches.submit("c")
    gone.cancel()
    runner.go.set()
    outcomes = await answered([failing, queued])
    assert all(isinstance(o, StoreError) for o in outcomes), outcomes
    assert (done.result(), gone.cancelled()) == ("a", True)
    assert batches.stopped
    with pytest.raises(StoreError):
        batches.submit("d")
    with contextlib.suppress(RuntimeError):  # the runner's failure, seen
        await batches.cancel()


async def test_a_runner_cancelled_fails_every_caller_waiting_at_once() -> None:
    """The event loop shuts down under the store: the batch running and every caller
    queued behind it get StoreError at once."""
    runner = Runner()
    batches: Batches[str] = Batches(runner, name="test")
    running = batches.submit("wait")
    await asyncio.wait_for(runner.running.wait(), 5)
    queued = [batches.submit("b"), batches.submit("c")]
    await batches.cancel()
    outcomes = await answered([running, *queued])
    assert all(isinstance(o, StoreError) for o in outcomes), outcomes
    with pytest.raises(StoreError):
        batches.submit("d")
