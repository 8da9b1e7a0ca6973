"""The adapter to httptools, llhttp's binding, which parses every request head and
body the data plane (:mod:`fenceproxy.http.server`) reads: what its errors mean to
a client, in one table, the one place they are read.

llhttp runs strict (no leniency is ever turned on): it refuses bare LFs, obsolete
line folding, whitespace before a colon, control characters in a field, a
``Content-Length`` beside ``Transfer-Encoding``, two ``Content-Length`` fields,
a length that is not digits, a request ``Transfer-Encoding`` whose final coding is
not ``chunked``, and broken chunked framing. The checks it leaves to its caller
(field sizes and counts, singleton fields, ``Host``, the version) are the data
plane's own, made while the head is parsed, and raised from the parser's
callbacks; llhttp then stops with a callback error whose context is that refusal.
A callback may also stop parsing what one read brought, with no error
(:class:`ParsingStopped`): :func:`feed` tells the three apart, each by its own type.

==============================================  =========================================
raised by ``feed_data``                         answered
==============================================  =========================================
``HttpParserCallbackError``                     the refusal a callback raised, or
                                                ``ParsingStopped`` when it stopped
``HttpParserError``: "Pause on PRI/Upgrade"     505 ``VersionNotSupported`` (HTTP/2's preface)
``HttpParserInvalidMethodError``                400 ``RequestMalformed``
``HttpParserInvalidURLError``                   400 ``RequestMalformed``
``HttpParserInvalidStatusError``                400 ``RequestMalformed`` (a response's; never
                                                a request parser's)
any other ``HttpParserError``                   400 ``RequestMalformed``, naming llhttp's reason
``HttpParserUpgrade``                           not an error: the head of a request that
                                                asks for another protocol (or ``CONNECT``)
                                                is in, and llhttp parses no more
==============================================  =========================================

llhttp's reasons are fixed strings of its own (never the bytes it was fed), so the
answer may name them. ``tests/test_httptools_parser.py`` maps every exception class
httptools defines and feeds the real parser the input behind each row.
"""

from __future__ import annotations

import httptools

from ..errors import InternalError, Refusal, RequestMalformed, VersionNotSupported
from ..log import server_log

__all__ = [
    "ERRORS",
    "HttpRequestParser",
    "ParserUpgrade",
    "ParsingStopped",
    "feed",
    "parser_refusal",
]

HttpRequestParser = httptools.HttpRequestParser
ParserUpgrade = httptools.HttpParserUpgrade

_H2_PREFACE = "Pause on PRI/Upgrade"
"""llhttp's reason for HPE_PAUSED_H2_UPGRADE: the request line of HTTP/2's preface."""

ERRORS: dict[type[Exception], str] = {
    httptools.HttpParserCallbackError: "the refusal a callback raised, or ParsingStopped",
    httptools.HttpParserInvalidMethodError: "400 request-malformed",
    httptools.HttpParserInvalidURLError: "400 request-malformed",
    httptools.HttpParserInvalidStatusError: "400 request-malformed",
    httptools.HttpParserError: "400 request-malformed, or 505 for HTTP/2's preface",
    httptools.HttpParserUpgrade: "not an error: the head is in, the rest is not HTTP/1",
}
"""Every exception class httptools raises from ``feed_data``, and what it means here
(the table above; ``tests/test_httptools_parser.py`` checks it is complete)."""


class ParsingStopped(Exception):
    """Raised from a parser callback to stop parsing what one read brought, and out of
    :func:`feed` when one did: the rest of the read is left unread, by choice."""


def feed(parser: HttpRequestParser, data: bytes) -> None:
    """Parse ``data``, its callbacks run as it goes. Raises, each by its own type:
    ParsingStopped when a callback stopped it, ParserUpgrade at the head of a request
    for another protocol, and the Refusal that what came gets (:func:`parser_refusal`)."""
    try:
        parser.feed_data(data)
    except httptools.HttpParserCallbackError as exc:
        if isinstance(exc.__context__, ParsingStopped):
            raise ParsingStopped from None
        raise parser_refusal(exc) from None
    except httptools.HttpParserError as exc:  # not ParserUpgrade, which is no error
        raise parser_refusal(exc) from None


def parser_refusal(exc: Exception) -> Refusal:
    """What the parser refusing a request means to the client (a callback that failed
    with anything but a refusal is a bug: logged with its traceback, answered 500)."""
    if isinstance(exc, httptools.HttpParserCallbackError):
        cause = exc.__context__
        if isinstance(cause, Refusal):
            return cause
        server_log.error("a parser callback failed", exc_info=cause)
        return InternalError("the proxy failed on this request; nothing was forwarded")
    if not isinstance(exc, httptools.HttpParserError):
        raise exc
    reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
    if reason == _H2_PREFACE:
        return VersionNotSupported("this proxy speaks HTTP/1.1, not HTTP/2")
    if isinstance(exc, httptools.HttpParserInvalidMethodError):
        return RequestMalformed("the request is not valid HTTP/1.1: its method is not one")
    return RequestMalformed(f"the request is not valid HTTP/1.1: {reason}")
