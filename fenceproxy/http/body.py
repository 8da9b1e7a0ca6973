"""What both ends of the data plane share: a message's body as it arrives on a
connection, for one reader (a request's on the proxy's port,
:mod:`fenceproxy.http.server`; an answer's on an upstream connection,
:mod:`fenceproxy.http.http1`), the flow control of that connection in both
directions, and the fields of a message read as a mapping."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Protocol

from multidict import CIMultiDict, CIMultiDictProxy

from ..errors import InvariantError

__all__ = ["Body", "Flow", "Reading", "read_fields"]


def read_fields(fields: list[tuple[bytes, bytes]]) -> CIMultiDictProxy[str]:
    """A message's fields as a case-insensitive mapping: names as sent, values decoded
    as UTF-8, bytes that are not kept as surrogate escapes (so they go back out as
    they came)."""
    return CIMultiDictProxy(
        CIMultiDict(
            (name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))
            for name, value in fields
        )
    )


class Flow(asyncio.Protocol):
    """A connection's flow control: reading stops while a body's reader is behind (or
    anything else holds it), and a writer waits while the socket is full."""

    transport: asyncio.Transport | None

    def __init__(self) -> None:
        self.transport = None
        self._held: set[object] = set()
        self._write_paused = False
        self._drained: asyncio.Future[None] | None = None
        self._gone = False

    def hold_reading(self, holder: object) -> None:
        """Stop reading from the socket until ``holder`` lets go."""
        if not self._held and self.transport is not None:
            with contextlib.suppress(RuntimeError):  # closing already
                self.transport.pause_reading()
        self._held.add(holder)

    @property
    def holds_reading(self) -> bool:
        """Something holds reading: a body's reader is behind."""
        return bool(self._held)

    def release_reading(self, holder: object) -> None:
        held = self._held
        if holder in held:
            held.discard(holder)
            if not held and self.transport is not None and not self.transport.is_closing():
                self.reading_again()

    def reading_again(self) -> None:
        """Nothing holds reading any more."""
        assert self.transport is not None
        with contextlib.suppress(RuntimeError):
            self.transport.resume_reading()

    @property
    def writing_paused(self) -> bool:
        """The socket takes no more for now (:meth:`drain` waits until it does)."""
        return self._write_paused

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def drain(self) -> None:
        """Wait until the socket takes more; ConnectionResetError once it is gone."""
        if self._gone:
            raise ConnectionResetError("the connection is closed")
        if not self._write_paused:
            return
        self._drained = asyncio.get_running_loop().create_future()
        try:
            await self._drained
        finally:
            self._drained = None

    def flow_lost(self) -> None:
        """The socket is gone: a writer waiting learns it."""
        self._gone = True
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ConnectionResetError("the connection is closed"))
            self._drained.exception()  # retrieved, should nobody await it any more


# A body buffers at most this much of what the client sent ahead of its reader
# before the connection stops reading; it reads again once the reader took it.
_HIGH = 256 * 1024


class Reading(Protocol):
    """The connection a body arrives on, which stops reading from its socket while a
    body holds it."""

    def hold_reading(self, holder: object) -> None: ...
    def release_reading(self, holder: object) -> None: ...


class Body:
    """A message's body as it arrives, in order, until its end or a failure: what the
    peer sent ahead of the reader is buffered up to ``_HIGH`` bytes, then the
    connection stops reading until the reader catches up (TCP's window holds the
    rest back). A failure (the peer left, its framing broke, a deadline) is raised
    to the reader once what came before it is read."""

    __slots__ = ("_chunks", "_conn", "_done", "_error", "_size", "_waiter", "received")

    def __init__(self, conn: Reading | None) -> None:
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._done = conn is None
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.received = 0
        """Bytes of the body received so far."""

    @property
    def done(self) -> bool:
        """Every byte of it has arrived (none may still come)."""
        return self._done and self._error is None

    @property
    def failed(self) -> BaseException | None:
        return self._error

    def is_eof(self) -> bool:
        """Nothing more will arrive: the end, or a failure."""
        return self._done or self._error is not None

    # -- the connection's side ----------------------------------------------------

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        self.received += len(data)
        self._wake()
        if self._size > _HIGH and self._conn is not None:
            self._conn.hold_reading(self)

    def finish(self) -> None:
        self._done = True
        self._wake()

    def fail(self, exc: BaseException) -> None:
        """Nothing more will come: ``exc`` says why, to the reader."""
        if self._done or self._error is not None:
            return
        self._error = exc
        self._wake()

    def discard(self) -> None:
        """Free what is buffered, now: nobody will read it."""
        self._chunks.clear()
        self._size = 0
        if self._conn is not None:
            self._conn.release_reading(self)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the reader's side --------------------------------------------------------

    def whole_now(self) -> bytes | None:
        """The whole body if every byte of it is in and none was read yet (as a small
        body arrives with its head), else None."""
        if not self._done or self._error is not None or self._size != self.received:
            return None
        return self._take()

    async def next(self) -> bytes:
        """What arrived since the last call, waiting for it if nothing did; ``b""`` at
        the end. Raises what failed the body, once what came before it was read."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            if self._waiter is not None:
                raise InvariantError("one reader at a time")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._take()

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        if self._conn is not None:
            self._conn.release_reading(self)
        return data
