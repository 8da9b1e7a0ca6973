"""Every step of both lease clients, written once as sans-IO generators (as httpx's
``Auth.auth_flow`` serves its sync and async clients alike).

A flow yields what is to be done, an *op*, and is sent its answer, or thrown the
exception that doing it raised:

* a :class:`~.core.Call` to the lease API, answered with its :class:`Reply`;
* a :class:`Sleep`;
* a :class:`Write` through the worker's own HTTP client, answered with its response;
* :attr:`Renewer.PAUSE` (answered with whether the renewer stopped before the
  lease's local deadline) and :attr:`Renewer.RESUME`.

It returns its result. :func:`run` does the ops in the calling thread,
:func:`run_async` in a coroutine; each client hands them its I/O: a task it can
cancel (async) or a thread it stops while the worker polls ``check()`` (sync).
The decisions are :mod:`.core`'s; the order of the steps is here, and only here.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias, TypeVar

from ..errors import LeaseLost, LeaseRefused, LeaseServiceError
from ..log import lease_log
from .core import (
    EXPIRED,
    Call,
    Endpoint,
    Grant,
    Holding,
    Patience,
    holder,
    late,
    retry_after,
)

__all__ = [
    "AsyncIO",
    "Flow",
    "Flows",
    "Renewer",
    "Reply",
    "Sleep",
    "SyncIO",
    "Write",
    "run",
    "run_async",
]

T = TypeVar("T")
Record = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to a :class:`~.core.Call`, read whole."""

    status: int
    content: bytes


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Write:
    """A write of the worker's, with ``http`` (its own client): ``http.request(method,
    url, **kwargs)``."""

    http: Any
    method: str
    url: str
    kwargs: dict[str, Any]


class Renewer(enum.Enum):
    PAUSE = "pause"
    RESUME = "resume"


Op: TypeAlias = Call | Sleep | Write | Renewer
Flow: TypeAlias = Generator[Op, Any, T]


class SyncIO(Protocol):
    """What :func:`run` asks of a client; a held lease's also does
    ``write(Write) -> response``, ``pause() -> bool`` and ``resume() -> None``."""

    def send(self, call: Call, /) -> Reply: ...

    def sleep(self, seconds: float, /) -> None: ...


class AsyncIO(Protocol):
    """The same as :class:`SyncIO`, each a coroutine function, for :func:`run_async`."""

    def send(self, call: Call, /) -> Awaitable[Reply]: ...

    def sleep(self, seconds: float, /) -> Awaitable[None]: ...


def _do(io: Any, op: Op) -> Any:
    """The op done by ``io`` (for :func:`run_async`, an awaitable of it)."""
    if isinstance(op, Call):
        return io.send(op)
    if isinstance(op, Sleep):
        return io.sleep(op.seconds)
    if isinstance(op, Write):
        return io.write(op)
    return io.pause() if op is Renewer.PAUSE else io.resume()


class _Steps:
    """A flow, and what the last op it asked for came to."""

    def __init__(self, flow: Flow[Any]) -> None:
        self.flow = flow
        self.answer: Any = None
        self.error: BaseException | None = None
        self.result: Any = None

    def next(self) -> Op | None:
        """The next op, or None once the flow has returned (its :attr:`result`)."""
        error, self.error = self.error, None
        try:
            return self.flow.send(self.answer) if error is None else self.flow.throw(error)
        except StopIteration as end:
            self.result = end.value
            return None


def run(flow: Flow[T], io: SyncIO) -> T:
    """Do ``flow``'s ops in this thread; what it returns (or raises)."""
    steps = _Steps(flow)
    while (op := steps.next()) is not None:
        try:
            steps.answer = _do(io, op)
        except BaseException as exc:
            steps.error = exc
    result: T = steps.result
    return result


async def run_async(flow: Flow[T], io: AsyncIO) -> T:
    """Do ``flow``'s ops in this coroutine; what it returns (or raises)."""
    steps = _Steps(flow)
    while (op := steps.next()) is not None:
        try:
            steps.answer = await _do(io, op)
        except BaseException as exc:  # a cancellation too: the flow cleans up
            steps.error = exc
    result: T = steps.result
    return result


def _with_ttl(body: Record, ttl: float | None) -> Record:
    return body if ttl is None else {**body, "ttl": ttl}


class Flows:
    """The flows of a client of the lease API behind ``endpoint``, on ``clock``."""

    def __init__(self, endpoint: Endpoint, clock: Callable[[], float]) -> None:
        self.endpoint = endpoint
        self.clock = clock

    # -- one call each ------------------------------------------------------------

    def call(
        self,
        method: str,
        job: str,
        action: str | None,
        body: Record | None,
        within: float | None = None,
    ) -> Flow[Record]:
        """One call; its answer's JSON object (see :meth:`.core.Endpoint.read`)."""
        reply = yield self.endpoint.call(method, job, action, body, within)
        return self.endpoint.read(reply.status, reply.content)

    # The calls of the clients' methods of the same names, which say what each does.

    def claim(
        self, job: str, owner: str | None, ttl: float | None, wait: float = 0.0
    ) -> Flow[Grant]:
        """With ``wait``, the server holds the claim up to that long while the job is
        busy (so the call may take that much longer)."""
        body = _with_ttl(holder(owner), ttl)
        if wait <= 0:
            return self._grant(job, "claim", body, None)
        within = self.endpoint.request_timeout + wait
        return self._grant(job, "claim", {**body, "wait": wait}, within)

    def renew(
        self,
        job: str,
        owner: str | None,
        generation: int,
        ttl: float | None,
        *,
        within: float | None,
        not_after: float | None,
    ) -> Flow[Grant]:
        body = _with_ttl(holder(owner, generation), ttl)
        return self._grant(job, "renew", body, within, not_after)

    def complete(self, job: str, owner: str | None, generation: int) -> Flow[Record]:
        return self.call("POST", job, "complete", holder(owner, generation))

    def release(
        self, job: str, owner: str | None, generation: int, *, within: float | None
    ) -> Flow[Record]:
        return self.call("POST", job, "release", holder(owner, generation), within)

    def show(self, job: str) -> Flow[Record]:
        return self.call("GET", job, None, None)

    def claim_waiting(self, holding: Holding, wait: float) -> Flow[Grant]:
        """Claim, waiting up to ``wait`` seconds while another worker holds the job: the
        server holds the claim meanwhile and grants it as soon as the job is free. A
        claim it answered before the wait was over (its own longest wait, or it was
        stopping) is sent again after a backoff."""
        if wait <= 0:
            return (yield from self.claim(holding.job_id, holding.owner, holding.ttl))
        patience = Patience(wait, self.clock)
        while True:
            left = patience.left()
            try:
                return (yield from self.claim(holding.job_id, holding.owner, holding.ttl, left))
            except LeaseRefused as refused:
                delay = patience.next(refused)
                if delay is None:
                    raise
                lease_log.info("job %r is held; claiming again in %.3fs", holding.job_id, delay)
                yield Sleep(delay)

    def _grant(
        self,
        job: str,
        action: str,
        body: Record,
        within: float | None,
        not_after: float | None = None,
    ) -> Flow[Grant]:
        """Send a claim or renewal; the grant, with its local deadline (see
        :func:`~fenceproxy.client.core.late`)."""
        sent = self.clock()
        record = yield from self.call("POST", job, action, body, within)
        grant = self.endpoint.grant(action, record, sent)
        lost = late(action, grant, self.clock(), not_after)
        if lost is None:
            return grant
        if action == "claim":  # the store thinks we hold it: give it back
            with contextlib.suppress(Exception):
                within = self.endpoint.give_back_within
                yield from self.release(job, body.get("owner"), grant.generation, within=within)
        raise lost

    # -- a held lease ---------------------------------------------------------------

    def enter(self, holding: Holding, wait: float) -> Flow[None]:
        """The block begins: claim, waiting up to ``wait`` seconds, and start renewing."""
        holding.taken((yield from self.claim_waiting(holding, wait)))
        yield Renewer.RESUME

    def keep_alive(self, holding: Holding) -> Flow[str]:
        """The renewer: renew whenever due until the lease is lost; why it was. A
        renewer that fails must not leave the lease trusted."""
        try:
            return (yield from self._renew_until_lost(holding))
        except Exception as exc:
            return f"the renewer failed: {exc!r}"

    def _renew_until_lost(self, holding: Holding) -> Flow[str]:
        while True:
            wait = holding.due()
            if wait is None:
                return EXPIRED
            if wait > 0:
                yield Sleep(wait)
                continue
            grant = holding.granted()
            within = holding.within(self.endpoint.request_timeout)
            try:
                renewed = yield from self.renew(
                    holding.job_id, holding.owner, grant.generation, holding.ttl,
                    within=within, not_after=grant.deadline,
                )  # fmt: skip
            except (LeaseRefused, LeaseLost, LeaseServiceError) as exc:
                why = holding.renewal_failed(exc)
                if why is not None:
                    return why
                continue
            holding.taken(renewed)

    def write(
        self, holding: Holding, http: Any, method: str, url: str, kwargs: dict[str, Any]
    ) -> Flow[Any]:
        """A write under the lease, its fencing headers added, sent again after a
        refusal's ``Retry-After`` while :func:`~.core.retry_after` says it is safe."""
        extra = dict(kwargs.pop("headers", None) or {})
        attempt = 0
        while True:
            headers = {**extra, **holding.headers()}
            answer = yield Write(http, method, url, {**kwargs, "headers": headers})
            left = holding.left()
            delay = retry_after(answer.status_code, answer.headers, answer.content, left, attempt)
            if delay is None:
                return answer
            yield Sleep(delay)
            attempt += 1

    def end(self, holding: Holding, action: Literal["complete", "release"]) -> Flow[None]:
        """Complete or release the lease: LeaseLost if it is lost, or the service
        refuses; on any other failure the lease is kept (and renewed) as it was."""
        if holding.lost_why is not None:
            raise LeaseLost(holding.lost_why)
        # No renewal may race the call: it would be refused as completed.
        if not (yield Renewer.PAUSE):
            holding.lose(EXPIRED)
            raise LeaseLost(holding.lost_why or EXPIRED)
        try:
            yield from self.call("POST", holding.job_id, action, _holder_of(holding))
        except LeaseRefused as exc:
            holding.lose(f"the lease service refused: {exc}")
            raise LeaseLost(holding.lost_why or str(exc)) from exc
        except GeneratorExit:
            raise
        except BaseException:
            if not holding.lost:
                yield Renewer.RESUME  # not ended: keep the lease while the caller decides
            raise
        holding.ended = True

    def leave(self, holding: Holding, error: BaseException | None) -> Flow[None]:
        """The block ends, with ``error`` or none. After a loss, leaving says so: an
        error of the body's becomes LeaseLost (from it), while a LeaseLost, a
        cancellation or an interrupt goes on as it is. A lease still held that was
        not completed is released, never past its local deadline."""
        if not (yield Renewer.PAUSE):
            holding.lose(EXPIRED)
        holding.leaving()
        if holding.lost_why is not None:
            if error is None:
                raise LeaseLost(holding.lost_why)
            if isinstance(error, LeaseLost) or not isinstance(error, Exception):
                return
            raise LeaseLost(holding.lost_why) from error
        if not holding.ended:
            left = holding.left()
            if left > 0:
                with contextlib.suppress(LeaseRefused, LeaseServiceError):
                    yield from self.call(
                        "POST", holding.job_id, "release", _holder_of(holding), left
                    )
            holding.ended = True


def _holder_of(holding: Holding) -> Record:
    return holder(holding.owner, holding.granted().generation)
