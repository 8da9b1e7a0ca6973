"""The sqlite3 adapter (fenceproxy.store.sqlite_errors): every error sqlite3 can raise
is mapped, by SQLite's result code rather than its wording, and the codes and
attributes it reads exist in this Python."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from fenceproxy.errors import StoreError, StoreLocked
from fenceproxy.store import sqlite_errors


def _subclasses(cls: type[BaseException]) -> Iterator[type[BaseException]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


# SQLite's primary error result codes (sqlite.org/rescode.html), less the ones that
# are not errors (OK, ROW, DONE, NOTICE, WARNING).
_ERROR_NAMES = frozenset(
    [
        "SQLITE_ERROR",
        "SQLITE_INTERNAL",
        "SQLITE_PERM",
        "SQLITE_ABORT",
        "SQLITE_BUSY",
        "SQLITE_LOCKED",
        "SQLITE_NOMEM",
        "SQLITE_READONLY",
        "SQLITE_INTERRUPT",
        "SQLITE_IOERR",
        "SQLITE_CORRUPT",
        "SQLITE_NOTFOUND",
        "SQLITE_FULL",
        "SQLITE_CANTOPEN",
        "SQLITE_PROTOCOL",
        "SQLITE_EMPTY",
        "SQLITE_SCHEMA",
        "SQLITE_TOOBIG",
        "SQLITE_CONSTRAINT",
        "SQLITE_MISMATCH",
        "SQLITE_MISUSE",
        "SQLITE_NOLFS",
        "SQLITE_AUTH",
        "SQLITE_FORMAT",
        "SQLITE_RANGE",
        "SQLITE_NOTADB",
    ]
)


def _error(cls: type[sqlite3.Error], code: int | None) -> sqlite3.Error:
    exc = cls("an error")
    if code is not None:
        exc.sqlite_errorcode = code  # type: ignore[attr-defined]
    return exc


@pytest.mark.parametrize("cls", list(_subclasses(sqlite3.Error)), ids=lambda c: c.__name__)
def test_every_sqlite3_error_class_is_caught_and_becomes_a_store_error(
    cls: type[sqlite3.Error],
) -> None:
    assert issubclass(cls, sqlite_errors.ERRORS)
    exc = _error(cls, None)  # raised by sqlite3 itself: no result code
    assert sqlite_errors.kind(exc) is StoreError
    assert type(sqlite_errors.failed(exc)) is StoreError
    assert isinstance(sqlite_errors.opening_failed("x.db", exc, None), StoreError)


def test_every_primary_error_code_is_mapped_and_only_busy_and_locked_mean_another_process() -> None:
    for name in sorted(_ERROR_NAMES):
        code = getattr(sqlite3, name)  # named by this Python's sqlite3 (3.11+)
        for extended in (code, code | (1 << 8), code | (2 << 8)):  # extended codes too
            kind = sqlite_errors.kind(_error(sqlite3.OperationalError, extended))
            expected = StoreLocked if name in ("SQLITE_BUSY", "SQLITE_LOCKED") else StoreError
            assert kind is expected, (name, extended)


def test_a_locked_error_is_told_by_its_code_not_its_words() -> None:
    worded = _error(sqlite3.OperationalError, sqlite3.SQLITE_IOERR)
    worded.args = ("database is locked",)
    assert sqlite_errors.kind(worded) is StoreError
    coded = _error(sqlite3.OperationalError, sqlite3.SQLITE_BUSY)
    coded.args = ("something SQLite may word otherwise one day",)
    refused = sqlite_errors.opening_failed("x.db", coded, None)
    assert isinstance(refused, StoreLocked)
    assert (
        str(refused)
        == "SQLite store 'x.db' is in use by another process; one proxy per SQLite file"
    )


def test_an_opening_failure_names_the_folder_problem_else_sqlites_reason() -> None:
    exc = _error(sqlite3.OperationalError, sqlite3.SQLITE_CANTOPEN)
    exc.args = ("unable to open database file",)
    said = sqlite_errors.opening_failed("/x/y.db", exc, "its folder '/x' does not exist")
    assert str(said) == "cannot open SQLite store '/x/y.db': its folder '/x' does not exist"
    said = sqlite_errors.opening_failed("/x/y.db", exc, None)
    assert str(said) == "cannot open SQLite store '/x/y.db': unable to open database file"


def test_the_real_library_reports_a_file_held_by_another_connection_as_busy(
    tmp_path: Path,
) -> None:
    """What the adapter reads, pinned against the installed sqlite3: the result code
    attributes (Python 3.11+) and what SQLite says when a file is held exclusively."""
    path = str(tmp_path / "held.db")
    holder = sqlite3.connect(path, isolation_level=None)
    other = sqlite3.connect(path, isolation_level=None, timeout=0.05)
    try:
        holder.execute("PRAGMA locking_mode = EXCLUSIVE")
        holder.execute("PRAGMA journal_mode = WAL")
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(sqlite3.OperationalError) as caught:
            other.execute("BEGIN IMMEDIATE")
        assert caught.value.sqlite_errorname == "SQLITE_BUSY"
        assert caught.value.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY
        assert sqlite_errors.kind(caught.value) is StoreLocked
    finally:
        other.close()
        holder.close()


def test_the_real_library_reports_a_missing_folder_as_cantopen(tmp_path: Path) -> None:
    with pytest.raises(sqlite3.OperationalError) as caught:
        sqlite3.connect(str(tmp_path / "absent" / "x.db"))
    assert caught.value.sqlite_errorname == "SQLITE_CANTOPEN"
    assert sqlite_errors.kind(caught.value) is StoreError
