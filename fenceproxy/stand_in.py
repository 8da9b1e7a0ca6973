"""``fenceproxy stand-in``: a stand-in for the API behind the proxy, to try the proxy
with before it fronts a real one.

It answers every request 200 with a small JSON body (``{"applied": true, "path":
"/billing/charges"}``) and prints one line per write it receives, every method but
the safe ones a route leaves unfenced by default (GET, HEAD, OPTIONS, PROPFIND, REPORT,
SEARCH: :data:`~fenceproxy.fence.write.SAFE_METHODS`): the method, the path, the
fencing headers and the body, each with what a terminal would act on escaped and cut
short. A write the proxy refused never arrives, so never shows. It keeps nothing of
what it received, so it may run for as long as it is left to.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from typing import TextIO

from aiohttp import web

from . import hdrs
from .config import parse_listen
from .errors import ListenError
from .fence.write import SAFE_METHODS
from .testing import Received, RecordingUpstream

__all__ = ["run_stand_in", "write_line"]

_FENCING = (hdrs.DEFAULT_JOB, hdrs.DEFAULT_TOKEN, hdrs.DEFAULT_KEY)
_MAX_FIELD = 80  # characters of a path or a header's value
_MAX_BODY = 200


def _shown(text: str, limit: int) -> str:
    """``text`` with every character that is not printable escaped (a line break, an
    escape sequence, a byte that is not UTF-8), cut to ``limit`` characters."""
    shown = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def write_line(received: Received) -> str:
    """How the stand-in prints a write: ``POST /billing/charges (Fencing-Job:
    invoice-42, Fencing-Token: 1, Idempotency-Key: charge-1) {"amount": 10}``, the
    fencing headers that came (none: no parentheses) and the body, if any."""
    fields = ", ".join(
        f"{name}: {_shown(value, _MAX_FIELD)}"
        for name in _FENCING
        for value in received.headers.getall(name, ())
    )
    parts = [received.method, _shown(received.path_qs, _MAX_FIELD)]
    if fields:
        parts.append(f"({fields})")
    if received.body:
        parts.append(_shown(received.body.decode("utf-8", "backslashreplace"), _MAX_BODY))
    return " ".join(parts)


async def run_stand_in(listen: str, out: TextIO = sys.stdout) -> int:
    """Serve on ``listen`` (``HOST:PORT``) until SIGINT or SIGTERM, then return 0.
    ValueError when ``listen`` is no such address; ListenError, naming it, when it
    cannot be listened on."""
    host, port = parse_listen(listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        try:
            upstream = await stack.enter_async_context(RecordingUpstream.serve(host, port))
        except OSError as exc:
            reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            raise ListenError(f"cannot listen on {listen}: {reason}") from None
        answer = upstream.respond  # the recording upstream's: 200 {"applied": true, ...}

        async def respond(request: web.Request, received: Received) -> web.StreamResponse:
            upstream.received.clear()  # kept by the recording upstream, not needed here
            if received.method not in SAFE_METHODS:
                print(write_line(received), file=out, flush=True)
            return await answer(request, received)

        upstream.respond = respond
        print(
            f"stand-in API on {upstream.url}: answers every request 200, prints each write",
            file=out,
            flush=True,
        )
        await stop.wait()
    return 0
