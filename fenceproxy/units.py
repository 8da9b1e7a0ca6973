"""Durations and sizes as people write them (``250ms``, ``30s``, ``24h``; ``10MiB``),
read alike by the config and the command line. No dependencies: the clients' command
line uses it too."""

from __future__ import annotations

import re

__all__ = ["parse_duration", "parse_size"]

_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d)?", re.ASCII)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_SIZE = re.compile(r"([0-9]+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?", re.ASCII)
_SIZE_UNITS = {
    None: 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3,
    "KB": 1000, "MB": 1000**2, "GB": 1000**3,
}  # fmt: skip


def parse_duration(text: str) -> float:
    """Seconds, from ``"30"``, ``"250ms"``, ``"30s"``, ``"5m"``, ``"24h"``, ``"7d"``;
    ValueError otherwise."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise ValueError("expected seconds or a duration such as 250ms, 30s, 5m, 24h, 7d")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def parse_size(text: str) -> int:
    """Bytes, from ``"4096"``, ``"512KiB"``, ``"10MiB"``, ``"1GB"``; ValueError otherwise."""
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError("expected bytes or a size such as 512KiB, 10MiB")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]
