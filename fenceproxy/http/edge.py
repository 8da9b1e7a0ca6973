"""The HTTP edge: aiohttp's low-level server with the proxy's own limits at the door,
and every answer it gives before a handler runs as an RFC 9457 problem.

What a client may hold of the proxy (``limits:`` in the config, nginx's defaults):

* **the request head** must arrive within ``header_timeout`` of its first byte (or of
  the connection's opening): 408 and the connection is closed;
* **a body** may pause at most ``body_timeout`` between two reads: 408;
* **bodies held in memory** (a fenced write's, read whole before its turn; a lease
  call's; a small unfenced one's) are counted across every request, and a body that
  would take the total above ``max_buffered`` gets 503 with ``Retry-After``; a fenced
  write's body beyond ``body_buffer`` goes to a file as it arrives
  (:mod:`fenceproxy.spool`), and only what waits to be written counts;
* **open connections** are capped at ``max_connections``, lowered at start to fit
  the descriptor limit (each may need an upstream connection too). A connection
  beyond the cap closes the least recently active one that the proxy is not working
  for (idle, or still sending its request), so a live client is still served while
  stalled ones hold the cap; only when every connection is being worked for is the
  newcomer refused with 503;
* **an idle keep-alive connection** is closed after ``keepalive_timeout``.

HTTP/1.1 as clients use it:

* **``Expect: 100-continue``** (curl above 1 KiB, botocore on every upload) gets
  ``100 Continue`` once the request has passed every check that needs no body, just
  before its body is first read (:class:`Bodies`, the one place bodies are read,
  after the declared length is checked against the limit), once, and only in
  HTTP/1.1; in HTTP/1.0 it is ignored. Any other expectation gets 417;
* **an answer given before the request's body is all in** (a refusal on the head,
  413 by ``Content-Length``, 408 or 503 mid-body, 417, or a client still sending)
  says ``Connection: close`` (RFC 9110 §10.1.1): neither the body nor a request the
  client sends behind it is ever read as a request. The answer ends with the
  proxy's FIN; then the connection lingers, reading and dropping what the client
  still sends so it is not reset before it reads the answer, until the client
  closes, for at most ``LINGER_FOR`` (1 s) and ``LINGER_BYTES`` (1 MiB), and is
  closed. A lingering connection is not worked for, so the cap may take it back
  (aiohttp's own lingering, 10 s and unbounded in bytes, is off).

The HTTP layer's own refusals (framing, a line too long, too many headers, another
HTTP version, the HTTP/2 preface) are answered as problems too, and logged in one
line. A request that carries ``Upgrade`` is answered as plain HTTP/1.1, then the
connection is closed: nothing sent behind it is read as a request.

This module subclasses aiohttp's ``web.Server`` and ``RequestHandler``, makes each
request with the server's documented ``request_factory``, and reads aiohttp's
internal state only through :mod:`fenceproxy.http.aiohttp_server`, which names each
private read and says what the parser's errors mean.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import HttpVersion10, HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import EmptyStreamReader, StreamReader
from aiohttp.web_protocol import RequestHandler
from yarl import URL

from ..config import LimitsSpec
from ..errors import (
    BodyTooLarge,
    ExpectationFailed,
    HeaderTimeout,
    InternalError,
    ProxyBusy,
    Refusal,
    RequestTargetMalformed,
    VersionNotSupported,
)
from ..fence.fencing import Digest
from ..log import server_log
from ..spool import CHUNK, SpoolFile, SpoolFolder, spool_failure
from .aiohttp_server import (
    BODY_FAILURES,
    HandlerBase,
    ServerBase,
    body_refusal,
    clear_buffer,
    request_refusal,
)

__all__ = [
    "PROBLEM_JSON",
    "Bodies",
    "HeldBody",
    "ProxyServer",
    "RefusedRequest",
    "check_body_size",
    "connection_cap",
    "log_accept_errors",
    "problem_response",
]

PROBLEM_JSON = "application/problem+json"
_SPOKEN = (HttpVersion11, HttpVersion10)
# Descriptors kept for the store, the logs, the listening sockets and the like.
_SPARE_FDS = 64
_LOG_EVERY = 10.0
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# After an answer given before its request's body was in: how long, and how much of
# the body, the connection goes on reading (and dropping) before it is closed.
LINGER_FOR = 1.0
LINGER_BYTES = 1024 * 1024


def problem_response(refusal: Refusal) -> web.Response:
    response = web.json_response(
        refusal.problem(),
        status=refusal.status,
        reason=_reason(refusal.status),
        content_type=PROBLEM_JSON,
    )
    if refusal.retry_after is not None:
        response.headers["Retry-After"] = _retry_after(refusal.retry_after)
    if refusal.challenge is not None:
        response.headers["WWW-Authenticate"] = refusal.challenge
    return response


def _retry_after(seconds: float) -> str:
    """Whole seconds, rounded up, at least one."""
    return str(max(1, round(seconds + 0.499)))


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Client Closed Request" if status == 499 else "Refused"


def _raw_problem(refusal: Refusal) -> bytes:
    """A whole answer that closes the connection, for when no request object exists."""
    body = json.dumps(refusal.problem()).encode()
    head = (
        f"HTTP/1.1 {refusal.status} {_reason(refusal.status)}\r\n"
        f"Content-Type: {PROBLEM_JSON}\r\nContent-Length: {len(body)}\r\n"
        + (
            f"Retry-After: {_retry_after(refusal.retry_after)}\r\n"
            if refusal.retry_after is not None
            else ""
        )
        + "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _Every:
    """A log line at most every ``_LOG_EVERY`` seconds, saying how many were held back."""

    __slots__ = ("_held", "_next")

    def __init__(self) -> None:
        self._next = 0.0
        self._held = 0

    def __call__(self, level: int, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._held += 1
            return
        if self._held:
            message += " (and %d more like it in the last %.0fs)"
            args = (*args, self._held, _LOG_EVERY)
        server_log.log(level, message, *args)
        self._next, self._held = now + _LOG_EVERY, 0


# -- bodies ---------------------------------------------------------------------


class Bodies:
    """Request bodies: read whole within the memory shared by every request (a fenced
    write's beyond ``in_memory`` bytes into a file of ``spool`` instead), or streamed,
    each bounded by its limit and by the wait between two reads."""

    __slots__ = ("cap", "held", "in_memory", "spool", "timeout")

    def __init__(
        self,
        cap: int,
        timeout: float,
        *,
        in_memory: int = 1024 * 1024,
        spool: SpoolFolder | None = None,
    ) -> None:
        self.cap = cap
        self.held = 0
        """Bytes of bodies read whole into memory and not yet given back."""
        self.timeout = timeout
        self.in_memory = in_memory
        """The most of one body read whole that stays in memory when it may go to disk."""
        self.spool = spool

    async def read(
        self,
        request: web.BaseRequest,
        limit: int,
        *,
        spill: bool = False,
        digest: Digest | None = None,
    ) -> HeldBody:
        """The whole body, up to ``limit`` bytes (BodyTooLarge above). What it holds
        in memory counts against the cap until it is released (ProxyBusy beyond the
        cap). With ``spill``, a body beyond ``in_memory`` bytes is written to a file
        as it arrives, and only what waits to be written counts. ``digest`` is fed
        the body, once, in order. A client that waits for ``100 Continue`` gets it
        here, once its declared length is known to fit."""
        _go_on(request, limit)
        content = request.content
        spill = spill and self.spool is not None
        pieces: AsyncIterator[bytes]
        if content.is_eof() and content.exception() is None:
            # Arrived whole with the request head, as a small body does: no loop.
            whole = content.read_nowait()
            check_body_size(len(whole), limit)
            if not (spill and len(whole) > self.in_memory):
                self._take(len(whole))
                if digest is not None:
                    digest.update(whole)
                return HeldBody(whole, self)
            pieces = _once(whole)
        else:
            pieces = self._chunks(content)
        declared = request.content_length
        return await self._gather(pieces, limit, spill and (declared or 0) > self.in_memory,
                                  spill, digest)  # fmt: skip

    async def _gather(
        self,
        source: AsyncIterator[bytes],
        limit: int,
        to_file: bool,
        spill: bool,
        digest: Digest | None,
    ) -> HeldBody:
        """``source`` whole: in memory, or in a file from the start (``to_file``) or
        from when it grows beyond ``in_memory`` (``spill``)."""
        # Kept as the pieces that came, joined once whole: a buffer grown piece by
        # piece would be copied as it grows and leave the allocator fragmented.
        pieces: list[bytes] = []
        size = 0
        taken = 0  # of the cap: what is in memory
        file = self._create() if to_file else None
        try:
            async for chunk in source:
                check_body_size(size + len(chunk), limit)
                self._take(len(chunk))
                taken += len(chunk)
                pieces.append(chunk)
                size += len(chunk)
                if file is None and spill and size > self.in_memory:
                    file = self._create()
                if file is not None and taken >= CHUNK:
                    taken -= await self._flush(file, pieces, digest)
            if file is not None:
                taken -= await self._flush(file, pieces, digest)
                return HeldBody(b"", self, file)
        except BaseException:
            self.held -= taken
            if file is not None:
                file.remove()
            raise
        whole = b"".join(pieces)
        if digest is not None:
            digest.update(whole)
        return HeldBody(whole, self)

    def _create(self) -> SpoolFile:
        assert self.spool is not None
        try:
            return self.spool.create()
        except OSError as exc:
            raise spool_failure(exc, "making its file") from None

    async def _flush(self, file: SpoolFile, pieces: list[bytes], digest: Digest | None) -> int:
        """Write what is in memory to the file and give its share of the cap back;
        how much that was."""
        data = b"".join(pieces)
        pieces.clear()
        await file.write(data, digest)
        self.held -= len(data)
        return len(data)

    async def stream(self, request: web.BaseRequest, limit: int) -> AsyncIterator[bytes]:
        """The body as it arrives, stopped above ``limit`` bytes (BodyTooLarge), so an
        over-long body never reaches the upstream as a complete request. A client
        that waits for ``100 Continue`` gets it when the first piece is asked for."""
        _go_on(request, limit)
        seen = 0
        async for chunk in self._chunks(request.content):
            seen += len(chunk)
            check_body_size(seen, limit)
            yield chunk

    async def _chunks(self, content: StreamReader) -> AsyncIterator[bytes]:
        """Each piece of the body as it arrives; BodyTimeout when none comes for
        ``timeout`` (only the wait for the client counts, never the time the caller
        takes between pieces), ClientClosedRequest when the client goes away or its
        connection fails, RequestMalformed when its framing breaks. None of them is
        an upstream's failure."""
        while True:
            try:
                async with asyncio.timeout(self.timeout) as deadline:
                    chunk = await content.readany()
            except BODY_FAILURES as exc:
                expired = deadline.expired()
                raise body_refusal(exc, timeout=self.timeout, expired=expired) from None
            if not chunk:
                return
            yield chunk

    def _take(self, size: int) -> None:
        if self.held + size > self.cap:
            raise ProxyBusy(
                f"the proxy holds as many request bodies in memory as it may ({self.cap} "
                "bytes, limits.max_buffered); retry",
                retry_after=1.0,
            )
        self.held += size


class HeldBody:
    """A body read whole, in memory (``data``) or in a file (``file``), and its share
    of the budget until :meth:`release`: as soon as the upstream has it, or when the
    request ends, whichever comes first. Releasing removes its file."""

    __slots__ = ("_bodies", "data", "file")

    def __init__(self, data: bytes, bodies: Bodies, file: SpoolFile | None = None) -> None:
        self.data = data
        """The body, when it is in memory; empty when it is in ``file``."""
        self.file = file
        self._bodies: Bodies | None = bodies

    @property
    def size(self) -> int:
        return self.file.size if self.file is not None else len(self.data)

    def payload(self) -> bytes | AsyncIterator[bytes]:
        """What to send: the bytes, or the file's chunks (the sender states the length)."""
        return self.data if self.file is None else self.file.chunks()

    def release(self) -> None:
        """Give its share back and remove its file; again, nothing more."""
        if self._bodies is not None:
            self._bodies.held -= len(self.data)
            self._bodies = None
        if self.file is not None:
            self.file.remove()


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _go_on(request: web.BaseRequest, limit: int) -> None:
    """Before a body is read: refuse a declared length above ``limit``, then send the
    ``100 Continue`` the client may be waiting for."""
    if request.content_length is not None:
        check_body_size(request.content_length, limit)
    protocol = request.protocol
    if isinstance(protocol, ClientConnection):
        protocol.send_continue()


def _drop(payload: StreamReader) -> None:
    """Free what a client sent of a body nobody will read, now. The request and its
    handler's task refer to each other, so left to them the bytes would stay until
    the cycle collector happens to run: 150 uploads refused mid-body kept 110 MiB
    resident until then."""
    if isinstance(payload, EmptyStreamReader):  # a request without a body: shared
        return
    clear_buffer(payload)


def check_body_size(size: int, limit: int) -> None:
    """BodyTooLarge when ``size`` bytes are above ``limit``."""
    if size > limit:
        raise BodyTooLarge(f"the body is larger than the limit of {limit} bytes", max_body=limit)


# -- the server -------------------------------------------------------------------


class RefusedRequest(web.BaseRequest):
    """A request refused as it came in, before any handler looks at it: its line names
    another HTTP than 1.0 or 1.1 (``HTTP/2.0``, ``HTTP/0.9``, none at all), or its
    target cannot even be made into a request (an invalid IDNA host). It is answered
    with ``refusal``, as HTTP/1.1, and the connection is closed."""

    refusal: Refusal


def _expectation(message: RawRequestMessage) -> bool | ExpectationFailed:
    """Whether the request's ``Expect`` fields ask for 100-continue (False when they
    ask for nothing); the refusal when they ask for anything else (the value is
    never quoted back)."""
    headers = message.headers
    if "Expect" not in headers:  # also aiohttp's stand-in for what it could not parse
        return False
    asked = {
        member.strip().lower() for field in headers.getall("Expect") for member in field.split(",")
    } - {""}
    if asked <= {"100-continue"}:
        return bool(asked)
    return ExpectationFailed(
        "the only expectation this proxy meets is 100-continue; send the request without the others"
    )


def connection_cap(configured: int) -> int:
    """``configured``, lowered to what the descriptor limit leaves: each client
    connection may hold an upstream connection too."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, (soft - _SPARE_FDS) // 2))


class ProxyServer(ServerBase):
    """aiohttp's low-level server, with :class:`ClientConnection` for each client and
    the cap on open connections."""

    def __init__(
        self,
        handler: Any,
        limits: LimitsSpec,
        *,
        max_connections: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, request_factory=self._new_request, **kwargs)
        self.limits = limits
        self.max_connections = max_connections or connection_cap(limits.max_connections)
        # Every open connection, least recently active first.
        self._open: OrderedDict[ClientConnection, None] = OrderedDict()
        self.log = _Every()
        """Rate-limited lines about the door."""

    def reconfigure(self, limits: LimitsSpec) -> None:
        """Hold every connection to ``limits`` from now on (a reload): a new connection
        gets the new keep-alive timeout, a new request head the new deadline, and
        the cap applies at the next connection."""
        self.limits = limits
        self.max_connections = connection_cap(limits.max_connections)

    def __call__(self) -> ClientConnection:
        # aiohttp's own lingering (up to 10 s, unbounded in bytes) is replaced by
        # ClientConnection's, bounded by LINGER_FOR and LINGER_BYTES.
        kwargs = {**self.handler_kwargs, "lingering_time": 0.0}
        return ClientConnection(
            self, loop=self.event_loop, keepalive_timeout=self.limits.keepalive_timeout, **kwargs
        )

    def _new_request(
        self,
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        assert isinstance(protocol, ClientConnection)
        protocol.body = payload
        protocol.owes_continue = False
        refusal: Refusal
        if message.version not in _SPOKEN:
            sent = f"{message.version.major}.{message.version.minor}"
            refusal = VersionNotSupported(
                f"this proxy speaks HTTP/1.1 and HTTP/1.0, not HTTP/{sent}"
            )
        elif isinstance(expects := _expectation(message), ExpectationFailed):
            refusal = expects
        else:
            # 100-continue in an HTTP/1.0 request is ignored (RFC 9110 §10.1.1).
            protocol.owes_continue = expects and message.version == HttpVersion11
            if message.upgrade:
                # Upgrade is not spoken: answered as HTTP/1.1 and closed after, so bytes
                # sent behind it (another protocol's) are never read as a request.
                message = message._replace(should_close=True)
            try:
                return web.BaseRequest(message, payload, protocol, writer, task, self.event_loop)
            except ValueError:  # UnicodeError included: yarl could not read the host
                refusal = RequestTargetMalformed("the request target's host is not a valid name")
        message = message._replace(
            version=HttpVersion11, should_close=True, path="/", url=URL("/"), upgrade=False
        )
        request = RefusedRequest(message, payload, protocol, writer, task, self.event_loop)
        request.refusal = refusal
        return request

    def opened(self, conn: ClientConnection) -> bool:
        """Count a new connection in; False when it must be refused."""
        self._open[conn] = None
        if len(self._open) <= self.max_connections:
            return True
        victim = next(c for c in self._open if c is conn or not c.busy())
        if victim is conn:
            del self._open[conn]
            self.log(
                logging.WARNING,
                "refused a connection: all %d connections are being worked for "
                "(limits.max_connections)",
                self.max_connections,
            )
            return False
        self.log(
            logging.WARNING,
            "at %d connections (limits.max_connections): closed the least recently "
            "active one not being worked for",
            self.max_connections,
        )
        victim.force_close()
        self._open.pop(victim, None)
        return True

    def touched(self, conn: ClientConnection) -> None:
        if conn in self._open:
            self._open.move_to_end(conn)

    def closed(self, conn: ClientConnection) -> None:
        self._open.pop(conn, None)

    @property
    def open_connections(self) -> int:
        return len(self._open)


class _Lingering:
    """A connection that answered before its request's body was in, dropping what the
    client still sends: done once the client closes or ``LINGER_BYTES`` came."""

    __slots__ = ("_dropped", "_left")

    def __init__(self, left: asyncio.Future[None]) -> None:
        self._left = left
        self._dropped = 0

    def drop(self, size: int) -> None:
        self._dropped += size
        if self._dropped >= LINGER_BYTES:
            self.end()

    def end(self) -> None:
        if not self._left.done():
            self._left.set_result(None)


class ClientConnection(HandlerBase):
    """One client connection: aiohttp's, plus the head timeout, the cap's bookkeeping
    and problem answers for what the parser refuses."""

    __slots__ = (
        "_head_deadline",
        "_head_requests",
        "_lingering",
        "_server",
        "body",
        "owes_continue",
    )

    def __init__(self, manager: ProxyServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._server = manager
        self._head_deadline: asyncio.TimerHandle | None = None
        self._head_requests = 0
        self.body: StreamReader | None = None
        """The body of the last request: bytes that come while it is still read (or
        drained after its answer) are not the head of a next request."""
        self.owes_continue = False
        """The last request asked for ``100 Continue`` (HTTP/1.1), and has not had it."""
        self._lingering: _Lingering | None = None

    def busy(self) -> bool:
        """Whether the proxy is working for this client: its request is in whole and
        being handled (not idle, not still sending)."""
        request = self.current_request
        return self.request_in_progress and request is not None and request.content.is_eof()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self._server.opened(self):
            transport.write(  # type: ignore[attr-defined]
                _raw_problem(
                    ProxyBusy(
                        f"the proxy has {self._server.max_connections} connections open, all "
                        "being worked for (limits.max_connections); retry",
                        retry_after=1.0,
                    )
                )
            )
            self.force_close()
            return
        self._arm_head_deadline()

    def connection_lost(self, exc: BaseException | None) -> None:
        try:
            self._server.closed(self)
            self._disarm_head_deadline()
            if self._lingering is not None:  # the client is gone: nothing more to drop
                self._lingering.end()
            if self.body is not None:
                _drop(self.body)
        finally:
            super().connection_lost(exc)  # aiohttp's bookkeeping, whatever went before

    def send_continue(self) -> None:
        """``100 Continue``, once, to a client waiting for it before it sends its body;
        nothing when it asked for none, or has begun sending its body anyway."""
        if not self.owes_continue:
            return
        self.owes_continue = False
        body = self.body
        if body is None or body.is_eof() or body.total_bytes:
            return
        if self.transport is not None and not self.transport.is_closing():
            # Beside aiohttp's writer, which counts only the final answer's bytes.
            self.transport.write(_CONTINUE)

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        """Send the answer. One given before the request's body was all in says
        ``Connection: close`` (RFC 9110 §10.1.1): what the client sends behind it,
        whether the body or, from a client that was waiting for ``100 Continue``, its
        next request, is never read as a request. The connection then lingers, a
        little, and is closed."""
        payload = request.content
        unread = not payload.is_eof()
        if unread:
            resp.force_close()
        answered = await super().finish_response(request, resp, start_time)
        if unread:
            if not answered[1]:
                await self._linger(payload)
            _drop(payload)
        return answered

    async def _linger(self, payload: StreamReader) -> None:
        """After an answer given before the body was in: end the answer with our side's
        FIN, then drop what the client still sends, below the parser, until it
        closes, for ``LINGER_FOR`` at most and ``LINGER_BYTES`` at most, so that a
        client still sending is not reset before it has read the answer. Not being
        worked for, the connection may be taken back by the cap meanwhile."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if transport.can_write_eof():
            transport.write_eof()
        _drop(payload)
        left = self.event_loop.create_future()
        self._lingering = _Lingering(left)
        transport.resume_reading()  # the payload may have paused it, full
        try:
            async with asyncio.timeout(LINGER_FOR):
                await left
        except TimeoutError:
            pass  # gone quiet: closed all the same
        finally:
            self._lingering = None

    def data_received(self, data: bytes) -> None:
        if (lingering := self._lingering) is not None:
            lingering.drop(len(data))  # never parsed, never buffered
            return
        self._server.touched(self)
        if (
            data  # aiohttp calls this with nothing, to parse what it held back
            and self._head_deadline is None
            and not self.request_in_progress
            and not self.messages_waiting
            and not self.force_closing
            and (self.body is None or self.body.is_eof())
        ):
            self._arm_head_deadline()  # the first bytes of the next request
        count = self.request_count
        super().data_received(data)
        if self.request_count != count:
            self._disarm_head_deadline()

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """aiohttp's answer to what its parser refused, or to a handler that raised:
        a problem, and the connection closed. A parser refusal is logged in one line;
        anything else is a bug, logged with its traceback."""
        refusal: Refusal
        if isinstance(exc, HttpProcessingError):
            refusal = request_refusal(exc, self.max_line_size, self.max_headers)
        elif status == 504:
            refusal = InternalError("the request's handling timed out")
        else:
            self.log_exception("Error handling request", exc_info=exc)
            refusal = InternalError("the proxy failed on this request; nothing was forwarded")
        if isinstance(exc, HttpProcessingError):
            self._server.log(
                logging.INFO,
                "refused a malformed request (%d %s): %s",
                refusal.status,
                refusal.slug,
                refusal.detail,
            )
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was partly sent; the connection is closed")
        response = problem_response(refusal)
        response.force_close()
        return response

    def _arm_head_deadline(self) -> None:
        self._head_requests = self.request_count
        self._head_deadline = self.event_loop.call_later(
            self._server.limits.header_timeout, self._head_too_slow
        )

    def _disarm_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_slow(self) -> None:
        self._head_deadline = None
        if self.request_count != self._head_requests or self.request_in_progress:
            return  # a request came in whole meanwhile
        if self.transport is not None and not self.force_closing:
            timeout = self._server.limits.header_timeout
            self.transport.write(
                _raw_problem(HeaderTimeout(f"the request head did not arrive within {timeout:g}s"))
            )
            self._server.log(
                logging.INFO, "closed a connection: no request head within %gs", timeout
            )
        self.force_close()


def log_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log the loop's failures to accept a connection (out of descriptors, say) in one
    line at most every ten seconds, rather than a traceback each; the rest as before."""
    every = _Every()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if "accept" in message:
            every(logging.ERROR, "could not accept a connection: %s", context.get("exception"))
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
