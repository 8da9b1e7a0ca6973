"""fenceproxy: a reverse proxy that refuses stale and duplicate fenced writes.

Put it in front of an HTTP API that cannot check fencing tokens itself: it keeps
the highest generation accepted per job, durably, and refuses older generations
and retried duplicates before they reach the API. Its lease API hands workers
their generations; :class:`LeaseClient` (async) and :class:`SyncLeaseClient` keep a
lease and stop a worker's work the moment it is lost.

The clients need only httpx (``pip install fenceproxy``); the proxy's own names
(:class:`FenceProxy`, :func:`serve`, the stores, the config) load its server
libraries when first used (``pip install 'fenceproxy[server]'``), and the clients
load httpx when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__
from .errors import (
    ConfigError,
    FenceProxyError,
    LeaseLost,
    LeaseRefused,
    LeaseServiceError,
    Refusal,
    StoreError,
)

if TYPE_CHECKING:
    from .client import LeaseClient, SyncLeaseClient
    from .config import Config, load_config
    from .server.app import FenceProxy, serve
    from .store import SQLiteStore, Store, open_store

__all__ = [
    "Config",
    "ConfigError",
    "FenceProxy",
    "FenceProxyError",
    "LeaseClient",
    "LeaseLost",
    "LeaseRefused",
    "LeaseServiceError",
    "Refusal",
    "SQLiteStore",
    "Store",
    "StoreError",
    "SyncLeaseClient",
    "load_config",
    "open_store",
    "serve",
]

_LAZY = {
    "LeaseClient": "client",
    "SyncLeaseClient": "client",
    "FenceProxy": "server.app",
    "serve": "server.app",
    "Config": "config",
    "load_config": "config",
    "SQLiteStore": "store",
    "Store": "store",
    "open_store": "store",
}


def __getattr__(name: str) -> Any:
    """Imported on first use: a worker never loads the proxy, nor the proxy the
    clients' HTTP library."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fenceproxy' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
