"""A lean HTTP/1.1 client for the upstreams, and the one boundary where its failures
become :class:`~fenceproxy.errors.UpstreamError` (as the table in
:mod:`fenceproxy.http.aiohttp_client` says).

One pool of keep-alive connections per upstream origin. A request's head goes out in
one buffer (with its body when the body is buffered); the answer is parsed by
aiohttp's own response parser (its C build where installed), the same parser and
connection protocol aiohttp's ``ClientSession`` uses, without the session's
per-request machinery (request objects, connector bookkeeping, timer contexts,
tracing, cookies, redirects).

The client adds nothing the caller did not ask for but ``Host`` (the origin's
authority unless the caller gives one) and the body's framing, never follows a
redirect, never decompresses, and never sends a request twice. A connection goes
back to its pool only once its answer was read to the end and both sides keep it
open; an answer that is malformed, cut short, timed out or abandoned closes it, and
so does anything the upstream sends unasked.

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

from aiohttp.client_proto import ResponseHandler
from aiohttp.http import HttpVersion, RawResponseMessage
from aiohttp.streams import StreamReader
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from ..errors import UpstreamFailed
from .aiohttp_client import (
    CONNECT_FAILURES,
    FAILURES,
    connect_failure,
    map_failure,
    stream_writer,
)

__all__ = ["Origin", "UpstreamResponse", "map_failure"]

# Methods whose empty body goes without a Content-Length, as aiohttp's client does.
_BODILESS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# Idle connections kept per origin, and for how long: less than the common upstream
# keep-alive timeouts (aiohttp 75 s, nginx 75 s, Node 5 s is the outlier), so a
# connection is rarely reused at the moment the upstream closes it.
_IDLE_MAX = 256
_IDLE_FOR = 4.0
# The answer's limits: aiohttp's client defaults.
_MAX_LINE = 8190
_MAX_FIELD = 8190
_MAX_HEADERS = 128
# SO_LINGER on, for 0 s: close() drops what is unsent and resets the connection.
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)
_CLOSE_GRACEFULLY = struct.pack("ii", 0, 0)


def _linger(conn: ResponseHandler, how: bytes) -> None:
    transport = conn.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):  # already reset by the peer: nothing to send
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, how)


def _close(conn: ResponseHandler) -> None:
    """End a connection whose exchange is over (or that never had one) with a FIN."""
    _linger(conn, _CLOSE_GRACEFULLY)
    conn.close()


def _abort(conn: ResponseHandler) -> asyncio.Future[None] | None:
    """Cut a connection mid-exchange: what is unsent is dropped, in the proxy and in
    the kernel, and the upstream gets a reset. Returns what is done once the socket
    is closed (on the loop's next turn), if it is not already."""
    closed = conn.closed
    conn.abort()
    return closed


async def _gone(conn: ResponseHandler) -> None:
    """Abort ``conn`` and return once its socket is closed: nothing more of the
    exchange can reach the upstream. A cancellation meanwhile is raised, the
    connection being cut all the same."""
    closed = _abort(conn)
    if closed is not None:
        await asyncio.wait((closed,))
        if not closed.cancelled():
            closed.exception()  # retrieved: a reset is what was asked for


class UpstreamResponse:
    """The upstream's status and headers; the body is read with :meth:`chunks` or
    :meth:`read_capped`. :meth:`release` must be called once done with it: it gives
    the connection back to its pool when the answer was read to the end, and closes
    it otherwise."""

    __slots__ = ("_conn", "_origin", "_payload", "headers", "reason", "status", "version")

    def __init__(
        self,
        message: RawResponseMessage,
        payload: StreamReader,
        conn: ResponseHandler,
        origin: Origin,
    ) -> None:
        self.status: int = message.code
        self.reason: str = message.reason
        self.version: HttpVersion = message.version
        self.headers: CIMultiDictProxy[str] = message.headers
        self._payload = payload
        self._conn: ResponseHandler | None = conn
        self._origin = origin

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives. Raises UpstreamError if the upstream breaks off."""
        payload = self._payload
        try:
            while chunk := await payload.readany():
                yield chunk
        except FAILURES as exc:
            raise map_failure(exc) from exc

    def received_whole(self) -> bytes | None:
        """The rest of the body if every byte of it has arrived, else None."""
        payload = self._payload
        if not payload.is_eof() or payload.exception() is not None:
            return None
        return payload.read_nowait()

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
        """Give the connection back to its pool once the answer was read to the end,
        or cut it (:meth:`cut`, not waiting for the socket to close)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._payload.is_eof() and self._payload.exception() is None:
            self._origin.put(conn)
        else:
            _abort(conn)

    async def cut(self) -> None:
        """Abort the exchange, whatever it still had to send or answer, and return
        once its socket is closed. The response is released."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await _gone(conn)


class Origin:
    """Keep-alive connections to one upstream origin (scheme, host, port)."""

    def __init__(self, url: URL) -> None:
        assert url.host is not None
        self.host = url.host
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self._ssl: ssl.SSLContext | None = (
            ssl.create_default_context() if url.scheme == "https" else None
        )
        default_port = url.port is None or url.is_default_port()
        host = f"[{url.host}]" if ":" in url.host else url.host
        self.authority = host if default_port else f"{host}:{self.port}"
        self._idle: deque[tuple[ResponseHandler, float]] = deque()
        self.opened = 0
        """Connections opened so far; how tests see that one was reused."""
        self.retired = False
        """No route names it since a reload: requests already bound to it finish,
        and each connection is closed as it comes back."""

    @property
    def idle(self) -> int:
        return len(self._idle)

    async def request(
        self,
        method: str,
        target: str,
        headers: CIMultiDict[str],
        body: bytes | AsyncIterable[bytes] | None,
        *,
        connect_timeout: float,
        read_timeout: float,
        host: str | None = None,
    ) -> UpstreamResponse:
        """Send a request and return once the upstream's status and headers are in.

        ``headers`` are sent as given, after ``Host``: ``host`` when given, else this
        origin's authority; the body's framing is set here:
        ``Content-Length`` for bytes (or a stream whose length the caller put in
        ``headers``), chunked for any other stream. ``read_timeout`` bounds each wait
        for the upstream once the request is out. Raises UpstreamError, or whatever
        the body stream raises (the connection is closed then).
        """
        conn = await self._connect(connect_timeout)
        try:
            conn.set_response_params(
                skip_payload=method == "HEAD",
                auto_decompress=False,
                read_timeout=read_timeout,
                max_line_size=_MAX_LINE,
                max_field_size=_MAX_FIELD,
                max_headers=_MAX_HEADERS,
            )
            writer = stream_writer(conn)
            out: CIMultiDict[str] = CIMultiDict(Host=self.authority if host is None else host)
            out.extend(headers)
            if isinstance(body, bytes | bytearray):
                out["Content-Length"] = str(len(body))
            elif body is None:
                if method not in _BODILESS:
                    out["Content-Length"] = "0"
            elif "Content-Length" not in out:
                out["Transfer-Encoding"] = "chunked"
                writer.enable_chunking()
            await writer.write_headers(f"{method} {target} HTTP/1.1", out)
            if body is None or isinstance(body, bytes | bytearray):
                await writer.write_eof(body or b"")
            else:
                async for chunk in body:
                    await writer.write(chunk)
                await writer.write_eof()
            conn.start_timeout()
            while True:
                message, payload = await conn.read()
                # Interim answers (100 Continue and the like) are not the answer.
                if not 100 <= message.code < 200 or message.code == 101:
                    break
        except FAILURES as exc:
            await _gone(conn)
            raise map_failure(exc) from exc
        except BaseException:
            # Cancelled (a deadline, the client gone, shutdown), or the body stream
            # failed: the exchange is cut, and only once its socket is gone does
            # the caller go on (and give the job's turn back).
            await _gone(conn)
            raise
        if message.code == 101:
            _abort(conn)
            raise UpstreamFailed("the upstream switched protocols, which is not proxied")
        return UpstreamResponse(message, payload, conn, self)

    def put(self, conn: ResponseHandler) -> None:
        """Keep a connection whose last answer was read to its end, if both sides may
        go on with it."""
        if (
            self.retired
            or conn.should_close
            or not conn.is_connected()
            or len(self._idle) >= _IDLE_MAX
        ):
            _close(conn)
            return
        self._idle.append((conn, time.monotonic()))

    async def _connect(self, connect_timeout: float) -> ResponseHandler:
        """The most recently used idle connection still open, or a new one."""
        now = time.monotonic()
        while self._idle:
            conn, since = self._idle.pop()
            if now - since < _IDLE_FOR and conn.is_connected() and not conn.should_close:
                return conn
            _close(conn)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: ResponseHandler(loop),
                    self.host,
                    self.port,
                    ssl=self._ssl,
                    server_hostname=self.host if self._ssl is not None else None,
                )
        except CONNECT_FAILURES as exc:
            raise connect_failure(exc, connect_timeout) from exc
        self.opened += 1
        _linger(conn, _RESET_ON_CLOSE)  # so even a process that dies sends no more
        return conn

    def close(self) -> None:
        while self._idle:
            _close(self._idle.pop()[0])
