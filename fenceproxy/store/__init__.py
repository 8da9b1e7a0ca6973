"""Where fences and idempotency keys live. :func:`open_store` picks the backend."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..config import StoreURL, parse_store_url
from .base import JobLocks, Store
from .sqlite import SQLiteStore

__all__ = ["JobLocks", "SQLiteStore", "Store", "open_store"]


async def open_store(
    url: str | StoreURL,
    *,
    key_ttl: float,
    clock: Callable[[], float] = time.time,
) -> Store:
    """Open the store a ``store:`` URL names. Raises StoreError when it cannot be
    opened, ValueError for a URL that config validation would have refused."""
    parsed = parse_store_url(url) if isinstance(url, str) else url
    return await SQLiteStore.open(
        parsed.path,
        synchronous=parsed.synchronous,
        key_ttl=key_ttl,
        clock=clock,
    )
