"""The adapter to aiohttp's client protocol and response parser, which the upstream
client (:mod:`fenceproxy.http.http1`) drives: the one table of what their errors,
the socket's and a deadline's, mean to a write, and the one private name of aiohttp
it reads.

Once the request may have left (:data:`FAILURES`, :func:`map_failure`), the first
matching row wins:

==============================================  =========================================
raised                                          becomes
==============================================  =========================================
``UpstreamError``                               itself
``TimeoutError`` (aiohttp's read timeout,       504 ``UpstreamTimeout``
``ServerTimeoutError``, is one; so is the
proxy's own deadline, :func:`timed_out`)
``HttpProcessingError`` (the parser's)          502 ``UpstreamFailed``, naming its reason
``ClientError``, ``OSError``                    502 ``UpstreamFailed``, naming the class
==============================================  =========================================

While connecting (:data:`CONNECT_FAILURES`, :func:`connect_failure`), when nothing
was sent: ``TimeoutError`` and ``OSError`` become 502 ``UpstreamUnreachable``.

The parser's errors are told apart by type only: none of its texts decides anything.
``tests/test_aiohttp_client.py`` maps every exception class aiohttp's client and
parser define, and checks the protocol's surface used here exists.
"""

from __future__ import annotations

from aiohttp.client_exceptions import ClientError
from aiohttp.client_proto import ResponseHandler
from aiohttp.http import StreamWriter
from aiohttp.http_exceptions import HttpProcessingError

from ..errors import UpstreamError, UpstreamFailed, UpstreamTimeout, UpstreamUnreachable

__all__ = [
    "CONNECT_FAILURES",
    "FAILURES",
    "connect_failure",
    "map_failure",
    "stream_writer",
    "timed_out",
]

FAILURES = (ClientError, HttpProcessingError, OSError, TimeoutError)
"""What an upstream connection can raise once it is open: aiohttp's client errors
(the parser's, the protocol's), the socket's, and the read timeout."""

CONNECT_FAILURES = (TimeoutError, OSError)
"""What opening a connection can raise: the connect deadline, and the socket's."""


def timed_out() -> UpstreamTimeout:
    """No answer in time, after the request may have left."""
    return UpstreamTimeout("the upstream did not answer in time; it may have applied the write")


def map_failure(exc: BaseException) -> UpstreamError:
    """What a failure met after the request may have left means to the caller."""
    if isinstance(exc, UpstreamError):
        return exc
    if isinstance(exc, TimeoutError):  # before ClientError: aiohttp's read timeout is both
        return timed_out()
    if isinstance(exc, HttpProcessingError):
        reason = str(exc.message).splitlines()[0] if exc.message else "unparseable"
        return UpstreamFailed(
            f"the upstream's answer was malformed ({reason}); it may have applied the write"
        )
    return UpstreamFailed(
        f"the upstream connection failed after the request was sent ({type(exc).__name__}); "
        "it may have applied the write"
    )


def connect_failure(exc: BaseException, connect_timeout: float) -> UpstreamUnreachable:
    """What a failure to connect (:data:`CONNECT_FAILURES`) means: nothing was sent."""
    if isinstance(exc, TimeoutError):
        return UpstreamUnreachable(f"could not connect to the upstream within {connect_timeout:g}s")
    strerror = exc.strerror if isinstance(exc, OSError) else None
    return UpstreamUnreachable(
        f"could not connect to the upstream: {strerror or type(exc).__name__}"
    )


def stream_writer(conn: ResponseHandler) -> StreamWriter:
    """aiohttp's request writer on ``conn``."""
    return StreamWriter(conn, conn._loop)  # the protocol's loop, kept under a private name
