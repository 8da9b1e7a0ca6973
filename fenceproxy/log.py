"""Named loggers, one per layer."""

from __future__ import annotations

import logging

__all__ = [
    "access_log",
    "lease_log",
    "proxy_log",
    "server_log",
    "store_log",
]

proxy_log = logging.getLogger("fenceproxy.proxy")
access_log = logging.getLogger("fenceproxy.access")
store_log = logging.getLogger("fenceproxy.store")
lease_log = logging.getLogger("fenceproxy.leases")
server_log = logging.getLogger("fenceproxy.server")
