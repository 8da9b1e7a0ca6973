"""Wake-ups for claims waiting for a job, in this process.

A claim that may wait (the lease API's ``wait``) is held while the job is held or
has a write in flight, and asks again when something it waits for may have
changed: the holder released or completed the job, or one of the job's in-flight
records was cleared. The store that commits such a change wakes the job's watchers
(:meth:`JobWakes.wake`); on PostgreSQL a release or completion on another proxy
reaches this one by LISTEN/NOTIFY. A wake says only "ask again": the claim is
decided by the store, as every claim is, so a wake too many costs one claim and a
wake lost costs the time until the watcher's own timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

__all__ = ["JobWakes"]


class JobWakes:
    """The futures of the claims watching each job, set when the job may have changed."""

    __slots__ = ("_closed", "_watching", "first_watch")

    def __init__(self) -> None:
        self._watching: dict[str, set[asyncio.Future[None]]] = {}
        self._closed = False
        self.first_watch: Callable[[], object] | None = None
        """Called once, at the first watch: a backend that hears of other processes'
        changes starts listening then, not before anyone waits."""

    @property
    def closed(self) -> bool:
        """Whether the store is closing: every watch ends at once."""
        return self._closed

    @contextlib.contextmanager
    def watch(self, job: str) -> Iterator[asyncio.Future[None]]:
        """A future set at the job's next wake (or once closed), for as long as the
        block runs. Watch before reading what is waited for: a change committed in
        between is then not missed."""
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._closed:
            woken.set_result(None)
        if (start := self.first_watch) is not None and not self._closed:
            self.first_watch = None
            start()
        watchers = self._watching.setdefault(job, set())
        watchers.add(woken)
        try:
            yield woken
        finally:
            watchers.discard(woken)
            if not watchers and self._watching.get(job) is watchers:
                del self._watching[job]

    def watched(self, job: str) -> bool:
        """Whether a claim watches ``job`` now."""
        return job in self._watching

    def wake(self, job: str) -> None:
        """Wake whoever watches ``job``; nothing when nobody does."""
        for woken in self._watching.get(job, ()):
            if not woken.done():
                woken.set_result(None)

    def wake_all(self) -> None:
        """Wake every watcher (after a notification may have been missed)."""
        for job in list(self._watching):
            self.wake(job)

    def close(self) -> None:
        """End every watch now and later: the store is closing."""
        self._closed = True
        self.wake_all()
