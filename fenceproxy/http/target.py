"""The request path as both the proxy and the upstream read it, decided once.

A fence is only as good as the agreement between the proxy and the upstream about
which path a write goes to. Upstreams resolve dot segments, decode percent-encoding
and merge slashes before they route (nginx does all three), so a proxy that matched
the raw path could fence ``/orders/fresh/../victim/pay`` as job ``fresh`` while the
upstream applies it to ``victim``. :func:`canonical_path` turns the raw path into
one form that is a fixed point of those normalisations; the proxy matches routes,
takes the job and fingerprints keys on that form, and forwards it, so there is
nothing left for the upstream to read differently. Requests whose reading depends on
the upstream are refused (:class:`~fenceproxy.errors.RequestTargetMalformed`, 400)
rather than guessed at.

The rules, with nginx as the reference (``tests/test_target.py`` checks them against
a real nginx when one is installed):

* percent-encoded unreserved characters are decoded (``%2e`` is ``.``, ``%41`` is
  ``A``) and other escapes get upper-case hex (RFC 3986 section 6.2.2);
* characters a path may not hold raw (space is refused by the HTTP parser already;
  ``"``, ``<``, ``{``, non-ASCII bytes ...) are percent-encoded;
* empty segments are merged (``//`` is ``/``), then ``.`` and ``..`` segments are
  resolved (RFC 3986 section 5.2.4), in that order, as nginx does;
* refused: a path that climbs above the root (``/..``), a malformed escape
  (``%zz``), an encoded NUL; an encoded slash ``%2F`` or backslash ``%5C``, or a raw
  backslash, anywhere (nginx decodes ``%2F`` into a separator, other servers keep it
  as data); a double-encoded dot, slash or backslash (``%252e``: an upstream that
  decodes twice would resolve it); a ``;`` (servlet containers strip ``;``
  parameters before routing, so ``/..;/`` climbs there and is a name elsewhere:
  send ``%3B`` for a literal semicolon).

The query string is not touched.

How much of that a route takes is its ``paths`` setting (:class:`PathMode`), and
:func:`read_path` applies it, after finding the route on the canonical form:

* ``refuse`` (the default): a path that differs from its canonical form in anything
  but the spelling of escapes (``%7e`` for ``~``, ``%3b`` for ``%3B``, ``"`` for
  ``%22``) is refused, 400 :class:`~fenceproxy.errors.RequestTargetNotCanonical`,
  whose ``canonical`` member is the form the proxy would take. Nothing is rewritten
  that an upstream could read as another resource; the canonical spelling is
  forwarded.
* ``normalize``: the canonical form is routed and forwarded, as nginx would.
* ``exact``: the path is forwarded byte for byte, and its route, ``{job}`` and key
  fingerprint come from those bytes, for upstreams that take the path as an opaque
  key (S3, GCS, Swift, WebDAV). Only what is never a path is refused
  (:func:`check_exact`). The route is found on the canonical form first, then the
  raw path must match that same route, so a path can never be checked under one
  route and forwarded as a target another route owns (``/public/../private``:
  canonical ``/private``, raw ``/public``: refused). A path that has no canonical
  form (``;``, ``%2F``, a backslash, a climb above the root) is routed on its raw
  bytes, and taken only by an ``exact`` route. An ``exact`` route in front of an
  upstream that resolves dot segments or merges slashes reopens the hole this module
  closes: the upstream applies the write to a path the proxy did not fence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal
from urllib.parse import unquote

from ..errors import RequestTargetMalformed

__all__ = [
    "PATH_SAFE",
    "PathMode",
    "canonical_path",
    "check_exact",
    "decode_exact",
    "decode_path",
    "escaped_path",
]

PathMode = Literal["refuse", "normalize", "exact"]
"""A route's ``paths``: what it does with a path that is not canonical."""

PATH_SAFE = frozenset(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~!$&'()*+,=:@/"
)
"""What a canonical path holds unescaped: RFC 3986 ``pchar`` and ``/``, less ``;``."""

_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_HEX = frozenset("0123456789abcdefABCDEF")
# Already canonical: only safe characters, no escapes, no empty or dot segments.
_PLAIN = re.compile(r"/[A-Za-z0-9\-._~!$&'()*+,=:@/]*", re.ASCII)
# Double-encoded ".", "/" and "\": an upstream that decodes twice would act on them.
_DOUBLE = re.compile(r"%25(?:2e|2f|5c)", re.IGNORECASE | re.ASCII)
# What each escape is refused for, by the byte it encodes.
_REFUSED_BYTES = {
    0x00: "an encoded NUL (%00)",
    0x2F: "an encoded slash (%2F): upstreams disagree on whether it separates segments",
    0x5C: "an encoded backslash (%5C): some upstreams read it as a separator",
}


@dataclass(frozen=True, slots=True)
class RequestPath:
    """A request's raw path read once, in every form routing weighs: its canonical
    form, and when that differs from what was sent, the sent escapes spelled
    canonically and the decoded form an ``exact`` route matches. A form that does not
    exist is None, with the refusal that says why beside it."""

    raw: str
    canonical: str | None
    """The canonical form (:func:`canonical_path`); None when the path has none."""
    not_canonical: RequestTargetMalformed | None = None
    """Why there is no canonical form."""
    escaped: str | None = None
    """``raw`` with its escapes spelled canonically (:func:`escaped_path`), when it
    has a canonical form other than itself."""
    exact: str | None = None
    """``raw`` decoded for an ``exact`` route (:func:`decode_exact`), when it is not
    canonical and may be taken as sent."""
    not_exact: RequestTargetMalformed | None = None
    """Why it may not be taken as sent (:func:`check_exact`)."""


def read_path(raw: str) -> RequestPath:
    """Every form of ``raw`` that routing needs, in one pass: for the common,
    canonical path, only that."""
    try:
        canonical = canonical_path(raw)
    except RequestTargetMalformed as exc:
        return _as_sent(RequestPath(raw, None, exc))
    if canonical == raw:
        return RequestPath(raw, raw)
    return _as_sent(RequestPath(raw, canonical, escaped=escaped_path(raw)))


def _as_sent(path: RequestPath) -> RequestPath:
    try:
        check_exact(path.raw)
    except RequestTargetMalformed as exc:
        return replace(path, not_exact=exc)
    return replace(path, exact=decode_exact(path.raw))


def canonical_path(raw: str) -> str:
    """The canonical, percent-encoded form of a request's raw path (no query).

    Raises RequestTargetMalformed for a path the proxy and an upstream could read
    differently, or one that is not a path at all; see the module docstring.
    """
    if _PLAIN.fullmatch(raw) and "/." not in raw and "//" not in raw:
        return raw  # the common case: nothing to decode, merge or resolve
    if not raw.startswith("/"):
        raise RequestTargetMalformed("the request target must be a path starting with /")
    if "\\" in raw:
        raise RequestTargetMalformed(
            "a backslash in the path is refused: some upstreams read it as a separator"
        )
    if ";" in raw:
        raise RequestTargetMalformed(
            "a ';' in the path is refused: servlet containers strip ';' parameters before "
            "routing and other servers do not; send %3B for a literal semicolon"
        )
    if _DOUBLE.search(raw):
        raise RequestTargetMalformed(
            "a double-encoded dot, slash or backslash (%252e, %252f, %255c) is refused"
        )
    return _resolve(escaped_path(raw))


def escaped_path(raw: str) -> str:
    """``raw`` with its escapes spelled canonically and nothing resolved or merged:
    what a path in ``refuse`` mode must equal its canonical form in. Raises
    RequestTargetMalformed for a malformed escape or an encoded NUL, slash or
    backslash."""
    return _normalise_escapes(raw)


_EXACT_REFUSED = re.compile(r"[^\x21-\x7e]|%(?![0-9A-Fa-f]{2})|%00", re.ASCII)


def check_exact(raw: str) -> None:
    """Refuse what is never a path, whatever the upstream: a target not starting
    with ``/``, a control character, space, DEL or a byte beyond ASCII, a malformed
    escape, an encoded NUL. Raises RequestTargetMalformed saying which."""
    if not raw.startswith("/"):
        raise RequestTargetMalformed("the request target must be a path starting with /")
    bad = _EXACT_REFUSED.search(raw)
    if bad is None:
        return
    if bad.group() == "%00":
        raise RequestTargetMalformed("the path holds an encoded NUL (%00)")
    if bad.group() == "%":
        raise RequestTargetMalformed("the path has a malformed percent-escape")
    raise RequestTargetMalformed(
        "the path holds a control character, a space or a byte beyond ASCII, which a "
        "request target may not hold raw"
    )


def decode_exact(raw: str) -> str:
    """A path checked by :func:`check_exact`, decoded for routing, ``%2F`` included:
    an object store reads ``a%2Fb`` as the key ``a/b``, so the proxy fences it as
    the segments ``a`` and ``b`` (an upstream that keeps ``%2F`` as data is then
    fenced under more than it reads, never less)."""
    return unquote(raw, errors="surrogateescape") if "%" in raw else raw


def _normalise_escapes(raw: str) -> str:
    out: list[str] = []
    i, n = 0, len(raw)
    while i < n:
        c = raw[i]
        if c == "%":
            digits = raw[i + 1 : i + 3]
            if len(digits) != 2 or not _HEX.issuperset(digits):
                raise RequestTargetMalformed("the path has a malformed percent-escape")
            byte = int(digits, 16)
            if byte in _REFUSED_BYTES:
                raise RequestTargetMalformed(f"the path holds {_REFUSED_BYTES[byte]}")
            decoded = chr(byte)
            out.append(decoded if decoded in _UNRESERVED else "%" + digits.upper())
            i += 3
            continue
        if c in PATH_SAFE:
            out.append(c)
        else:
            out.append(_encode(c))
        i += 1
    return "".join(out)


def _resolve(path: str) -> str:
    """Merge empty segments, then remove dot segments; a trailing ``/``, ``/.`` or
    ``/..`` leaves the path ending in ``/``."""
    segments = path.split("/")[1:]
    last = len(segments) - 1
    out: list[str] = []
    for i, segment in enumerate(segments):
        if segment == "..":
            if not out:
                raise RequestTargetMalformed("the path climbs above the root with '..'")
            out.pop()
        elif segment not in ("", "."):
            out.append(segment)
            continue
        if i == last:
            out.append("")
    return "/" + "/".join(out)


def _encode(text: str) -> str:
    """Percent-encode every character of ``text`` outside :data:`PATH_SAFE`, as
    UTF-8 (surrogate-escaped bytes as themselves), with upper-case hex."""
    if all(c in PATH_SAFE for c in text):
        return text
    return "".join(
        c if c in PATH_SAFE else "".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogateescape"))
        for c in text
    )


def decode_path(path: str) -> str:
    """A canonical path, decoded (surrogate-escaped where the bytes are not UTF-8).
    It has as many segments as the encoded form: a canonical path holds no ``%2F``."""
    return unquote(path, errors="surrogateescape")
