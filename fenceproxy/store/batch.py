"""Operations that arrive together, run together: one transaction, one commit.

Both backends group their writes this way. While a batch runs, the operations
that arrive wait; when it ends, all of them go into the next batch. Under load a
commit (and its fsync, and on PostgreSQL its round trips) is shared by every
write that came meanwhile; without load a batch holds one operation and costs what
it would alone. An operation's caller resumes only once its batch has committed,
or failed: a batch is undone as a whole, and every caller in it is told.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from ..errors import StoreError

__all__ = ["Batches"]

Op = TypeVar("Op")
Outcome = Any
"""What one operation of a batch came to: its result, or the exception its caller gets."""


class Batches(Generic[Op]):
    """A queue of operations, run one batch at a time by ``run``, which returns one
    outcome per operation, in order (an exception instance is raised to its caller)."""

    def __init__(self, run: Callable[[list[Op]], Awaitable[list[Outcome]]], *, name: str) -> None:
        # Looked up once: asyncio.get_running_loop() is a getpid() system call each time.
        self._loop = asyncio.get_running_loop()
        self._run = run
        self._pending: list[tuple[Op, asyncio.Future[Any]]] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._runner = self._loop.create_task(self._drain(), name=name)

    def submit(self, op: Op) -> asyncio.Future[Any]:
        """Queue ``op`` for the next batch; its outcome, once the batch is over.
        StoreError at once when the queue is closed or its runner stopped."""
        if self._closing or self._runner.done():
            raise StoreError("the store is closed")
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending.append((op, future))
        self._wake.set()
        return future

    @property
    def stopped(self) -> bool:
        return self._runner.done()

    async def close(self) -> None:
        """Run what is queued, then stop."""
        self._closing = True
        self._wake.set()
        if not self._runner.done():  # one that stopped already has nothing to finish
            await self._runner

    async def cancel(self) -> None:
        """Stop at once (as when the event loop shuts down under it): what is queued fails."""
        self._runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._runner

    async def _drain(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._pending:
                    batch, self._pending = self._pending, []
                    try:
                        outcomes = await self._run([op for op, _ in batch])
                    except BaseException:
                        self._pending = batch + self._pending  # failed below, with the rest
                        raise
                    for (_, future), outcome in zip(batch, outcomes, strict=True):
                        if future.done():
                            continue
                        if isinstance(outcome, BaseException):
                            future.set_exception(outcome)
                        else:
                            future.set_result(outcome)
                if self._closing:
                    return
        finally:
            # Whatever stopped the runner, nobody waits on it for ever.
            for _, future in self._pending:
                if not future.done():
                    future.set_exception(StoreError("the store's writer stopped"))
            self._pending = []
