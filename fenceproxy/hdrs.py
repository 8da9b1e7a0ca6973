"""Header names fenceproxy reads or writes, compared case-insensitively."""

from __future__ import annotations

from multidict import istr

__all__ = [
    "DEFAULT_JOB",
    "DEFAULT_KEY",
    "DEFAULT_TOKEN",
    "FENCING_DECISION",
    "HOP_BY_HOP",
    "IDEMPOTENT_REPLAYED",
    "METHOD_OVERRIDES",
    "TRANSFER_ENCODING",
    "VIA",
    "X_FORWARDED_FOR",
    "X_FORWARDED_HOST",
    "X_FORWARDED_PROTO",
    "lower",
]

DEFAULT_JOB = istr("Fencing-Job")
DEFAULT_TOKEN = istr("Fencing-Token")
DEFAULT_KEY = istr("Idempotency-Key")

IDEMPOTENT_REPLAYED = istr("Idempotent-Replayed")
FENCING_DECISION = istr("Fencing-Decision")
"""On a report-only route: what enforcing would have done with a write it forwarded."""

# Headers with which many frameworks let a request name another method than its own
# (a GET with X-HTTP-Method-Override: DELETE is a DELETE to them).
METHOD_OVERRIDES = (
    istr("X-HTTP-Method-Override"),
    istr("X-HTTP-Method"),
    istr("X-Method-Override"),
)
TRANSFER_ENCODING = istr("Transfer-Encoding")
VIA = istr("Via")
X_FORWARDED_FOR = istr("X-Forwarded-For")
X_FORWARDED_PROTO = istr("X-Forwarded-Proto")
X_FORWARDED_HOST = istr("X-Forwarded-Host")


def lower(names: frozenset[istr]) -> frozenset[str]:
    """``names`` lower-cased, for matching with ``name.lower()``: membership in a set
    of ``istr`` is case-sensitive."""
    return frozenset(name.lower() for name in names)


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
