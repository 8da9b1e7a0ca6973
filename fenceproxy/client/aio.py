"""The async lease client, on httpx. In a coroutine:

    async with LeaseClient("http://127.0.0.1:8080") as leases:
        async with leases.hold("invoice-42", owner="worker-a", ttl=30) as lease:
            answer = await http.post(url, json=..., headers=lease.headers())
            answer.raise_for_status()  # a refused write is no success
            await lease.complete()

``hold`` claims the job (waiting up to ``wait`` seconds while another worker holds
it), renews in a background task (every ttl/3 by default), and when a renewal is
refused, or no renewal is confirmed before the lease's *local deadline*, cancels the
body of the ``async with`` and raises :class:`LeaseLost`. The steps are
:mod:`fenceproxy.client.flow`'s and the rules :mod:`fenceproxy.client.core`'s, shared
with the synchronous client; this module does their I/O in a coroutine.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

import httpx

from ..errors import InvariantError, LeaseLost
from .adapter import send_async
from .base import Held, LeaseAPI
from .core import Call, Grant, Holding
from .flow import Flow, Record, Reply, Write, run_async

__all__ = ["HeldLease", "LeaseClient"]

Sleep = Callable[[float], Awaitable[None]]
C = TypeVar("C", bound=type)


def _coroutine_functions(*names: str) -> Callable[[C], C]:
    """Make the named methods (inherited, each returning a coroutine) ``async def``
    of the class, so that ``inspect.iscoroutinefunction`` tells them for what they
    are, as mocks (``create_autospec``) and frameworks ask."""

    def make(cls: C) -> C:
        for name in names:
            setattr(cls, name, _coroutine_function(getattr(cls, name)))
        return cls

    return make


def _coroutine_function(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(method)
    async def coroutine_function(*args: Any, **kwargs: Any) -> Any:
        return await method(*args, **kwargs)

    return coroutine_function


@_coroutine_functions("claim", "renew", "complete", "release", "show", "claim_waiting")
class LeaseClient(
    LeaseAPI[
        httpx.AsyncClient,
        Sleep,
        "HeldLease",
        Coroutine[Any, Any, Grant],
        Coroutine[Any, Any, Record],
    ]
):
    """A client of the lease API at ``url`` (the proxy's address), in a coroutine:
    in ``async with``, which opens and closes its httpx client, or with yours
    (``http``). Its calls are coroutines."""

    async def __aenter__(self) -> LeaseClient:
        if self._http is None:
            self._http = httpx.AsyncClient()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._own_http and self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _send(self, call: Call) -> Reply:
        if self._http is None:
            raise RuntimeError("use LeaseClient in 'async with', or pass it an httpx client")
        return await send_async(self._http, call, self.endpoint.base)

    def _new_http(self) -> None:
        return None  # opened by 'async with'

    def _default_sleep(self) -> Sleep:
        return asyncio.sleep

    def _held(self, holding: Holding, wait: float) -> HeldLease:
        return HeldLease(self, holding, wait)

    def _grant(self, flow: Flow[Grant]) -> Coroutine[Any, Any, Grant]:
        return run_async(flow, _Awaiting(self))

    def _record(self, flow: Flow[Record]) -> Coroutine[Any, Any, Record]:
        return run_async(flow, _Awaiting(self))


class HeldLease(Held[LeaseClient]):
    """A lease kept alive in the background for the duration of ``async with``.

    Use :meth:`headers` on every fenced write (or :meth:`request`), and
    :meth:`complete` when done. Leaving the block without completing releases the
    lease. When the lease is lost, the body is cancelled and LeaseLost raised.
    """

    def __init__(self, client: LeaseClient, holding: Holding, wait: float) -> None:
        super().__init__(client, holding, wait)
        self._io = _HeldIO(self)
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._cancelled = False
        self._renewer: asyncio.Task[None] | None = None

    async def request(
        self, http: httpx.AsyncClient, method: str, url: str, **kwargs: Any
    ) -> httpx.Response:
        """Send a write under this lease with ``http``, its fencing headers added
        (keep an ``Idempotency-Key`` in ``kwargs["headers"]`` for retries to be
        safe). A refusal that says nothing was applied (see
        :data:`~fenceproxy.client.core.SAFE_TO_RETRY`) is sent again after its
        ``Retry-After`` while the lease lasts; any other answer is returned as it
        is: check its status."""
        flow = self._flows.write(self._holding, http, method, url, kwargs)
        answer: httpx.Response = await run_async(flow, self._io)
        return answer

    async def complete(self) -> None:
        """Complete the job. Raises LeaseLost if the service refuses (the lease was
        taken over or expired); LeaseServiceError if it cannot be reached, in which
        case calling again is safe."""
        await run_async(self._flows.end(self._holding, "complete"), self._io)

    async def release(self) -> None:
        """Give the job up for another worker to claim."""
        await run_async(self._flows.end(self._holding, "release"), self._io)

    # -- the context manager ----------------------------------------------------

    async def __aenter__(self) -> HeldLease:
        self._task = asyncio.current_task()
        if self._task is None:
            raise InvariantError("hold() needs a running task")
        self._cancelling = self._task.cancelling()
        await run_async(self._flows.enter(self._holding, self._wait), self._io)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        try:
            await run_async(self._flows.leave(self._holding, exc), self._io)
        finally:
            ours = self._take_back_cancel()
        if ours and exc_type is asyncio.CancelledError:
            raise LeaseLost(self._holding.lost_why or "lease lost") from None
        return False

    # -- internals ----------------------------------------------------------------

    def _take_back_cancel(self) -> bool:
        """As asyncio.timeout does: take back the one cancel injected on a loss;
        whether no other cancel is pending, so that a CancelledError is ours to
        turn into LeaseLost."""
        if not self._cancelled:
            return False
        assert self._task is not None
        self._cancelled = False
        return self._task.uncancel() <= self._cancelling

    def _start_renewing(self) -> None:
        self._renewer = asyncio.create_task(
            self._keep_alive(), name=f"fenceproxy-renew-{self.job_id}"
        )

    async def _stop_renewing(self) -> None:
        """Stop the renewer and wait for it, without swallowing a cancellation aimed
        at the caller."""
        renewer, self._renewer = self._renewer, None
        if renewer is not None and renewer is not asyncio.current_task():
            renewer.cancel()
            await asyncio.wait({renewer})

    async def _keep_alive(self) -> None:
        why = await run_async(self._flows.keep_alive(self._holding), _Awaiting(self._client))
        if not self._holding.lose(why):
            return
        task = self._task
        if task is not None and not task.done() and not self._cancelled:
            self._cancelled = True
            task.cancel(msg=f"lease lost: {why}")


class _Awaiting:
    """The ops of a client's flows, done in a coroutine."""

    def __init__(self, client: LeaseClient) -> None:
        self.client = client

    async def send(self, call: Call) -> Reply:
        return await self.client._send(call)

    async def sleep(self, seconds: float) -> None:
        await self.client.sleep(seconds)


class _HeldIO(_Awaiting):
    """... and of a held lease's: the worker's writes, the renewer task paused
    (cancelled, at once) and resumed."""

    def __init__(self, lease: HeldLease) -> None:
        super().__init__(lease._client)
        self.lease = lease

    async def write(self, write: Write) -> httpx.Response:
        answer: httpx.Response = await write.http.request(write.method, write.url, **write.kwargs)
        return answer

    async def pause(self) -> bool:
        await self.lease._stop_renewing()
        return True

    async def resume(self) -> None:
        self.lease._start_renewing()
