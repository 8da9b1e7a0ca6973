"""A request as the data plane (:mod:`fenceproxy.http.server`) hands it over: its
head, read once, and its body as it arrives. No framework object: the values a
route, the fence and the upstream need, and nothing built that none of them reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from multidict import CIMultiDictProxy

from .body import Body, read_fields

if TYPE_CHECKING:
    from .server import Connection

__all__ = ["HTTP10", "HTTP11", "NONE_NAMED", "Body", "Request", "Version", "connection_named"]


class Version(NamedTuple):
    major: int
    minor: int


HTTP10 = Version(1, 0)
HTTP11 = Version(1, 1)
NONE_NAMED: frozenset[bytes] = frozenset()


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
        conn: Connection,
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
        return "http"

    def send_continue(self) -> None:
        """``100 Continue``, once, to a client waiting for it before it sends its body;
        nothing when it asked for none, or has begun sending its body anyway."""
        self._conn.send_continue(self)
