"""The asyncpg adapter (fenceproxy.store.asyncpg_errors): every error asyncpg defines
is caught and becomes a StoreError, and what the PostgreSQL store calls on the driver
exists in the installed version."""

from __future__ import annotations

import inspect
import logging
import socket
from collections.abc import Iterator

import asyncpg
import asyncpg.exceptions
import asyncpg.exceptions._base
import pytest

from fenceproxy.errors import StoreError
from fenceproxy.store import asyncpg_errors


def _asyncpg_errors() -> Iterator[type[BaseException]]:
    """Every exception class asyncpg defines, less its warnings (logged, never raised)."""
    seen: set[type[BaseException]] = set()
    for module in (asyncpg.exceptions, asyncpg.exceptions._base):
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__.startswith("asyncpg")
                and not issubclass(value, Warning)
                and value not in seen
            ):
                seen.add(value)
                yield value


ASYNCPG_ERRORS = sorted(_asyncpg_errors(), key=lambda c: c.__qualname__)


def test_asyncpg_defines_the_errors_the_table_names() -> None:
    assert len(ASYNCPG_ERRORS) > 200  # every SQLSTATE class, and the driver's own
    assert asyncpg.PostgresError in ASYNCPG_ERRORS
    assert asyncpg.InterfaceError in ASYNCPG_ERRORS
    assert asyncpg.exceptions.InternalClientError in ASYNCPG_ERRORS


@pytest.mark.parametrize("cls", ASYNCPG_ERRORS, ids=lambda c: c.__qualname__)
def test_every_asyncpg_error_is_caught(cls: type[BaseException]) -> None:
    assert issubclass(cls, asyncpg_errors.ERRORS), f"{cls.__qualname__} would escape the store"


def test_an_error_becomes_a_store_error_that_says_what_failed() -> None:
    exc = asyncpg.exceptions.AdminShutdownError("terminating connection")
    assert exc.sqlstate == "57P01"
    said = asyncpg_errors.failed("cannot read the PostgreSQL store db:5432/x", exc)
    assert type(said) is StoreError
    assert str(said) == "cannot read the PostgreSQL store db:5432/x: terminating connection"


def test_the_network_and_time_are_caught_too() -> None:
    for cls in (ConnectionRefusedError, ConnectionResetError, socket.gaierror, TimeoutError):
        assert issubclass(cls, asyncpg_errors.ERRORS)


async def test_the_real_driver_raises_an_os_error_for_a_refused_connection() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(asyncpg_errors.ERRORS) as caught:
        await asyncpg.connect(f"postgresql://u@127.0.0.1:{port}/x", timeout=2)
    assert isinstance(caught.value, OSError)


def test_the_driver_surface_the_store_calls_exists() -> None:
    """What fenceproxy.store.postgres calls on asyncpg, by name, on this version."""
    assert callable(asyncpg.create_pool)
    assert callable(asyncpg.connect)
    for name in ("acquire", "close"):
        assert callable(getattr(asyncpg.Pool, name))
    names = ("transaction", "execute", "fetch", "fetchrow", "fetchval", "close", "terminate")
    for name in (*names, "get_settings", "get_server_pid"):
        assert callable(getattr(asyncpg.Connection, name))
    create_pool = inspect.signature(asyncpg.create_pool).parameters
    assert {"min_size", "max_size", "init", "reset"} <= set(create_pool)  # the rest: connect()
    connect = inspect.signature(asyncpg.connect).parameters
    assert {"password", "timeout", "command_timeout", "target_session_attrs"} <= set(connect)
    assert asyncpg.exceptions.ReadOnlySQLTransactionError.sqlstate == "25006"
    assert "timeout" in inspect.signature(asyncpg.Pool.acquire).parameters
    assert asyncpg.exceptions.UniqueViolationError.sqlstate == "23505"


def test_the_pools_reconnects_are_logged_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """asyncpg logs each failed reconnect of its pool with a traceback; while a
    database fails over that is one every second or so, per proxy."""
    asyncpg_errors.reconnects_in_one_line()
    asyncpg_errors.reconnects_in_one_line()  # once, however often
    pool_log = logging.getLogger("asyncpg.pool")
    assert pool_log.filters.count(asyncpg_errors._ONE_LINE) == 1
    try:
        raise ConnectionRefusedError(111, "Connection refused")
    except OSError:
        pool_log.warning("Failed to restore the pool connection floor; retrying", exc_info=True)
    (record,) = caplog.records
    assert record.getMessage() == (
        "Failed to restore the pool connection floor; retrying: [Errno 111] Connection refused"
    )
    assert record.exc_info is None
    assert "Traceback" not in caplog.text
