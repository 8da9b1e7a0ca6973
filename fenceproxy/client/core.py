"""What every lease client decides, with no I/O: how a call to the lease API is
made and read, when a grant is trusted and until when, when to renew, when a lease
is lost, how long to wait for a busy job, and which refused writes are safe to send
again. The async client (:mod:`.aio`) and the synchronous one (:mod:`.sync`) only
do the sending and the waiting, each its own way, so the two cannot disagree.

Time is the client's monotonic clock, passed in as ``now``; the wall clock is never
read: a worker whose clock is hours off behaves exactly like one whose clock is
right.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from ..errors import PROBLEM_BASE, LeaseLost, LeaseRefused, LeaseServiceError
from ..log import lease_log

__all__ = [
    "JOB_HEADER",
    "SAFE_TO_RETRY",
    "TOKEN_HEADER",
    "Call",
    "Endpoint",
    "Grant",
    "Holding",
    "Patience",
    "retry_after",
]

JOB_HEADER = "Fencing-Job"
TOKEN_HEADER = "Fencing-Token"

SAFE_TO_RETRY = frozenset(
    {
        "job-quarantined",  # an earlier write's outcome is unknown: nothing was sent
        "proxy-busy",  # at one of its limits: nothing was sent
        "store-unavailable",  # the fence could not be recorded: nothing was sent
        "duplicate-in-flight",  # the same key is at the upstream: a retry is replayed
        "upstream-unreachable",  # no connection: nothing was sent, the key released
    }
)
"""The refusals after which the same write (same key) may be sent again: each says
nothing reached the upstream, or that a retry is answered from the first. Never a
stale generation, a lease no longer live, or an outcome the proxy cannot know."""

EXPIRED = "no renewal was confirmed before the local deadline"
"""Why a lease is lost when its deadline passed without a renewal."""

_BACKOFF_FIRST = 0.05
_BACKOFF_MAX = 2.0


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


@dataclass(frozen=True, slots=True)
class Call:
    """One request to the lease API."""

    method: str
    url: str
    body: dict[str, Any] | None
    headers: dict[str, str]
    timeout: float


class Endpoint:
    """The lease API at ``url`` (the proxy's address) under ``prefix``: how a call
    is made and how its answer is read."""

    def __init__(
        self, url: str, prefix: str, token: str | None, margin: float, request_timeout: float
    ) -> None:
        if not 0 <= margin < 1:
            raise ValueError("margin is a share of the ttl, from 0 up to (not including) 1")
        if "://" not in url:
            raise ValueError(f"the lease API's URL needs a scheme, such as http://{url}")
        self.base = url.rstrip("/") + prefix
        self.margin = margin
        self.request_timeout = request_timeout
        self._headers = {} if token is None else {"Authorization": f"Bearer {token}"}

    def call(
        self,
        method: str,
        job: str,
        action: str | None,
        body: dict[str, Any] | None,
        within: float | None = None,
    ) -> Call:
        """One request, to be over within ``within`` seconds (the request timeout by
        default); LeaseLost when no time is left for it (a renewal at its deadline)."""
        timeout = self.request_timeout if within is None else within
        if timeout <= 0:
            raise LeaseLost(EXPIRED)
        url = f"{self.base}/{quote(job, safe='').replace('.', '%2E')}"
        return Call(method, url + (f"/{action}" if action else ""), body, self._headers, timeout)

    def read(self, status: int, content: bytes) -> dict[str, Any]:
        """The answer's JSON object; LeaseRefused for a refusal, LeaseServiceError for
        anything else that is not one."""
        try:
            answer = json.loads(content)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise LeaseServiceError(
                f"lease service at {self.base} answered {status} with {content[:200]!r}"
            )
        if status >= 400:
            raise LeaseRefused(status, answer)
        return answer

    @property
    def give_back_within(self) -> float:
        """How long the release of a claim answered too late may take: the store
        thinks it is held, and another worker should not wait for it to expire."""
        return min(self.request_timeout, 2.0)

    def grant(self, action: str, record: dict[str, Any], sent: float) -> Grant:
        """A claim's or renewal's answer, trusted until ``sent`` (read before the
        request went out: the safe side of the server's clock) plus the ttl less
        the margin. A claim the server held waiting says for how long (``waited``):
        it was granted no earlier than that after it was sent."""
        try:
            ttl = float(record["ttl"])
            waited = float(record.get("waited", 0.0))
            if not 0 <= waited < float("inf"):
                raise ValueError(waited)
            return Grant(
                job_id=str(record["job_id"]),
                owner=str(record["owner"]),
                generation=int(record["generation"]),
                token=str(record["token"]),
                ttl=ttl,
                deadline=sent + waited + ttl * (1 - self.margin),
                record=record,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise LeaseServiceError(f"lease service answered {action} with {record!r}") from exc


def late(action: str, grant: Grant, now: float, not_after: float | None) -> LeaseLost | None:
    """A grant that came after its own deadline (or after ``not_after``, the deadline
    of the lease it renews) is no lease: the worker may already be past it."""
    if now >= grant.deadline or (not_after is not None and now >= not_after):
        return LeaseLost(f"the {action} of {grant.job_id!r} was answered after its local deadline")
    return None


def holder(owner: str | None, generation: int | None = None) -> dict[str, Any]:
    """A request body naming the holder: the owner (unless the credential names it)
    and the generation."""
    body: dict[str, Any] = {} if owner is None else {"owner": owner}
    if generation is not None:
        body["generation"] = generation
    return body


class Holding:
    """One held lease: its grant, and whether it is lost, ended, or due a renewal.

    A lease is lost when a renewal is refused, when no renewal is confirmed before
    the local deadline, or when the renewer fails; from then on :meth:`headers` and
    :meth:`check` raise LeaseLost, so a worker cannot build its next write.
    """

    def __init__(
        self,
        job: str,
        owner: str | None,
        ttl: float | None,
        renew_every: float | None,
        margin: float,
        clock: Callable[[], float],
    ) -> None:
        if renew_every is not None and (
            renew_every <= 0 or (ttl is not None and renew_every >= ttl * (1 - margin))
        ):
            raise ValueError("renew_every must be above 0 and below the ttl minus the margin")
        self.job_id = job
        self.owner = owner
        self.ttl = ttl
        self.renew_every = renew_every
        self.clock = clock
        self.grant: Grant | None = None
        self.lost_why: str | None = None
        self.ended = False
        self.next_try = 0.0

    def granted(self) -> Grant:
        if self.grant is None:
            raise RuntimeError("the lease is held only inside 'with hold(...)'")
        return self.grant

    @property
    def lost(self) -> bool:
        return self.lost_why is not None or self.clock() >= self.granted().deadline

    def check(self) -> None:
        """Raise LeaseLost once the lease is lost, ended or past its local deadline."""
        grant = self.granted()
        if self.lost_why is not None:
            raise LeaseLost(self.lost_why)
        if self.ended:
            raise LeaseLost(f"the lease of {self.job_id!r} was completed or released")
        if self.clock() >= grant.deadline:
            raise LeaseLost(f"the lease of {self.job_id!r} is past its local deadline")

    def headers(self) -> dict[str, str]:
        """The fencing headers for a write under this lease (after :meth:`check`)."""
        self.check()
        return {JOB_HEADER: self.job_id, TOKEN_HEADER: self.granted().token}

    def lose(self, why: str) -> bool:
        """Mark the lease lost, and say so in the log; whether it was not already."""
        if self.lost_why is not None:
            return False
        self.lost_why = why
        generation = None if self.grant is None else self.grant.generation
        lease_log.warning("lease of %r at generation %s lost: %s", self.job_id, generation, why)
        return True

    # -- renewing -------------------------------------------------------------

    @property
    def every(self) -> float:
        return self.renew_every or self.granted().ttl / 3

    def taken(self, grant: Grant) -> None:
        """A claim or renewal was granted: the next renewal is due ``every`` from now."""
        self.grant = grant
        self.next_try = self.clock() + self.every

    def due(self) -> float | None:
        """Seconds until the next renewal is due (0: now); None once the local
        deadline has passed without one: the lease is lost (:data:`EXPIRED`)."""
        now = self.clock()
        grant = self.granted()
        if now >= grant.deadline:
            return None
        return max(0.0, min(self.next_try, grant.deadline) - now)

    def within(self, request_timeout: float) -> float:
        """How long a renewal sent now may take: never past the local deadline."""
        return min(request_timeout, self.granted().deadline - self.clock())

    def renewal_failed(self, exc: LeaseRefused | LeaseLost | LeaseServiceError) -> str | None:
        """Why a renewal that raised ``exc`` loses the lease; None when it does not (the
        service could not be reached: the next try comes soon, before the deadline)."""
        if isinstance(exc, LeaseRefused):
            return f"renewal refused: {exc}"
        if isinstance(exc, LeaseLost):
            return str(exc)
        lease_log.warning("renewal of %r failed, retrying: %s", self.job_id, exc)
        self.next_try = self.clock() + min(self.every / 4, 1.0)
        return None

    def left(self) -> float:
        """Seconds until the local deadline (a release must not outlive the lease)."""
        return self.granted().deadline - self.clock()

    def leaving(self) -> None:
        """The block ends: a lease past its deadline is lost now, even if the renewer
        had no turn to find it, so the loss is never silent."""
        if not self.ended and self.lost_why is None and self.left() <= 0:
            self.lose(EXPIRED)


_WAITABLE = frozenset({"lease-held", "write-in-flight"})
"""Claim refusals that end by themselves: a live lease, or an older write in flight."""


class Patience:
    """How long a claim waits for a busy job, ``wait`` seconds in all: the server
    holds each claim for what is left of it; one the server answered early (at its own
    longest wait, or stopping) is sent again after an exponential backoff from 50 ms
    to 2 s, each a random half to all of it (so workers waiting for one job spread
    out), never later than the current lease's expiry (the server's ``Retry-After``),
    which is when the job is free at the latest."""

    def __init__(
        self, wait: float, clock: Callable[[], float], rand: Callable[[], float] = random.random
    ) -> None:
        self._until = clock() + wait
        self._clock = clock
        self._rand = rand
        self._backoff = _BACKOFF_FIRST

    def left(self) -> float:
        """Seconds of the wait still to go (0 once it is over)."""
        return max(0.0, self._until - self._clock())

    def next(self, refused: LeaseRefused) -> float | None:
        """Seconds to wait before the next claim, or None to give up (the job is not
        merely held, or the wait is over)."""
        left = self._until - self._clock()
        if refused.slug not in _WAITABLE or left <= 0:
            return None
        expires = refused.problem.get("expires_in")
        free_by = float(expires) if isinstance(expires, int | float) else _BACKOFF_MAX
        delay = min(self._backoff * (0.5 + self._rand() / 2), free_by + 0.01, left)
        self._backoff = min(self._backoff * 2, _BACKOFF_MAX)
        return max(0.0, delay)


RETRIES = 5
"""How many times :meth:`request` sends a write again, at most."""


def retry_after(
    status: int, headers: Mapping[str, str], content: bytes, left: float, attempt: int = 0
) -> float | None:
    """Seconds to wait before sending a refused write again (its ``attempt``-th
    retry), or None when it must not be (:data:`SAFE_TO_RETRY`), not within ``left``
    seconds (the lease's), or after :data:`RETRIES` already."""
    kind = refusal_kind(status, headers, content)
    if kind not in SAFE_TO_RETRY or attempt >= RETRIES:
        return None
    try:
        delay = float(headers.get("Retry-After", "0.1"))
    except ValueError:
        delay = 1.0
    return delay if delay < left else None


def refusal_kind(status: int, headers: Mapping[str, str], content: bytes) -> str | None:
    """The proxy's problem kind of an answer (``stale-generation``, ...), or None
    when it is not a refusal of the proxy's (a success, or the upstream's answer)."""
    if status < 400 or not headers.get("Content-Type", "").startswith("application/problem+json"):
        return None
    try:
        problem = json.loads(content)
    except ValueError:
        return None
    kind = problem.get("type") if isinstance(problem, dict) else None
    if not isinstance(kind, str) or not kind.startswith(PROBLEM_BASE):
        return None
    return kind.removeprefix(PROBLEM_BASE)
