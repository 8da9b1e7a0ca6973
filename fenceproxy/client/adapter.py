"""The clients' one adapter to httpx: a call to the lease API sent and read whole
within its time, blocking or in a coroutine, and httpx's exceptions turned into the
project's (:data:`ERRORS`, the one table of them). A worker's own writes
(``lease.request``) are the worker's: their exceptions are left as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx

from ..errors import LeaseError, LeaseServiceError
from .core import Call
from .flow import Reply

__all__ = ["ERRORS", "error_for", "lease_service_errors", "send", "send_async"]

ERRORS: dict[type[Exception], type[LeaseError] | None] = {
    # No answer, or none to read: a timeout, no connection, a broken or odd
    # exchange (protocol, proxy, scheme), a body that does not decode, a redirect
    # loop; an error status (only from raise_for_status, which the clients never call).
    httpx.HTTPError: LeaseServiceError,
    # httpx cannot send to the URL (a job name beyond httpx's longest URL).
    httpx.InvalidURL: LeaseServiceError,
    # The whole call was not over within its time.
    TimeoutError: LeaseServiceError,
    # A cookie looked up by name, or a body read twice or after closing: the clients
    # do neither, so one of these is a bug of theirs and goes up as it is.
    httpx.CookieConflict: None,
    httpx.StreamError: None,
}
"""What each exception the clients can meet while calling the lease API becomes: a
project error, or None (raised as it is). Looked up by the exception's class, then
its bases; a class not here is not httpx's and is raised as it is."""


def error_for(kind: type[BaseException]) -> type[LeaseError] | None:
    """The project error an exception of ``kind`` becomes (None: none)."""
    for cls in kind.__mro__:
        if cls in ERRORS:
            return ERRORS[cls]
    return None


@contextlib.contextmanager
def lease_service_errors(base: str) -> Iterator[None]:
    """Turn the exceptions of a call to the lease API at ``base`` into the project's."""
    try:
        yield
    except Exception as exc:
        error = error_for(type(exc))
        if error is None:
            raise
        raise error(f"lease service at {base}: {type(exc).__name__}: {exc}") from exc


def _arguments(call: Call) -> dict[str, Any]:
    return {
        "method": call.method,
        "url": call.url,
        "json": call.body,
        "headers": call.headers,
        "timeout": httpx.Timeout(call.timeout),
    }


def send(http: httpx.Client, call: Call, base: str) -> Reply:
    """Send ``call`` and read its answer whole, over within the call's time as a
    whole: httpx bounds each read, and an answer that trickles in could otherwise
    hold a lease's calls past its deadline. The time is the real monotonic clock's,
    as asyncio's is for :func:`send_async`."""
    deadline = time.monotonic() + call.timeout
    with lease_service_errors(base), http.stream(**_arguments(call)) as answer:
        content = bytearray()
        for chunk in answer.iter_bytes():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no whole answer within {call.timeout:g}s")
            content += chunk
    return Reply(answer.status_code, bytes(content))


async def send_async(http: httpx.AsyncClient, call: Call, base: str) -> Reply:
    """Send ``call`` and read its answer whole, within asyncio's own timeout over
    the whole exchange."""
    with lease_service_errors(base):
        async with asyncio.timeout(call.timeout):
            answer = await http.request(**_arguments(call))
    return Reply(answer.status_code, answer.content)
