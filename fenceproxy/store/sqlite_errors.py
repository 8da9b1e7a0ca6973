"""The one place where :mod:`sqlite3`'s errors become
:class:`~fenceproxy.errors.StoreError`: the SQLite store catches :data:`ERRORS` and
asks here what each one means.

An error is told apart by SQLite's primary result code (``sqlite_errorcode``,
Python 3.11+), never by its message, which SQLite words as it pleases. An error
``sqlite3`` raises on its own (a closed connection, a wrong parameter) has no code.

==================================  ============  ==================================
SQLite's result code                while          becomes
==================================  ============  ==================================
``SQLITE_BUSY``, ``SQLITE_LOCKED``  opening        :class:`~fenceproxy.errors.StoreLocked`:
                                                   another process holds the file
any other, or none                  opening        StoreError, naming why it failed
any                                 an operation   StoreError; the batch is undone
==================================  ============  ==================================
"""

from __future__ import annotations

import sqlite3

from ..errors import StoreError, StoreLocked

__all__ = ["ERRORS", "failed", "kind", "opening_failed"]

ERRORS: tuple[type[sqlite3.Error], ...] = (sqlite3.Error,)
"""What the SQLite store catches: every error ``sqlite3`` raises derives from it."""

_BY_CODE: dict[int, type[StoreError]] = {
    # The file's lock is held by another connection: with the exclusive locking mode
    # the store opens in, by another process (SQLite waits ``timeout`` first).
    sqlite3.SQLITE_BUSY: StoreLocked,
    sqlite3.SQLITE_LOCKED: StoreLocked,
}


def result_code(exc: sqlite3.Error) -> int | None:
    """SQLite's primary result code for ``exc`` (its extended code less the
    extension), or None for an error of ``sqlite3`` itself."""
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def kind(exc: sqlite3.Error) -> type[StoreError]:
    """What an error met while opening the store means: StoreLocked or StoreError."""
    code = result_code(exc)
    return StoreError if code is None else _BY_CODE.get(code, StoreError)


def opening_failed(path: str, exc: sqlite3.Error, why: str | None) -> StoreError:
    """The error to raise when the store at ``path`` cannot be opened; ``why`` is what
    its folder says, if anything (else SQLite's own words)."""
    if kind(exc) is StoreLocked:
        return StoreLocked(
            f"SQLite store {path!r} is in use by another process; one proxy per SQLite file"
        )
    return StoreError(f"cannot open SQLite store {path!r}: {why or exc}")


def failed(exc: sqlite3.Error) -> StoreError:
    """The error an operation's caller gets when its batch failed in SQLite."""
    return StoreError(f"SQLite store failed: {exc}")
