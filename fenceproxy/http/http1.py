"""A lean HTTP/1.1 client for the upstreams, on llhttp (httptools' response parser):
one pool of keep-alive connections per upstream origin, and the one boundary where
its failures become :class:`~fenceproxy.errors.UpstreamError` (as the table in
:mod:`fenceproxy.http.client_errors` says).

A request goes out in one write, its head and (when it is whole) its body; the
answer's fields are kept as the bytes that came (:attr:`UpstreamResponse.fields`),
and read as a mapping only when asked. Nothing is built that the proxy does not
read: no request or response objects of a library, no cookie jar, no redirects, no
decompression, no tracing.

The client adds nothing the caller did not ask for but ``Host`` (the origin's
authority unless the caller gives one) and the body's framing, never follows a
redirect, never decompresses, and never sends a request twice. A connection goes
back to its pool only once its answer was read to the end and both sides keep it
open; an answer that is malformed, cut short, timed out or abandoned closes it, and
so does anything the upstream sends unasked. The answer to a ``HEAD`` carries no
body whatever its framing says, and the next exchange on its connection starts
with a new parser.

What a failure means for a write (``UpstreamError.sent``): only a failure to
connect is known to have sent nothing. Once a byte of the request may have left,
the upstream may apply it.

A cut exchange is cut, never finished: when a request fails, times out or is
cancelled before its answer was read whole, its connection is *aborted*. What the
proxy still buffered of the request is dropped, and the socket, which discards
what the kernel still holds unsent (``SO_LINGER`` 0, set when it connects), resets
the connection: no more of the request reaches the upstream, which sees the body
end short and never a whole request. A graceful close would flush the rest, so a
write cut at its deadline could still land long after a newer one. The same holds
when the process dies: the kernel resets its upstream sockets rather than sending
their buffers on. A connection is closed gracefully only once its exchange is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator
from typing import cast

import httptools
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from ..errors import UpstreamFailed
from ..tls import ClientTLS, client_context
from .answer import NO_BODY
from .body import Body, Flow, read_fields
from .client_errors import (
    CONNECT_FAILURES,
    FAILURES,
    body_not_taken,
    connect_failure,
    map_failure,
)
from .request import HTTP10, HTTP11, MAX_HEAD, MAX_LINE, NONE_NAMED, Version, connection_named

__all__ = ["Origin", "UpstreamConnection", "UpstreamResponse", "encode_fields", "map_failure"]

# Methods whose empty body goes without a Content-Length, as common clients do.
_BODILESS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# Idle connections kept per origin, and for how long: less than the common upstream
# keep-alive timeouts (aiohttp 75 s, nginx 75 s, Node 5 s is the outlier), so a
# connection is rarely reused at the moment the upstream closes it.
_IDLE_MAX = 256
_IDLE_FOR = 4.0
# The answer's limits: the request's line and head sizes (MAX_LINE, MAX_HEAD), and
# more fields than a request may have, as aiohttp's client allows.
_MAX_FIELDS = 128
# SO_LINGER on, for 0 s: close() drops what is unsent and resets the connection.
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)
_CLOSE_GRACEFULLY = struct.pack("ii", 0, 0)


def encode_fields(headers: CIMultiDict[str]) -> bytes:
    """Header fields as they go on the wire, values back to the bytes they came as."""
    return "".join(f"{name}: {value}\r\n" for name, value in headers.items()).encode(
        "utf-8", "surrogateescape"
    )


class UpstreamResponse:
    """The upstream's status and fields; the body is read with :meth:`chunks` or
    :meth:`read_capped`. :meth:`release` must be called once done with it: it gives
    the connection back to its pool when the answer arrived to its end, and closes
    it otherwise."""

    __slots__ = (
        "_conn",
        "_headers",
        "_origin",
        "_payload",
        "connection_named",
        "content_length",
        "raw_fields",
        "reason",
        "status",
        "version",
    )

    def __init__(
        self,
        status: int,
        reason: str,
        version: Version,
        raw_fields: list[tuple[bytes, bytes]],
        payload: Body,
        conn: UpstreamConnection,
        origin: Origin,
    ) -> None:
        self.status = status
        self.reason = reason
        self.version = version
        self.raw_fields = raw_fields
        """The answer's fields as the bytes that came, names as sent, in order."""
        self.content_length: int | None = None
        self.connection_named = NONE_NAMED
        """The names its ``Connection`` fields list: hop-by-hop too."""
        self._headers: CIMultiDictProxy[str] | None = None
        self._payload = payload
        self._conn: UpstreamConnection | None = conn
        self._origin = origin

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        """The answer's fields as a case-insensitive mapping, values decoded as UTF-8
        (bytes that are not kept as surrogate escapes)."""
        if self._headers is None:
            self._headers = read_fields(self.raw_fields)
        return self._headers

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives. Raises UpstreamError if the upstream breaks off."""
        payload = self._payload
        while chunk := await payload.next():
            yield chunk

    def received_whole(self) -> bytes | None:
        """The rest of the body if every byte of it has arrived, else None."""
        return self._payload.whole_now()

    async def read_capped(self, cap: int) -> tuple[bytes, bool]:
        """Up to a little over ``cap`` bytes of the body, and whether that is all of it."""
        whole = self.received_whole()
        if whole is not None:
            return whole, len(whole) <= cap
        data = bytearray()
        async for chunk in self.chunks():
            data += chunk
            if len(data) > cap:
                return bytes(data), False
        return bytes(data), True

    def release(self) -> None:
        """Give the connection back to its pool once the answer arrived to its end
        (what of it was not read is dropped, and reading let go), or abort it, not
        waiting for the socket to close."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        done = self._payload.done
        self._payload.discard()
        if done:
            self._origin.put(conn)
        else:
            conn.abort()

    async def cut(self) -> None:
        """Abort the exchange, whatever it still had to send or answer, and return
        once its socket is closed. The response is released."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.gone()


class UpstreamConnection(Flow):
    """One connection to an upstream, one exchange at a time: llhttp's callbacks build
    the answer; a deadline between two reads fails it."""

    def __init__(self, origin: Origin) -> None:
        super().__init__()
        self._origin = origin
        self._loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[None] = self._loop.create_future()
        """Done once the socket is closed."""
        self.should_close = False
        """The upstream will not go on with it, or it broke: never reused."""
        self._parser = httptools.HttpResponseParser(self)
        self._stale_parser = False  # a HEAD's answer left it waiting for a body
        self._method = ""
        self._head: asyncio.Future[UpstreamResponse] | None = None
        self._response: UpstreamResponse | None = None
        self._until_close = False  # the answer's body ends with the connection
        self._interim = False
        self._unasked = False
        self._reason = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._read_timeout = 0.0
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._sent = False  # the exchange's request is out
        self._reported = False  # a parser callback came during this read
        self._unreported = 0  # bytes read since the parser last reported anything

    # -- the exchange -------------------------------------------------------------------

    def is_connected(self) -> bool:
        return (
            self.transport is not None
            and not self.transport.is_closing()
            and not self.closed.done()
        )

    def begin(self, method: str, read_timeout: float) -> None:
        """A request is about to go out on this connection."""
        if self._stale_parser:
            self._parser = httptools.HttpResponseParser(self)
            self._stale_parser = False
        self._method = method
        self._read_timeout = read_timeout
        self._head = self._loop.create_future()
        self._response = None
        self._unasked = False
        self._sent = False  # the read deadline waits for the request to be out

    def sent(self) -> None:
        """The request is out: the read deadline runs from now."""
        self._sent = True
        self._last_read = self._loop.time()
        if self._timer is None and self._in_exchange():
            self._timer = self._loop.call_at(self._last_read + self._read_timeout, self._check)

    async def answer(self) -> UpstreamResponse:
        """The answer's status and fields, once they are in."""
        assert self._head is not None
        return await self._head

    def abort(self) -> None:
        """Cut the connection: the unsent is dropped, the upstream gets a reset."""
        self.should_close = True
        if self.transport is not None:
            self.transport.abort()

    async def gone(self) -> None:
        """Abort and return once the socket is closed: nothing more of the exchange can
        reach the upstream. A cancellation meanwhile is raised, the connection being
        cut all the same."""
        self.abort()
        await asyncio.wait((self.closed,))

    def close(self) -> None:
        """End a connection whose exchange is over (or never began) with a FIN."""
        self.should_close = True
        self._set_so_linger(_CLOSE_GRACEFULLY)
        if self.transport is not None:
            self.transport.close()

    def _in_exchange(self) -> bool:
        """A request is out whose answer has not all arrived."""
        return self._awaits_head() or (
            self._response is not None and not self._response._payload.is_eof()
        )

    def _awaits_head(self) -> bool:
        return self._head is not None and not self._head.done()

    def _fail(self, exc: BaseException) -> None:
        """The exchange in progress cannot go on: its caller gets ``exc`` mapped."""
        self.should_close = True
        error = map_failure(exc)
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # retrieved by answer(), or by nobody if it gave up
        elif self._response is not None:
            self._response._payload.fail(error)
        self._stop_timer()

    def _check(self) -> None:
        """The read deadline: no byte of the answer for ``read_timeout``, once the
        request is out, fails it. One timer per connection, not per exchange: set
        when a request is out, it outlives a quick exchange and, when it fires while
        the next is waiting for its answer, sets itself again from the last byte
        read (or the request's end); while a request is still going out, it lets go,
        to be set again once it is out."""
        self._timer = None
        if not self._sent or not self._in_exchange() or self._held:
            return  # set again when a request is out, or reading resumes
        due = self._last_read + self._read_timeout
        if self._loop.time() >= due:
            self._fail(TimeoutError())
            self.abort()
        else:
            self._timer = self._loop.call_at(due, self._check)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _set_so_linger(self, how: bytes) -> None:
        transport = self.transport
        if transport is None or self.closed.done():
            return  # closed already: nothing to send
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # OSError: reset by the peer meanwhile; ValueError: uvloop's socket is gone.
            with contextlib.suppress(OSError, ValueError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, how)

    # -- the transport's side -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self._set_so_linger(_RESET_ON_CLOSE)  # so even a process that dies sends no more

    def data_received(self, data: bytes) -> None:
        self._last_read = self._loop.time()
        if not self._in_exchange():
            self.should_close = True  # sent unasked: never reused
            return
        self._reported = False
        try:
            self._parser.feed_data(data)
        except FAILURES as exc:
            self._fail(exc)
            self.abort()
            return
        # llhttp holds what it has not reported (a field that never ends): no more
        # than MAX_HEAD of it, give or take one read.
        self._unreported = 0 if self._reported else self._unreported + len(data)
        if self._unreported > MAX_HEAD:
            self._fail(UpstreamFailed("the upstream's answer has a head too large to read"))
            self.abort()

    def eof_received(self) -> bool:
        self.should_close = True
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self.should_close = True
        response = self._response
        if response is not None and not response._payload.is_eof() and self._until_close:
            if exc is None:
                response._payload.finish()  # an answer that ends with its connection
            self._until_close = False
        if self._in_exchange():
            self._fail(exc or ConnectionResetError("the upstream closed the connection"))
        self._stop_timer()
        self.flow_lost()
        if not self.closed.done():
            self.closed.set_result(None)

    def reading_again(self) -> None:
        """The reader caught up: read again, the read deadline from now."""
        super().reading_again()
        self._last_read = self._loop.time()
        if self._timer is None and self._sent and self._in_exchange():
            self._timer = self._loop.call_at(self._last_read + self._read_timeout, self._check)

    # -- llhttp's callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._reported = True
        self._reason = b""
        self._fields = []
        self._interim = False
        if not self._awaits_head():
            self._unasked = True  # a second answer to one request
            self.should_close = True

    def on_status(self, reason: bytes) -> None:
        self._reported = True
        self._reason += reason
        if len(self._reason) > MAX_LINE:
            raise ValueError("the status line is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._reported = True
        if self._unasked or self._response is not None:
            return  # trailers, or an answer nobody asked for
        if len(self._fields) >= _MAX_FIELDS or len(name) + len(value) > MAX_LINE:
            raise ValueError("the answer's head is too large")
        self._fields.append((name, value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        self._reported = True
        if self._unasked:
            return
        parser = self._parser
        status = parser.get_status_code()
        if status == 101:
            self._fail(httptools.HttpParserUpgrade())  # never relayed
            return
        if 100 <= status < 200:
            self._interim = True  # 100 Continue and the like are not the answer
            return
        version = HTTP11 if parser.get_http_version() == "1.1" else HTTP10
        if not parser.should_keep_alive():
            self.should_close = True
        body = Body(self)
        length, coding, named = _framing(self._fields)
        if coding is not None and coding.strip().lower() != b"chunked":
            self._fail(
                UpstreamFailed(
                    "the upstream's answer has a transfer coding other than chunked, which "
                    "is not relayed; it may have applied the write"
                )
            )
            return
        # Bytes that are not UTF-8 kept as surrogate escapes: they go back out as they came.
        reason = self._reason.decode("utf-8", "surrogateescape")
        response = UpstreamResponse(
            status, reason, version, self._fields, body, self, self._origin
        )  # fmt: skip
        self._response = response
        response.content_length = length
        response.connection_named = named
        if self._method == "HEAD" or status in NO_BODY:
            body.finish()
            self._stale_parser = self._method == "HEAD"  # it may wait for a body
        else:
            self._until_close = length is None and coding is None
        head = self._head
        if head is not None and not head.done():
            head.set_result(response)

    def on_body(self, data: bytes) -> None:
        self._reported = True
        response = self._response
        if response is not None and not self._unasked and not self._stale_parser:
            response._payload.feed(data)

    def on_message_complete(self) -> None:
        self._reported = True
        if self._interim or self._unasked:
            return
        response = self._response
        if response is not None and not self._stale_parser:
            response._payload.finish()
            self._until_close = False


def _framing(
    fields: list[tuple[bytes, bytes]],
) -> tuple[int | None, bytes | None, frozenset[bytes]]:
    """The answer's Content-Length and Transfer-Encoding (llhttp checked how they
    frame it), and the names its ``Connection`` fields list."""
    length, coding, named = None, None, NONE_NAMED
    for name, value in fields:
        lower = name.lower()
        if lower == b"content-length":
            length = int(value)
        elif lower == b"transfer-encoding":
            coding = value if coding is None else coding + b", " + value
        elif lower == b"connection":
            named = connection_named(fields)
    return length, coding, named


class Origin:
    """Keep-alive connections to one upstream origin (scheme, host, port)."""

    def __init__(self, url: URL, tls: ClientTLS | None = None) -> None:
        assert url.host is not None
        self.host = url.host
        self.port = url.port or (443 if url.scheme == "https" else 80)
        https = url.scheme == "https"
        self._tls = tls
        self._ssl: ssl.SSLContext | None = client_context(tls) if https else None
        self._server_name = (tls.server_name if tls is not None else None) or url.host
        default_port = url.port is None or url.is_default_port()
        host = f"[{url.host}]" if ":" in url.host else url.host
        self.authority = host if default_port else f"{host}:{self.port}"
        self._authority = self.authority.encode("ascii")
        self._idle: deque[tuple[UpstreamConnection, float]] = deque()
        self.opened = 0
        """Connections opened so far; how tests see that one was reused."""
        self.retired = False
        """No route names it since a reload: requests already bound to it finish,
        and each connection is closed as it comes back."""

    @property
    def idle(self) -> int:
        return len(self._idle)

    def renew_tls(self) -> None:
        """Load the route's CA and client certificate files again (a reload: renewed
        where they are), for the connections opened from now on; ValueError naming
        the file when one cannot be loaded, the context left as it was."""
        if self._ssl is not None and self._tls is not None:
            self._ssl = client_context(self._tls)

    async def request(
        self,
        method: str,
        target: str,
        headers: CIMultiDict[str] | bytes,
        body: bytes | AsyncIterable[bytes] | None,
        *,
        connect_timeout: float,
        read_timeout: float,
        host: str | None = None,
        length: int | None = None,
    ) -> UpstreamResponse:
        """Send a request and return once the upstream's status and fields are in.

        ``headers`` (a mapping, or field lines already encoded) are sent as given,
        after ``Host``: ``host`` when given, else this origin's authority; the body's
        framing is set here: ``Content-Length`` for bytes, or for a stream whose
        ``length`` the caller knows, chunked for any other stream.
        ``read_timeout`` bounds each wait for the upstream once the request is out.
        Raises UpstreamError, or whatever the body stream raises (the connection is
        closed then).
        """
        conn = await self._connect(connect_timeout)
        fields = headers if isinstance(headers, bytes) else encode_fields(headers)
        authority = self._authority if host is None else host.encode("utf-8", "surrogateescape")
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\n%s" % (
            method.encode("ascii"),
            target.encode("utf-8", "surrogateescape"),
            authority,
            fields,
        )
        try:
            conn.begin(method, read_timeout)
            transport = conn.transport
            assert transport is not None
            if isinstance(body, bytes | bytearray):
                transport.write(b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body))
            elif body is None:
                transport.write(head + b"\r\n" if method in _BODILESS else head + _EMPTY)
            else:
                await _send_stream(conn, transport, head, body, length, within=read_timeout)
            conn.sent()
            return await conn.answer()
        except FAILURES as exc:
            await conn.gone()
            raise map_failure(exc) from exc
        except BaseException:
            # Cancelled (a deadline, the client gone, shutdown), or the body stream
            # failed: the exchange is cut, and only once its socket is gone does
            # the caller go on (and give the job's turn back).
            await conn.gone()
            raise

    def put(self, conn: UpstreamConnection) -> None:
        """Keep a connection whose last answer arrived to its end, if both sides may
        go on with it."""
        if (
            self.retired
            or conn.should_close
            or not conn.is_connected()
            or conn.holds_reading
            or len(self._idle) >= _IDLE_MAX
        ):
            conn.close()
            return
        self._idle.append((conn, time.monotonic()))

    async def _connect(self, connect_timeout: float) -> UpstreamConnection:
        """The most recently used idle connection still open, or a new one."""
        now = time.monotonic()
        idle = self._idle
        while idle and (now - idle[0][1] >= _IDLE_FOR or not idle[0][0].is_connected()):
            idle.popleft()[0].close()  # the oldest, gone stale or closed by the upstream
        while idle:
            conn, since = idle.pop()
            if now - since < _IDLE_FOR and conn.is_connected() and not conn.should_close:
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: UpstreamConnection(self),
                    self.host,
                    self.port,
                    ssl=self._ssl,
                    server_hostname=self._server_name if self._ssl is not None else None,
                )
        except CONNECT_FAILURES as exc:
            raise connect_failure(exc, connect_timeout) from exc
        self.opened += 1
        return conn

    def close(self) -> None:
        while self._idle:
            self._idle.pop()[0].close()


_EMPTY = b"Content-Length: 0\r\n\r\n"


async def _send_stream(
    conn: UpstreamConnection,
    transport: asyncio.Transport,
    head: bytes,
    body: AsyncIterable[bytes],
    length: int | None,
    *,
    within: float,
) -> None:
    """A body as it comes: framed by its ``length`` when the caller knows it, else
    chunked; waiting for the socket whenever it is full, ``within`` seconds at most:
    an upstream that takes none of it for that long is cut (UpstreamTimeout)."""
    chunked = length is None
    if length is None:
        transport.write(head + b"Transfer-Encoding: chunked\r\n\r\n")
    else:
        transport.write(b"%sContent-Length: %d\r\n\r\n" % (head, length))
    left = length
    async for chunk in body:
        if not chunk:
            continue
        if left is not None:
            left -= len(chunk)
            if left < 0:  # more than declared: never sent as the start of another request
                raise ValueError("a body longer than its declared length")
        if chunked:
            transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
        else:
            transport.write(chunk)
        if not conn.writing_paused:
            await conn.drain()  # at once; raises when the upstream is gone
            continue
        try:
            async with asyncio.timeout(within):
                await conn.drain()
        except TimeoutError:
            raise body_not_taken(within) from None
    if chunked:
        transport.write(b"0\r\n\r\n")
    elif left:
        raise ValueError("a body shorter than its declared length")
