"""Named loggers, one per layer."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "JsonFormatter",
    "TextFormatter",
    "access_log",
    "configure_logging",
    "decision_log",
    "lease_log",
    "proxy_log",
    "server_log",
    "store_log",
    "tracing_log",
]

proxy_log = logging.getLogger("fenceproxy.proxy")
access_log = logging.getLogger("fenceproxy.access")
store_log = logging.getLogger("fenceproxy.store")
lease_log = logging.getLogger("fenceproxy.leases")
server_log = logging.getLogger("fenceproxy.server")
tracing_log = logging.getLogger("fenceproxy.tracing")
"""What OpenTelemetry says of the traces' export, one line a minute at most
(:mod:`fenceproxy.ops.tracing`)."""
decision_log = logging.getLogger("fenceproxy.decisions")
"""One line per fenced decision: refusals at INFO, forwarded and replayed writes at
DEBUG. Its fields ride on the record as ``fields``; never a token, body or secret."""


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class TextFormatter(logging.Formatter):
    """``time level logger message key=value ...``: the fields as ``key=value``, values
    quoted as JSON strings when they hold a space or a quote."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields(record)
        if not fields:
            return line
        return line + "".join(f" {key}={_text(value)}" for key, value in fields.items())


def _text(value: Any) -> str:
    if value is None:
        return "-"
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return json.dumps(text) if not text or any(c in text for c in ' "=') else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (UTC, ISO 8601), ``level``, ``logger``,
    ``message``, the fields, and ``error`` with a traceback's text when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(_fields(record))
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


_before: dict[str, int] = {}  # each logger the config set, and its level before


def configure_logging(log_format: str, levels: Mapping[str, str]) -> None:
    """Format the root logger's lines as ``log_format`` says (``text`` or ``json``)
    and set each named logger's level; a logger an earlier call set and this one
    does not gets back the level it had before (a reload that drops it)."""
    formatter = JsonFormatter() if log_format == "json" else TextFormatter()
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)
    for name in list(_before):
        if name not in levels:
            logging.getLogger(name).setLevel(_before.pop(name))
    for name, level in levels.items():
        logger = logging.getLogger(name)
        _before.setdefault(name, logger.level)
        logger.setLevel(level)
