"""What a reload may change: the keys only a restart changes, which a reload keeps
at their running values (and says so), and how the file is read again."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .schema import Config

__all__ = ["RESTART_ONLY", "Reader", "restart_only", "setting"]


RESTART_ONLY = (
    "listen",
    "tls",
    "admin",
    "admin_tls",
    "store",
    "workers",
    "idempotency.ttl",
    "shutdown_timeout",
    "limits.body_temp_path",
    "tracing",
)
"""What a reload cannot change: where it listens, what it keeps its state in, where
its traces go (the exporter and its thread are made once, at start)."""

Reader = Callable[[Mapping[str, Any] | None], Config]
"""Reads the config file again, keeping the given dotted keys' values (``keep`` of
:func:`load_config`)."""


def restart_only(running: Config, config: Config) -> dict[str, Any]:
    """What ``config`` changes that only a restart can: each dotted key of
    :data:`RESTART_ONLY` (``store``, ``idempotency.ttl``, ...) with its value in
    ``running``, to keep on a reload."""
    kept = {}
    for name in RESTART_ONLY:
        value = setting(running, name)
        if setting(config, name) != value:
            kept[name] = False if value is None else value  # admin: false
    return kept


def setting(config: Config, name: str) -> Any:
    """The value of a dotted key (``limits.body_temp_path``)."""
    value: Any = config
    for part in name.split("."):
        value = getattr(value, part)
    return value
