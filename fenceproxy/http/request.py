"""A request as the data plane (:mod:`fenceproxy.http.server`) hands it over: its
head, read once, and its body as it arrives. No framework object: the values a
route, the fence and the upstream need, and nothing built that none of them reads.

:func:`read_head` takes what llhttp parsed of a head and checks what llhttp leaves
to its caller: the version (1.1 or 1.0), RFC 9110's fields that must come once,
``Host`` in HTTP/1.1, the target's form, and ``Expect``.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple, Protocol

from multidict import CIMultiDictProxy
from yarl import URL

from ..errors import (
    ExpectationFailed,
    RequestMalformed,
    RequestTargetMalformed,
    VersionNotSupported,
)
from .body import Body, Reading, read_fields
from .httptools_parser import HttpRequestParser

__all__ = [
    "HTTP10",
    "HTTP11",
    "MAX_FIELDS",
    "MAX_HEAD",
    "MAX_LINE",
    "NONE_NAMED",
    "Body",
    "ClientConnection",
    "Request",
    "Version",
    "connection_named",
    "read_head",
    "too_large",
]


class Version(NamedTuple):
    major: int
    minor: int


HTTP10 = Version(1, 0)
HTTP11 = Version(1, 1)
NONE_NAMED: frozenset[bytes] = frozenset()
MAX_LINE = 8190
"""The longest request target, and the longest field name or value (nginx: 8k)."""
MAX_FIELDS = 100
"""The most fields in a request head."""
MAX_HEAD = 64 * 1024
"""The most bytes of one request head's field lines, or of a body's trailer fields
(nginx: 32 KiB); also the most the parser may take in without reporting anything (a
field that never ends)."""
# RFC 9110's fields that appear once; a second is refused, as aiohttp's parser does.
_SINGLETONS = frozenset(
    {
        b"content-length",
        b"content-location",
        b"content-range",
        b"content-type",
        b"etag",
        b"host",
        b"max-forwards",
        b"server",
        b"transfer-encoding",
        b"user-agent",
    }
)


def connection_named(fields: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """The (lower-case) names that a message's ``Connection`` fields list: hop-by-hop
    too (RFC 9110 §7.6.1)."""
    named: set[bytes] = set()
    for name, value in fields:
        if name.lower() == b"connection":
            named.update(token.strip().lower() for token in value.split(b","))
    named.discard(b"")
    return frozenset(named)


_EMPTY = Body(None)


class ClientConnection(Reading, Protocol):
    """The connection a request came on, as the request reads it (the data plane's
    :class:`~fenceproxy.http.server.Connection`): who the client is, whether it is
    still there, and the ``100 Continue`` it may wait for."""

    @property
    def peer(self) -> str | None: ...
    @property
    def scheme(self) -> str: ...
    @property
    def subject(self) -> dict[str, str]: ...
    def gone(self) -> asyncio.Future[None]: ...
    def send_continue(self, request: Request) -> None: ...


class Request:
    """One request's head, as read, and its :class:`Body`.

    ``path`` and ``query`` are the target's, as sent (decoded as UTF-8, bytes that
    are not kept as surrogate escapes); ``raw_headers`` are every field but the
    trailers', as the bytes that came, values with their surrounding whitespace
    stripped; :attr:`headers` reads them as a mapping, when asked."""

    __slots__ = (
        "_conn",
        "_headers",
        "body",
        "coding",
        "connection_named",
        "content_length",
        "forwarding",
        "keep_alive",
        "method",
        "path",
        "query",
        "raw_headers",
        "target",
        "upgrade",
        "version",
    )

    def __init__(
        self,
        conn: ClientConnection,
        method: str,
        target: str,
        path: str,
        query: str,
        version: Version,
        raw_headers: list[tuple[bytes, bytes]],
        *,
        content_length: int | None,
        coding: bytes | None,
        keep_alive: bool,
        upgrade: bool,
        named: frozenset[bytes] = NONE_NAMED,
    ) -> None:
        self._conn = conn
        self.method = method
        self.target = target
        """The request target as sent (origin-form, or absolute-form)."""
        self.path = path
        self.query = query
        self.version = version
        self.raw_headers = raw_headers
        self._headers: CIMultiDictProxy[str] | None = None
        self.content_length = content_length
        self.coding = coding
        """The ``Transfer-Encoding`` field's value, if it has one (its final coding
        is chunked: the parser refuses any other)."""
        self.keep_alive = keep_alive
        self.connection_named = named
        """The names its ``Connection`` fields list (:func:`connection_named`)."""
        self.upgrade = upgrade
        """It asked for another protocol: answered as HTTP/1.1, then closed."""
        has_body = coding is not None or bool(content_length)
        self.body = Body(conn) if has_body else _EMPTY
        self.forwarding = False
        """Set by its handler as it begins to send it on to an upstream: should the
        handler fail after that, the request may have been forwarded."""

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        """The fields as a case-insensitive mapping, values decoded as UTF-8 (bytes that
        are not kept as surrogate escapes), built on first use."""
        if self._headers is None:
            self._headers = read_fields(self.raw_headers)
        return self._headers

    @property
    def body_exists(self) -> bool:
        return self.body is not _EMPTY

    @property
    def remote(self) -> str | None:
        """The peer's address."""
        return self._conn.peer

    @property
    def scheme(self) -> str:
        """``https`` when the client's connection is TLS."""
        return self._conn.scheme

    @property
    def subject(self) -> dict[str, str]:
        """The subject of the client certificate TLS verified on this request's
        connection (``{"CN": ...}``); empty without one."""
        return self._conn.subject

    def client_gone(self) -> asyncio.Future[None]:
        """Set once the client's connection is lost (see :meth:`ClientConnection.gone`)."""
        return self._conn.gone()

    def send_continue(self) -> None:
        """``100 Continue``, once, to a client waiting for it before it sends its body;
        nothing when it asked for none, or has begun sending its body anyway."""
        self._conn.send_continue(self)


def read_head(
    conn: ClientConnection,
    parser: HttpRequestParser,
    url: bytes,
    fields: list[tuple[bytes, bytes]],
) -> tuple[Request, bool]:
    """The request whose head llhttp has read (its target ``url``, its ``fields``),
    and whether it waits for ``100 Continue``; a Refusal when it cannot be taken: a
    version other than 1.1 and 1.0 (505), a field that must come once sent twice, an
    HTTP/1.1 request without ``Host``, a target naming no path (400), an expectation
    other than 100-continue (417)."""
    version = _version(parser.get_http_version())
    if version is None:
        raise VersionNotSupported(
            f"this proxy speaks HTTP/1.1 and HTTP/1.0, not HTTP/{parser.get_http_version()}"
        )
    method = parser.get_method().decode("ascii")
    target = url.decode("utf-8", "surrogateescape")
    seen: set[bytes] = set()
    length: int | None = None
    coding: bytes | None = None
    expect: list[bytes] = []
    named = NONE_NAMED
    for name, value in fields:
        lower = name.lower()
        if lower in _SINGLETONS:
            if lower in seen:
                raise RequestMalformed(
                    f"the request is not valid HTTP/1.1: a second {name.decode()} field"
                )
            seen.add(lower)
            if lower == b"content-length":
                length = int(value)
            elif lower == b"transfer-encoding":
                coding = value  # llhttp refused any whose final coding is not chunked
        elif lower == b"expect":
            expect.append(value)
        elif lower == b"connection":
            named = connection_named(fields)
    if version == HTTP11 and b"host" not in seen:
        raise RequestMalformed("the request is not valid HTTP/1.1: it has no Host field")
    path, query = _split_target(target, method)
    upgrade = parser.should_upgrade()
    # An HTTP/1.0 message with Transfer-Encoding has faulty framing: closed after it
    # (RFC 9112 §6.1).
    keep_alive = parser.should_keep_alive() and not upgrade
    keep_alive = keep_alive and not (version == HTTP10 and coding is not None)
    request = Request(
        conn, method, target, path, query, version, fields,
        content_length=length, coding=coding, keep_alive=keep_alive, upgrade=upgrade,
        named=named,
    )  # fmt: skip
    if upgrade and coding is not None:
        raise RequestMalformed(
            "the request is not valid HTTP/1.1: a chunked body with Upgrade is not read"
        )
    # 100-continue is ignored in HTTP/1.0 (RFC 9110 §10.1.1).
    return request, bool(expect) and _expects_continue(expect) and version == HTTP11


def _version(text: str) -> Version | None:
    if text == "1.1":
        return HTTP11
    if text == "1.0":
        return HTTP10
    return None


def too_large() -> str:
    return (
        f"the request line or a header is longer than {MAX_LINE} bytes, "
        f"or there are more than {MAX_FIELDS} headers"
    )


def _split_target(target: str, method: str) -> tuple[str, str]:
    """The path and query of a request target: origin-form as sent, absolute-form
    read by yarl. RequestTargetMalformed for CONNECT, for what names no path, and for
    a fragment (``#``), which no request target carries (RFC 9112 §3.2) and which
    servers cut in different places: refused, never repaired."""
    if method == "CONNECT":
        raise RequestTargetMalformed("CONNECT is not proxied: a request must name a path")
    if "#" in target:
        raise RequestTargetMalformed("a request target carries no fragment (#)")
    if target.startswith("/"):
        path, _, query = target.partition("?")
        return path, query
    try:
        url = URL(target, encoded=True)
        url.host  # noqa: B018 - a host that is not a valid name raises here
    except ValueError:  # UnicodeError included: yarl could not read the host
        raise RequestTargetMalformed("the request target's host is not a valid name") from None
    return url.raw_path, url.raw_query_string


def _expects_continue(fields: list[bytes]) -> bool:
    """Whether the request's ``Expect`` fields ask for 100-continue (False when they
    ask for nothing); ExpectationFailed when they ask for anything else (the value
    is never quoted back)."""
    asked = {member.strip().lower() for field in fields for member in field.split(b",")} - {b""}
    if asked <= {b"100-continue"}:
        return bool(asked)
    raise ExpectationFailed(
        "the only expectation this proxy meets is 100-continue; send the request without the others"
    )
