"""Header names fenceproxy reads or writes, compared case-insensitively."""

from __future__ import annotations

from multidict import istr

__all__ = [
    "DEFAULT_JOB",
    "DEFAULT_KEY",
    "DEFAULT_TOKEN",
    "HOP_BY_HOP",
    "IDEMPOTENT_REPLAYED",
    "TRANSFER_ENCODING",
    "VIA",
    "X_FORWARDED_FOR",
    "X_FORWARDED_HOST",
    "X_FORWARDED_PROTO",
]

DEFAULT_JOB = istr("Fencing-Job")
DEFAULT_TOKEN = istr("Fencing-Token")
DEFAULT_KEY = istr("Idempotency-Key")

IDEMPOTENT_REPLAYED = istr("Idempotent-Replayed")
TRANSFER_ENCODING = istr("Transfer-Encoding")
VIA = istr("Via")
X_FORWARDED_FOR = istr("X-Forwarded-For")
X_FORWARDED_PROTO = istr("X-Forwarded-Proto")
X_FORWARDED_HOST = istr("X-Forwarded-Host")

# RFC 9110 section 7.6.1, plus the de facto Proxy-Connection. Headers named in
# Connection are hop-by-hop too; upstream.py drops those per message.
HOP_BY_HOP: frozenset[istr] = frozenset(
    istr(h)
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Proxy-Authorization",
        "Proxy-Authenticate",
    )
)
