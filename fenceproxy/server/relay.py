"""Forwarding a request as it came, and relaying the upstream's answer to the client.

An unfenced request goes through :meth:`Relay.pass_through`: a body of known length
up to 64 KiB is read whole and sent in one piece, as nginx buffers request bodies;
a longer or chunked one is streamed through. A report-only route's writes that the
fence would refuse go the same way, their answer marked (``mark``). Every answer,
fenced or not, reaches the client through :func:`relay`, which gives the data plane
an upstream's answer to stream on, or in one piece when it is whole already
(:func:`answer`, :func:`replayed`).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

from multidict import CIMultiDict

from .. import hdrs
from ..errors import RequestHeaderMalformed
from ..fence.fencing import StoredResponse
from ..http.answer import Answer
from ..http.edge import Bodies, HeldBody, check_body_size
from ..http.http1 import UpstreamResponse
from ..http.request import Request
from ..http.routes import Route
from ..http.upstream import TrustedProxies, UpstreamPool, answer_fields, forwarded_fields

__all__ = [
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


class Relay:
    """Requests sent on as they came, through ``upstreams``; bodies held by ``bodies``."""

    def __init__(self, bodies: Bodies, upstreams: UpstreamPool) -> None:
        self._bodies = bodies
        self._upstreams = upstreams
        self.trusted = TrustedProxies(())
        """Peers whose X-Forwarded-* headers are believed."""

    async def pass_through(
        self, request: Request, route: Route, target: str, mark: str | None = None
    ) -> Answer:
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
        request: Request,
        route: Route,
        target: str,
        length: int | None,
        body: HeldBody | AsyncIterator[bytes] | None,
        mark: str | None = None,
    ) -> Answer:
        """Send ``body`` (``length`` bytes, None: chunked) and relay the answer."""
        fields, host = self.head(request, route, fenced=mark is not None)
        payload = body.payload() if isinstance(body, HeldBody) else body
        request.forwarding = True
        upstream = await self._upstreams.send(
            route, request.method, target, fields, payload, host=host, length=length
        )
        if isinstance(body, HeldBody):
            body.release()  # the upstream has it
        return relay(request, upstream, mark=mark)

    async def report(
        self,
        request: Request,
        route: Route,
        target: str,
        held: HeldBody | None,
        kind: str,
    ) -> Answer:
        """Report only: a write enforcing would refuse (``kind``, its problem kind) or
        answer from its key (``replayed``) goes to the upstream as it came, unfenced,
        its body ``held`` whole or, refused on its head, still unread; the answer says
        so. Nothing of it is recorded, as enforcing would record nothing of it."""
        mark = "would-replay" if kind == "replayed" else f"would-refuse; kind={kind}"
        if held is None:
            response = await self.pass_through(request, route, target, mark)
        else:
            response = await self.send(request, route, target, held.size, held, mark)
        response.decision = "would-replay" if kind == "replayed" else f"would-{kind}"
        return response

    def head(self, request: Request, route: Route, *, fenced: bool) -> tuple[bytes, str | None]:
        """The field lines and the ``Host`` (None: the upstream's own) the upstream
        gets (:func:`forwarded_fields`, :func:`upstream_host`); the fencing fields of
        a ``fenced`` write go on as they came even when ``Connection`` names them.
        RequestHeaderMalformed for a ``Host`` that cannot be sent on unchanged."""
        fence = route.fence
        keep = fence.fields if fence is not None and fenced else frozenset()
        return forwarded_fields(request, self.trusted, keep=keep), upstream_host(request, route)


def check_length(request: Request, route: Route) -> None:
    """BodyTooLarge when the declared length is over the route's ``max_body``."""
    length = request.content_length
    if length is not None:
        check_body_size(length, route.max_body)


def answer(upstream: UpstreamResponse, body: bytes) -> Answer:
    """The upstream's answer, ``body`` read whole, in one piece."""
    fields = answer_fields(upstream, length=False)
    return Answer(upstream.status, body=body, reason=upstream.reason, fields=fields)


def replayed(stored: StoredResponse) -> Answer:
    """A stored answer given again, marked ``Idempotent-Replayed: true``."""
    assert stored.body is not None
    headers: CIMultiDict[str] = CIMultiDict(stored.headers)
    headers[hdrs.IDEMPOTENT_REPLAYED] = "true"
    response = Answer(stored.status, headers, stored.body)
    response.decision = "replayed"
    return response


def relay(
    request: Request,
    upstream: UpstreamResponse,
    prefix: bytes = b"",
    mark: str | None = None,
) -> Answer:
    """The upstream's answer (after ``prefix``, already read from it) as the client
    gets it: in one piece when every byte of it is in already (the common small
    one), else streamed on by the data plane as it arrives, which cuts the client's
    connection should the upstream break off mid-answer or the client take nothing
    for ``limits.send_timeout``. The upstream connection is given back once the
    answer was sent, or given up."""
    if request.method != "HEAD" and upstream.status not in _NO_BODY:
        whole = upstream.received_whole()
        if whole is not None:
            upstream.release()
            response = answer(upstream, prefix + whole)
            if mark is not None:
                response.headers[hdrs.FENCING_DECISION] = mark
            return response
    response = Answer(
        upstream.status,
        body=prefix,
        reason=upstream.reason,
        fields=answer_fields(upstream, length=True),
        framed=upstream.content_length is not None,
        stream=upstream.chunks(),
        finish=upstream.release,
    )
    if mark is not None:
        response.headers[hdrs.FENCING_DECISION] = mark
    return response


def upstream_host(request: Request, route: Route) -> str | None:
    """The ``Host`` the upstream gets: the client's on a ``host: preserve`` route, if
    it sent one (an HTTP/1.0 request may not); None for the upstream's authority.
    RequestHeaderMalformed when it cannot be forwarded unchanged."""
    if not route.preserve_host:
        return None
    if not request.target.startswith("/"):
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
