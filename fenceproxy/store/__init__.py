"""Where fences, idempotency keys, leases and in-flight records live.
:func:`open_store` and :func:`migrate_store` pick the backend from a ``store:`` URL."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from ..errors import StoreError
from .base import Store
from .postgres import PostgresStore
from .sqlite import SQLiteStore, folder_problem
from .url import StoreURL, parse_store_url

__all__ = [
    "PostgresStore",
    "SQLiteStore",
    "Store",
    "check_store",
    "migrate_store",
    "open_store",
]


async def open_store(
    url: str | StoreURL,
    *,
    key_ttl: float,
    clock: Callable[[], float] = time.time,
) -> Store:
    """Open the store a ``store:`` URL names. ``clock`` is SQLite's clock; PostgreSQL
    reads its own, unless ``clock`` is another than ``time.time`` (a test's).
    Raises StoreError when it cannot be opened, ValueError for a URL that config
    validation would have refused."""
    parsed = parse_store_url(url) if isinstance(url, str) else url
    if parsed.backend == "postgresql":
        return await PostgresStore.open(
            parsed.dsn,
            pool_size=parsed.pool,
            password=_password(parsed),
            key_ttl=key_ttl,
            clock=(lambda: None) if clock is time.time else clock,
            require_sync=parsed.require_sync,
        )
    return await SQLiteStore.open(
        parsed.path,
        synchronous=parsed.synchronous,
        key_ttl=key_ttl,
        clock=clock,
    )


async def check_store(url: str | StoreURL) -> None:
    """StoreError unless a proxy could open this store now, without touching it: a
    SQLite file's folder exists and is writable (the file itself may be held by a
    running proxy); a PostgreSQL database answers, at this build's schema."""
    parsed = parse_store_url(url) if isinstance(url, str) else url
    if parsed.backend == "postgresql":
        store = await PostgresStore.open(
            parsed.dsn, pool_size=1, password=_password(parsed), key_ttl=60.0
        )
        await store.close()
        return
    if (why := folder_problem(parsed.path)) is not None:
        raise StoreError(f"SQLite store {parsed.path!r}: {why}")


async def migrate_store(url: str | StoreURL) -> tuple[int, int]:
    """Bring the store a URL names to this fenceproxy's schema; the versions before
    and after. Raises StoreError."""
    parsed = parse_store_url(url) if isinstance(url, str) else url
    if parsed.backend == "postgresql":
        return await PostgresStore.migrate(parsed.dsn, password=_password(parsed))
    return await SQLiteStore.migrate(parsed.path)


def _password(url: StoreURL) -> str | None:
    if url.password_env is None:
        return None  # the driver falls back on PGPASSWORD and ~/.pgpass
    password = os.environ.get(url.password_env)
    if password is None:
        raise StoreError(
            f"the store's password is to come from ${url.password_env}, which is not set"
        )
    return password
