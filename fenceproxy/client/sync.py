"""The synchronous lease client, on httpx, for workers without an event loop (Celery,
RQ, Dramatiq, cron scripts, Django commands):

    leases = SyncLeaseClient("http://127.0.0.1:8080")
    with leases.hold("invoice-42", owner="worker-a", ttl=30, wait=60) as lease:
        for step in steps:
            lease.check()  # LeaseLost once the lease is gone: stop producing effects
            answer = lease.request(http, "POST", url, json=step)  # headers added
            answer.raise_for_status()
        lease.complete()

A thread renews the lease in the background. A thread cannot interrupt the
worker's code, so the worker asks: :meth:`SyncHeldLease.check`,
:meth:`~SyncHeldLease.headers` and :meth:`~SyncHeldLease.request` raise LeaseLost
once a renewal was refused or the local deadline passed without one. The steps are
:mod:`fenceproxy.client.flow`'s and the rules :mod:`fenceproxy.client.core`'s, shared
with the async client; this module does their I/O in the calling thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal

import httpx

from ..errors import InvariantError
from .adapter import send
from .base import Held, LeaseAPI
from .core import Call, Grant, Holding
from .flow import Flow, Record, Reply, Write, run

__all__ = ["SyncHeldLease", "SyncLeaseClient"]


class SyncLeaseClient(
    LeaseAPI[httpx.Client, Callable[[float], None], "SyncHeldLease", Grant, Record]
):
    """A client of the lease API at ``url`` (the proxy's address), without asyncio.
    Usable as a context manager (it closes its connections on exit) or as is."""

    def close(self) -> None:
        if self._own_http and self._http is not None:
            self._http.close()

    def __enter__(self) -> SyncLeaseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, call: Call) -> Reply:
        if self._http is None:
            raise InvariantError("made with the client")
        return send(self._http, call, self.endpoint.base)

    def _new_http(self) -> httpx.Client:
        return httpx.Client()

    def _default_sleep(self) -> Callable[[float], None]:
        return time.sleep

    def _held(self, holding: Holding, wait: float) -> SyncHeldLease:
        return SyncHeldLease(self, holding, wait)

    def _grant(self, flow: Flow[Grant]) -> Grant:
        return run(flow, _Blocking(self))

    def _record(self, flow: Flow[Record]) -> Record:
        return run(flow, _Blocking(self))


class SyncHeldLease(Held[SyncLeaseClient]):
    """A lease kept alive by a background thread for the duration of ``with``.

    Ask :meth:`check` (or :attr:`lost`) between steps; :meth:`headers` and
    :meth:`request` raise LeaseLost too. Leaving the block without completing
    releases the lease; leaving it normally after the lease was lost raises
    LeaseLost, so the loss is never silent.
    """

    def __init__(self, client: SyncLeaseClient, holding: Holding, wait: float) -> None:
        super().__init__(client, holding, wait)
        self._io = _HeldIO(self)
        self._renewer: _Renewer | None = None

    def request(self, http: Any, method: str, url: str, **kwargs: Any) -> Any:
        """Send a write under this lease with ``http`` (an ``httpx.Client`` or a
        ``requests.Session``), its fencing headers added. A refusal that says
        nothing was applied is sent again after its ``Retry-After`` while the lease
        lasts (keep an ``Idempotency-Key`` in ``headers``); any other answer is
        returned as it is: check its status."""
        return run(self._flows.write(self._holding, http, method, url, kwargs), self._io)

    def complete(self) -> None:
        """Complete the job; LeaseLost if the service refuses, LeaseServiceError if it
        cannot be reached (calling again is safe)."""
        run(self._flows.end(self._holding, "complete"), self._io)

    def release(self) -> None:
        """Give the job up for another worker to claim."""
        run(self._flows.end(self._holding, "release"), self._io)

    def __enter__(self) -> SyncHeldLease:
        run(self._flows.enter(self._holding, self._wait), self._io)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        run(self._flows.leave(self._holding, exc), self._io)
        return False

    def _start_renewing(self) -> None:
        self._renewer = _Renewer(self._client, self._holding)

    def _stop_renewing(self) -> bool:
        """Stop the renewer; whether it stopped before the local deadline."""
        renewer, self._renewer = self._renewer, None
        return renewer is None or renewer.stop(self._holding.left())


class _Blocking:
    """The ops of a client's flows, done in the calling thread."""

    def __init__(self, client: SyncLeaseClient) -> None:
        self.client = client

    def send(self, call: Call) -> Reply:
        return self.client._send(call)

    def sleep(self, seconds: float) -> None:
        self.client.sleep(seconds)


class _HeldIO(_Blocking):
    """... and of a held lease's: the worker's writes, the renewer thread paused
    (stopped, once a renewal on the wire is answered) and resumed."""

    def __init__(self, lease: SyncHeldLease) -> None:
        super().__init__(lease._client)
        self.lease = lease

    @staticmethod
    def write(write: Write) -> Any:
        return write.http.request(write.method, write.url, **write.kwargs)

    def pause(self) -> bool:
        return self.lease._stop_renewing()

    def resume(self) -> None:
        self.lease._start_renewing()


class _Stopped(BaseException):
    """Thrown into a renewer's flow when it is stopped, as a task is cancelled."""


class _Renewer:
    """The thread that renews a lease, doing the ops of its flow: its waits end the
    moment it is stopped, and its calls are made one at a time, so that stopping it
    can wait for the one on the wire."""

    def __init__(self, client: SyncLeaseClient, holding: Holding) -> None:
        self._client = client
        self._holding = holding
        self._stopped = threading.Event()
        self._on_the_wire = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name=f"fenceproxy-renew-{holding.job_id}", daemon=True
        )
        self._thread.start()

    def send(self, call: Call) -> Reply:
        with self._on_the_wire:
            if self._stopped.is_set():
                raise _Stopped
            return self._client._send(call)

    def sleep(self, seconds: float) -> None:
        if self._stopped.wait(seconds):
            raise _Stopped

    def stop(self, left: float) -> bool:
        """Stop renewing, once a renewal on the wire is answered, waiting for it at
        most ``left`` seconds (the lease's); whether it was answered by then."""
        self._stopped.set()
        if not self._on_the_wire.acquire(timeout=max(0.0, left)):
            return False
        self._on_the_wire.release()
        self._thread.join()
        return True

    def _run(self) -> None:
        try:
            why = run(self._client.flows.keep_alive(self._holding), self)
        except _Stopped:
            return
        self._holding.lose(why)
