"""A client connection's life on the proxy's port, in states: pure, no I/O. The data
plane (:class:`fenceproxy.http.server.Connection`) moves through them and acts on
where it stands; nothing else holds its life.

A connection has two halves, each with its own state, as HTTP/1.1 has two parties
(h11 keeps its client's and its server's the same way): the **reading half**, what
the client sends as the proxy reads it, and the **answering half**, the answers it
owes, sent one at a time, in order. They run side by side: a request's body arrives
while it is answered, and the next request's head may be read meanwhile::

    reading:   opened --head begins--> head --head read--> body --body read--> idle
               idle --head begins--> head ...           (the keep-alive deadline runs
                                                          while nothing is owed)
               body --upgraded--> upgrade body --body read--> stopped
               idle --not taken--> left unread          (pipelined beyond MAX_AHEAD,
                                                          or sent as it closes)
               any --refused / client done / answer ends it / close--> stopped
               stopped --linger--> lingering --linger over--> stopped
               any --lost--> closed

    answering: owes nothing --owed--> answering --owed--> read ahead
               read ahead --caught up--> answering --all answered--> owes nothing
               answering, read ahead --close after--> closing --close--> closed
               owes nothing --close--> closed
               any --lost--> closed

:data:`TRANSITIONS` is the whole table, both halves in it (they meet only at
``closed``): every move goes through :func:`move`, and a move it does not list is a
bug, raised as :class:`~fenceproxy.errors.IllegalConnectionMove`. A connection
starts reading at :data:`READING_STARTS` (the first row's state) and answering at
:data:`ANSWERING_STARTS`.
"""

from __future__ import annotations

import enum

from ..errors import IllegalConnectionMove

__all__ = [
    "ANSWERING_STARTS",
    "ANSWERING_STATES",
    "READING_STARTS",
    "READING_STATES",
    "TRANSITIONS",
    "Event",
    "State",
    "move",
]


class State(enum.Enum):
    """Where a half of a connection stands."""

    # A member is its one instance, compared by identity: hashed by it too, in C,
    # for the table is read on every move (Enum's own hash runs in Python).
    __hash__ = object.__hash__

    # -- the reading half -------------------------------------------------------------
    OPENED = "opened"
    """Nothing read yet: the first request head is due within ``header_timeout`` of
    the opening (408 otherwise)."""
    IDLE = "idle"
    """Between two requests. While nothing is owed, the connection is closed after
    ``keepalive_timeout`` of this."""
    HEAD = "head"
    """A request head is arriving: due within ``header_timeout`` of its first byte,
    a deadline that runs only while the proxy reads (408 otherwise)."""
    BODY = "body"
    """The request last read is in, but for its body (none, for a bodiless one, until
    llhttp says so: at once); a field now is a trailer."""
    UPGRADE_BODY = "upgrade body"
    """llhttp stopped at the head of a request asking for another protocol: its body,
    if it declared one, is taken by its length; nothing after it is read."""
    STOPPED = "stopped"
    """Nothing more is read as a request: what comes is dropped unparsed. The answers
    owed go out, then the connection closes."""
    LEFT_UNREAD = "left unread"
    """A request began that is not taken (pipelined beyond ``MAX_AHEAD``, or sent once
    the connection was closing): it and what follows are never read. The answers owed
    go out, then the connection lingers, so the client is not reset before it reads
    them."""
    LINGERING = "lingering"
    """An answer ended the connection before the client was done sending: the proxy's
    FIN is sent, and what the client still sends is dropped until it closes, for
    ``LINGER_FOR`` and ``LINGER_BYTES`` at most. Not worked for: the cap may take it."""

    # -- the answering half -----------------------------------------------------------
    OWES_NOTHING = "owes nothing"
    """No request waits for an answer."""
    ANSWERING = "answering"
    """The request in front is being answered (its handler runs, or its answer is
    sent); reading goes on, one request ahead at most."""
    READ_AHEAD = "read ahead"
    """A request read ahead waits behind the one answered: reading is held until that
    answer is sent, so a pipelining client never has the proxy queue its requests."""
    CLOSING = "closing"
    """The answers owed go out, then the connection closes: no request after them is
    taken (shutting down, the client is done, or an answer ended it)."""

    # -- both -------------------------------------------------------------------------
    CLOSED = "closed"
    """The connection is closed (lost, or closed by the proxy): nothing more is read
    or answered."""


class Event(enum.Enum):
    """What moves a half of a connection."""

    __hash__ = object.__hash__  # as State's

    # -- the reading half -------------------------------------------------------------
    HEAD_BEGINS = "head begins"
    """llhttp began a request, which is taken."""
    HEAD_READ = "head read"
    """The head is in, and checked: the request is handed over."""
    BODY_READ = "body read"
    """The body is in whole (llhttp's end of the message, or an Upgrade's length)."""
    UPGRADED = "upgraded"
    """llhttp stopped at the head of a request that asks for another protocol."""
    NOT_TAKEN = "not taken"
    """A request began beyond what is taken."""
    REFUSED = "refused"
    """What came cannot be read as a request (the parser's refusal, a head too large
    or too late), or the connection is refused at the door: answered as a problem."""
    CLIENT_DONE = "client done"
    """The client will send no more (its FIN)."""
    ANSWER_ENDS = "answer ends it"
    """An answer was the connection's last."""
    LINGER = "linger"
    """An answer ended the connection before the client was done sending."""
    LINGER_OVER = "linger over"
    """The client closed, sent ``LINGER_BYTES``, or ``LINGER_FOR`` passed."""

    # -- the answering half -----------------------------------------------------------
    OWED = "owed"
    """A request, or a refusal of what came, is owed an answer."""
    CAUGHT_UP = "caught up"
    """The request read ahead is the one answered now: reading goes on."""
    ALL_ANSWERED = "all answered"
    """Every answer owed is sent, and the connection goes on."""
    CLOSE_AFTER = "close after"
    """No request after those owed is taken: the proxy is shutting down, the client is
    done sending, or an answer ends the connection."""

    # -- both -------------------------------------------------------------------------
    CLOSE = "close"
    """The proxy closes the connection (what it buffers goes out first)."""
    LOST = "lost"
    """The connection is gone."""


_S, _E = State, Event

TRANSITIONS: dict[tuple[State, Event], State] = {
    # the reading half
    (_S.OPENED, _E.HEAD_BEGINS): _S.HEAD,
    (_S.IDLE, _E.HEAD_BEGINS): _S.HEAD,
    (_S.HEAD, _E.HEAD_READ): _S.BODY,
    (_S.BODY, _E.BODY_READ): _S.IDLE,
    (_S.BODY, _E.UPGRADED): _S.UPGRADE_BODY,
    (_S.UPGRADE_BODY, _E.BODY_READ): _S.STOPPED,
    (_S.IDLE, _E.NOT_TAKEN): _S.LEFT_UNREAD,
    (_S.OPENED, _E.REFUSED): _S.STOPPED,
    (_S.IDLE, _E.REFUSED): _S.STOPPED,
    (_S.HEAD, _E.REFUSED): _S.STOPPED,
    (_S.BODY, _E.REFUSED): _S.STOPPED,
    (_S.OPENED, _E.CLIENT_DONE): _S.STOPPED,
    (_S.IDLE, _E.CLIENT_DONE): _S.STOPPED,
    (_S.HEAD, _E.CLIENT_DONE): _S.STOPPED,
    (_S.BODY, _E.CLIENT_DONE): _S.STOPPED,
    (_S.UPGRADE_BODY, _E.CLIENT_DONE): _S.STOPPED,
    (_S.STOPPED, _E.CLIENT_DONE): _S.STOPPED,
    (_S.LEFT_UNREAD, _E.CLIENT_DONE): _S.LEFT_UNREAD,
    (_S.LINGERING, _E.CLIENT_DONE): _S.LINGERING,
    (_S.IDLE, _E.ANSWER_ENDS): _S.STOPPED,
    (_S.HEAD, _E.ANSWER_ENDS): _S.STOPPED,
    (_S.BODY, _E.ANSWER_ENDS): _S.STOPPED,
    (_S.UPGRADE_BODY, _E.ANSWER_ENDS): _S.STOPPED,
    (_S.STOPPED, _E.ANSWER_ENDS): _S.STOPPED,
    (_S.LEFT_UNREAD, _E.ANSWER_ENDS): _S.STOPPED,
    (_S.STOPPED, _E.LINGER): _S.LINGERING,
    (_S.LINGERING, _E.LINGER_OVER): _S.STOPPED,
    (_S.OPENED, _E.CLOSE): _S.STOPPED,
    (_S.IDLE, _E.CLOSE): _S.STOPPED,
    (_S.HEAD, _E.CLOSE): _S.STOPPED,
    (_S.BODY, _E.CLOSE): _S.STOPPED,
    (_S.UPGRADE_BODY, _E.CLOSE): _S.STOPPED,
    (_S.STOPPED, _E.CLOSE): _S.STOPPED,
    (_S.LEFT_UNREAD, _E.CLOSE): _S.STOPPED,
    (_S.OPENED, _E.LOST): _S.CLOSED,
    (_S.IDLE, _E.LOST): _S.CLOSED,
    (_S.HEAD, _E.LOST): _S.CLOSED,
    (_S.BODY, _E.LOST): _S.CLOSED,
    (_S.UPGRADE_BODY, _E.LOST): _S.CLOSED,
    (_S.STOPPED, _E.LOST): _S.CLOSED,
    (_S.LEFT_UNREAD, _E.LOST): _S.CLOSED,
    (_S.LINGERING, _E.LOST): _S.CLOSED,
    # the answering half
    (_S.OWES_NOTHING, _E.OWED): _S.ANSWERING,
    (_S.ANSWERING, _E.OWED): _S.READ_AHEAD,
    (_S.READ_AHEAD, _E.OWED): _S.READ_AHEAD,
    (_S.CLOSING, _E.OWED): _S.CLOSING,
    (_S.READ_AHEAD, _E.CAUGHT_UP): _S.ANSWERING,
    (_S.ANSWERING, _E.ALL_ANSWERED): _S.OWES_NOTHING,
    (_S.ANSWERING, _E.CLOSE_AFTER): _S.CLOSING,
    (_S.READ_AHEAD, _E.CLOSE_AFTER): _S.CLOSING,
    (_S.CLOSING, _E.CLOSE_AFTER): _S.CLOSING,
    (_S.OWES_NOTHING, _E.CLOSE): _S.CLOSED,
    (_S.CLOSING, _E.CLOSE): _S.CLOSED,
    (_S.OWES_NOTHING, _E.LOST): _S.CLOSED,
    (_S.ANSWERING, _E.LOST): _S.CLOSED,
    (_S.READ_AHEAD, _E.LOST): _S.CLOSED,
    (_S.CLOSING, _E.LOST): _S.CLOSED,
    (_S.CLOSED, _E.LOST): _S.CLOSED,
}
"""Every move either half of a connection can make. ``closed`` is final."""

READING_STARTS = State.OPENED
ANSWERING_STARTS = State.OWES_NOTHING
READING_STATES = frozenset(
    {
        State.OPENED,
        State.IDLE,
        State.HEAD,
        State.BODY,
        State.UPGRADE_BODY,
        State.STOPPED,
        State.LEFT_UNREAD,
        State.LINGERING,
        State.CLOSED,
    }
)
ANSWERING_STATES = frozenset(
    {State.OWES_NOTHING, State.ANSWERING, State.READ_AHEAD, State.CLOSING, State.CLOSED}
)


def move(state: State, event: Event) -> State:
    """Where ``event`` moves a half that stands at ``state``; IllegalConnectionMove
    when the table lists no such move (a bug: the connection is used against its
    life)."""
    moved = TRANSITIONS.get((state, event))
    if moved is None:
        raise IllegalConnectionMove(state, event)
    return moved
