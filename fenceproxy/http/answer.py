"""What the data plane sends back: an :class:`Answer`, whole or streamed, and the
one place its head is written out as bytes."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from email.utils import formatdate
from http import HTTPStatus

from multidict import CIMultiDict

from ..errors import Refusal

__all__ = [
    "NO_BODY",
    "PROBLEM_JSON",
    "Answer",
    "head_bytes",
    "http_date",
    "problem_answer",
    "raw_problem",
    "reason",
    "retry_after",
]

PROBLEM_JSON = "application/problem+json"
NO_BODY = frozenset({204, 304})
"""Statuses whose answer has no body, whatever its fields say."""


class Answer:
    """A status, its fields and a body: ``body`` whole, or ``body`` and then what
    ``stream`` yields (an upstream's answer relayed as it arrives). Its fields are
    ``headers``, and, for an upstream's answer, ``fields``: the upstream's as they
    came (with ``Date``), already encoded. ``finish`` is called once the answer was
    sent or given up (an upstream connection given back). ``decision`` says what
    became of a fenced write (never sent as a field)."""

    __slots__ = (
        "body",
        "close",
        "decision",
        "fields",
        "finish",
        "framed",
        "headers",
        "reason",
        "status",
        "stream",
    )

    def __init__(
        self,
        status: int,
        headers: CIMultiDict[str] | None = None,
        body: bytes = b"",
        *,
        reason: str | None = None,
        fields: bytes = b"",
        framed: bool = False,
        stream: AsyncIterator[bytes] | None = None,
        finish: Callable[[], None] | None = None,
    ) -> None:
        self.status = status
        self.headers: CIMultiDict[str] = CIMultiDict() if headers is None else headers
        self.body = body
        self.reason = reason
        self.fields = fields
        self.framed = framed
        """``fields`` hold the body's ``Content-Length`` (a streamed answer's)."""
        self.stream = stream
        self.finish = finish
        self.decision: str | None = None
        self.close = False
        """The connection is closed after it."""

    @classmethod
    def json(
        cls, data: object, status: int = 200, content_type: str = "application/json"
    ) -> Answer:
        headers: CIMultiDict[str] = CIMultiDict({"Content-Type": f"{content_type}; charset=utf-8"})
        return cls(status, headers, json.dumps(data).encode())


def problem_answer(refusal: Refusal) -> Answer:
    """``refusal`` as an RFC 9457 problem."""
    answer = Answer.json(refusal.problem(), refusal.status, PROBLEM_JSON)
    answer.reason = reason(refusal.status)
    if refusal.retry_after is not None:
        answer.headers["Retry-After"] = retry_after(refusal.retry_after)
    if refusal.challenge is not None:
        answer.headers["WWW-Authenticate"] = refusal.challenge
    return answer


def raw_problem(refusal: Refusal) -> bytes:
    """A whole answer that closes the connection, for when no request was read."""
    answer = problem_answer(refusal)
    return head_bytes(answer, "HTTP/1.1", close=True, length=True) + answer.body


def retry_after(seconds: float) -> str:
    """Whole seconds, rounded up, at least one."""
    return str(max(1, round(seconds + 0.499)))


def reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Client Closed Request" if status == 499 else "Refused"


class _Clock:
    """The ``Date`` field, formatted once a second."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = formatdate(now, usegmt=True).encode()
        return self._value


http_date = _Clock()
"""The ``Date`` field's value for now."""


def head_bytes(
    answer: Answer,
    version: str,
    *,
    close: bool,
    length: bool,
    chunked: bool = False,
    keep_alive_10: bool = False,
) -> bytes:
    """The status line and fields of ``answer``, ended by the empty line: its
    ``fields``, then its ``headers`` in their order, ``Date`` when it has none, the
    framing (its body's ``Content-Length`` when ``length``, or chunked) and
    ``Connection``. Values go out as they came in (surrogate escapes back to their
    bytes)."""
    status = answer.status
    phrase = answer.reason if answer.reason is not None else reason(status)
    head = f"{version} {status} {phrase}\r\n".encode("utf-8", "surrogateescape") + answer.fields
    headers = answer.headers
    if headers:
        head += "".join(f"{name}: {value}\r\n" for name, value in headers.items()).encode(
            "utf-8", "surrogateescape"
        )
    if not answer.fields and "Date" not in headers:  # an upstream's fields are dated
        head += b"Date: " + http_date() + b"\r\n"
    if length:
        head += b"Content-Length: %d\r\n" % len(answer.body)
    elif chunked:
        head += b"Transfer-Encoding: chunked\r\n"
    if close:
        head += b"Connection: close\r\n"
    elif keep_alive_10:
        head += b"Connection: keep-alive\r\n"
    return head + b"\r\n"
