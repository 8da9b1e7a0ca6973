"""What both lease clients are, whatever their I/O: their options, their one-call
methods and ``hold`` (each a flow of :mod:`.flow`, done by the client's own driver),
and what a held lease tells its worker.

A method's result is the client's: a :class:`~.core.Grant` or a record for the
synchronous client, a coroutine of one for the async client.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .core import Endpoint, Grant, Holding
from .flow import Flow, Flows, Record

__all__ = ["Held", "LeaseAPI"]

HttpT = TypeVar("HttpT")
SleepT = TypeVar("SleepT")
HeldT = TypeVar("HeldT")
GrantT = TypeVar("GrantT")
RecordT = TypeVar("RecordT")


class LeaseAPI(ABC, Generic[HttpT, SleepT, HeldT, GrantT, RecordT]):
    """A client of the lease API at ``url`` (the proxy's address)."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "/_leases",
        token: str | None = None,
        http: HttpT | None = None,
        margin: float = 0.1,
        request_timeout: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: SleepT | None = None,
    ) -> None:
        """``margin`` is the share of the ttl held back from the local deadline;
        ``token`` is the lease API credential, if it takes credentials; ``http`` an
        httpx client of yours to send with (by default one of its own); ``clock``
        the monotonic clock the lease's deadlines are read on; ``sleep`` how the
        client waits (by default ``asyncio.sleep``, or ``time.sleep``)."""
        self.endpoint = Endpoint(url, prefix, token, margin, request_timeout)
        self._own_http = http is None
        self._http = self._new_http() if http is None else http
        self.clock = clock
        self.sleep = self._default_sleep() if sleep is None else sleep
        self.flows = Flows(self.endpoint, clock)

    @property
    def margin(self) -> float:
        return self.endpoint.margin

    @property
    def request_timeout(self) -> float:
        return self.endpoint.request_timeout

    # -- one call each ----------------------------------------------------------

    def claim(self, job: str, owner: str | None, ttl: float | None = None) -> GrantT:
        """Claim ``job``. Raises LeaseRefused (held, completed), LeaseServiceError,
        or LeaseLost when the grant arrives after its own local deadline. ``owner``
        may be None with a credential: the lease is then owned by its name."""
        return self._grant(self.flows.claim(job, owner, ttl))

    def renew(
        self,
        job: str,
        owner: str | None,
        generation: int,
        ttl: float | None = None,
        *,
        within: float | None = None,
        not_after: float | None = None,
    ) -> GrantT:
        """Extend the lease; ``within`` bounds the request (by default the client's
        request timeout); a reply after ``not_after`` raises LeaseLost."""
        flow = self.flows.renew(job, owner, generation, ttl, within=within, not_after=not_after)
        return self._grant(flow)

    def complete(self, job: str, owner: str | None, generation: int) -> RecordT:
        """Mark the job done. Safe to retry: a repeat by the same holder answers the same."""
        return self._record(self.flows.complete(job, owner, generation))

    def release(
        self, job: str, owner: str | None, generation: int, *, within: float | None = None
    ) -> RecordT:
        """Give the job up for another worker to claim."""
        return self._record(self.flows.release(job, owner, generation, within=within))

    def show(self, job: str) -> RecordT:
        """The job's record at the lease service."""
        return self._record(self.flows.show(job))

    def hold(
        self,
        job: str,
        *,
        owner: str | None = None,
        ttl: float | None = None,
        renew_every: float | None = None,
        wait: float = 0.0,
    ) -> HeldT:
        """Claim ``job`` and keep it for the duration of a ``with`` block (``async
        with`` for the async client), renewing every ``renew_every`` seconds (ttl/3
        by default). While another worker holds the job, wait up to ``wait`` seconds
        for it (:class:`~fenceproxy.client.core.Patience`)."""
        return self._held(Holding(job, owner, ttl, renew_every, self.margin, self.clock), wait)

    def claim_waiting(self, holding: Holding, wait: float) -> GrantT:
        """Claim, waiting up to ``wait`` seconds while another worker holds the job."""
        return self._grant(self.flows.claim_waiting(holding, wait))

    # -- what each client does its own way --------------------------------------

    @abstractmethod
    def _new_http(self) -> HttpT | None:
        """The httpx client to send with when none was given."""

    @abstractmethod
    def _default_sleep(self) -> SleepT: ...

    @abstractmethod
    def _held(self, holding: Holding, wait: float) -> HeldT: ...

    @abstractmethod
    def _grant(self, flow: Flow[Grant]) -> GrantT:
        """``flow`` run by the client's driver."""

    @abstractmethod
    def _record(self, flow: Flow[Record]) -> RecordT:
        """``flow`` run by the client's driver."""


ClientT = TypeVar("ClientT", bound=LeaseAPI[Any, Any, Any, Any, Any])


class Held(Generic[ClientT]):
    """A lease held by ``client`` for the duration of a block: what its worker asks
    of it between steps."""

    def __init__(self, client: ClientT, holding: Holding, wait: float) -> None:
        self._client = client
        self._flows = client.flows
        self._holding = holding
        self._wait = wait
        self.job_id = holding.job_id
        self.owner = holding.owner

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
