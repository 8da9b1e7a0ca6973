"""The HTTP edge's limits on what a client holds of the proxy, shared by the data
plane (:mod:`fenceproxy.http.server`) and every handler behind it.

* **a body** may pause at most ``body_timeout`` between two reads: 408; one read
  whole must also keep up ``body_min_rate`` bytes a second over every 10 s (or
  ``body_timeout``, when shorter): 408, so a body sent a byte at a time holds its
  share of memory for seconds, not hours;
* **bodies held in memory** (a fenced write's, read whole before its turn; a lease
  call's; a small unfenced one's) are counted across every request, and a body that
  would take the total above ``max_buffered`` gets 503 with ``Retry-After``; a
  sixteenth of it is kept for the lease API's calls, and one client (its address,
  or behind a trusted proxy the address ``X-Forwarded-For`` names) may hold at most
  ``max_buffered_per_client`` of it: a few clients cannot take the rest's share. A
  fenced write's body beyond ``body_buffer`` goes to a file as it arrives
  (:mod:`fenceproxy.spool`), and only what waits to be written counts;
* **a body above its limit** (a route's ``max_body``, the lease API's) is refused
  with 413 by its declared length before any of it is read, or as soon as what
  arrived passes the limit: an over-long body never reaches the upstream whole;
* **open connections** are capped below the descriptor limit
  (:func:`connection_cap`), and failures to accept are logged once in a while.

A client waiting for ``100 Continue`` gets it when its body is first read, once its
declared length is known to fit (:meth:`Bodies.read`, :meth:`Bodies.stream`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import AsyncIterator
from typing import Any

from ..errors import (
    BodyTimeout,
    BodyTooLarge,
    ClientClosedRequest,
    ProxyBusy,
)
from ..fence.fencing import Digest
from ..log import server_log
from ..spool import CHUNK, SpoolFile, SpoolFolder, spool_failure
from .answer import PROBLEM_JSON
from .request import Body, Request
from .upstream import TrustedProxies

__all__ = [
    "LINGER_BYTES",
    "LINGER_FOR",
    "PROBLEM_JSON",
    "Bodies",
    "Every",
    "HeldBody",
    "check_body_size",
    "connection_cap",
    "log_accept_errors",
]

# Descriptors kept for the store, the logs, the listening sockets and the like.
_SPARE_FDS = 64
_LOG_EVERY = 10.0
# After an answer given before its request's body was in: how long, and how much of
# the body, the connection goes on reading (and dropping) before it is closed.
LINGER_FOR = 1.0
LINGER_BYTES = 1024 * 1024
RATE_WINDOW = 10.0
"""The window over which a body read whole must keep up ``limits.body_min_rate``."""


class Every:
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


def connection_cap(configured: int) -> int:
    """``configured``, lowered to what the descriptor limit leaves: each client
    connection may hold an upstream connection too."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, (soft - _SPARE_FDS) // 2))


def log_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log the loop's failures to accept a connection (out of descriptors, say) in one
    line at most every ten seconds, rather than a traceback each; the rest as before."""
    every = Every()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if "accept" in message:
            every(logging.ERROR, "could not accept a connection: %s", context.get("exception"))
            return
        loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


# -- bodies ---------------------------------------------------------------------


class Share:
    """One client's bodies held in memory, and the reads of its bodies under way: kept
    while either is above zero, so every read of one client counts against one share."""

    __slots__ = ("client", "held", "reading")

    def __init__(self, client: str) -> None:
        self.client = client
        self.held = 0
        self.reading = 0


class Bodies:
    """Request bodies: read whole within the memory shared by every request (a fenced
    write's beyond ``in_memory`` bytes into a file of ``spool`` instead), or streamed,
    each bounded by its limit and by the wait between two reads."""

    __slots__ = (
        "_shares",
        "cap",
        "held",
        "in_memory",
        "min_rate",
        "per_client",
        "spool",
        "timeout",
        "trusted",
    )

    def __init__(
        self,
        cap: int,
        timeout: float,
        *,
        in_memory: int = 1024 * 1024,
        spool: SpoolFolder | None = None,
        per_client: int | None = None,
        min_rate: int = 0,
    ) -> None:
        self.cap = cap
        self.held = 0
        """Bytes of bodies read whole into memory and not yet given back."""
        self.timeout = timeout
        self.in_memory = in_memory
        """The most of one body read whole that stays in memory when it may go to disk."""
        self.spool = spool
        self.per_client = cap if per_client is None else per_client
        """The most of ``cap`` one client's bodies may hold together."""
        self.min_rate = min_rate
        """Bytes a second a body read whole must keep up (0: no minimum)."""
        self.trusted = TrustedProxies(())
        """Peers whose X-Forwarded-For names the client."""
        self._shares: dict[str, Share] = {}

    async def read(
        self,
        request: Request,
        limit: int,
        *,
        spill: bool = False,
        digest: Digest | None = None,
        lease: bool = False,
    ) -> HeldBody:
        """The whole body, up to ``limit`` bytes (BodyTooLarge above). What it holds
        in memory counts against the cap, and against its client's share, until it is
        released (ProxyBusy beyond either; a ``lease`` call's may use the slice of the
        cap kept for the lease API). With ``spill``, a body beyond ``in_memory`` bytes
        is written to a file as it arrives, and only what waits to be written counts.
        ``digest`` is fed the body, once, in order. A client that waits for ``100
        Continue`` gets it here, once its declared length is known to fit."""
        _go_on(request, limit)
        body = request.body
        spill = spill and self.spool is not None
        share = self._share(self.trusted.client(request.remote, request.raw_headers))
        budget = self.cap if lease else self.cap - self.cap // 16
        pieces: AsyncIterator[bytes]
        whole = body.whole_now()
        try:
            if whole is not None:
                # Arrived whole with the request head, as a small body does: no loop.
                check_body_size(len(whole), limit)
                if not (spill and len(whole) > self.in_memory):
                    self._take(len(whole), share, budget)
                    if digest is not None:
                        digest.update(whole)
                    return HeldBody(whole, self, share)
                pieces = _once(whole)
            else:
                pieces = self._chunks(body, self.min_rate)
            to_file = spill and (request.content_length or 0) > self.in_memory
            return await self._gather(pieces, limit, to_file, spill, digest, share, budget)
        finally:
            self._read_ended(share)

    def _share(self, client: str) -> Share:
        """``client``'s share, with one more read under way."""
        share = self._shares.get(client)
        if share is None:
            share = self._shares[client] = Share(client)
        share.reading += 1
        return share

    def _read_ended(self, share: Share) -> None:
        share.reading -= 1
        self._drop_share(share)

    def _drop_share(self, share: Share) -> None:
        # Only the client's current share: a body that held nothing (empty, or on
        # disk) may keep one that was dropped, and a newer one then stands for it.
        if share.held == 0 and share.reading == 0 and self._shares.get(share.client) is share:
            del self._shares[share.client]

    async def _gather(
        self,
        source: AsyncIterator[bytes],
        limit: int,
        to_file: bool,
        spill: bool,
        digest: Digest | None,
        share: Share,
        budget: int,
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
                self._take(len(chunk), share, budget)
                taken += len(chunk)
                pieces.append(chunk)
                size += len(chunk)
                if file is None and spill and size > self.in_memory:
                    file = self._create()
                if file is not None and taken >= CHUNK:
                    taken -= await self._flush(file, pieces, digest, share)
            if file is not None:
                taken -= await self._flush(file, pieces, digest, share)
                return HeldBody(b"", self, share, file)
        except BaseException:
            self.give(taken, share)
            if file is not None:
                file.remove()
            raise
        whole = b"".join(pieces)
        if digest is not None:
            digest.update(whole)
        return HeldBody(whole, self, share)

    def _create(self) -> SpoolFile:
        assert self.spool is not None
        try:
            return self.spool.create()
        except OSError as exc:
            raise spool_failure(exc, "making its file") from None

    async def _flush(
        self, file: SpoolFile, pieces: list[bytes], digest: Digest | None, share: Share
    ) -> int:
        """Write what is in memory to the file and give its share of the cap back;
        how much that was."""
        data = b"".join(pieces)
        pieces.clear()
        await file.write(data, digest)
        self.give(len(data), share)
        return len(data)

    async def stream(self, request: Request, limit: int) -> AsyncIterator[bytes]:
        """The body as it arrives, stopped above ``limit`` bytes (BodyTooLarge), so an
        over-long body never reaches the upstream as a complete request. A client
        that waits for ``100 Continue`` gets it when the first piece is asked for."""
        _go_on(request, limit)
        seen = 0
        async for chunk in self._chunks(request.body, 0):
            seen += len(chunk)
            check_body_size(seen, limit)
            yield chunk

    async def _chunks(self, body: Body, min_rate: int) -> AsyncIterator[bytes]:
        """Each piece of the body as it arrives; BodyTimeout when none comes for
        ``timeout``, or, with ``min_rate``, when fewer than ``min_rate`` bytes a second
        came over a window (:data:`RATE_WINDOW`, or ``timeout`` when shorter). Only
        the wait for the client counts, never the time the caller takes between
        pieces. ClientClosedRequest when the client goes away or its connection
        fails, RequestMalformed when its framing breaks (the parser's refusal). None
        of them is an upstream's failure."""
        loop = asyncio.get_running_loop()
        window = min(RATE_WINDOW, self.timeout)
        waited, came = 0.0, body.received  # the window's wait so far; what came before it
        pause = 0.0  # the wait for the next piece so far
        while True:
            wait = self.timeout - pause
            if min_rate:
                wait = min(wait, window - waited)
            start = loop.time()
            chunk: bytes | None = None
            try:
                async with asyncio.timeout(max(wait, 0.0)):
                    chunk = await body.next()
            except TimeoutError:
                pass  # the pause or the window is over: judged below
            except OSError:
                raise ClientClosedRequest("the client's connection closed mid-body") from None
            spent = loop.time() - start
            pause += spent
            waited += spent
            if chunk is None and pause >= self.timeout:
                raise BodyTimeout(
                    f"no part of the body arrived for {self.timeout:g}s; "
                    "nothing was forwarded complete"
                )
            if min_rate and waited >= window:
                if body.received - came < min_rate * window:
                    raise BodyTimeout(
                        f"the body arrived at less than {min_rate} bytes a second over "
                        f"{window:g}s (limits.body_min_rate); nothing was forwarded complete"
                    )
                waited, came = 0.0, body.received
            if chunk is None:
                continue
            pause = 0.0
            if not chunk:
                return
            yield chunk

    def _take(self, size: int, share: Share, budget: int) -> None:
        """Count ``size`` more bytes held for ``share``'s client; ProxyBusy when that
        would take the total above ``budget``, or the client's above its share."""
        if self.held + size > budget:
            raise ProxyBusy(
                f"the proxy holds as many request bodies in memory as it may ({budget} "
                "bytes of limits.max_buffered); retry",
                retry_after=1.0,
            )
        if share.held + size > self.per_client:
            raise ProxyBusy(
                f"this client's requests hold as much of the proxy's memory as one client "
                f"may ({self.per_client} bytes, limits.max_buffered_per_client); retry",
                retry_after=1.0,
            )
        self.held += size
        share.held += size

    def give(self, size: int, share: Share) -> None:
        """Give ``size`` bytes of ``share``'s back."""
        self.held -= size
        share.held -= size
        self._drop_share(share)


class HeldBody:
    """A body read whole, in memory (``data``) or in a file (``file``), and its share
    of the budget until :meth:`release`: as soon as the upstream has it, or when the
    request ends, whichever comes first. Releasing removes its file."""

    __slots__ = ("_bodies", "_share", "data", "file")

    def __init__(
        self, data: bytes, bodies: Bodies, share: Share, file: SpoolFile | None = None
    ) -> None:
        self.data = data
        """The body, when it is in memory; empty when it is in ``file``."""
        self.file = file
        self._bodies: Bodies | None = bodies
        self._share = share

    @property
    def size(self) -> int:
        return self.file.size if self.file is not None else len(self.data)

    def payload(self) -> bytes | AsyncIterator[bytes]:
        """What to send: the bytes, or the file's chunks (the sender states the length)."""
        return self.data if self.file is None else self.file.chunks()

    def release(self) -> None:
        """Give its share back and remove its file; again, nothing more."""
        if self._bodies is not None:
            self._bodies.give(len(self.data), self._share)
            self._bodies = None
        if self.file is not None:
            self.file.remove()


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _go_on(request: Request, limit: int) -> None:
    """Before a body is read: refuse a declared length above ``limit``, then send the
    ``100 Continue`` the client may be waiting for."""
    if request.content_length is not None:
        check_body_size(request.content_length, limit)
    request.send_continue()


def check_body_size(size: int, limit: int) -> None:
    """BodyTooLarge when ``size`` bytes are above ``limit``."""
    if size > limit:
        raise BodyTooLarge(f"the body is larger than the limit of {limit} bytes", max_body=limit)
