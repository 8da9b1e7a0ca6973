"""A client connection's life on the proxy's port, state by state (the table of
fenceproxy.http.connection_states), without a socket: a real
:class:`~fenceproxy.http.server.Connection` of a real data plane is fed the bytes a
client sends and its FIN through a transport that keeps what the proxy writes, and
each test checks where both halves stand and what the client got. The last test
drives them all again and checks that every move they make is a row of the table,
and every row is made."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from fenceproxy.errors import IllegalConnectionMove, InvariantError, Refusal, RequestHeadTooLarge
from fenceproxy.http import server
from fenceproxy.http.answer import Answer, problem_answer
from fenceproxy.http.connection_states import (
    ANSWERING_STARTS,
    ANSWERING_STATES,
    READING_STARTS,
    READING_STATES,
    TRANSITIONS,
    Event,
    State,
    move,
)
from fenceproxy.http.httptools_parser import HttpRequestParser, ParsingStopped, feed
from fenceproxy.http.request import MAX_HEAD, Request
from fenceproxy.http.server import MAX_AHEAD, Connection, DataPlane, Limits
from fenceproxy.testing import eventually

LIMITS = Limits(
    header_timeout=60.0,
    keepalive_timeout=75.0,
    send_timeout=60.0,
    max_connections=100,
    max_connections_per_client=None,
)
"""Deadlines far off: a test says when one passes (:meth:`Connection.expire`)."""


def get(path: str = "/a", extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: a\r\n" + extra + b"\r\n"


def post(body: bytes, length: int | None = None, path: str = "/w") -> bytes:
    size = len(body) if length is None else length
    return (
        b"POST %s HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % (path.encode(), size) + body
    )


UPGRADE = (
    b"GET /up HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: x\r\nContent-Length: 4\r\n\r\n"
)


class App:
    """The handler behind the plane: answers 200 with the request's path once it has
    read its body whole (a refusal of the body answered as a problem), or at once,
    unread, when ``read`` is False; while held, every request waits."""

    def __init__(self, *, read: bool = True) -> None:
        self.read = read
        self.seen: list[Request] = []
        self._gate = asyncio.Event()
        self._gate.set()

    def hold(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    async def __call__(self, request: Request) -> Answer:
        self.seen.append(request)
        await self._gate.wait()
        if self.read:
            try:
                while await request.body.next():
                    pass
            except Refusal as refusal:
                return problem_answer(refusal)
            except ConnectionResetError:
                return Answer(400)  # the client left mid-body: sent to nobody
        return Answer(200, body=request.path.encode())


class Wire(asyncio.Transport):
    """A client connection with no socket under it, as the event loop drives a
    protocol: what the client sends is delivered while reading is not paused (held
    back, as the kernel would, while it is), its FIN after that; what the proxy
    writes is kept; closing it loses the connection once what is delivered is."""

    def __init__(self, conn: Connection) -> None:
        super().__init__()
        self.conn = conn
        self.written = bytearray()
        self.closing = False
        self.paused = False
        self.fin_sent = False
        """The proxy ended its side (``write_eof``)."""
        self._inbox: deque[bytes] = deque()
        self._fin = False
        self._loop = asyncio.get_running_loop()

    # -- the client's side
    def send(self, data: bytes) -> None:
        self._inbox.append(data)
        self._deliver()

    def finish(self) -> None:
        """The client's FIN."""
        self._fin = True
        self._deliver()

    def lose(self) -> None:
        """The connection breaks."""
        self.closing = True
        self.conn.connection_lost(ConnectionResetError())

    def _deliver(self) -> None:
        while self._inbox and not self.paused and not self.closing:
            self.conn.data_received(self._inbox.popleft())
        if self._fin and not self._inbox and not self.paused and not self.closing:
            self._fin = False
            if not self.conn.eof_received():
                self.close()

    # -- the proxy's side
    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.written += line

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self._loop.call_soon(self.conn.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False
        self._loop.call_soon(self._deliver)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.fin_sent = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default


def connect(app: App, plane: DataPlane | None = None) -> tuple[Connection, Wire]:
    plane = plane or DataPlane(app, LIMITS)
    conn = plane()
    wire = Wire(conn)
    conn.connection_made(wire)
    return conn, wire


def halves(conn: Connection) -> tuple[State, State]:
    return conn.state, conn.answers.state


def answered(wire: Wire) -> int:
    return wire.written.count(b"HTTP/1.1 ")


async def settled(conn: Connection, wire: Wire, app: App) -> None:
    """Every request taken so far is answered, and nothing is owed."""
    await eventually(
        lambda: conn.answers.state is State.OWES_NOTHING and answered(wire) == len(app.seen)
    )


async def closed(conn: Connection) -> None:
    await eventually(lambda: halves(conn) == (State.CLOSED, State.CLOSED), within=5)


# -- reading a request, answering it ---------------------------------------------------


async def test_a_request_is_read_head_then_body_then_answered_and_the_connection_idles() -> None:
    """A connection waits for its first head from its opening; a head, its body, its
    answer; then idle, the keep-alive deadline running; the next head's deadline runs
    from its first byte."""
    app = App()
    conn, wire = connect(app)
    loop = asyncio.get_running_loop()
    assert halves(conn) == (State.OPENED, State.OWES_NOTHING)
    opened_due = conn.due
    assert opened_due == pytest.approx(loop.time() + LIMITS.header_timeout, abs=1)
    wire.send(b"POST /w HTTP/1.1\r\nHo")
    assert halves(conn) == (State.HEAD, State.OWES_NOTHING)
    assert conn.due == opened_due  # the first head's deadline runs from the opening
    wire.send(b"st: a\r\nContent-Length: 4\r\n\r\nab")
    assert halves(conn) == (State.BODY, State.ANSWERING)
    wire.send(b"cd")
    assert conn.state is State.IDLE
    await eventually(lambda: conn.answers.state is State.OWES_NOTHING)
    assert wire.written.startswith(b"HTTP/1.1 200 OK\r\n")
    assert conn.due == pytest.approx(loop.time() + LIMITS.keepalive_timeout, abs=1)
    wire.send(b"GET /b HT")
    assert halves(conn) == (State.HEAD, State.OWES_NOTHING)
    assert conn.due == pytest.approx(loop.time() + LIMITS.header_timeout, abs=1)
    wire.lose()
    assert halves(conn) == (State.CLOSED, State.CLOSED)
    assert conn.gone().done()


async def test_an_idle_connection_past_its_keep_alive_is_closed_without_a_word() -> None:
    app = App()
    conn, wire = connect(app)
    wire.send(get())
    await eventually(lambda: conn.answers.state is State.OWES_NOTHING)
    before = bytes(wire.written)
    conn.expire()  # the keep-alive deadline passed
    assert wire.closing
    assert wire.written == before
    await closed(conn)


@pytest.mark.parametrize("begun", [b"", b"GET / HT"], ids=["nothing-sent", "head-begun"])
async def test_a_head_not_in_within_its_deadline_is_408_then_the_connection_lingers(
    begun: bytes,
) -> None:
    """The head deadline passed: 408, the proxy's FIN, and what the client still sends
    is dropped until it closes (its FIN), then the connection is closed."""
    app = App()
    conn, wire = connect(app)
    wire.send(begun)
    conn.expire()
    assert conn.state is State.STOPPED
    await eventually(lambda: conn.state is State.LINGERING)
    assert wire.written.startswith(b"HTTP/1.1 408 ")
    assert wire.fin_sent
    assert conn.answers.state is State.CLOSING
    wire.send(get("/dropped"))
    wire.finish()
    await closed(conn)
    assert app.seen == []


async def test_a_head_read_ahead_has_no_deadline_while_reading_is_held() -> None:
    """Behind a request being answered, one more is read ahead and reading is held:
    the next head's deadline waits until the proxy reads again."""
    app = App()
    app.hold()
    conn, wire = connect(app)
    wire.send(get("/1") + get("/2") + get("/3") + b"GET /4 HT")
    assert halves(conn) == (State.HEAD, State.READ_AHEAD)
    assert wire.paused
    conn.expire()  # had it a deadline, it would have passed
    assert conn.state is State.HEAD
    app.release()
    await eventually(lambda: answered(wire) == 3)
    assert halves(conn) == (State.HEAD, State.OWES_NOTHING)  # caught up: reading again
    assert not wire.paused
    loop = asyncio.get_running_loop()
    assert conn.due == pytest.approx(loop.time() + LIMITS.header_timeout, abs=1)
    wire.send(b"TP/1.1\r\nHost: a\r\n\r\n")
    await eventually(lambda: conn.answers.state is State.OWES_NOTHING)
    assert [r.path for r in app.seen] == ["/1", "/2", "/3", "/4"]
    wire.lose()


async def test_a_client_pipelining_beyond_max_ahead_has_the_rest_left_unread() -> None:
    """What one read brings beyond MAX_AHEAD requests ahead is never read: those taken
    are answered, the last saying close, then the connection lingers."""
    app = App()
    app.hold()
    conn, wire = connect(app)
    wire.send(b"".join(get(f"/{n}") for n in range(MAX_AHEAD + 4)))
    assert halves(conn) == (State.LEFT_UNREAD, State.CLOSING)
    app.release()
    await eventually(lambda: conn.state is State.LINGERING)
    assert answered(wire) == MAX_AHEAD + 1
    assert wire.written.count(b"Connection: close") == 1
    wire.finish()
    await closed(conn)
    assert len(app.seen) == MAX_AHEAD + 1


async def test_an_answer_before_the_body_is_in_ends_the_connection_and_lingers() -> None:
    """Answered before its body was in, a request's answer says close; what the client
    sends after it is dropped, never read as a request, until the client closes."""
    app = App(read=False)
    conn, wire = connect(app)
    wire.send(post(b"abc", length=10))
    await eventually(lambda: conn.state is State.LINGERING)
    assert b"Connection: close" in wire.written
    wire.send(b"defghij" + get("/smuggled"))
    assert conn.state is State.LINGERING
    wire.finish()
    await closed(conn)
    assert [r.path for r in app.seen] == ["/w"]


@pytest.mark.parametrize(
    ("sent", "lingers"),
    [
        (get("/a", b"Connection: close\r\n"), False),
        (get("/a", b"Connection: close\r\n") + b"GET /b HT", True),
    ],
    ids=["nothing-behind", "more-behind"],
)
async def test_an_answer_that_closes_lingers_only_when_more_was_sent(
    sent: bytes, lingers: bool
) -> None:
    app = App()
    conn, wire = connect(app)
    wire.send(sent)
    await eventually(lambda: conn.state in (State.LINGERING, State.CLOSED))
    assert wire.fin_sent is lingers
    wire.finish()
    await closed(conn)
    assert len(app.seen) == 1


async def test_an_upgrade_requests_body_is_taken_by_its_length_then_nothing_is_read() -> None:
    app = App()
    conn, wire = connect(app)
    wire.send(UPGRADE + b"ab")
    assert conn.state is State.UPGRADE_BODY
    wire.send(b"cd" + get("/no"))
    assert conn.state is State.STOPPED
    await closed(conn)
    assert [r.path for r in app.seen] == ["/up"]
    assert answered(wire) == 1


async def test_an_upgrade_answered_before_its_body_is_in_lingers() -> None:
    app = App(read=False)
    conn, wire = connect(app)
    wire.send(UPGRADE + b"ab")
    await eventually(lambda: conn.state is State.LINGERING)
    wire.finish()
    await closed(conn)


async def test_broken_framing_mid_body_fails_the_body_and_stops_reading() -> None:
    app = App()
    conn, wire = connect(app)
    wire.send(b"POST /w HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
    assert conn.state is State.BODY
    wire.send(b"zz\r\n")
    assert conn.state is State.STOPPED
    await eventually(lambda: answered(wire) == 1)
    assert wire.written.startswith(b"HTTP/1.1 400 ")
    wire.finish()
    await closed(conn)


@pytest.mark.parametrize("first", [b"", get("/a")], ids=["opened", "idle"])
async def test_a_flood_of_blank_lines_where_a_request_is_due_is_431(first: bytes) -> None:
    """llhttp skips blank lines between requests, reporting nothing: past MAX_HEAD of
    them, the connection is refused as a head too large would be."""
    app = App()
    conn, wire = connect(app)
    wire.send(first)
    await settled(conn, wire, app)
    wire.send(b"\r\n" * (MAX_HEAD // 2 + 1))
    assert conn.state is State.STOPPED
    await eventually(lambda: b" 431 " in wire.written)
    wire.lose()


def closing_behind_a_held_answer(head: bytes) -> tuple[App, Connection, Wire]:
    """A connection told to close when done while the answer in front is held and
    the ``head`` behind it has begun to arrive."""
    app = App()
    app.hold()
    conn, wire = connect(app)
    wire.send(get("/1") + head)
    conn.close_when_done()
    assert halves(conn) == (State.HEAD, State.CLOSING)
    return app, conn, wire


async def test_a_head_taken_while_closing_is_a_refusal_owed_in_turn() -> None:
    """A head already begun when the connection began closing is still read; refused
    (too large), its refusal is answered after the answer in front."""
    app, conn, wire = closing_behind_a_held_answer(b"GET /2 HTTP/1.1\r\n")
    wire.send(b"X: " + b"a" * (MAX_HEAD + 1) + b"\r\n")
    assert halves(conn) == (State.STOPPED, State.CLOSING)
    app.release()
    await eventually(lambda: b" 431 " in wire.written)
    wire.lose()


# -- the client done sending ------------------------------------------------------------


NOTHING_IN_HAND = pytest.mark.parametrize(
    "sent", [b"", get("/a"), b"GET /a HT"], ids=["opened", "idle", "head"]
)
"""A connection opened, idle, or with a head begun, and nothing owed."""


async def settled_after(sent: bytes) -> tuple[Connection, Wire]:
    """A connection sent ``sent``, once every request taken is answered."""
    app = App()
    conn, wire = connect(app)
    wire.send(sent)
    await settled(conn, wire, app)
    return conn, wire


@NOTHING_IN_HAND
async def test_a_client_done_sending_with_nothing_owed_is_closed(sent: bytes) -> None:
    conn, wire = await settled_after(sent)
    wire.finish()
    await closed(conn)


async def test_a_client_done_sending_gets_the_answers_owed_then_the_connection_closes() -> None:
    app = App()
    app.hold()
    conn, wire = connect(app)
    wire.send(get("/a"))
    wire.finish()
    assert halves(conn) == (State.STOPPED, State.CLOSING)
    app.release()
    await closed(conn)
    assert b"Connection: close" in wire.written


@pytest.mark.parametrize(
    "sent",
    [post(b"ab", length=4), UPGRADE + b"ab"],
    ids=["body", "upgrade-body"],
)
async def test_a_body_cut_short_by_the_clients_fin_fails(sent: bytes) -> None:
    app = App()
    app.hold()
    conn, wire = connect(app)
    wire.send(sent)
    wire.finish()
    assert halves(conn) == (State.STOPPED, State.CLOSING)
    request = conn.answers.queue[0]
    assert isinstance(request, Request)
    assert isinstance(request.body.failed, ConnectionResetError)
    app.release()
    await eventually(lambda: answered(wire) == 1)
    wire.lose()


async def test_a_client_done_after_a_request_left_unread_still_gets_its_answer() -> None:
    app = App()
    app.hold()
    conn, wire = connect(app)
    wire.send(post(b"ab", length=4))
    conn.close_when_done()
    wire.send(b"cd" + get("/after"))
    wire.finish()
    assert halves(conn) == (State.LEFT_UNREAD, State.CLOSING)
    app.release()
    await eventually(lambda: answered(wire) == 1)
    wire.lose()


async def test_a_client_done_while_its_refusal_is_owed_gets_it() -> None:
    app = App()
    conn, wire = connect(app)
    conn.expire()
    wire.finish()
    assert halves(conn) == (State.STOPPED, State.CLOSING)
    await eventually(lambda: b" 408 " in wire.written)
    wire.lose()


# -- shutting down, refusing, losing ----------------------------------------------------


@NOTHING_IN_HAND
async def test_shutting_down_closes_a_connection_with_nothing_in_hand_at_once(sent: bytes) -> None:
    conn, wire = await settled_after(sent)
    conn.close_when_done()
    assert wire.closing
    await closed(conn)


async def test_shutting_down_with_a_head_arriving_answers_the_one_in_front_and_lingers() -> None:
    """The answer in front is the last, saying close; the head arriving behind it is
    never taken, and the connection lingers so the client reads that answer."""
    app, conn, wire = closing_behind_a_held_answer(b"GET /2 HT")
    app.release()
    await eventually(lambda: conn.state is State.LINGERING)
    assert b"Connection: close" in wire.written
    wire.send(b"TP/1.1\r\nHost: a\r\n\r\n")
    wire.finish()
    await closed(conn)
    assert [r.path for r in app.seen] == ["/1"]


async def test_shutting_down_reads_the_body_under_way_to_its_end_and_no_request_after_it() -> None:
    app = App()
    conn, wire = connect(app)
    wire.send(post(b"ab", length=4))
    conn.close_when_done()
    assert halves(conn) == (State.BODY, State.CLOSING)
    wire.send(b"cd" + get("/after"))
    assert halves(conn) == (State.LEFT_UNREAD, State.CLOSING)
    await eventually(lambda: conn.state is State.LINGERING)
    assert b"Connection: close" in wire.written
    wire.lose()
    assert [r.path for r in app.seen] == ["/w"]


@pytest.mark.parametrize(
    ("sent", "state"),
    [
        (post(b"ab", length=4), State.BODY),
        (UPGRADE + b"ab", State.UPGRADE_BODY),
        (b"".join(get(f"/{n}") for n in range(MAX_AHEAD + 2)), State.LEFT_UNREAD),
        (get("/a"), State.IDLE),
    ],
    ids=["body", "upgrade-body", "left-unread", "idle"],
)
async def test_a_shutdown_cuts_what_is_still_unanswered_when_its_time_is_up(
    sent: bytes, state: State
) -> None:
    app = App()
    app.hold()
    plane = DataPlane(app, LIMITS)
    conn, wire = connect(app, plane)
    wire.send(sent)
    assert conn.state is state
    await eventually(lambda: len(app.seen) == 1)  # the request in front is in its handler
    task = conn.task
    assert task is not None
    await plane.shutdown(within=0.01)
    assert halves(conn) == (State.CLOSED, State.CLOSED)
    assert answered(wire) == 0
    assert task.cancelled()  # cut, and closed after it without a fault


async def test_a_connection_refused_at_the_door_is_told_503_and_closed() -> None:
    app = App()
    plane = DataPlane(app, LIMITS)
    plane.pre_shutdown()
    conn, wire = connect(app, plane)
    assert wire.written.startswith(b"HTTP/1.1 503 ")
    assert halves(conn) == (State.STOPPED, State.CLOSED)
    await closed(conn)


async def _lost_in(state: State) -> tuple[Connection, Wire, App]:
    app = App()
    conn, wire = connect(app)
    sent = {
        State.OPENED: b"",
        State.HEAD: get("/1") + get("/2") + b"GET /3 HT",  # two owed: one read ahead
        State.BODY: post(b"ab", length=4),
        State.UPGRADE_BODY: UPGRADE + b"ab",
        State.LEFT_UNREAD: b"".join(get(f"/{n}") for n in range(MAX_AHEAD + 2)),
        State.STOPPED: get("/a"),
    }
    if state is State.IDLE:
        wire.send(get("/a"))
        await eventually(lambda: conn.answers.state is State.OWES_NOTHING)
    elif state is State.LINGERING:
        app.read = False
        wire.send(post(b"ab", length=4))
        await eventually(lambda: conn.state is State.LINGERING)
    else:
        app.hold()
        wire.send(sent[state])
        if state is State.STOPPED:
            wire.finish()
    return conn, wire, app


@pytest.mark.parametrize("state", sorted(READING_STATES - {State.CLOSED}, key=lambda s: s.value))
async def test_a_lost_connection_is_closed_in_both_halves_whatever_it_was_reading(
    state: State,
) -> None:
    """Whatever it was doing, a connection the client lost answers nothing more, and
    a handler waiting on its client learns it is gone."""
    conn, wire, app = await _lost_in(state)
    assert conn.state is state
    gone = conn.gone()
    wire.lose()
    assert halves(conn) == (State.CLOSED, State.CLOSED)
    assert gone.done()
    app.release()
    await eventually(lambda: conn.answers.task is None)


# -- a handler's bug ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("forwarding", "says"),
    [(False, b"nothing was forwarded"), (True, b"it may have reached the upstream")],
    ids=["before-forwarding", "after-forwarding"],
)
async def test_a_handlers_bug_is_500_saying_whether_the_request_may_have_been_forwarded(
    forwarding: bool, says: bytes
) -> None:
    """A handler that fails is answered 500, and the answer says what is true: nothing
    was forwarded, or, once the handler began sending the request on, that it may
    have reached the upstream (retrying it may apply it twice)."""

    async def buggy(request: Request) -> Answer:
        request.forwarding = forwarding
        raise KeyError("a bug")

    conn, wire = connect(App(), DataPlane(buggy, LIMITS))
    wire.send(get("/a"))
    await closed(conn)
    assert wire.written.startswith(b"HTTP/1.1 500 ")
    assert says in wire.written


# -- the table ------------------------------------------------------------------------


def test_a_move_the_table_does_not_list_is_raised_as_a_bug() -> None:
    with pytest.raises(IllegalConnectionMove) as raised:
        move(State.OPENED, Event.BODY_READ)
    assert isinstance(raised.value, InvariantError)
    assert (raised.value.state, raised.value.event) == (State.OPENED, Event.BODY_READ)


async def test_a_connection_asked_for_a_move_its_state_lacks_raises() -> None:
    conn, wire = connect(App())
    with pytest.raises(IllegalConnectionMove):
        conn.stop_reading()  # no answer was sent: none can be the last
    assert conn.state is State.OPENED
    wire.lose()


def test_the_halves_meet_only_once_closed_and_closed_is_final() -> None:
    assert set(State) == READING_STATES | ANSWERING_STATES
    assert {State.CLOSED} == READING_STATES & ANSWERING_STATES
    for (before, _), after in TRANSITIONS.items():
        half = READING_STATES if before in READING_STATES - {State.CLOSED} else ANSWERING_STATES
        assert after in half, f"{before} moves to {after}, in the other half"
    assert {event for (before, event) in TRANSITIONS if before is State.CLOSED} == {Event.LOST}
    assert all(
        after is State.CLOSED
        for (before, _), after in TRANSITIONS.items()
        if before is State.CLOSED
    )


def test_every_state_is_reached_from_where_its_half_starts_and_every_one_can_be_lost() -> None:
    for start, states in ((READING_STARTS, READING_STATES), (ANSWERING_STARTS, ANSWERING_STATES)):
        reached, frontier = {start}, [start]
        while frontier:
            here = frontier.pop()
            for (before, _), after in TRANSITIONS.items():
                if before is here and after not in reached:
                    reached.add(after)
                    frontier.append(after)
        assert reached == states
        assert all(TRANSITIONS.get((state, Event.LOST)) is State.CLOSED for state in states)


def test_a_parser_stop_and_a_refusal_are_told_apart_by_their_types() -> None:
    class Callbacks:
        stop = True

        def on_message_begin(self) -> None:
            if self.stop:
                raise ParsingStopped

        def on_header(self, name: bytes, value: bytes) -> None:
            raise RequestHeadTooLarge("too large")

    callbacks = Callbacks()
    with pytest.raises(ParsingStopped):
        feed(HttpRequestParser(callbacks), get())
    callbacks.stop = False
    with pytest.raises(RequestHeadTooLarge):
        feed(HttpRequestParser(callbacks), get())


# -- every move the code makes is in the table, and every row is made ------------------


async def test_every_move_the_connection_makes_is_a_row_and_every_row_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every test above, run again with each move recorded: none the table lacks is
    asked for (wherever it is, in a parser callback or an answering task, where no
    test would see it raised), and a row no behaviour makes is a row too many."""
    made: set[tuple[State, Event]] = set()
    lacking: set[tuple[State, Event]] = set()

    def recorded(state: State, event: Event) -> State:
        try:
            moved = move(state, event)
        except IllegalConnectionMove:
            lacking.add((state, event))
            raise
        made.add((state, event))
        return moved

    monkeypatch.setattr(server, "move", recorded)
    for test, cases in _scenarios():
        for case in cases:
            await test(*case)
    assert lacking == set()
    assert made == set(TRANSITIONS), f"rows no behaviour makes: {set(TRANSITIONS) - made}"


_NOT_SCENARIOS = {
    "test_a_connection_asked_for_a_move_its_state_lacks_raises",  # asks for one on purpose
    "test_every_move_the_connection_makes_is_a_row_and_every_row_is_made",
}


def _scenarios() -> list[tuple[Callable[..., Awaitable[None]], list[tuple[Any, ...]]]]:
    """Each test of a connection above, with every case it is parametrized with."""
    found = []
    for name, test in globals().items():
        if not name.startswith("test_") or not asyncio.iscoroutinefunction(test):
            continue
        if name in _NOT_SCENARIOS:
            continue
        marks = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]
        if not marks:
            found.append((test, [()]))
            continue
        names, values = marks[0].args
        single = "," not in names if isinstance(names, str) else len(names) == 1
        found.append((test, [(v,) if single else tuple(v) for v in values]))
    return found
