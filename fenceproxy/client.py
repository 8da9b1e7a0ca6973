"""The Python lease client. In a coroutine, with an aiohttp ``session``:

    async with LeaseClient("http://127.0.0.1:8080") as leases:
        async with leases.hold("invoice-42", owner="worker-a", ttl=30) as lease:
            await session.post(url, json=..., headers=lease.headers())
            await lease.complete()

``hold`` claims the job, renews in the background (every ttl/3 by default), and
when a renewal is refused, or no renewal is confirmed before the lease's *local
deadline*, cancels the body of the ``async with`` and raises :class:`LeaseLost`.

The local deadline is the client's monotonic clock read *before* the claim or
renewal was sent, plus the ttl, minus a safety margin (ttl/10 by default). The
wall clock is never read: a worker whose clock is hours off behaves exactly like
one whose clock is right, and a reply that arrives after the deadline counts as
lost. ``lease.headers()`` raises LeaseLost once the deadline has passed, so a
worker that was frozen past its lease cannot even build its next write.

When the lease API takes credentials, pass yours as ``token``
(``LeaseClient(url, token=os.environ["FENCEPROXY_LEASE_TOKEN"])``): it is sent as
``Authorization: Bearer``, and the leases you take are owned by its name, qualified
by ``owner``.

Failures, all under :class:`~fenceproxy.errors.LeaseError`: ``LeaseRefused`` (the
service said no, with its problem body), ``LeaseServiceError`` (it could not be
reached or answered oddly), ``LeaseLost``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aiohttp

from . import hdrs
from .errors import LeaseLost, LeaseRefused, LeaseServiceError
from .log import lease_log

__all__ = ["Grant", "HeldLease", "LeaseClient", "LeaseLost", "LeaseRefused", "LeaseServiceError"]

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Grant:
    """A claim or renewal the service granted, with its local deadline."""

    job_id: str
    owner: str
    generation: int
    token: str
    ttl: float
    deadline: float
    """On the client's monotonic clock: the lease is not to be trusted from then on."""
    record: dict[str, Any]


class LeaseClient:
    """A client of the lease API at ``url`` (the proxy's address)."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "/_leases",
        token: str | None = None,
        session: aiohttp.ClientSession | None = None,
        margin: float = 0.1,
        request_timeout: float = 10.0,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        """``margin`` is the share of the ttl held back from the local deadline;
        ``token`` is the lease API credential, if it takes credentials."""
        if not 0 <= margin < 1:
            raise ValueError("margin is a share of the ttl, from 0 up to (not including) 1")
        self._base = url.rstrip("/") + prefix
        self._auth = {} if token is None else {"Authorization": f"Bearer {token}"}
        self._session = session
        self._own_session = session is None
        self.margin = margin
        self.request_timeout = request_timeout
        self._timeout = request_timeout
        self.clock = clock
        self.sleep = sleep

    async def __aenter__(self) -> LeaseClient:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    # -- one call each ----------------------------------------------------------

    async def claim(self, job: str, owner: str | None, ttl: float | None = None) -> Grant:
        """Claim ``job``. Raises LeaseRefused (held, completed), LeaseServiceError,
        or LeaseLost when the grant arrives after its own local deadline. ``owner``
        may be None with a credential: the lease is then owned by its name."""
        body = _holder(owner)
        if ttl is not None:
            body["ttl"] = ttl
        return await self._grant(job, "claim", body, self._timeout)

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
        body = _holder(owner, generation)
        if ttl is not None:
            body["ttl"] = ttl
        return await self._grant(job, "renew", body, within or self._timeout, not_after)

    async def complete(self, job: str, owner: str | None, generation: int) -> dict[str, Any]:
        """Mark the job done. Safe to retry: a repeat by the same holder answers the same."""
        return await self._call("POST", job, "complete", _holder(owner, generation))

    async def release(
        self, job: str, owner: str | None, generation: int, *, within: float | None = None
    ) -> dict[str, Any]:
        return await self._call("POST", job, "release", _holder(owner, generation), within)

    async def show(self, job: str) -> dict[str, Any]:
        return await self._call("GET", job, None, None)

    def hold(
        self,
        job: str,
        *,
        owner: str,
        ttl: float | None = None,
        renew_every: float | None = None,
    ) -> HeldLease:
        """Claim ``job`` and keep it for the duration of an ``async with`` block,
        renewing every ``renew_every`` seconds (ttl/3 by default)."""
        if renew_every is not None and (
            renew_every <= 0 or (ttl is not None and renew_every >= ttl * (1 - self.margin))
        ):
            raise ValueError("renew_every must be above 0 and below the ttl minus the margin")
        return HeldLease(self, job, owner, ttl, renew_every)

    # -- plumbing ---------------------------------------------------------------

    async def _grant(
        self,
        job: str,
        action: str,
        body: dict[str, Any],
        within: float,
        not_after: float | None = None,
    ) -> Grant:
        """Send a claim or renewal; the grant, with its local deadline. A reply that
        arrives after that deadline, or after ``not_after`` (the deadline of the
        lease being renewed), raises LeaseLost."""
        sent = self.clock()  # before sending: the safe side of the server's clock
        record = await self._call("POST", job, action, body, within)
        try:
            ttl = float(record["ttl"])
            grant = Grant(
                job_id=str(record["job_id"]),
                owner=str(record["owner"]),
                generation=int(record["generation"]),
                token=str(record["token"]),
                ttl=ttl,
                deadline=sent + ttl * (1 - self.margin),
                record=record,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise LeaseServiceError(f"lease service answered {action} with {record!r}") from exc
        now = self.clock()
        if now >= grant.deadline or (not_after is not None and now >= not_after):
            if action == "claim":  # the store thinks we hold it: give it back
                with contextlib.suppress(Exception):
                    await self._call(
                        "POST", job, "release",
                        _holder(body.get("owner"), grant.generation),
                        min(self._timeout, 2.0),
                    )  # fmt: skip
            raise LeaseLost(f"the {action} of {job!r} was answered after its local deadline")
        return grant

    async def _call(
        self,
        method: str,
        job: str,
        action: str | None,
        body: dict[str, Any] | None,
        within: float | None = None,
    ) -> dict[str, Any]:
        if self._session is None:
            raise RuntimeError("use LeaseClient in 'async with', or pass it a session")
        url = f"{self._base}/{quote(job, safe='')}" + (f"/{action}" if action else "")
        try:
            # asyncio's own timeout: aiohttp's rounds long ones up to a whole second.
            async with asyncio.timeout(within or self._timeout):
                async with self._session.request(
                    method, url, json=body, headers=self._auth
                ) as response:
                    status = response.status
                    answer = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise LeaseServiceError(
                f"lease service at {self._base}: {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(answer, dict):
            raise LeaseServiceError(f"lease service answered {status} with {answer!r}")
        if status >= 400:
            raise LeaseRefused(status, answer)
        return answer


def _holder(owner: str | None, generation: int | None = None) -> dict[str, Any]:
    """A request body naming the holder: the owner (unless the credential names it)
    and the generation."""
    body: dict[str, Any] = {} if owner is None else {"owner": owner}
    if generation is not None:
        body["generation"] = generation
    return body


class HeldLease:
    """A lease kept alive in the background for the duration of ``async with``.

    Use :meth:`headers` on every fenced write, and :meth:`complete` when done.
    Leaving the block without completing releases the lease.
    """

    def __init__(
        self,
        client: LeaseClient,
        job: str,
        owner: str,
        ttl: float | None,
        renew_every: float | None,
    ) -> None:
        self._client = client
        self.job_id = job
        self.owner = owner
        self._ttl = ttl
        self._renew_every = renew_every
        self._grant: Grant | None = None
        self._lost: str | None = None
        self._ended = False
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._cancelled = False
        self._renewer: asyncio.Task[None] | None = None

    # -- what the worker uses ---------------------------------------------------

    @property
    def generation(self) -> int:
        return self._granted().generation

    @property
    def token(self) -> str:
        return self._granted().token

    @property
    def deadline(self) -> float:
        """The local deadline, on the client's monotonic clock."""
        return self._granted().deadline

    @property
    def lost(self) -> bool:
        return self._lost is not None or self._client.clock() >= self.deadline

    def headers(self) -> dict[str, str]:
        """The fencing headers for a write under this lease.

        Raises LeaseLost once the lease is lost, ended, or past its local deadline.
        """
        grant = self._granted()
        if self._lost is not None:
            raise LeaseLost(self._lost)
        if self._ended:
            raise LeaseLost(f"the lease of {self.job_id!r} was completed or released")
        if self._client.clock() >= grant.deadline:
            raise LeaseLost(f"the lease of {self.job_id!r} is past its local deadline")
        return {hdrs.DEFAULT_JOB: self.job_id, hdrs.DEFAULT_TOKEN: grant.token}

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
        self._grant = await self._client.claim(self.job_id, self.owner, self._ttl)
        self._start_renewing()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        await self._stop_renewing()
        if self._cancelled:
            # As asyncio.timeout does: take back the one cancel we injected; only if
            # no other cancel is pending is the CancelledError ours to convert.
            assert self._task is not None
            self._cancelled = False
            if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
                raise LeaseLost(self._lost or "lease lost") from None
        if self._lost is not None:
            if exc_type is None:
                raise LeaseLost(self._lost)
            if issubclass(exc_type, asyncio.CancelledError | LeaseLost):
                return False
            raise LeaseLost(self._lost) from exc
        if not self._ended:
            # The body left without completing: let another worker have the job now,
            # if the lease is still ours to give, and without outliving it.
            left = self.deadline - self._client.clock()
            if left > 0:
                with contextlib.suppress(LeaseRefused, LeaseServiceError):
                    await self._client.release(
                        self.job_id, self.owner, self.generation, within=left
                    )
            self._ended = True
        return False

    # -- internals ----------------------------------------------------------------

    def _granted(self) -> Grant:
        if self._grant is None:
            raise RuntimeError("the lease is held only inside 'async with hold(...)'")
        return self._grant

    async def _end(self, call: Callable[..., Awaitable[dict[str, Any]]]) -> None:
        if self._lost is not None:
            raise LeaseLost(self._lost)
        # No renewal may race the completion: it would be refused as completed.
        await self._stop_renewing()
        try:
            await call(self.job_id, self.owner, self.generation)
        except LeaseRefused as exc:
            self._lose(f"the lease service refused: {exc}", cancel=False)
            raise LeaseLost(self._lost or str(exc)) from exc
        except BaseException:
            if not self.lost:
                self._start_renewing()  # not ended: keep the lease while the caller decides
            raise
        self._ended = True

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
        if self._lost is not None:
            return
        self._lost = why
        lease_log.warning("lease of %r at generation %s lost: %s", self.job_id, self.token, why)
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
        client = self._client
        every = self._renew_every or self._granted().ttl / 3
        next_try = client.clock() + every
        while True:
            grant = self._granted()
            await client.sleep(max(0.0, min(next_try, grant.deadline) - client.clock()))
            now = client.clock()
            if now >= grant.deadline:
                self._lose("no renewal was confirmed before the local deadline")
                return
            if now < next_try:
                continue
            try:
                renewed = await client.renew(
                    self.job_id,
                    self.owner,
                    grant.generation,
                    self._ttl,
                    within=min(client.request_timeout, grant.deadline - now),
                    not_after=grant.deadline,
                )
            except LeaseRefused as exc:
                self._lose(f"renewal refused: {exc}")
                return
            except LeaseLost as exc:
                self._lose(str(exc))
                return
            except LeaseServiceError as exc:
                lease_log.warning("renewal of %r failed, retrying: %s", self.job_id, exc)
                next_try = client.clock() + min(every / 4, 1.0)
                continue
            self._grant = renewed
            next_try = client.clock() + every
