"""The async lease client, on httpx. In a coroutine:

    async with LeaseClient("http://127.0.0.1:8080") as leases:
        async with leases.hold("invoice-42", owner="worker-a", ttl=30) as lease:
            answer = await http.post(url, json=..., headers=lease.headers())
            answer.raise_for_status()  # a refused write is no success
            await lease.complete()

``hold`` claims the job (waiting up to ``wait`` seconds while another worker holds
it), renews in the background (every ttl/3 by default), and when a renewal is
refused, or no renewal is confirmed before the lease's *local deadline*, cancels the
body of the ``async with`` and raises :class:`LeaseLost`. The rules are
:mod:`fenceproxy.client.core`'s, shared with the synchronous client.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import httpx

from ..errors import LeaseLost, LeaseRefused, LeaseServiceError
from ..log import lease_log
from .core import EXPIRED, Endpoint, Grant, Holding, Patience, holder, late, retry_after

__all__ = ["HeldLease", "LeaseClient"]

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


class LeaseClient:
    """A client of the lease API at ``url`` (the proxy's address), in a coroutine."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "/_leases",
        token: str | None = None,
        http: httpx.AsyncClient | None = None,
        margin: float = 0.1,
        request_timeout: float = 10.0,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        """``margin`` is the share of the ttl held back from the local deadline;
        ``token`` is the lease API credential, if it takes credentials; ``http`` an
        httpx client of yours to send with (by default one of its own)."""
        self.endpoint = Endpoint(url, prefix, token, margin, request_timeout)
        self._http = http
        self._own_http = http is None
        self.clock = clock
        self.sleep = sleep

    @property
    def margin(self) -> float:
        return self.endpoint.margin

    @property
    def request_timeout(self) -> float:
        return self.endpoint.request_timeout

    async def __aenter__(self) -> LeaseClient:
        if self._http is None:
            self._http = httpx.AsyncClient()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._own_http and self._http is not None:
            await self._http.aclose()
            self._http = None

    # -- one call each ----------------------------------------------------------

    async def claim(self, job: str, owner: str | None, ttl: float | None = None) -> Grant:
        """Claim ``job``. Raises LeaseRefused (held, completed), LeaseServiceError,
        or LeaseLost when the grant arrives after its own local deadline. ``owner``
        may be None with a credential: the lease is then owned by its name."""
        body = holder(owner)
        if ttl is not None:
            body["ttl"] = ttl
        return await self._grant(job, "claim", body, None)

    async def renew(
        self,
        job: str,
        owner: str | None,
        generation: int,
        ttl: float | None = None,
        *,
        within: float | None = None,
        not_after: float | None = None,
    ) -> Grant:
        """Extend the lease; ``within`` bounds the request (by default the client's
        request timeout); a reply after ``not_after`` raises LeaseLost."""
        body = holder(owner, generation)
        if ttl is not None:
            body["ttl"] = ttl
        return await self._grant(job, "renew", body, within, not_after)

    async def complete(self, job: str, owner: str | None, generation: int) -> dict[str, Any]:
        """Mark the job done. Safe to retry: a repeat by the same holder answers the same."""
        return await self._call("POST", job, "complete", holder(owner, generation))

    async def release(
        self, job: str, owner: str | None, generation: int, *, within: float | None = None
    ) -> dict[str, Any]:
        return await self._call("POST", job, "release", holder(owner, generation), within)

    async def show(self, job: str) -> dict[str, Any]:
        return await self._call("GET", job, None, None)

    def hold(
        self,
        job: str,
        *,
        owner: str | None = None,
        ttl: float | None = None,
        renew_every: float | None = None,
        wait: float = 0.0,
    ) -> HeldLease:
        """Claim ``job`` and keep it for the duration of an ``async with`` block,
        renewing every ``renew_every`` seconds (ttl/3 by default). While another
        worker holds the job, wait up to ``wait`` seconds for it
        (:class:`~fenceproxy.client.core.Patience`)."""
        holding = Holding(job, owner, ttl, renew_every, self.margin, self.clock)
        return HeldLease(self, holding, wait)

    async def claim_waiting(self, holding: Holding, wait: float) -> Grant:
        """Claim, waiting up to ``wait`` seconds while another worker holds the job."""
        patience = Patience(wait, self.clock)
        while True:
            try:
                return await self.claim(holding.job_id, holding.owner, holding.ttl)
            except LeaseRefused as refused:
                delay = patience.next(refused)
                if delay is None:
                    raise
                lease_log.info("job %r is held; claiming again in %.3fs", holding.job_id, delay)
                await self.sleep(delay)

    # -- plumbing ---------------------------------------------------------------

    async def _grant(
        self,
        job: str,
        action: str,
        body: dict[str, Any],
        within: float | None,
        not_after: float | None = None,
    ) -> Grant:
        """Send a claim or renewal; the grant, with its local deadline (see
        :func:`~fenceproxy.client.core.late`)."""
        sent = self.clock()
        grant = self.endpoint.grant(
            action, await self._call("POST", job, action, body, within), sent
        )
        lost = late(action, grant, self.clock(), not_after)
        if lost is not None:
            if action == "claim":  # the store thinks we hold it: give it back
                with contextlib.suppress(Exception):
                    within = self.endpoint.give_back_within
                    await self.release(job, body.get("owner"), grant.generation, within=within)
            raise lost
        return grant

    async def _call(
        self,
        method: str,
        job: str,
        action: str | None,
        body: dict[str, Any] | None,
        within: float | None = None,
    ) -> dict[str, Any]:
        if self._http is None:
            raise RuntimeError("use LeaseClient in 'async with', or pass it an httpx client")
        call = self.endpoint.call(method, job, action, body, within)
        try:
            # asyncio's own timeout over the whole exchange; httpx's bounds each read.
            async with asyncio.timeout(call.timeout):
                answer = await self._http.request(
                    call.method,
                    call.url,
                    json=call.body,
                    headers=call.headers,
                    timeout=httpx.Timeout(call.timeout),
                )
        except (httpx.HTTPError, TimeoutError) as exc:
            raise LeaseServiceError(
                f"lease service at {self.endpoint.base}: {type(exc).__name__}: {exc}"
            ) from exc
        return self.endpoint.read(answer.status_code, answer.content)


class HeldLease:
    """A lease kept alive in the background for the duration of ``async with``.

    Use :meth:`headers` on every fenced write (or :meth:`request`), and
    :meth:`complete` when done. Leaving the block without completing releases the
    lease. When the lease is lost, the body is cancelled and LeaseLost raised.
    """

    def __init__(self, client: LeaseClient, holding: Holding, wait: float) -> None:
        self._client = client
        self._holding = holding
        self._wait = wait
        self.job_id = holding.job_id
        self.owner = holding.owner
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._cancelled = False
        self._renewer: asyncio.Task[None] | None = None

    # -- what the worker uses ---------------------------------------------------

    @property
    def generation(self) -> int:
        return self._holding.granted().generation

    @property
    def token(self) -> str:
        return self._holding.granted().token

    @property
    def deadline(self) -> float:
        """The local deadline, on the client's monotonic clock."""
        return self._holding.granted().deadline

    @property
    def lost(self) -> bool:
        return self._holding.lost

    def check(self) -> None:
        """Raise LeaseLost once the lease is lost, ended or past its local deadline."""
        self._holding.check()

    def headers(self) -> dict[str, str]:
        """The fencing headers for a write under this lease.

        Raises LeaseLost once the lease is lost, ended, or past its local deadline.
        """
        return self._holding.headers()

    async def request(
        self, http: httpx.AsyncClient, method: str, url: str, **kwargs: Any
    ) -> httpx.Response:
        """Send a write under this lease with ``http``, its fencing headers added
        (keep an ``Idempotency-Key`` in ``kwargs["headers"]`` for retries to be
        safe). A refusal that says nothing was applied (see
        :data:`~fenceproxy.client.core.SAFE_TO_RETRY`) is sent again after its
        ``Retry-After`` while the lease lasts; any other answer is returned as it
        is: check its status."""
        extra = dict(kwargs.pop("headers", None) or {})
        attempt = 0
        while True:
            answer = await http.request(method, url, headers={**extra, **self.headers()}, **kwargs)
            delay = retry_after(
                answer.status_code, answer.headers, answer.content, self._holding.left(), attempt
            )
            if delay is None:
                return answer
            await self._client.sleep(delay)
            attempt += 1

    async def complete(self) -> None:
        """Complete the job. Raises LeaseLost if the service refuses (the lease was
        taken over or expired); LeaseServiceError if it cannot be reached, in which
        case calling again is safe."""
        await self._end(self._client.complete)

    async def release(self) -> None:
        """Give the job up for another worker to claim."""
        await self._end(self._client.release)

    # -- the context manager ----------------------------------------------------

    async def __aenter__(self) -> HeldLease:
        self._task = asyncio.current_task()
        assert self._task is not None, "hold() needs a running task"
        self._cancelling = self._task.cancelling()
        self._holding.taken(await self._client.claim_waiting(self._holding, self._wait))
        self._start_renewing()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        await self._stop_renewing()
        holding = self._holding
        holding.leaving()
        if self._cancelled:
            # As asyncio.timeout does: take back the one cancel we injected; only if
            # no other cancel is pending is the CancelledError ours to convert.
            assert self._task is not None
            self._cancelled = False
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise LeaseLost(holding.lost_why or "lease lost") from None
        if holding.lost_why is not None:
            if exc_type is None:
                raise LeaseLost(holding.lost_why)
            if issubclass(exc_type, asyncio.CancelledError | LeaseLost):
                return False
            raise LeaseLost(holding.lost_why) from exc
        if not holding.ended:
            # The body left without completing: let another worker have the job now,
            # if the lease is still ours to give, and without outliving it.
            left = holding.left()
            if left > 0:
                with contextlib.suppress(LeaseRefused, LeaseServiceError):
                    await self._client.release(
                        self.job_id, self.owner, self.generation, within=left
                    )
            holding.ended = True
        return False

    # -- internals ----------------------------------------------------------------

    async def _end(self, call: Callable[..., Awaitable[dict[str, Any]]]) -> None:
        holding = self._holding
        if holding.lost_why is not None:
            raise LeaseLost(holding.lost_why)
        # No renewal may race the completion: it would be refused as completed.
        await self._stop_renewing()
        try:
            await call(self.job_id, self.owner, self.generation)
        except LeaseRefused as exc:
            self._lose(f"the lease service refused: {exc}", cancel=False)
            raise LeaseLost(holding.lost_why or str(exc)) from exc
        except BaseException:
            if not holding.lost:
                self._start_renewing()  # not ended: keep the lease while the caller decides
            raise
        holding.ended = True

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

    def _lose(self, why: str, *, cancel: bool = True) -> None:
        if not self._holding.lose(why):
            return
        if cancel and self._task is not None and not self._task.done() and not self._cancelled:
            self._cancelled = True
            self._task.cancel(msg=f"lease lost: {why}")

    async def _keep_alive(self) -> None:
        try:
            await self._renew_until_lost()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a renewer that dies must not leave the body running
            self._lose(f"the renewer failed: {exc!r}")

    async def _renew_until_lost(self) -> None:
        client, holding = self._client, self._holding
        while True:
            wait = holding.due()
            if wait is None:
                self._lose(EXPIRED)
                return
            if wait > 0:
                await client.sleep(wait)
                continue
            grant = holding.granted()
            try:
                renewed = await client.renew(
                    self.job_id,
                    self.owner,
                    grant.generation,
                    holding.ttl,
                    within=holding.within(client.request_timeout),
                    not_after=grant.deadline,
                )
            except (LeaseRefused, LeaseLost, LeaseServiceError) as exc:
                why = holding.renewal_failed(exc)
                if why is not None:
                    self._lose(why)
                    return
                continue
            holding.taken(renewed)
