"""The data plane: the proxy's port, served by one :class:`asyncio.Protocol` per
client connection on llhttp (:mod:`fenceproxy.http.httptools_parser`), with a
:class:`~fenceproxy.http.request.Request` per request and no web framework between
the socket and the handler. The head is read once, fields kept as the bytes that
came and as one case-insensitive mapping; an answer goes out in one write when it
is whole.

What a client may hold of the proxy (:class:`Limits`, the data plane's own, built
from ``limits:`` in the config; nginx's defaults):

* **the request head** must arrive within ``header_timeout`` of its first byte (or of
  the connection's opening): 408 and the connection is closed;
* **the head's size**: a request line or a field above ``MAX_LINE`` bytes, more
  than ``MAX_FIELDS`` fields, or a head above ``MAX_HEAD`` bytes in all, is 431; so
  are a chunked body's trailer fields beyond the same limits (they are read, never
  forwarded). The parser holds no more than ``MAX_HEAD`` bytes it has not reported;
* **open connections** are capped at ``max_connections``, lowered at start to fit
  the descriptor limit (each may need an upstream connection too). A connection
  beyond the cap closes the least recently active one that the proxy is not working
  for (idle, or still sending its request), so a live client is still served while
  stalled ones hold the cap; only when every connection is being worked for is the
  newcomer refused with 503;
* **an idle keep-alive connection** is closed after ``keepalive_timeout``;
* **pipelined requests** are answered in order, one at a time, each answer taken
  by the client (within ``send_timeout``) before the next request is handled. The
  proxy reads one request ahead of the one it answers, then stops reading; of what
  one read brought it takes at most ``MAX_AHEAD`` requests ahead, and a client that
  pipelines more has those answered, then its connection closed: what it sent
  beyond them is never read as a request (RFC 9112 §9.3.2 lets a server close). The
  head deadline of a request read ahead runs only while the proxy reads.

Bodies are read through :class:`~fenceproxy.http.edge.Bodies`, which holds them to
their limits and their timeouts.

HTTP/1.1 as clients use it:

* **``Expect: 100-continue``** (curl above 1 KiB, botocore on every upload) gets
  ``100 Continue`` once the request has passed every check that needs no body, just
  before its body is first read (:meth:`Request.send_continue`), once, and only in
  HTTP/1.1; in HTTP/1.0 it is ignored. Any other expectation gets 417;
* **an answer given before the request's body is all in** (a refusal on the head,
  413 by ``Content-Length``, 408 or 503 mid-body, 417, or a client still sending)
  says ``Connection: close`` (RFC 9110 §10.1.1): neither the body nor a request the
  client sends behind it is ever read as a request. The answer ends with the
  proxy's FIN; then the connection lingers, dropping what the client still sends
  so it is not reset before it reads the answer, until the client closes, for at
  most ``LINGER_FOR`` (1 s) and ``LINGER_BYTES`` (1 MiB), and is closed. A
  lingering connection is not worked for, so the cap may take it back.

What the parser refuses (framing, a line too long, too many fields, another HTTP
version, the HTTP/2 preface) is answered as a problem after the answers owed before
it, logged in one line, and the connection closed. A request that asks for another
protocol (``Upgrade``) is answered as plain HTTP/1.1, then the connection is
closed: nothing sent behind it is read as a request.

A handler runs to its end even when its client leaves (a fenced write must settle),
unless the plane is made with ``handler_cancellation``. A handler that fails (a bug)
is answered 500, saying whether the request may have reached an upstream
(:attr:`Request.forwarding <fenceproxy.http.request.Request.forwarding>`).

A connection lives in two halves, each in a state of its own
(:mod:`~fenceproxy.http.connection_states`, one table): :class:`Connection` is its
reading half, the protocol llhttp's callbacks build requests in, and
:class:`Answering` its answering half.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

from ..errors import (
    HeaderTimeout,
    InternalError,
    ProxyBusy,
    Refusal,
    RequestHeadTooLarge,
    RequestMalformed,
    UpstreamError,
)
from ..log import proxy_log, server_log
from ..tls import subject
from .answer import NO_BODY, Answer, head_bytes, problem_answer, raw_problem
from .body import Flow
from .connection_states import ANSWERING_STARTS, READING_STARTS, Event, State, move
from .edge import LINGER_BYTES, LINGER_FOR, Every, connection_cap
from .httptools_parser import HttpRequestParser, ParserUpgrade, ParsingStopped, feed
from .request import (
    HTTP10,
    HTTP11,
    MAX_FIELDS,
    MAX_HEAD,
    MAX_LINE,
    Request,
    read_head,
    too_large,
)
from .upstream import TrustedProxies

# The states and events, bound once as module names: read off its Enum class, a member
# takes EnumType's slow attribute path (on Python 3.11), and the data plane reads
# them on every request (some twenty times: 2 µs of a request's 15, measured).
OPENED, IDLE, HEAD, BODY = State.OPENED, State.IDLE, State.HEAD, State.BODY
UPGRADE_BODY, LEFT_UNREAD, LINGERING = State.UPGRADE_BODY, State.LEFT_UNREAD, State.LINGERING
OWES_NOTHING, ANSWERING, READ_AHEAD = State.OWES_NOTHING, State.ANSWERING, State.READ_AHEAD
CLOSING, CLOSED = State.CLOSING, State.CLOSED
HEAD_BEGINS, HEAD_READ, BODY_READ = Event.HEAD_BEGINS, Event.HEAD_READ, Event.BODY_READ
UPGRADED, NOT_TAKEN, REFUSED = Event.UPGRADED, Event.NOT_TAKEN, Event.REFUSED
CLIENT_DONE, ANSWER_ENDS = Event.CLIENT_DONE, Event.ANSWER_ENDS
LINGER, LINGER_OVER, OWED = Event.LINGER, Event.LINGER_OVER, Event.OWED
CAUGHT_UP, ALL_ANSWERED, CLOSE_AFTER = Event.CAUGHT_UP, Event.ALL_ANSWERED, Event.CLOSE_AFTER
CLOSE, LOST = Event.CLOSE, Event.LOST

__all__ = ["Answering", "Connection", "DataPlane", "Handler", "Limits", "Listener"]

Handler = Callable[[Request], Awaitable[Answer]]

MAX_AHEAD = 16
"""The most requests pipelined ahead of the one being answered that are taken."""
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_READ_AHEAD = "a request read ahead"  # what holds reading while one is queued
_NEVER = float("inf")
_TERMINAL_CHUNK = b"0\r\n\r\n"


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """What one client may hold of the proxy's port (the config's ``limits:``)."""

    header_timeout: float
    """A request head must arrive within this of its first byte (or of the opening)."""
    keepalive_timeout: float
    """An idle keep-alive connection is closed after this."""
    send_timeout: float
    """The longest wait for a client to take the next part of an answer."""
    max_connections: int
    """Open client connections; lowered to fit the descriptor limit."""
    max_connections_per_client: int | None
    """Of those, the most one client may hold; None: a tenth of the cap as lowered."""


class _Refused:
    """A place in the connection's order of answers for a refusal of what came in
    (the parser's, the head's deadline): answered in turn, then the connection closes.
    A head that could not be read at all is answered in HTTP/1.0, which every client
    reads; one refused for what it says (its version, its expectation, its target)
    in HTTP/1.1."""

    __slots__ = ("refusal", "version")

    def __init__(self, refusal: Refusal) -> None:
        self.refusal = refusal
        unread = isinstance(refusal, RequestMalformed | RequestHeadTooLarge)
        self.version = HTTP10 if unread else HTTP11


class DataPlane:
    """The proxy's port: makes a :class:`Connection` for each client (it is the
    protocol factory), keeps the cap on them, and shuts them down."""

    def __init__(
        self,
        handler: Handler,
        limits: Limits,
        *,
        max_connections: int | None = None,
        access_log: logging.Logger | None = None,
        handler_cancellation: bool = False,
        trusted: TrustedProxies | None = None,
    ) -> None:
        trusted = trusted or TrustedProxies(())
        self.handler = handler
        self.limits = limits
        self.max_connections = max_connections or connection_cap(limits.max_connections)
        self.access_log = access_log
        self.handler_cancellation = handler_cancellation
        # Every open connection the cap counts, least recently active first (one
        # refused at the cap is closed at once, and never counted).
        self._open: OrderedDict[Connection, None] = OrderedDict()
        self._all_closed: asyncio.Event | None = None  # while shutting down
        self._per_client: dict[str, int] = {}  # open connections by peer address
        self.trusted = trusted
        """Peers that proxies stand for many clients behind: no share of connections."""
        self.shutting_down = False
        self.log = Every()
        """Rate-limited lines about the door."""
        self._ticker: asyncio.TimerHandle | None = None

    def __call__(self) -> Connection:
        return Connection(self)

    def reconfigure(self, limits: Limits, trusted: TrustedProxies) -> None:
        """Hold every connection to ``limits`` from now on (a reload): a new connection
        gets the new keep-alive timeout, a new request head the new deadline, and
        the cap applies at the next connection."""
        self.limits = limits
        self.trusted = trusted
        self.max_connections = connection_cap(limits.max_connections)

    @property
    def tick(self) -> float:
        """How often the connections' deadlines are looked at: a quarter of the shorter
        of the head and keep-alive timeouts, at most a second. A deadline is met to
        within it."""
        limits = self.limits
        return min(1.0, max(0.01, min(limits.header_timeout, limits.keepalive_timeout) / 4))

    def _watch(self) -> None:
        """Look at every connection's deadline (:meth:`Connection.expire`), once a
        tick, while there are connections: one timer for them all, rather than two
        set and cancelled per request."""
        self._ticker = None
        if not self._open:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for conn in [c for c in self._open if c.due <= now]:
            conn.expire()
        self._ticker = loop.call_later(self.tick, self._watch)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    @property
    def connections(self) -> list[Connection]:
        """Every open connection, least recently active first."""
        return list(self._open)

    @property
    def connections_per_client(self) -> int:
        """The most connections one client may hold: the configured share, or a tenth
        of the cap (as lowered to fit the descriptor limit)."""
        return self.limits.max_connections_per_client or max(1, self.max_connections // 10)

    def opened(self, conn: Connection) -> str | None:
        """Count a new connection in (a TLS one from before its handshake); the limit
        that refuses it, if one does. Beyond its client's share, the client's own
        least recently active connection not being worked for is closed for it, or
        it is refused; beyond the cap, anyone's."""
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().call_later(self.tick, self._watch)
        self._open[conn] = None
        client = conn.peer or "unknown"
        if client not in self.trusted:  # behind a trusted proxy, many clients: no share
            conn.counted_as = client
            self._per_client[client] = self._per_client.get(client, 0) + 1
            if self._per_client[client] > self.connections_per_client:
                mine = (c for c in self._open if c.counted_as == client)
                if not self._make_room(conn, mine, _CLIENT_SHARE):
                    return _CLIENT_SHARE
        if len(self._open) <= self.max_connections:
            return None
        return None if self._make_room(conn, iter(self._open), _CAP) else _CAP

    def _make_room(self, conn: Connection, among: Iterator[Connection], limit: str) -> bool:
        """Close the least recently active of ``among`` not being worked for, to make
        room for ``conn``; False, ``conn`` refused, when that is ``conn`` itself."""
        victim = next(c for c in among if c is conn or not c.busy())
        if victim is conn:
            self.closed(conn)
            self.log(
                logging.WARNING,
                "refused a connection: every one of %s is being worked for",
                limit,
            )
            return False
        self.log(
            logging.WARNING,
            "at %s: closed the least recently active connection not being worked for",
            limit,
        )
        self.closed(victim)
        victim.abort()
        return True

    def is_open(self, conn: Connection) -> bool:
        return conn in self._open

    def touched(self, conn: Connection) -> None:
        if conn in self._open:
            self._open.move_to_end(conn)

    def closed(self, conn: Connection) -> None:
        if self._open.pop(conn, False) is None and conn.counted_as is not None:
            client, conn.counted_as = conn.counted_as, None  # counted out once
            left = self._per_client.get(client, 0) - 1
            if left > 0:
                self._per_client[client] = left
            else:
                self._per_client.pop(client, None)
        if not self._open and self._all_closed is not None:
            self._all_closed.set()

    def pre_shutdown(self) -> None:
        """Take no more requests: idle connections close now, the others once the
        answers they owe are sent."""
        self.shutting_down = True
        for conn in list(self._open):
            conn.close_when_done()

    async def shutdown(self, within: float) -> None:
        """Let the requests in hand finish, and their answers reach the clients, for
        up to ``within`` seconds in all; then cancel what is left and cut every
        connection still open."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        self._all_closed = asyncio.Event()
        self.pre_shutdown()
        tasks = [t for t in (c.task for c in self._open) if t is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=within)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        if self._open:  # closing: what they still buffer goes out first
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - loop.time())):
                    await self._all_closed.wait()
        for conn in list(self._open):
            conn.abort()


class _Lingering:
    """What a lingering connection drops of what the client still sends: done once
    the client closes or ``LINGER_BYTES`` came."""

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


_PARSED = frozenset({OPENED, IDLE, HEAD, BODY})
"""Where what the client sends is fed to llhttp."""
_WORKING = frozenset({ANSWERING, READ_AHEAD, CLOSING})


class Connection(Flow):
    """One client connection, and its reading half: llhttp's callbacks build each
    request from what the socket brings, held to the limits at the door, and hand it
    to the answering half (:attr:`answers`), which answers them one at a time, in
    order. :attr:`state` is where the reading half stands
    (:mod:`~fenceproxy.http.connection_states`)."""

    def __init__(self, plane: DataPlane) -> None:
        super().__init__()
        self._plane = plane
        self._loop = asyncio.get_running_loop()
        self.peer: str | None = None
        self.counted_as: str | None = None
        """The client whose share of connections this one counts against, if any."""
        self.handshaking: socket.socket | None = None
        """Its socket while its TLS handshake is under way."""
        self.scheme = "http"
        """``https`` on a TLS connection."""
        self.subject: dict[str, str] = {}
        """The subject of the client certificate TLS verified, if the client sent one."""
        self.state = READING_STARTS
        self.answers = Answering(self, plane, self._loop)
        self._parser = HttpRequestParser(self)
        # The head being parsed.
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        self._unreported = 0  # bytes fed to llhttp since it last reported anything
        self._reported = False  # a callback came during this feed
        self._head_size = 0  # of the head (or trailer fields) being read
        self._trailers = 0  # trailer fields of the body being received
        self._receiving: Request | None = None  # the request whose body is arriving
        self._upgrade_left = 0  # body bytes of an Upgrade request llhttp left to us
        self.due = _NEVER
        """The loop's time when what the connection waits for is late (its request
        head, or its next request), looked at by :meth:`DataPlane._watch`."""
        self._departed: asyncio.Future[None] | None = None  # made when a handler asks
        self._lingering: _Lingering | None = None  # while lingering

    @property
    def task(self) -> asyncio.Task[None] | None:
        """Answering the requests owed, if any are."""
        return self.answers.task

    def _go(self, event: Event) -> None:
        self.state = move(self.state, event)

    # -- the transport's side ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport = transport
        plane = self._plane
        if self.handshaking is not None:  # over TLS: counted in when it was accepted
            self.handshaking = None
            self.scheme = "https"
            self.subject = subject(transport.get_extra_info("peercert"))
            if not plane.is_open(self) or plane.shutting_down:
                transport.abort()  # closed for another, or shutting down, meanwhile
                return
            self._deadline(plane.limits.header_timeout)
            return
        self.peer = _peer(transport)
        refused = "shutting down" if plane.shutting_down else plane.opened(self)
        if refused is not None:
            transport.write(
                raw_problem(
                    ProxyBusy(
                        f"the proxy's connections ({refused}) are all being worked for; retry",
                        retry_after=1.0,
                    )
                )
            )
            self._go(REFUSED)
            self.close()
            return
        self._deadline(plane.limits.header_timeout)

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state is LINGERING:
            assert self._lingering is not None
            self._lingering.drop(len(data))  # never parsed, never buffered
            return
        self._plane.touched(self)
        if state is UPGRADE_BODY:
            self._take_upgrade_body(data)
            return
        if state not in _PARSED:
            return
        self._reported = False
        try:
            feed(self._parser, data)
            # llhttp holds what it has not reported (a field that never ends): no
            # more than MAX_HEAD of it, give or take one read.
            self._unreported = 0 if self._reported else self._unreported + len(data)
            if self._unreported > MAX_HEAD:
                raise RequestHeadTooLarge(too_large())
        except ParserUpgrade as upgrade:
            self._upgraded(data[upgrade.args[0] :])
        except ParsingStopped:
            self._not_taken()
        except Refusal as refusal:
            self._refuse_input(refusal)

    def eof_received(self) -> bool:
        """The client will send no more: a body cut short fails; answers owed still go
        out, then the connection closes."""
        receiving = self._receiving
        if receiving is not None:
            receiving.body.fail(ConnectionResetError("the client closed mid-body"))
        self._go(CLIENT_DONE)
        if self._lingering is not None:
            self._lingering.end()
            return False
        answers = self.answers
        if not answers.queue or answers.state not in _WORKING:
            return False  # nothing owed: the transport closes itself
        answers.close_after()
        return True

    def gone(self) -> asyncio.Future[None]:
        """A future set once the client's connection is lost (already, if it is): a
        handler that waits long (a claim's wait) stops for nobody. Not cancelled by
        anyone who waits for it."""
        if self._departed is None:
            self._departed = self._loop.create_future()
            if self.state is CLOSED:
                self._departed.set_result(None)
        return self._departed

    def connection_lost(self, exc: BaseException | None) -> None:
        self._go(LOST)
        if self._departed is not None and not self._departed.done():
            self._departed.set_result(None)
        self._plane.closed(self)
        self.due = _NEVER
        if self._lingering is not None:  # the client is gone: nothing more to drop
            self._lingering.end()
        answers = self.answers
        answers.lost()
        self.flow_lost()
        if answers.task is not None and self._plane.handler_cancellation:
            answers.task.cancel()

    # -- llhttp's callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        answers = self.answers
        if answers.state is CLOSING and answers.queue:
            raise ParsingStopped  # shutting down, or the client is done sending
        if len(answers.queue) > MAX_AHEAD:
            raise ParsingStopped  # pipelined beyond what is taken: parse no further
        # The first head's deadline runs from the opening; one read ahead, from when
        # the proxy reads again.
        if self.state is IDLE and not self._held:
            self._deadline(self._plane.limits.header_timeout)
        self._go(HEAD_BEGINS)
        self._url = b""
        self._fields = []
        self._head_size = 0
        self._reported = True

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._reported = True
        if len(self._url) > MAX_LINE:
            raise RequestHeadTooLarge(too_large())

    def on_header(self, name: bytes, value: bytes) -> None:
        self._reported = True
        if len(name) > MAX_LINE or len(value) > MAX_LINE:
            raise RequestHeadTooLarge(too_large())
        self._head_size += len(name) + len(value) + 4
        if self._head_size > MAX_HEAD:
            raise RequestHeadTooLarge(too_large())
        if self.state is not HEAD:
            self._trailers += 1  # a trailer field: read, never forwarded
            if self._trailers > MAX_FIELDS:
                raise RequestHeadTooLarge(too_large())
            return
        if len(self._fields) >= MAX_FIELDS:
            raise RequestHeadTooLarge(too_large())
        self._fields.append((name, value.rstrip(b" \t")))

    def on_headers_complete(self) -> None:
        self._head_size = 0
        self._trailers = 0
        self._reported = True
        self.due = _NEVER
        request, expects = read_head(self, self._parser, self._url, self._fields)
        self._go(HEAD_READ)
        self._receiving = request
        if expects:
            self.answers.owes_continue = request
        self.answers.owe(request)

    def on_body(self, data: bytes) -> None:
        self._reported = True
        receiving = self._receiving
        if receiving is not None:
            receiving.body.feed(data)

    def on_message_complete(self) -> None:
        self._reported = True
        receiving = self._receiving
        if receiving is None or receiving.upgrade:
            return  # an Upgrade request's body, if any, is taken by _upgraded
        receiving.body.finish()
        self._receiving = None
        self._go(BODY_READ)

    # -- reading requests -------------------------------------------------------------

    def _upgraded(self, rest: bytes) -> None:
        """llhttp stops at the head of a request that asks for another protocol:
        nothing after it is read as a request; its body, when it declares one, is
        taken as its length says."""
        request = self._receiving
        assert request is not None  # llhttp stops after the head it reported
        self._go(UPGRADED)
        self._upgrade_left = request.content_length or 0
        self._take_upgrade_body(rest)

    def _take_upgrade_body(self, data: bytes) -> None:
        request = self._receiving
        assert request is not None
        part = data[: self._upgrade_left]
        self._upgrade_left -= len(part)
        if part:
            request.body.feed(part)
        if not self._upgrade_left:
            request.body.finish()
            self._receiving = None
            self._go(BODY_READ)

    def _refuse_input(self, refusal: Refusal) -> None:
        """What came in cannot be read as a request: the refusal is answered once the
        answers owed before it are sent, and nothing more is read."""
        self._go(REFUSED)
        self.due = _NEVER
        receiving = self._receiving
        if receiving is not None and receiving in self.answers.queue:
            # Its head was read: the refusal is its body's (broken framing).
            receiving.body.fail(refusal)
            self._receiving = None
            return
        self._plane.log(
            logging.INFO,
            "refused a malformed request (%d %s): %s",
            refusal.status,
            refusal.slug,
            refusal.detail,
        )
        self.answers.owe(_Refused(refusal))

    def _not_taken(self) -> None:
        """A request began that is not taken (a client pipelined beyond
        ``MAX_AHEAD``, or the connection closes): the requests taken are answered,
        then it closes."""
        if self.answers.state is not CLOSING:
            self._plane.log(
                logging.INFO,
                "closing a connection after its answers: more than %d requests pipelined ahead",
                MAX_AHEAD,
            )
        self._go(NOT_TAKEN)
        self.due = _NEVER
        self.answers.close_after()

    def _deadline(self, seconds: float) -> None:
        """What the reading half stands at (a head, the next request) is due within
        ``seconds``."""
        self.due = self._loop.time() + seconds

    def expire(self) -> None:
        """What the connection waited for is late (:attr:`due`): a request head (408),
        or, idle, the next request (closed). A head's deadline does not run while the
        proxy holds reading: it starts again when it reads."""
        self.due = _NEVER
        state = self.state
        if state is HEAD and self._held and self.answers.queue:
            return
        if state is OPENED or state is HEAD:
            timeout = self._plane.limits.header_timeout
            self._plane.log(
                logging.INFO, "closed a connection: no request head within %gs", timeout
            )
            self._refuse_input(
                HeaderTimeout(f"the request head did not arrive within {timeout:g}s")
            )
        elif state is IDLE and self.answers.state is OWES_NOTHING:
            self.close()

    def reading_again(self) -> None:
        if self.state is not LINGERING:  # a lingering one reads, and drops, anyway
            super().reading_again()
            if self.state is HEAD and self.due == _NEVER:
                self._deadline(self._plane.limits.header_timeout)

    def send_continue(self, request: Request) -> None:
        self.answers.send_continue(request)

    # -- the answering half's calls -----------------------------------------------------

    def answered_all(self) -> None:
        """Every answer owed is sent and the connection goes on: idle, it waits
        ``keepalive_timeout`` for the next request."""
        if self.state is IDLE:
            self._deadline(self._plane.limits.keepalive_timeout)

    @property
    def goes_on(self) -> bool:
        """Whether requests are still read, so the connection may go on once every
        answer owed is sent."""
        return self.state in _PARSED

    @property
    def sending(self) -> bool:
        """Whether the client may still be sending what is never read: a head read
        ahead, or a request left unread."""
        return self.state is HEAD or self.state is LEFT_UNREAD

    def stop_reading(self) -> None:
        """An answer was the connection's last: nothing more is read as a request, nor
        waited for."""
        self._go(ANSWER_ENDS)
        self.due = _NEVER

    async def linger(self) -> None:
        """After an answer given before the client was done sending: end the answer with
        our side's FIN, then drop what the client still sends, below the parser, until
        it closes, for ``LINGER_FOR`` at most and ``LINGER_BYTES`` at most, so that a
        client still sending is not reset before it has read the answer. Not being
        worked for, the connection may be taken back by the cap meanwhile."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if transport.can_write_eof():
            transport.write_eof()
        left = self._loop.create_future()
        self._go(LINGER)
        self._lingering = _Lingering(left)
        self._held.clear()
        with contextlib.suppress(RuntimeError):
            transport.resume_reading()  # the body may have paused it, full
        try:
            async with asyncio.timeout(LINGER_FOR):
                await left
        except TimeoutError:
            pass  # gone quiet: closed all the same
        finally:
            self._lingering = None
            if self.state is LINGERING:  # not lost meanwhile
                self._go(LINGER_OVER)

    # -- the door -------------------------------------------------------------------------

    def busy(self) -> bool:
        """Whether the proxy is working for this client: its request is in whole and
        being answered (not idle, not still sending, not lingering)."""
        answers = self.answers
        if answers.state not in _WORKING or not answers.queue or self.state is LINGERING:
            return False
        first = answers.queue[0]
        return isinstance(first, _Refused) or first.body.done

    def close_when_done(self) -> None:
        """Take no more requests: close now if none is in hand, else once the answers
        owed are sent (a body still arriving is read to its end)."""
        if self.handshaking is not None:
            self.abort()
        elif self.answers.state is OWES_NOTHING:
            self.close()
        elif self.answers.state is not CLOSED:
            self.answers.close_after()

    def close(self) -> None:
        """Close the connection: what it buffers goes out first; nothing more is read
        or answered."""
        self.due = _NEVER
        self._go(CLOSE)
        self.answers.go(CLOSE)
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        elif self.handshaking is not None:  # ends its handshake, with an error
            with contextlib.suppress(OSError):
                self.handshaking.shutdown(socket.SHUT_RDWR)


class Answering:
    """A connection's answering half: the requests it owes answers (and the refusals
    of what came), answered one at a time, in order, by one task, each answer taken
    by the client before the next request is handled. :attr:`state` is where it
    stands (:mod:`~fenceproxy.http.connection_states`)."""

    def __init__(self, conn: Connection, plane: DataPlane, loop: asyncio.AbstractEventLoop) -> None:
        self._conn = conn
        self._plane = plane
        self._loop = loop
        self.state = ANSWERING_STARTS
        self.queue: deque[Request | _Refused] = deque()
        self.task: asyncio.Task[None] | None = None
        """Answering the requests in the queue, while any are owed."""
        self.owes_continue: Request | None = None
        """The request that waits for ``100 Continue`` before it sends its body."""

    def go(self, event: Event) -> None:
        self.state = move(self.state, event)

    def owe(self, item: Request | _Refused) -> None:
        """Answer ``item`` once the answers owed before it are sent. Behind one being
        answered, a request was read ahead: reading waits until it is the one answered."""
        self.queue.append(item)
        self.go(OWED)
        if len(self.queue) > 1 and isinstance(item, Request):
            self._conn.hold_reading(_READ_AHEAD)  # one request read ahead, no more
        if self.task is None:
            self.task = self._loop.create_task(self._answer_all())

    def close_after(self) -> None:
        """Take no request after those owed: the connection closes once they are sent."""
        self.go(CLOSE_AFTER)

    def lost(self) -> None:
        """The client is gone: what is owed is never sent, and the bodies still
        arriving fail."""
        self.go(LOST)
        lost = ConnectionResetError("the client's connection closed")
        for item in self.queue:
            if isinstance(item, Request):
                item.body.fail(lost)
                item.body.discard()

    def send_continue(self, request: Request) -> None:
        if self.owes_continue is not request:
            return
        self.owes_continue = None
        body = request.body
        if body.done or body.received or body.failed is not None:
            return
        transport = self._conn.transport
        if transport is not None and not transport.is_closing():
            transport.write(_CONTINUE)

    async def _answer_all(self) -> None:
        queue = self.queue
        try:
            while queue and self.state is not CLOSED:
                item = queue[0]
                if isinstance(item, _Refused):
                    went, _ = await self._send(item, problem_answer(item.refusal), close=True)
                    self._ended()
                    if went:
                        await self._conn.linger()  # what came behind it is dropped
                    return
                if not await self._answer(item):
                    return
                queue.popleft()
                if self.state is READ_AHEAD and len(queue) <= 1:
                    self.go(CAUGHT_UP)
                    self._conn.release_reading(_READ_AHEAD)
        finally:
            self.task = None
            if self.state is not CLOSED:
                self._after_answers()

    def _after_answers(self) -> None:
        if self.state is ANSWERING and not self.queue and self._conn.goes_on:
            self.go(ALL_ANSWERED)
            self._conn.answered_all()
            return
        if self.state is not CLOSING:  # cut short (cancelled), or nothing more is read
            self.go(CLOSE_AFTER)
        self._conn.close()

    def _ended(self) -> None:
        """The answer just sent was the connection's last."""
        if self.state is not CLOSED:
            self._conn.stop_reading()
            self.close_after()

    async def _answer(self, request: Request) -> bool:
        """Answer ``request``; whether the connection goes on. One that does not, and
        whose client may still be sending (its body, a request behind it), lingers:
        closed with unread bytes, the socket would reset, and the client might lose
        the answer before reading it."""
        try:
            answer = await self._plane.handler(request)
        except Exception:  # a bug: logged with its traceback, answered 500
            server_log.exception("Error handling request")
            answer = problem_answer(_failed(request))
            answer.close = True
        body = request.body
        unread = not body.done
        last = self.state is CLOSING and len(self.queue) == 1  # the last owed
        close = unread or answer.close or last or not request.keep_alive or request.upgrade
        if self.owes_continue is request:
            self.owes_continue = None
        went, goes_on = await self._send(request, answer, close=close)
        body.discard()  # what its handler did not read: freed, and reading let go
        if goes_on:
            return True
        more = unread or self._conn.sending or len(self.queue) > 1
        self._ended()
        if went and more:
            await self._conn.linger()
        return False

    async def _send(
        self, to: Request | _Refused, answer: Answer, *, close: bool
    ) -> tuple[bool, bool]:
        """Write ``answer`` out: whether all of it went, and whether the connection
        goes on after it (not when ``close``, nor when its end is the connection's)."""
        transport = self._conn.transport
        if transport is None or transport.is_closing():
            _finish(answer)
            return False, False
        request = to if isinstance(to, Request) else None
        version = "HTTP/1.0" if to.version == HTTP10 else "HTTP/1.1"
        no_body = answer.status in NO_BODY
        head_only = no_body or (request is not None and request.method == "HEAD")
        sent = 0
        try:
            if answer.stream is None:
                head = head_bytes(
                    answer, version, close=close, length=not no_body,
                    keep_alive_10=version == "HTTP/1.0" and not close,
                )  # fmt: skip
                if head_only or not answer.body:
                    transport.write(head)
                else:
                    transport.write(head + answer.body)
                    sent = len(answer.body)
                # Before the next request is read: a client that pipelines and reads
                # nothing never has the proxy hold its answers in memory.
                went = await self._flushed()
            else:
                went, sent, close = await self._stream(answer, version, close, head_only)
        finally:
            _finish(answer)
        if self._plane.access_log is not None and request is not None:
            self._log_access(request, answer.status, sent)
        return went, went and not close

    async def _stream(
        self, answer: Answer, version: str, close: bool, head_only: bool
    ) -> tuple[bool, int, bool]:
        """Relay an answer whose body is still arriving (its length framed as the
        upstream framed it, or chunked; to an HTTP/1.0 client, ended by the
        connection's end): whether all of it went, how much of its body, and whether
        the connection ends with it. If the upstream breaks off, or the client takes
        nothing for ``send_timeout``, the connection is cut, so the client never
        takes a cut answer for a whole one."""
        transport = self._conn.transport
        assert transport is not None
        assert answer.stream is not None
        framed = answer.framed or head_only
        chunked = not framed and version == "HTTP/1.1"
        close = close or not (framed or chunked)
        head = head_bytes(answer, version, close=close, length=False, chunked=chunked,
                          keep_alive_10=version == "HTTP/1.0" and not close)  # fmt: skip
        sent = 0
        try:
            transport.write(head)
            if not head_only:
                if answer.body:
                    _write(transport, answer.body, chunked)
                    sent += len(answer.body)
                async for chunk in answer.stream:
                    if self.state is CLOSED:
                        return False, sent, True  # the client went away
                    _write(transport, chunk, chunked)
                    sent += len(chunk)
                    if not await self._flushed():
                        return False, sent, True
                if chunked:
                    transport.write(_TERMINAL_CHUNK)
        except UpstreamError as exc:
            proxy_log.warning("upstream answer cut short: %s", exc.detail)
            transport.abort()
            return False, sent, True
        return True, sent, close

    async def _flushed(self) -> bool:
        """Wait until the client takes what was written, ``send_timeout`` at most;
        False when it is gone, or took nothing for that long (its connection cut)."""
        conn = self._conn
        if not conn.writing_paused:
            return self.state is not CLOSED
        timeout = self._plane.limits.send_timeout
        try:
            async with asyncio.timeout(timeout):
                await conn.drain()
        except TimeoutError:
            proxy_log.info("the client took no part of the answer for %gs: closed", timeout)
            if conn.transport is not None:
                conn.transport.abort()
            return False
        except ConnectionError:
            return False  # the client went away
        return True

    def _log_access(self, request: Request, status: int, sent: int) -> None:
        log = self._plane.access_log
        assert log is not None
        if not log.isEnabledFor(logging.INFO):
            return
        headers = request.headers
        log.info(
            '%s [%s] "%s %s HTTP/%d.%d" %d %d "%s" "%s"',
            self._conn.peer or "-",
            time.strftime("%d/%b/%Y:%H:%M:%S %z"),
            request.method,
            request.target,
            request.version.major,
            request.version.minor,
            status,
            sent,
            headers.get("Referer", "-"),
            headers.get("User-Agent", "-"),
        )


def _failed(request: Request) -> InternalError:
    """A handler's bug, told as it is: whether the request may have left for its
    upstream before it."""
    if request.forwarding:
        return InternalError(
            "the proxy failed on this request after it began forwarding it: "
            "it may have reached the upstream"
        )
    return InternalError("the proxy failed on this request; nothing was forwarded")


def _write(transport: asyncio.Transport, chunk: bytes, chunked: bool) -> None:
    if chunked:
        transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
    else:
        transport.write(chunk)


def _finish(answer: Answer) -> None:
    if answer.finish is not None:
        finish, answer.finish = answer.finish, None
        finish()


_CAP = "limits.max_connections"
_CLIENT_SHARE = "its client's share, limits.max_connections_per_client"


def _peer(transport: asyncio.BaseTransport) -> str | None:
    peer = transport.get_extra_info("peername")
    return peer[0] if isinstance(peer, tuple) else None


class _TlsAcceptor:
    """A TLS listener's sockets, accepted here rather than by the event loop, so that
    a connection is counted in by the plane from the moment it is accepted, before
    its handshake: handshakes that never end hold no more than the caps allow (the
    least recently active connection not being worked for, a pending handshake
    included, is closed to make room). The handshake must end within
    ``limits.header_timeout``."""

    def __init__(
        self, plane: DataPlane, sockets: list[socket.socket], context: ssl.SSLContext
    ) -> None:
        self._plane = plane
        self._context = context
        self.sockets = sockets
        loop = asyncio.get_running_loop()
        self._accepting = [loop.create_task(self._accept(sock)) for sock in sockets]
        self._handshakes: set[asyncio.Task[None]] = set()

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                client, address = await loop.sock_accept(sock)
            except OSError as exc:  # out of descriptors: let some connections end
                self._plane.log(logging.ERROR, "could not accept a connection: %s", exc)
                await asyncio.sleep(_ACCEPT_RETRY)
                continue
            task = loop.create_task(self._handshake(client, address))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, client: socket.socket, address: Any) -> None:
        plane = self._plane
        conn = plane()
        conn.peer = address[0] if isinstance(address, tuple) else None
        conn.handshaking = client
        made = False
        try:
            if plane.shutting_down or plane.opened(conn) is not None:
                return  # refused: nothing can be said before TLS
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: conn, client, ssl=self._context,
                ssl_handshake_timeout=plane.limits.header_timeout,
            )  # fmt: skip
            made = True  # the connection is the transport's now, and counted out by it
        except (OSError, ssl.SSLError, TimeoutError):  # refused, cut, timed out, closed
            pass
        finally:
            if not made:  # whatever ended it, cancellation at shutdown included
                conn.handshaking = None
                plane.closed(conn)
                client.close()

    def close(self) -> None:
        for task in self._accepting:
            task.cancel()
        for sock in self.sockets:
            sock.close()


_ACCEPT_RETRY = 0.1
"""Seconds before accepting again after a failure (asyncio's own wait is 1 s)."""


def _listening_sockets(
    host: str | None, port: int, *, reuse_port: bool, backlog: int
) -> list[socket.socket]:
    """Sockets listening on ``host:port`` (every address it resolves to; every
    interface for None), as the event loop's ``create_server`` makes them."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Listener:
    """A :class:`DataPlane` listening on a TCP address: ``listen`` opens it, ``close``
    stops taking connections and shuts the plane down within ``shutdown_timeout``."""

    def __init__(self, plane: DataPlane, shutdown_timeout: float = 60.0) -> None:
        self.server = plane
        self._shutdown_timeout = shutdown_timeout
        self._servers: list[asyncio.Server | _TlsAcceptor] = []

    async def listen(
        self,
        host: str | None,
        port: int,
        *,
        reuse_port: bool = False,
        backlog: int = 128,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """Listen on ``host:port``, with TLS when given its context: a handshake must end
        within ``limits.header_timeout``."""
        if tls is not None:
            sockets = _listening_sockets(host, port, reuse_port=reuse_port, backlog=backlog)
            self._servers.append(_TlsAcceptor(self.server, sockets, tls))
            return
        server = await asyncio.get_running_loop().create_server(
            self.server, host, port, reuse_address=True, reuse_port=reuse_port or None,
            backlog=backlog,
        )  # fmt: skip
        self._servers.append(server)

    async def listen_on(self, sock: Any) -> None:
        """Serve a socket already bound and listening (a test's)."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(self.server, sock=sock)
        self._servers.append(server)

    @property
    def ports(self) -> list[int]:
        return [sock.getsockname()[1] for server in self._servers for sock in server.sockets or ()]

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        self._servers.clear()
        await self.server.shutdown(self._shutdown_timeout)
