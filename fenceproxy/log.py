"""Named loggers, one per layer."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

__all__ = [
    "MalformedRequestFilter",
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


class MalformedRequestFilter(logging.Filter):
    """aiohttp logs every request its parser refuses at ERROR with a traceback. A
    malformed request from a client is not a server error: one INFO line, with the
    reason escaped, is what an operator needs."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            reason = str(exc.message).splitlines()[0] if exc.message else type(exc).__name__
            record.msg = "refused a malformed request (%d): %r"
            record.args = (exc.code, reason)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        return True
