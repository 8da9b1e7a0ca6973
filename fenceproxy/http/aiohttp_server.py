"""The adapter to aiohttp's low-level server: every private name of aiohttp the edge
(:mod:`fenceproxy.http.edge`) reads, and what each error aiohttp's request parser
raises means to a client.

**Private reads**, each on one line below with why, and nowhere else in fenceproxy;
``tests/test_aiohttp_server.py`` checks each still exists on the installed aiohttp,
which is pinned below its next minor version for them:

* ``web.Server._kwargs`` and ``_loop``: what a connection's handler is made with;
* ``RequestHandler._request_in_progress``, ``_current_request``, ``_messages``,
  ``_request_count`` and ``_force_close``: where a connection is in its requests;
* ``StreamReader._buffer`` and ``_size``: a body nobody will read, freed at once.

The rest the edge uses is aiohttp's public surface: ``web.Server``'s documented
``request_factory``, the handler's ``finish_response``, ``handle_error``,
``data_received`` and ``force_close``, and a parsed head's ``_replace`` (it is a
named tuple).

**The request parser's errors** (:func:`request_refusal`, :func:`body_refusal`) are
told apart by type, aiohttp's ``LineTooLong`` and ``HttpProcessingError``, save two
the parser raises as a plain ``BadHttpMessage``. Those are matched by the text it
gives them, here only (:data:`PARSER_TEXTS`), and the test feeds the real parser the
input that makes each, so a changed wording fails the test rather than the answer:

==============================================  =========================================
raised                                          answered
==============================================  =========================================
``LineTooLong``                                 431 ``RequestHeadTooLarge``
``BadHttpMessage``: "Too many headers received"  431 ``RequestHeadTooLarge``
``BadHttpMessage``: "Pause on PRI/Upgrade"      505 ``VersionNotSupported`` (HTTP/2's preface)
any other ``HttpProcessingError``               400 ``RequestMalformed``
==============================================  =========================================

and, while a body is read, :data:`BODY_FAILURES`:

==============================================  =========================================
``TimeoutError`` of the body's own deadline     408 ``BodyTimeout``
any other ``TimeoutError``, ``OSError``         499 ``ClientClosedRequest``
``HttpProcessingError``                         400 ``RequestMalformed`` (broken framing)
==============================================  =========================================
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from ..errors import (
    BodyTimeout,
    ClientClosedRequest,
    Refusal,
    RequestHeadTooLarge,
    RequestMalformed,
    VersionNotSupported,
)

__all__ = [
    "BODY_FAILURES",
    "PARSER_TEXTS",
    "HandlerBase",
    "ServerBase",
    "body_refusal",
    "clear_buffer",
    "reason",
    "request_refusal",
]

PARSER_TEXTS: dict[str, type[Refusal]] = {
    # llhttp counts no headers; aiohttp's parser raises this above max_headers.
    "Too many headers received": RequestHeadTooLarge,
    # llhttp's reason for HPE_PAUSED_H2_UPGRADE: the request line of HTTP/2's preface.
    "Pause on PRI/Upgrade": VersionNotSupported,
}
"""The parser's reasons (:func:`reason`) that its exception type does not tell apart."""

BODY_FAILURES = (TimeoutError, OSError, HttpProcessingError)
"""What reading a request's body can raise, besides a refusal of the proxy's own."""


class ServerBase(web.Server):
    """aiohttp's low-level server, with what it keeps privately by a public name."""

    @property
    def handler_kwargs(self) -> dict[str, Any]:
        return self._kwargs  # web.Server's **kwargs, which it makes each RequestHandler with

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop  # web.Server's loop, which a BaseRequest is made with


class HandlerBase(RequestHandler):
    """aiohttp's handler of one connection, with the state of it the edge reads."""

    __slots__ = ()

    @property
    def request_in_progress(self) -> bool:
        return self._request_in_progress  # a request's handler is running on the connection

    @property
    def current_request(self) -> BaseRequest | None:
        return self._current_request  # the request being handled, if any

    @property
    def messages_waiting(self) -> bool:
        return bool(self._messages)  # parsed requests queued behind the current one

    @property
    def request_count(self) -> int:
        return self._request_count  # requests whose head the parser has given so far

    @property
    def force_closing(self) -> bool:
        return self._force_close  # force_close() was called: the connection is ending

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop  # the loop the handler was made with


def clear_buffer(payload: StreamReader) -> None:
    """Free what a body's reader holds, now, even once it has failed (its ``read``
    methods refuse then, and the parser goes on appending until the socket closes)."""
    payload._buffer.clear()  # the chunks received and not yet read
    payload._size = 0  # their length, which flow control reads


def reason(exc: HttpProcessingError) -> str:
    """The parser's reason, without the bytes it quotes after a colon."""
    text = str(exc.message).splitlines()[0] if exc.message else type(exc).__name__
    return text.split(":")[0].strip()[:120]


def request_refusal(exc: HttpProcessingError, max_line_size: int, max_headers: int) -> Refusal:
    """What the parser refusing a request head means to the client."""
    said = reason(exc)
    kind = RequestHeadTooLarge if isinstance(exc, LineTooLong) else PARSER_TEXTS.get(said)
    if kind is RequestHeadTooLarge:
        return RequestHeadTooLarge(
            f"the request line or a header is longer than {max_line_size} bytes, "
            f"or there are more than {max_headers} headers"
        )
    if kind is VersionNotSupported:
        return VersionNotSupported("this proxy speaks HTTP/1.1, not HTTP/2")
    return RequestMalformed(f"the request is not valid HTTP/1.1: {said}")


def body_refusal(exc: BaseException, *, timeout: float, expired: bool) -> Refusal:
    """What an error of :data:`BODY_FAILURES` met while reading a body means; ``expired``
    tells whether the body's own deadline (``timeout`` seconds of silence) ran out."""
    if isinstance(exc, TimeoutError):
        if not expired:
            return ClientClosedRequest("the client's connection timed out")
        return BodyTimeout(
            f"no part of the body arrived for {timeout:g}s; nothing was forwarded complete"
        )
    if isinstance(exc, HttpProcessingError):
        return RequestMalformed(f"the body's framing is broken: {reason(exc)}")
    return ClientClosedRequest("the client's connection closed mid-body")
