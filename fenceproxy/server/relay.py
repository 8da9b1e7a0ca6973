"""Forwarding a request as it came, and relaying the upstream's answer to the client.

An unfenced request goes through :meth:`Relay.pass_through`: a body of known length
up to 64 KiB is read whole and sent in one piece, as nginx buffers request bodies;
a longer or chunked one is streamed through. A report-only route's writes that the
fence would refuse go the same way, their answer marked (``mark``). Every answer,
fenced or not, reaches the client through :func:`relay`, or in one piece when it
is whole already (:func:`answer`, :func:`replayed`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

from aiohttp import web
from multidict import CIMultiDict

from .. import hdrs
from ..errors import RequestHeaderMalformed, UpstreamError
from ..fence.fencing import StoredResponse
from ..http.edge import Bodies, HeldBody, check_body_size
from ..http.http1 import UpstreamResponse
from ..http.routes import Route
from ..http.upstream import TrustedProxies, UpstreamPool, forwarded_headers, response_headers
from ..log import proxy_log

__all__ = [
    "DECISION",
    "Relay",
    "answer",
    "check_length",
    "relay",
    "replayed",
    "upstream_host",
]

# An unfenced body up to this size is read whole and sent in one piece, as nginx
# buffers request bodies; a longer or chunked one is streamed through.
_BUFFERED = 64 * 1024
# Answers whose framing says more than their (empty) body: relayed as they came.
_NO_BODY = frozenset({204, 304})

DECISION = web.ResponseKey("fenceproxy.decision", str)
"""Where a fenced write's answer carries what became of it, never in its headers,
which the upstream writes too."""


class Relay:
    """Requests sent on as they came, through ``upstreams``; bodies held by ``bodies``."""

    def __init__(self, bodies: Bodies, upstreams: UpstreamPool) -> None:
        self._bodies = bodies
        self._upstreams = upstreams
        self.trusted = TrustedProxies(())
        """Peers whose X-Forwarded-* headers are believed."""
        self.send_timeout = 0.0
        """How long a client may take to read the next part of a streamed answer."""

    async def pass_through(
        self, request: web.BaseRequest, route: Route, target: str, mark: str | None = None
    ) -> web.StreamResponse:
        """Forward as it came; ``mark``, when given, is the answer's Fencing-Decision."""
        check_length(request, route)
        length = request.content_length
        body: HeldBody | AsyncIterator[bytes] | None = None
        if length is not None and length <= _BUFFERED:
            body = await self._bodies.read(request, route.max_body)  # one write upstream
        elif request.body_exists:
            body = self._bodies.stream(request, route.max_body)
        try:
            return await self.send(request, route, target, length, body, mark)
        finally:
            if isinstance(body, HeldBody):
                body.release()

    async def send(
        self,
        request: web.BaseRequest,
        route: Route,
        target: str,
        length: int | None,
        body: HeldBody | AsyncIterator[bytes] | None,
        mark: str | None = None,
    ) -> web.StreamResponse:
        """Send ``body`` (``length`` bytes, None: streamed) and relay the answer."""
        headers, host = self.head(request, route, length, fenced=mark is not None)
        payload = body.payload() if isinstance(body, HeldBody) else body
        upstream = await self._upstreams.send(
            route, request.method, target, headers, payload, host=host
        )
        if isinstance(body, HeldBody):
            body.release()  # the upstream has it
        try:
            return await relay(request, upstream, self.send_timeout, mark=mark)
        finally:
            upstream.release()

    async def report(
        self,
        request: web.BaseRequest,
        route: Route,
        target: str,
        held: HeldBody | None,
        kind: str,
    ) -> web.StreamResponse:
        """Report only: a write enforcing would refuse (``kind``, its problem kind) or
        answer from its key (``replayed``) goes to the upstream as it came, unfenced,
        its body ``held`` whole or, refused on its head, still unread; the answer says
        so. Nothing of it is recorded, as enforcing would record nothing of it."""
        mark = "would-replay" if kind == "replayed" else f"would-refuse; kind={kind}"
        if held is None:
            response = await self.pass_through(request, route, target, mark)
        else:
            response = await self.send(request, route, target, held.size, held, mark)
        response[DECISION] = "would-replay" if kind == "replayed" else f"would-{kind}"
        return response

    def head(
        self, request: web.BaseRequest, route: Route, length: int | None, *, fenced: bool
    ) -> tuple[CIMultiDict[str], str | None]:
        """The headers and the ``Host`` (None: the upstream's own) the upstream gets
        (:func:`forwarded_headers`, :func:`upstream_host`); the fencing fields of a
        ``fenced`` write go on as they came even when ``Connection`` names them.
        RequestHeaderMalformed for a header that cannot be sent on unchanged."""
        fence = route.fence
        keep = fence.fields if fence is not None and fenced else frozenset()
        headers = forwarded_headers(request, self.trusted, length, keep=keep)
        return headers, upstream_host(request, route)


def check_length(request: web.BaseRequest, route: Route) -> None:
    """BodyTooLarge when the declared length is over the route's ``max_body``."""
    length = request.content_length
    if length is not None:
        check_body_size(length, route.max_body)


def answer(upstream: UpstreamResponse, body: bytes) -> web.Response:
    """The upstream's answer, ``body`` read whole, in one piece."""
    headers = response_headers(upstream)
    headers.popall("Content-Length", None)
    return web.Response(status=upstream.status, reason=upstream.reason, headers=headers, body=body)


def replayed(stored: StoredResponse) -> web.Response:
    """A stored answer given again, marked ``Idempotent-Replayed: true``."""
    assert stored.body is not None
    headers: CIMultiDict[str] = CIMultiDict(stored.headers)
    headers[hdrs.IDEMPOTENT_REPLAYED] = "true"
    response = web.Response(status=stored.status, headers=headers, body=stored.body)
    response[DECISION] = "replayed"
    return response


async def relay(
    request: web.BaseRequest,
    upstream: UpstreamResponse,
    send_timeout: float,
    prefix: bytes = b"",
    mark: str | None = None,
) -> web.StreamResponse:
    """Stream the upstream's answer (after ``prefix``, already read from it) to the
    client. If the upstream breaks off mid-answer, or the client takes nothing for
    ``send_timeout``, the client's connection is closed, so the client never takes a
    cut answer for a whole one and a client that does not read holds nothing. An
    answer already in whole (the common small one) goes out in one piece."""
    if request.method != "HEAD" and upstream.status not in _NO_BODY:
        whole = upstream.received_whole()
        if whole is not None:
            response: web.StreamResponse = answer(upstream, prefix + whole)
            if mark is not None:
                response.headers[hdrs.FENCING_DECISION] = mark
            return response
    response = web.StreamResponse(
        status=upstream.status, reason=upstream.reason, headers=response_headers(upstream)
    )
    if mark is not None:
        response.headers[hdrs.FENCING_DECISION] = mark
    await _stream(request, response, upstream, send_timeout, prefix)
    return response


async def _stream(
    request: web.BaseRequest,
    response: web.StreamResponse,
    upstream: UpstreamResponse,
    send_timeout: float,
    prefix: bytes,
) -> None:
    try:
        await response.prepare(request)
        if prefix:
            await response.write(prefix)
        async for chunk in upstream.chunks():
            async with asyncio.timeout(send_timeout):
                await response.write(chunk)
        await response.write_eof()
    except UpstreamError as exc:
        proxy_log.warning("upstream answer cut short: %s", exc.detail)
        if request.transport is not None:
            request.transport.close()
    except TimeoutError:
        proxy_log.info("the client took no part of the answer for %gs: closed", send_timeout)
        if request.transport is not None:
            request.transport.close()
    except ConnectionError:
        pass  # the client went away


def upstream_host(request: web.BaseRequest, route: Route) -> str | None:
    """The ``Host`` the upstream gets: the client's on a ``host: preserve`` route, if
    it sent one (an HTTP/1.0 request may not); None for the upstream's authority.
    RequestHeaderMalformed when it cannot be forwarded unchanged."""
    if not route.preserve_host:
        return None
    if not request.raw_path.startswith("/"):
        # An absolute-form target names its own authority, which wins over Host
        # (RFC 9112 §3.2.2): which of the two a signature covers is the client's.
        raise RequestHeaderMalformed(
            "a route that forwards the client's Host takes origin-form targets only "
            "(/path, not http://host/path)",
            header="Host",
        )
    host = request.headers.get("Host")
    if host is not None and not _AUTHORITY.fullmatch(host):
        # Sent on as it came, it must be an authority (RFC 3986 §3.2): anything else
        # would reach the upstream re-encoded, or as a second header line.
        raise RequestHeaderMalformed(
            "the Host header is not a host[:port] and cannot be forwarded unchanged",
            header="Host",
        )
    return host


# An authority as RFC 3986 spells it: a reg-name, an IPv4 or a bracketed IPv6
# literal, and an optional port; ASCII only.
_AUTHORITY = re.compile(
    r"(?:[A-Za-z0-9\-._~!$&'()*+,;=%]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]*)?", re.ASCII
)
