"""What the upstream client's failures mean (:mod:`fenceproxy.http.http1`): the one
table of its errors, llhttp's (httptools' response parser), the socket's and a
deadline's, and the one place they become :class:`~fenceproxy.errors.UpstreamError`.

Once the request may have left (:data:`FAILURES`, :func:`map_failure`), the first
matching row wins:

==============================================  =========================================
raised                                          becomes
==============================================  =========================================
``UpstreamError``                               itself
``TimeoutError`` (the read deadline between     504 ``UpstreamTimeout``
two parts of the answer, or the proxy's own
deadline on the exchange, :func:`timed_out`)
``HttpParserUpgrade`` (a 101)                   502 ``UpstreamFailed``: switched protocols
``HttpParserError`` (the parser's)              502 ``UpstreamFailed``, naming llhttp's reason
``OSError`` (the socket's)                      502 ``UpstreamFailed``, naming the class
==============================================  =========================================

While connecting (:data:`CONNECT_FAILURES`, :func:`connect_failure`), when nothing
was sent: ``TimeoutError`` and ``OSError`` become 502 ``UpstreamUnreachable``; a TLS
handshake that fails (``ssl.SSLError``, an ``OSError``) says why, and a certificate
refused (``ssl.SSLCertVerificationError``) says what was wrong with it.

llhttp's reasons are fixed strings of its own, never the bytes it was fed.
``tests/test_client_errors.py`` maps every exception class httptools defines and
feeds the real parser the answers behind the rows.
"""

from __future__ import annotations

import ssl

import httptools

from ..errors import UpstreamError, UpstreamFailed, UpstreamTimeout, UpstreamUnreachable

__all__ = [
    "CONNECT_FAILURES",
    "FAILURES",
    "body_not_taken",
    "connect_failure",
    "map_failure",
    "timed_out",
]

FAILURES = (UpstreamError, TimeoutError, httptools.HttpParserUpgrade, httptools.HttpParserError,
            OSError)  # fmt: skip
"""What an upstream connection can raise once it is open, the table's rows in order."""

CONNECT_FAILURES = (TimeoutError, OSError)
"""What opening a connection can raise: the connect deadline, and the socket's."""


def timed_out() -> UpstreamTimeout:
    """No answer in time, after the request may have left."""
    return UpstreamTimeout("the upstream did not answer in time; it may have applied the write")


def body_not_taken(seconds: float) -> UpstreamTimeout:
    """The upstream took none of a request body for ``seconds``: the exchange is cut."""
    return UpstreamTimeout(
        f"the upstream took none of the request body for {seconds:g}s; it was cut, and "
        "may have applied part of what it read"
    )


def map_failure(exc: BaseException) -> UpstreamError:
    """What a failure met after the request may have left means to the caller."""
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, TimeoutError):
        return timed_out()
    if isinstance(exc, httptools.HttpParserUpgrade):
        return UpstreamFailed("the upstream switched protocols, which is not proxied")
    if isinstance(exc, httptools.HttpParserError):
        reason = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        return UpstreamFailed(
            f"the upstream's answer was malformed ({reason}); it may have applied the write"
        )
    return UpstreamFailed(
        f"the upstream connection failed after the request was sent ({type(exc).__name__}); "
        "it may have applied the write"
    )


def connect_failure(exc: BaseException, connect_timeout: float) -> UpstreamUnreachable:
    """What a failure to connect (:data:`CONNECT_FAILURES`) means: nothing was sent."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return UpstreamUnreachable(
            f"the upstream's TLS certificate was refused: {exc.verify_message or exc.reason}"
        )
    if isinstance(exc, ssl.SSLError):
        return UpstreamUnreachable(
            f"the TLS handshake with the upstream failed: {exc.reason or type(exc).__name__}"
        )
    if isinstance(exc, TimeoutError):
        return UpstreamUnreachable(f"could not connect to the upstream within {connect_timeout:g}s")
    strerror = exc.strerror if isinstance(exc, OSError) else None
    return UpstreamUnreachable(
        f"could not connect to the upstream: {strerror or type(exc).__name__}"
    )
