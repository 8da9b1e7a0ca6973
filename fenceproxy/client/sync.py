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
once a renewal was refused or the local deadline passed without one. The rules are
:mod:`fenceproxy.client.core`'s, shared with the async client.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal, Protocol

import httpx

from ..errors import LeaseLost, LeaseRefused, LeaseServiceError
from ..log import lease_log
from .core import EXPIRED, Endpoint, Grant, Holding, Patience, holder, late, retry_after

__all__ = ["SyncHeldLease", "SyncLeaseClient"]


class _Answer(Protocol):
    """What :meth:`SyncHeldLease.request` reads of an answer: httpx's or requests'."""

    status_code: int
    content: bytes

    @property
    def headers(self) -> Any: ...


class SyncLeaseClient:
    """A client of the lease API at ``url`` (the proxy's address), without asyncio.
    Usable as a context manager (it closes its connections on exit) or as is."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "/_leases",
        token: str | None = None,
        http: httpx.Client | None = None,
        margin: float = 0.1,
        request_timeout: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """The same options as :class:`~fenceproxy.client.LeaseClient`; ``http`` is an
        httpx client of yours to send with."""
        self.endpoint = Endpoint(url, prefix, token, margin, request_timeout)
        self._http = http or httpx.Client()
        self._own_http = http is None
        self.clock = clock
        self.sleep = sleep

    @property
    def margin(self) -> float:
        return self.endpoint.margin

    @property
    def request_timeout(self) -> float:
        return self.endpoint.request_timeout

    def close(self) -> None:
        if self._own_http:
            self._http.close()

    def __enter__(self) -> SyncLeaseClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one call each ----------------------------------------------------------

    def claim(self, job: str, owner: str | None, ttl: float | None = None) -> Grant:
        """Claim ``job``; see :meth:`fenceproxy.client.LeaseClient.claim`."""
        body = holder(owner)
        if ttl is not None:
            body["ttl"] = ttl
        return self._grant(job, "claim", body, None)

    def renew(
        self,
        job: str,
        owner: str | None,
        generation: int,
        ttl: float | None = None,
        *,
        within: float | None = None,
        not_after: float | None = None,
    ) -> Grant:
        body = holder(owner, generation)
        if ttl is not None:
            body["ttl"] = ttl
        return self._grant(job, "renew", body, within, not_after)

    def complete(self, job: str, owner: str | None, generation: int) -> dict[str, Any]:
        return self._call("POST", job, "complete", holder(owner, generation))

    def release(
        self, job: str, owner: str | None, generation: int, *, within: float | None = None
    ) -> dict[str, Any]:
        return self._call("POST", job, "release", holder(owner, generation), within)

    def show(self, job: str) -> dict[str, Any]:
        return self._call("GET", job, None, None)

    def hold(
        self,
        job: str,
        *,
        owner: str | None = None,
        ttl: float | None = None,
        renew_every: float | None = None,
        wait: float = 0.0,
    ) -> SyncHeldLease:
        """Claim ``job`` (waiting up to ``wait`` seconds while another worker holds
        it) and keep it for the duration of a ``with`` block."""
        holding = Holding(job, owner, ttl, renew_every, self.margin, self.clock)
        return SyncHeldLease(self, holding, wait)

    def claim_waiting(self, holding: Holding, wait: float) -> Grant:
        patience = Patience(wait, self.clock)
        while True:
            try:
                return self.claim(holding.job_id, holding.owner, holding.ttl)
            except LeaseRefused as refused:
                delay = patience.next(refused)
                if delay is None:
                    raise
                lease_log.info("job %r is held; claiming again in %.3fs", holding.job_id, delay)
                self.sleep(delay)

    # -- plumbing ---------------------------------------------------------------

    def _grant(
        self,
        job: str,
        action: str,
        body: dict[str, Any],
        within: float | None,
        not_after: float | None = None,
    ) -> Grant:
        sent = self.clock()
        grant = self.endpoint.grant(action, self._call("POST", job, action, body, within), sent)
        lost = late(action, grant, self.clock(), not_after)
        if lost is not None:
            if action == "claim":  # the store thinks we hold it: give it back
                with contextlib.suppress(Exception):
                    within = self.endpoint.give_back_within
                    self.release(job, body.get("owner"), grant.generation, within=within)
            raise lost
        return grant

    def _call(
        self,
        method: str,
        job: str,
        action: str | None,
        body: dict[str, Any] | None,
        within: float | None = None,
    ) -> dict[str, Any]:
        call = self.endpoint.call(method, job, action, body, within)
        # Over within the call's time as a whole: httpx bounds each read, and an answer
        # that trickles in could otherwise hold a lease's calls past its deadline.
        deadline = self.clock() + call.timeout
        try:
            with self._http.stream(
                call.method,
                call.url,
                json=call.body,
                headers=call.headers,
                timeout=httpx.Timeout(call.timeout),
            ) as answer:
                content = bytearray()
                for chunk in answer.iter_bytes():
                    if self.clock() > deadline:
                        raise httpx.ReadTimeout(f"no whole answer within {call.timeout:g}s")
                    content += chunk
        except httpx.HTTPError as exc:
            raise LeaseServiceError(
                f"lease service at {self.endpoint.base}: {type(exc).__name__}: {exc}"
            ) from exc
        return self.endpoint.read(answer.status_code, bytes(content))


class SyncHeldLease:
    """A lease kept alive by a background thread for the duration of ``with``.

    Ask :meth:`check` (or :attr:`lost`) between steps; :meth:`headers` and
    :meth:`request` raise LeaseLost too. Leaving the block without completing
    releases the lease; leaving it normally after the lease was lost raises
    LeaseLost, so the loss is never silent.
    """

    def __init__(self, client: SyncLeaseClient, holding: Holding, wait: float) -> None:
        self._client = client
        self._holding = holding
        self._wait = wait
        self.job_id = holding.job_id
        self.owner = holding.owner
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one call to the service at a time per lease
        self._renewer: threading.Thread | None = None

    # -- what the worker uses ---------------------------------------------------

    @property
    def generation(self) -> int:
        return self._holding.granted().generation

    @property
    def token(self) -> str:
        return self._holding.granted().token

    @property
    def deadline(self) -> float:
        return self._holding.granted().deadline

    @property
    def lost(self) -> bool:
        return self._holding.lost

    def check(self) -> None:
        """Raise LeaseLost once the lease is lost, ended or past its local deadline."""
        self._holding.check()

    def headers(self) -> dict[str, str]:
        """The fencing headers for a write under this lease; LeaseLost once it is lost."""
        return self._holding.headers()

    def request(self, http: Any, method: str, url: str, **kwargs: Any) -> Any:
        """Send a write under this lease with ``http`` (an ``httpx.Client`` or a
        ``requests.Session``), its fencing headers added. A refusal that says
        nothing was applied is sent again after its ``Retry-After`` while the lease
        lasts (keep an ``Idempotency-Key`` in ``headers``); any other answer is
        returned as it is: check its status."""
        extra = dict(kwargs.pop("headers", None) or {})
        attempt = 0
        while True:
            answer: _Answer = http.request(
                method, url, headers={**extra, **self.headers()}, **kwargs
            )
            delay = retry_after(
                answer.status_code, answer.headers, answer.content, self._holding.left(), attempt
            )
            if delay is None:
                return answer
            self._client.sleep(delay)
            attempt += 1

    def complete(self) -> None:
        """Complete the job; LeaseLost if the service refuses, LeaseServiceError if it
        cannot be reached (calling again is safe)."""
        self._end(self._client.complete)

    def release(self) -> None:
        """Give the job up for another worker to claim."""
        self._end(self._client.release)

    # -- the context manager ----------------------------------------------------

    def __enter__(self) -> SyncHeldLease:
        self._holding.taken(self._client.claim_waiting(self._holding, self._wait))
        self._renewer = threading.Thread(
            target=self._keep_alive, name=f"fenceproxy-renew-{self.job_id}", daemon=True
        )
        self._renewer.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        self._stop_renewing()
        holding = self._holding
        holding.leaving()
        if holding.lost_why is not None:
            if exc_type is None:
                raise LeaseLost(holding.lost_why)
            if issubclass(exc_type, LeaseLost):
                return False
            raise LeaseLost(holding.lost_why) from exc
        if not holding.ended:
            left = holding.left()
            if left > 0:
                with contextlib.suppress(LeaseRefused, LeaseServiceError):
                    self._client.release(self.job_id, self.owner, self.generation, within=left)
            holding.ended = True
        return False

    # -- internals ----------------------------------------------------------------

    def _end(self, call: Callable[..., dict[str, Any]]) -> None:
        holding = self._holding
        # Not while a renewal is on the wire (it would be refused), nor past the lease.
        if not self._lock.acquire(timeout=max(0.0, holding.left())):
            self._holding.lose(EXPIRED)
            raise LeaseLost(EXPIRED)
        try:
            if holding.lost_why is not None:
                raise LeaseLost(holding.lost_why)
            try:
                call(self.job_id, self.owner, self.generation)
            except LeaseRefused as exc:
                self._holding.lose(f"the lease service refused: {exc}")
                raise LeaseLost(holding.lost_why or str(exc)) from exc
            holding.ended = True
        finally:
            self._lock.release()
        self._stop_renewing()

    def _stop_renewing(self) -> None:
        self._stop.set()
        renewer, self._renewer = self._renewer, None
        if renewer is not None and renewer is not threading.current_thread():
            renewer.join()

    def _keep_alive(self) -> None:
        try:
            self._renew_until_lost()
        except Exception as exc:  # a renewer that dies must not leave the lease trusted
            self._holding.lose(f"the renewer failed: {exc!r}")

    def _renew_until_lost(self) -> None:
        client, holding = self._client, self._holding
        while not self._stop.is_set():
            wait = holding.due()
            if wait is None:
                self._holding.lose(EXPIRED)
                return
            if wait > 0:
                self._stop.wait(wait)
                continue
            with self._lock:
                if self._stop.is_set() or holding.ended:
                    return
                if holding.due() is None:  # waited for the lock past the deadline
                    self._holding.lose(EXPIRED)
                    return
                grant = holding.granted()
                try:
                    renewed = client.renew(
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
                        self._holding.lose(why)
                        return
                    continue
                holding.taken(renewed)
