"""The upstream side: the header rules in both directions, and one pool of
keep-alive connections per upstream origin (:mod:`fenceproxy.http.http1`, where the
client's failures become UpstreamErrors).

The client never follows redirects, never decompresses, keeps no cookies, and
never retries a request on its own: retrying a write is the worker's decision.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import AsyncIterable, Callable, Iterable
from typing import Any

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy, istr
from yarl import URL

from .. import hdrs
from ..errors import RequestHeaderMalformed
from .http1 import Origin, UpstreamResponse
from .routes import Route

__all__ = [
    "TrustedProxies",
    "UpstreamPool",
    "forwarded_headers",
    "replayable_headers",
    "response_headers",
]

_VIA = "fenceproxy"
# Set by the proxy itself or by aiohttp's framing, never copied from the client.
# Header names below are lower-case and compared with ``name.lower()``: a set of
# ``istr`` would compare them case-sensitively.
_NOT_FORWARDED = hdrs.lower(
    hdrs.HOP_BY_HOP | {istr("Host"), istr("Content-Length"), istr("Expect")}
)
# What a client may claim about itself; believed only from a trusted proxy.
_CLIENT_CLAIMS = (istr("Forwarded"), istr("X-Real-IP"))
# The proxy's own say about a fenced write: an upstream's would be taken for it.
_NOT_RETURNED = hdrs.lower(hdrs.HOP_BY_HOP | {hdrs.FENCING_DECISION})
_NOT_STORED = hdrs.lower(hdrs.HOP_BY_HOP | {istr("Content-Length"), hdrs.VIA})


def _copy_without(
    headers: CIMultiDictProxy[str], drop: frozenset[str], keep: frozenset[str] = frozenset()
) -> list[tuple[str, str]]:
    """``headers`` in their order, less the lower-case names in ``drop`` and less
    every header their ``Connection`` names, except those in ``keep``; names compared
    case-insensitively. A name sent in two spellings goes on in its first one: given
    ``X-A`` and ``x-a``, aiohttp's client would keep only the last field."""
    named = {
        token.strip().lower()
        for value in headers.getall("Connection", ())
        for token in value.split(",")
        if token.strip()
    }
    if named:
        drop = drop | (named - keep)
    spelling: dict[str, str] = {}
    out = []
    for name, value in headers.items():
        lower = name.lower()
        if lower not in drop:
            out.append((spelling.setdefault(lower, name), value))
    return out


class TrustedProxies:
    """Peers whose X-Forwarded-* headers are believed."""

    __slots__ = ("_networks",)

    def __init__(self, networks: Iterable[str]) -> None:
        self._networks = tuple(ipaddress.ip_network(n, strict=False) for n in networks)

    def __contains__(self, peer: str | None) -> bool:
        if peer is None or not self._networks:
            return False
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return False
        return any(address in net for net in self._networks)


def forwarded_headers(
    request: web.BaseRequest,
    trusted: TrustedProxies,
    body_length: int | None,
    *,
    keep: frozenset[str] = frozenset(),
) -> CIMultiDict[str]:
    """The headers to send upstream: the client's, less hop-by-hop ones, plus
    X-Forwarded-For/-Proto/-Host and Via. Incoming X-Forwarded-*, Forwarded and
    X-Real-IP values are kept only from a trusted peer. ``body_length`` is the
    Content-Length the aiohttp server already enforced on a body streamed through,
    or None to let aiohttp frame the body (a buffered body gets its exact length).
    ``keep`` names (lower-case) headers forwarded even when ``Connection`` lists
    them (the fencing fields, which the proxy read as the write's own)."""
    incoming = request.headers
    copied = _copy_without(incoming, _NOT_FORWARDED, keep)
    for name, value in copied:
        if not value.isascii() and not _is_utf8(value):
            # aiohttp would send it less the bytes that are not UTF-8.
            raise RequestHeaderMalformed(
                f"the value of {name} is not UTF-8 and cannot be forwarded unchanged",
                header=name,
            )
    out: CIMultiDict[str] = CIMultiDict(copied)
    peer = request.remote
    believe = peer in trusted
    if not believe:
        for name in _CLIENT_CLAIMS:
            out.popall(name, None)
    prior_for = incoming.get(hdrs.X_FORWARDED_FOR) if believe else None
    out[hdrs.X_FORWARDED_FOR] = f"{prior_for}, {peer}" if prior_for else (peer or "unknown")
    if not (believe and hdrs.X_FORWARDED_PROTO in incoming):
        out[hdrs.X_FORWARDED_PROTO] = request.scheme
    if not (believe and hdrs.X_FORWARDED_HOST in incoming):
        out.popall(hdrs.X_FORWARDED_HOST, None)
        if request.host:
            out[hdrs.X_FORWARDED_HOST] = request.host
    _append_via(out, request.version)
    if body_length is not None:
        out[istr("Content-Length")] = str(body_length)
    return out


def _is_utf8(value: str) -> bool:
    """Whether a header value arrived as UTF-8 (aiohttp surrogate-escapes other bytes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def response_headers(upstream: UpstreamResponse) -> CIMultiDict[str]:
    """The upstream's response headers less hop-by-hop ones, plus Via."""
    out: CIMultiDict[str] = CIMultiDict(_copy_without(upstream.headers, _NOT_RETURNED))
    _append_via(out, upstream.version)
    return out


def replayable_headers(upstream: UpstreamResponse) -> tuple[tuple[str, str], ...]:
    """The upstream's headers worth storing for a replay: no hop-by-hop, no framing
    (the replay is framed anew), no Via."""
    return tuple(_copy_without(upstream.headers, _NOT_STORED))


def _append_via(headers: CIMultiDict[str], version: Any) -> None:
    hop = f"{version.major}.{version.minor} {_VIA}" if version else f"1.1 {_VIA}"
    prior = ", ".join(headers.popall(hdrs.VIA, ()))
    headers[hdrs.VIA] = f"{prior}, {hop}" if prior else hop


Answered = Callable[[str, float, int | None], None]


class UpstreamPool:
    """The connection pool of each upstream origin the routes name."""

    def __init__(self, routes: Iterable[Route], answered: Answered | None = None) -> None:
        """``answered(route, seconds, status)`` is told of each exchange: its route's
        name, how long the upstream took, and its status (None when there was none)."""
        self._answered = answered
        self._origins: dict[URL, Origin] = {}
        self.update(routes)

    def update(self, routes: Iterable[Route]) -> None:
        """Serve ``routes`` from now on (a reload): an origin they still name keeps its
        connections; one they no longer name is retired, and a request already
        routed to it still gets it."""
        origins: dict[URL, Origin] = {}
        for route in routes:
            if route.upstream not in origins:
                origin = self._origins.get(route.upstream) or Origin(route.upstream)
                origin.retired = False
                origins[route.upstream] = origin
        for url, origin in self._origins.items():
            if url not in origins:
                origin.retired = True
                origin.close()  # its idle connections; busy ones close as they return
                origins.setdefault(url, origin)
        self._origins = origins

    def origin(self, route: Route) -> Origin:
        return self._origins[route.upstream]

    async def send(
        self,
        route: Route,
        method: str,
        target: str,
        headers: CIMultiDict[str],
        body: bytes | AsyncIterable[bytes] | None,
        *,
        host: str | None = None,
    ) -> UpstreamResponse:
        """Send a request to the route's upstream and return once the upstream's status
        and headers are in; the caller must release the response it gets. ``host`` is
        the ``Host`` to send (a ``host: preserve`` route's client's), None for the
        upstream's authority. Raises UpstreamError (see :mod:`fenceproxy.http.http1`)."""
        answered = self._answered
        started = time.monotonic()
        status: int | None = None
        try:
            response = await self._origins[route.upstream].request(
                method,
                route.base_path + target,
                headers,
                body,
                connect_timeout=route.connect_timeout,
                read_timeout=route.timeout,
                host=host,
            )
            status = response.status
            return response
        finally:
            if answered is not None:
                answered(route.name, time.monotonic() - started, status)

    async def close(self) -> None:
        for origin in self._origins.values():
            origin.close()
