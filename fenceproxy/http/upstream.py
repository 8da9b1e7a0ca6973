"""The upstream side: the header rules in both directions, and one pool of
keep-alive connections per upstream origin (:mod:`fenceproxy.http.http1`, where the
client's failures become UpstreamErrors).

The client never follows redirects, never decompresses, keeps no cookies, and
never retries a request on its own: retrying a write is the worker's decision.
"""

from __future__ import annotations

import ipaddress
import ssl
import time
from collections.abc import AsyncIterable, Callable, Iterable
from typing import Any

from multidict import CIMultiDict, istr
from yarl import URL

from .. import hdrs
from ..errors import RequestHeaderMalformed, UpstreamUnreachable
from ..log import server_log
from ..tls import ClientTLS
from .answer import http_date
from .http1 import Origin, UpstreamResponse
from .request import Request
from .routes import Route

__all__ = [
    "TrustedProxies",
    "UpstreamPool",
    "answer_fields",
    "forwarded_fields",
    "replayable_headers",
]

_VIA = b"fenceproxy"
# Names below are lower-case bytes, compared with ``name.lower()``.
# Set by the proxy itself or by the body's framing, never copied from the client.
_NOT_FORWARDED = frozenset(
    n.encode() for n in hdrs.lower(hdrs.HOP_BY_HOP | {istr("Host"), istr("Content-Length"),
                                                      istr("Expect")})
)  # fmt: skip
# Written anew by the proxy: X-Forwarded-* (from a trusted peer's, if any) and Via.
_REWRITTEN = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"via"})
# What a client may claim about itself; believed only from a trusted proxy.
_CLIENT_CLAIMS = frozenset({b"forwarded", b"x-real-ip"})
# The proxy's own say about a fenced write: an upstream's would be taken for it.
_NOT_RETURNED = frozenset(
    n.encode() for n in hdrs.lower(hdrs.HOP_BY_HOP | {hdrs.FENCING_DECISION, hdrs.VIA})
)
_NOT_RETURNED_NOR_LENGTH = _NOT_RETURNED | {b"content-length"}
_NOT_STORED = hdrs.lower(hdrs.HOP_BY_HOP | {istr("Content-Length"), hdrs.VIA})
# Dropped fields whose values the proxy reads to write its own.
_READ = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"via", b"host"})
Fields = list[tuple[bytes, bytes]]


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
        address = getattr(address, "ipv4_mapped", None) or address
        return any(address in net for net in self._networks)

    def client(self, peer: str | None, fields: Fields) -> str:
        """Whom a request is from: its peer, or, when the peer is a trusted proxy, the
        first address ``X-Forwarded-For`` names from the right that is not one (a
        client cannot pass itself off as another by naming it further left)."""
        if peer not in self:
            return peer or "unknown"
        hops = [
            hop.strip().decode("latin-1")
            for name, value in fields
            if name.lower() == b"x-forwarded-for"
            for hop in value.split(b",")
        ]
        for hop in reversed(hops):
            address = _address(hop)
            if address is None:  # not an address: nothing left of it can be believed
                break
            if address not in self:
                return address
        return peer or "unknown"


def _address(hop: str) -> str | None:
    """An X-Forwarded-For hop's IP address (its port, if it has one, dropped), in its
    canonical form; None when it is not one."""
    if hop.startswith("["):  # [v6]:port
        hop = hop[1:].partition("]")[0]
    elif hop.count(":") == 1:  # v4:port
        hop = hop.partition(":")[0]
    try:
        address = ipaddress.ip_address(hop)
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:10.0.0.5 is 10.0.0.5
    return str(mapped or address)


def forwarded_fields(
    request: Request, trusted: TrustedProxies, *, keep: frozenset[str] = frozenset()
) -> bytes:
    """The field lines to send upstream, in one pass: the client's as they came,
    less hop-by-hop ones, then X-Forwarded-For/-Proto/-Host and Via. Incoming
    X-Forwarded-*, Forwarded and X-Real-IP values are kept only from a trusted
    peer. ``keep`` names (lower-case) fields forwarded even when ``Connection``
    lists them (the fencing fields, which the proxy read as the write's own). The
    body's framing is the upstream client's to add. RequestHeaderMalformed for a
    value that cannot go on as it came (:func:`_check_utf8`)."""
    fields = request.raw_headers
    peer = request.remote
    believe = peer in trusted
    drop = _NOT_FORWARDED | _REWRITTEN if believe else _NOT_FORWARDED | _REWRITTEN | _CLIENT_CLAIMS
    if request.connection_named:
        drop = drop | (request.connection_named - {k.encode() for k in keep})
    out: list[bytes] = []
    seen: dict[bytes, list[bytes]] = {}
    for name, value in fields:
        lower = name.lower()
        if lower in drop:
            if lower in _READ:
                seen.setdefault(lower, []).append(value)
            continue
        if not value.isascii():
            _check_utf8(name, value)
        out += (name, b": ", value, b"\r\n")
    address = (peer or "unknown").encode()
    prior_for = seen.get(b"x-forwarded-for") if believe else None
    out += (b"X-Forwarded-For: ", b", ".join([*prior_for, address]) if prior_for else address)
    proto = seen.get(b"x-forwarded-proto") if believe else None
    out += (b"\r\nX-Forwarded-Proto: ", proto[0] if proto else request.scheme.encode(), b"\r\n")
    host = (seen.get(b"x-forwarded-host") if believe else None) or seen.get(b"host")
    if host:
        out += (b"X-Forwarded-Host: ", host[0], b"\r\n")
    out.append(_via(seen.get(b"via", ()), request.version))
    return b"".join(out)


def _check_utf8(name: bytes, value: bytes) -> None:
    """A request field's value goes on as it came only when it is UTF-8 (or ASCII):
    upstreams' own frameworks read other bytes each their own way (Latin-1, or
    replaced), so the proxy, the fence and the upstream might not read one value
    alike. RequestHeaderMalformed, never quoting the value."""
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        header = name.decode("latin-1")
        raise RequestHeaderMalformed(
            f"the value of {header} is not UTF-8 and cannot be forwarded unchanged",
            header=header,
        ) from None


def answer_fields(upstream: UpstreamResponse, *, length: bool) -> bytes:
    """The upstream's answer fields as the client gets them, in one pass, as they
    came: less hop-by-hop ones (and ``Content-Length`` unless ``length``: the proxy
    frames a body it read whole anew), plus Via, and ``Date`` when the upstream sent
    none (RFC 9110 §6.6.1)."""
    fields = upstream.raw_fields
    # A 204 has no Content-Length (RFC 9110 §8.6), whatever the upstream said.
    drop = _NOT_RETURNED if length and upstream.status != 204 else _NOT_RETURNED_NOR_LENGTH
    named = upstream.connection_named
    if named:
        drop = drop | named
    out: list[bytes] = []
    via: list[bytes] = []
    dated = False
    for name, value in fields:
        lower = name.lower()
        if lower in drop:
            if lower == b"via":
                via.append(value)
            continue
        if lower == b"date":
            dated = True
        out += (name, b": ", value, b"\r\n")
    out.append(_via(via, upstream.version))
    if not dated:
        out += (b"Date: ", http_date(), b"\r\n")
    return b"".join(out)


def replayable_headers(upstream: UpstreamResponse) -> tuple[tuple[str, str], ...]:
    """The upstream's headers worth storing for a replay: no hop-by-hop, no framing
    (the replay is framed anew), no Via."""
    named = {token.strip().lower() for v in upstream.headers.getall("Connection", ())
             for token in v.split(",")}  # fmt: skip
    drop = _NOT_STORED | named
    return tuple((n, v) for n, v in upstream.headers.items() if n.lower() not in drop)


def _via(prior: Iterable[bytes], version: Any) -> bytes:
    hop = b"%d.%d %s" % (version.major, version.minor, _VIA)
    return b"Via: %s\r\n" % (b", ".join([*prior, hop]))


def _renew(origin: Origin, route: str) -> None:
    try:
        origin.renew_tls()
    except ValueError as exc:
        server_log.error("route %r keeps its TLS files as they were: %s", route, exc)


Answered = Callable[[str, float, int | None], None]
_Key = tuple[URL, ClientTLS | None]  # an upstream origin, and how TLS is spoken to it


class UpstreamPool:
    """The connection pool of each upstream origin the routes name."""

    def __init__(self, routes: Iterable[Route], answered: Answered | None = None) -> None:
        """``answered(route, seconds, status)`` is told of each exchange: its route's
        name, how long the upstream took, and its status (None when there was none)."""
        self._answered = answered
        self._origins: dict[_Key, Origin] = {}
        self.update(routes)

    def update(self, routes: Iterable[Route]) -> None:
        """Serve ``routes`` from now on (a reload): an origin they still name keeps its
        connections, and loads its TLS files again for the next ones; one they no
        longer name is retired, and a request already routed to it still gets it."""
        origins: dict[_Key, Origin] = {}
        for route in routes:
            key = (route.upstream, route.tls)
            if key not in origins:
                origin = self._origins.get(key)
                if origin is None:
                    origin = Origin(route.upstream, route.tls)
                elif route.tls is not None:
                    _renew(origin, route.name)
                origin.retired = False
                origins[key] = origin
        for key, origin in self._origins.items():
            if key not in origins:
                origin.retired = True
                origin.close()  # its idle connections; busy ones close as they return
                origins.setdefault(key, origin)
        self._origins = origins

    def origin(self, route: Route) -> Origin:
        return self._origins[route.upstream, route.tls]

    async def send(
        self,
        route: Route,
        method: str,
        target: str,
        headers: CIMultiDict[str] | bytes,
        body: bytes | AsyncIterable[bytes] | None,
        *,
        host: str | None = None,
        length: int | None = None,
    ) -> UpstreamResponse:
        """Send a request to the route's upstream and return once the upstream's status
        and fields are in; the caller must release the response it gets. ``host`` is
        the ``Host`` to send (a ``host: preserve`` route's client's), None for the
        upstream's authority; ``length`` the length of a streamed body, if known.
        Raises UpstreamError (see :mod:`fenceproxy.http.http1`)."""
        answered = self._answered
        started = time.monotonic()
        status: int | None = None
        try:
            response = await self._origins[route.upstream, route.tls].request(
                method,
                route.base_path + target,
                headers,
                body,
                connect_timeout=route.connect_timeout,
                read_timeout=route.timeout,
                host=host,
                length=length,
            )
            status = response.status
            return response
        except UpstreamUnreachable as exc:
            if isinstance(exc.__cause__, ssl.SSLError):  # which route's TLS settings
                raise UpstreamUnreachable(f"route {route.name!r}: {exc.detail}") from exc
            raise
        finally:
            if answered is not None:
                answered(route.name, time.monotonic() - started, status)

    async def close(self) -> None:
        for origin in self._origins.values():
            origin.close()
