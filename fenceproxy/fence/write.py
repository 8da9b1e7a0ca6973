"""A fenced write, read from its request and followed through its job's turn: pure,
no I/O, no clock of its own (the caller passes the time).

:func:`read_write` reads, in one pass over a request's head, everything the fence
needs: whether the route fences the request, its job, generation, idempotency key and
caller, as a :class:`Reading`. A refusal is data there, with what was read before it,
so the proxy can log and count it.

:class:`Attempt` is one admitted write, in the states of the protocol's model
(model/fenceproxy.pml)::

    admitted --send within the slack--> sending --answer--> answered
       |                                   |--not sent----> not sent
       |--send past the slack------------> not sent
       '--end (cancelled, failed)--------> not sent
                                    sending --end (timed out, cancelled,
                                               broken after sending)--> unknown

:data:`TRANSITIONS` is the whole table; every move goes through it, and an event it
does not list is a bug (:class:`~fenceproxy.errors.IllegalMove`). :data:`SETTLING`
is the second table: what each final state asks of the store, which
:meth:`Attempt.end` reads into an :class:`Ending`: what becomes of the key, whether
the job's in-flight record is cleared or held (the outcome being unknown), and
whether the exchange is cut first.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from multidict import CIMultiDictProxy, istr

from .. import hdrs
from ..errors import (
    FencingHeaderMalformed,
    FencingHeaderMissing,
    IllegalMove,
    JobQuarantined,
    Refusal,
    UpstreamError,
)
from .fencing import (
    SHARED_SCOPE,
    FencedWrite,
    StoredResponse,
    parse_job,
    parse_key,
    parse_method_override,
    scope,
    single_field,
)
from .tokens import SigningKeys, read_token

__all__ = [
    "SAFE_METHODS",
    "SETTLING",
    "TRANSITIONS",
    "TURN_SLACK",
    "Attempt",
    "Ending",
    "Event",
    "Fence",
    "FencedRoute",
    "KeyFate",
    "Reading",
    "RecordFate",
    "Settlement",
    "Settling",
    "State",
    "in_flight_for",
    "read_write",
]

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PROPFIND", "REPORT", "SEARCH"})
"""What a route fences by default is every method but these: the methods the IANA HTTP
method registry marks safe (PROPFIND, RFC 4918, REPORT, RFC 3253, and SEARCH, RFC 5323,
are WebDAV's and CalDAV's reads, with a body), but TRACE, which stays fenced."""


@dataclass(frozen=True, slots=True)
class Fence:
    """How a route fences its writes."""

    methods: frozenset[str] | None
    """The fenced methods; None for every method but :data:`SAFE_METHODS`."""
    job_in_path: bool
    job_header: istr
    token_header: istr
    key_header: istr
    scope_headers: tuple[istr, ...]
    """Whose a key is: the headers whose values make a caller (none: every caller is one)."""
    replay: bool
    signed_only: bool
    """Only signed tokens are taken (plain integers are refused)."""
    check_lease: bool
    """A write goes only while its job's lease at its generation is live."""
    report: bool
    """Report only: what would be refused or replayed is forwarded, marked."""
    fields: frozenset[str]
    """The three names, lower-case: always forwarded, even when ``Connection`` names them."""
    by_generation: bool = False
    """``order: generation``: writes of one generation may be in flight together."""

    def fences(self, method: str) -> bool:
        if self.methods is None:
            return method not in SAFE_METHODS
        return method in self.methods


class FencedRoute(Protocol):
    """What the fence reads of a route (:class:`fenceproxy.http.routes.Route`)."""

    @property
    def name(self) -> str: ...
    @property
    def fence(self) -> Fence | None: ...
    @property
    def timeout(self) -> float: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def quarantine(self) -> float: ...


TURN_SLACK = 1.0
"""An admitted write is sent only this soon after its admission was asked for: its
in-flight record lasts the route's timeout plus quarantine plus this."""

Headers = CIMultiDictProxy[str]


def in_flight_for(route: FencedRoute) -> float:
    """The longest a fenced write may take from its send to the upstream's answer:
    connecting, sending the body, waiting. The job's in-flight record covers it."""
    return route.connect_timeout + route.timeout


# -- reading -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reading:
    """What a request's head tells the fence, as far as it was read.

    ``fenced``: the route fences the request's method, or the method its override
    names. When the override itself cannot be read, ``fenced`` is False and
    ``refusal`` says why. A fenced request has either ``write`` (its fingerprint
    still to come from the body) or ``refusal``; ``job``, ``generation`` and ``key``
    are what was read before a refusal, for its log line."""

    fenced: bool
    override: str | None = None
    job: str | None = None
    generation: int | None = None
    key: str | None = None
    write: FencedWrite | None = None
    refusal: Refusal | None = None


_UNFENCED = Reading(fenced=False)


def read_write(
    route: FencedRoute,
    method: str,
    headers: Headers,
    path_job: str | None,
    keys: SigningKeys | None,
) -> Reading:
    """Read a request's head for the fence; nothing here raises a refusal."""
    fence = route.fence
    if fence is None:
        return _UNFENCED
    aliases = _underscored(headers)
    overrides = [(str(n), v) for n in hdrs.METHOD_OVERRIDES for v in _values(headers, n, aliases)]
    fields = {n: _values(headers, n, aliases) for n in (*_fencing(fence), *fence.scope_headers)}
    try:
        override = parse_method_override(overrides)
    except Refusal as refusal:
        return Reading(fenced=False, refusal=refusal)
    if not any(fence.fences(m) for m in (method, override) if m is not None):
        return _UNFENCED
    return _read_fields(route, method, fields, path_job, keys, override)


def _read_fields(
    route: FencedRoute,
    method: str,
    fields: dict[istr, list[str]],
    path_job: str | None,
    keys: SigningKeys | None,
    override: str | None,
) -> Reading:
    """The write the fencing fields describe, or the refusal of the first fault."""
    fence = route.fence
    assert fence is not None
    hold = in_flight_for(route) + route.quarantine + TURN_SLACK
    job = generation = key = None
    try:
        header_job, raw_token, raw_key = (single_field(fields[n], str(n)) for n in _fencing(fence))
        job, token = _job_and_token(fence, method, header_job, raw_token, path_job)
        generation = read_token(token, str(fence.token_header), job, keys,
                                signed_only=fence.signed_only)  # fmt: skip
        key = None if raw_key is None else parse_key(raw_key, str(fence.key_header))
    except Refusal as refusal:
        return Reading(True, override, job, generation, key, refusal=refusal)
    # Whose the key is: a digest of the caller's credentials, never them.
    caller = (
        SHARED_SCOPE if key is None else scope([(str(n), fields[n]) for n in fence.scope_headers])
    )
    write = FencedWrite(route.name, job, generation, key, scope=caller, replay=fence.replay,
                        hold=hold, check_lease=fence.check_lease,
                        shared=fence.by_generation)  # fmt: skip
    return Reading(True, override, job, generation, key, write)


def _job_and_token(
    fence: Fence, method: str, header_job: str | None, token: str | None, path_job: str | None
) -> tuple[str, str]:
    """The job (from the path or its header) and the raw token: FencingHeaderMissing
    naming what is absent, FencingHeaderMalformed for a job id that is not one, or a
    header naming another job than the path."""
    raw_job, source = (path_job, "path") if fence.job_in_path else (header_job, fence.job_header)
    if raw_job is None or token is None:
        missing = [str(n) for n, v in ((source, raw_job), (fence.token_header, token)) if v is None]
        raise FencingHeaderMissing(
            f"a fenced {method} needs the header(s) {', '.join(missing)}", missing=missing
        )
    job = parse_job(raw_job, str(source))
    if fence.job_in_path and header_job is not None and header_job != job:
        raise FencingHeaderMalformed(
            f"{fence.job_header} names another job than the path does",
            header=str(fence.job_header),
        )
    return job, token


def _fencing(fence: Fence) -> tuple[istr, istr, istr]:
    return fence.job_header, fence.token_header, fence.key_header


def _underscored(headers: Headers) -> list[tuple[str, str]]:
    """The fields whose names hold ``_``, named with ``-`` instead, lower-case. CGI and
    WSGI servers read ``Fencing_Token`` and ``Fencing-Token`` as one variable, so for
    the fencing and method-override fields they count as the field they spell."""
    return [(n.replace("_", "-").lower(), v) for n, v in headers.items() if "_" in n]


def _values(headers: Headers, name: istr, aliases: Sequence[tuple[str, str]]) -> list[str]:
    """Every value of the field ``name``, in whichever spelling it came."""
    values = headers.getall(name, [])
    if aliases:
        lower = name.lower()
        values = [*values, *(v for n, v in aliases if n == lower)]
    return values


# -- the attempt ---------------------------------------------------------------


class State(enum.Enum):
    """Where an admitted write stands, named as the model names it."""

    ADMITTED = "admitted"
    """The store committed the fence, the key's in-flight mark and the job's record."""
    SENDING = "sending"
    """In doubt: it may be at the upstream, unanswered."""
    ANSWERED = "answered"
    NOT_SENT = "not sent"
    """Given back: none of it reached the upstream."""
    UNKNOWN = "unknown"
    """Sent, no answer: the upstream may still apply it."""


class Event(enum.Enum):
    SEND = "send"
    STALL = "stall"
    """The proxy stalled past the turn's slack between admission and sending."""
    ANSWER = "answer"
    NOT_SENT = "not sent"
    """The upstream exchange failed before any of the request left."""
    END = "end"
    """The turn ends: timed out, cancelled or failed, or after an answer."""


TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.ADMITTED, Event.SEND): State.SENDING,
    (State.ADMITTED, Event.STALL): State.NOT_SENT,
    (State.ADMITTED, Event.END): State.NOT_SENT,
    (State.SENDING, Event.ANSWER): State.ANSWERED,
    (State.SENDING, Event.NOT_SENT): State.NOT_SENT,
    (State.SENDING, Event.END): State.UNKNOWN,
    (State.ANSWERED, Event.END): State.ANSWERED,
    (State.NOT_SENT, Event.END): State.NOT_SENT,
    (State.UNKNOWN, Event.END): State.UNKNOWN,
}
"""Every move an attempt can make; the states on the right of an END are final."""


class KeyFate(enum.Enum):
    """What a keyed write's key becomes in the store when its attempt ends."""

    COMPLETED = "completed"
    """Its answer is stored: a duplicate gets it replayed, or is refused."""
    FORGOTTEN = "forgotten"
    """Released: none of the write was sent, so the key may come again as new."""
    UNKNOWN = "unknown"
    """Sent without an answer: a duplicate is refused, its outcome being unknown."""


class RecordFate(enum.Enum):
    """What becomes of the job's in-flight record when the attempt ends."""

    CLEARED = "cleared"
    """The job's next write may go at once."""
    HELD = "held"
    """Kept for the route's quarantine, marked unknown: the upstream may still apply
    the write, and no later write of the job may overtake it."""


@dataclass(frozen=True, slots=True)
class Settling:
    """What a final state asks of the store, in this order: ``cut``, the exchange is
    aborted first (so no more of it reaches the upstream); ``key``, what a keyed
    write's key becomes; ``record``, what becomes of the job's in-flight record."""

    key: KeyFate
    record: RecordFate
    cut: bool


SETTLING: dict[State, Settling] = {
    State.ANSWERED: Settling(KeyFate.COMPLETED, RecordFate.CLEARED, cut=False),
    State.NOT_SENT: Settling(KeyFate.FORGOTTEN, RecordFate.CLEARED, cut=False),
    State.UNKNOWN: Settling(KeyFate.UNKNOWN, RecordFate.HELD, cut=True),
}
"""Every final state, and what it asks of the store."""

Settlement = StoredResponse | Literal["forget", "unknown"]
"""What a keyed write's key becomes: its answer, released (never sent), or unknown."""


@dataclass(frozen=True, slots=True)
class Ending:
    """One attempt's :class:`Settling`, made concrete: ``key``, what to record for the
    key (None: unkeyed); ``unknown_for``, None when the job's in-flight record is
    cleared, else the seconds it is held, marked unknown; ``cut``, whether the
    exchange is aborted before either."""

    state: State
    key: Settlement | None
    unknown_for: float | None
    cut: bool


class Attempt:
    """One admitted write of ``write`` by ``route``, whose in-flight record was dated
    at or before ``recorded_at`` (monotonic seconds)."""

    __slots__ = ("_answer", "_quarantine", "_recorded_at", "state", "timeout", "write")

    def __init__(self, write: FencedWrite, route: FencedRoute, recorded_at: float) -> None:
        self.write = write
        self.state = State.ADMITTED
        self.timeout = in_flight_for(route)
        """How long sending and the answer may take, as a whole: then it is unknown."""
        self._recorded_at = recorded_at
        self._quarantine = route.quarantine
        self._answer: StoredResponse | None = None

    def send(self, now: float) -> None:
        """About to send at ``now``. Stalled past the slack since the record was taken,
        the write is not sent (it could reach the upstream after its record expired):
        JobQuarantined, to retry it. IllegalMove unless it was admitted and not sent."""
        if now - self._recorded_at > TURN_SLACK:
            self._go(Event.STALL)
            raise JobQuarantined(
                "the proxy stalled after recording this write, which was not sent; retry it",
                retry_after=1.0,
                job=self.write.job,
            )
        self._go(Event.SEND)

    def answered(
        self, status: int, headers: tuple[tuple[str, str], ...] = (), body: bytes = b"",
        *, whole: bool = True,
    ) -> None:  # fmt: skip
        """The upstream answered; for a keyed write ``headers`` and ``body`` are what a
        replay gives back, the body only when ``whole`` (not larger than the cap).
        IllegalMove unless it was sending."""
        self._go(Event.ANSWER)
        self._answer = StoredResponse(status, headers, body if whole else None)

    def end(self, error: BaseException | None = None) -> Ending:
        """The turn ends, on ``error`` if one was raised: what its final state asks of
        the store (:data:`SETTLING`). An upstream error that says nothing was sent
        gives the write back; anything else while sending leaves its outcome unknown.
        Every state ends, so this never raises."""
        if isinstance(error, UpstreamError) and not error.sent and self.state is State.SENDING:
            self._go(Event.NOT_SENT)
        state = self._go(Event.END)
        settling = SETTLING[state]
        held = settling.record is RecordFate.HELD
        return Ending(
            state, self._key(settling.key), self._quarantine if held else None, settling.cut
        )

    def _key(self, fate: KeyFate) -> Settlement | None:
        """What to record for the key: nothing for an unkeyed write."""
        if self.write.key is None:
            return None
        if fate is KeyFate.COMPLETED:
            return self._answer
        return "forget" if fate is KeyFate.FORGOTTEN else "unknown"

    def _go(self, event: Event) -> State:
        moved = TRANSITIONS.get((self.state, event))
        if moved is None:
            raise IllegalMove(self.state, event)
        self.state = moved
        return moved
