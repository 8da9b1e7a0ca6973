"""The one place where :mod:`asyncpg`'s and the network's errors become
:class:`~fenceproxy.errors.StoreError`: the PostgreSQL store catches :data:`ERRORS`,
and only them, and says with :func:`failed` what it was doing.

Every row fails closed the same way, whatever the SQLSTATE: a proxy that cannot
read or record a fence refuses the write (503), and the server rolls back what
was not committed, so nothing is half-applied. asyncpg's warnings
(``PostgresWarning``, ``InterfaceWarning``) are reported through the log, never
raised.

==============================================  =========================================
raised                                          means
==============================================  =========================================
``asyncpg.PostgresError`` (any SQLSTATE)        the server refused or failed a statement,
                                                or ended the session (``57P01`` ...)
``asyncpg.InterfaceError``                      the driver: the connection was closed,
                                                a misconfigured DSN, an unsupported feature
``asyncpg.exceptions.InternalClientError``      the protocol's state was lost mid-operation
                                                (a connection dropped during a reply)
``OSError``                                     the network: refused, reset, unreachable
``TimeoutError``                                connecting, a pooled connection, or a
                                                command took too long
==============================================  =========================================
"""

from __future__ import annotations

import logging

import asyncpg

from ..errors import StoreError

__all__ = ["ERRORS", "failed", "first", "reconnects_in_one_line"]

ERRORS: tuple[type[Exception], ...] = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    OSError,
    TimeoutError,
)
"""What the PostgreSQL store catches wherever it talks to the database."""


def failed(doing: str, exc: Exception) -> StoreError:
    """The StoreError for ``exc``, met while ``doing`` (a sentence's start that names
    the store, such as ``cannot connect to the PostgreSQL store host/db``)."""
    return StoreError(f"{doing}: {exc}")


def first(exc: Exception) -> Exception:
    """The error ``exc`` was raised over, while that was one of :data:`ERRORS` too: the
    one that says why. Leaving a transaction on a connection the server ended raises
    ``cannot call Transaction.__aexit__(): the underlying connection is closed`` over
    the server's own word (``terminating connection due to administrator command``)."""
    while isinstance(exc.__context__, ERRORS):
        exc = exc.__context__
    return exc


class _OneLine(logging.Filter):
    """The pool's own reconnects, while the database is down or failing over, logged
    in one line each: asyncpg logs every failed one with a traceback, which says no
    more than the error's message."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, ERRORS):
            record.msg, record.args = f"{record.getMessage()}: {error}", ()
            record.exc_info = record.exc_text = None
        return True


_ONE_LINE = _OneLine()


def reconnects_in_one_line() -> None:
    """Install the filter on asyncpg's pool logger (once, however often called)."""
    logging.getLogger("asyncpg.pool").addFilter(_ONE_LINE)
