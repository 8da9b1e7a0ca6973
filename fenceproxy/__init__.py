"""fenceproxy: a reverse proxy that refuses stale and duplicate fenced writes.

Put it in front of an HTTP API that cannot check fencing tokens itself: it keeps
the highest generation accepted per job, durably, and refuses older generations
and retried duplicates before they reach the API. Its lease API hands workers
their generations; :class:`LeaseClient` keeps a lease and stops a worker's work
the moment it is lost.
"""

from .app import FenceProxy, serve
from .client import LeaseClient
from .config import Config, load_config
from .errors import (
    ConfigError,
    FenceProxyError,
    LeaseLost,
    LeaseRefused,
    LeaseServiceError,
    Refusal,
    StoreError,
)
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
    "load_config",
    "open_store",
    "serve",
]

__version__ = "0.1.0"
