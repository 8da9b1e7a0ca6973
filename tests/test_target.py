"""The canonical request path: the documented rules one by one, then held against a
model of nginx's resolution over random paths, and the model against a real nginx."""

from __future__ import annotations

from urllib.parse import unquote_to_bytes

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from fenceproxy.errors import RequestTargetMalformed
from fenceproxy.http.target import canonical_path

from .nginx import Nginx, resolve_like_nginx

CANONICAL = {
    "/billing/charges": "/billing/charges",
    "/": "/",
    "/orders/fresh/../victim/pay": "/orders/victim/pay",
    "/orders/fresh/%2e%2e/victim/pay": "/orders/victim/pay",
    "/orders/fresh/%2E./victim/pay": "/orders/victim/pay",
    "/orders/fresh/.%2E/victim/pay": "/orders/victim/pay",
    "/health/../billing/charge": "/billing/charge",
    "/a/./b/.": "/a/b/",
    "/a/b/..": "/a/",
    "/a/b/%2e": "/a/b/",
    "//billing///charges//": "/billing/charges/",
    "/a//../b": "/b",  # slashes merged first, as nginx does: the '..' removes 'a'
    "/%76ictim/%7e%2D%5f": "/victim/~-_",  # unreserved characters decoded
    "/%41": "/A",  # the module's own example
    "/caf%c3%a9/%3b/%3f": "/caf%C3%A9/%3B/%3F",  # other escapes: upper-case hex
    "/a%20b/x%252Ay": "/a%20b/x%252Ay",  # double encoding of anything else is data
    '/a"b/{c}/|': "/a%22b/%7Bc%7D/%7C",  # characters a path may not hold raw
    "/caf\u00e9": "/caf%C3%A9",
    "/x\udcff": "/x%FF",  # a byte that was not UTF-8
    "/a/.../..b/b..": "/a/.../..b/b..",  # not dot segments
    "/.well-known/x": "/.well-known/x",
}

REFUSED = {
    "/..": "climbs above the root",
    "/a/../..": "climbs above the root",
    "/%2e%2e/a": "climbs above the root",
    "/orders/a%2Fb/pay": "encoded slash",
    "/orders/a%2fb": "encoded slash",
    "/a/..%2F..%2Fb": "encoded slash",
    "/a/%5C../b": "encoded backslash",
    "/a\\..\\b": "backslash",
    "/public/..;/billing/x": "';'",
    "/billing;v=1/x": "';'",
    "/a/%252e%252e/b": "double-encoded",
    "/a/%252F": "double-encoded",
    "/a/%255c": "double-encoded",
    "/a/%00": "NUL",
    "/a/%zz": "malformed percent-escape",
    "/a/%4": "malformed percent-escape",
    "/a/%": "malformed percent-escape",
    "/a/%%41": "malformed percent-escape",  # not %41 after a stray %
    "*": "must be a path",
    "billing/x": "must be a path",
}


@pytest.mark.parametrize(("raw", "canonical"), CANONICAL.items(), ids=list(CANONICAL))
def test_canonical_form(raw: str, canonical: str) -> None:
    assert canonical_path(raw) == canonical
    assert canonical_path(canonical) == canonical  # a fixed point


@pytest.mark.parametrize(("raw", "reason"), REFUSED.items(), ids=list(REFUSED))
def test_refused_paths_say_why(raw: str, reason: str) -> None:
    with pytest.raises(RequestTargetMalformed) as refused:
        canonical_path(raw)
    assert reason in refused.value.detail
    assert refused.value.status == 400


SEGMENTS = [
    "orders", "victim", "pay", "public", "a", ".", "..", "%2e", "%2E", "%2e%2e", ".%2E",
    "%2E.", "", "...", "%2F", "%2f..", "..%2F", "%5C", "\\", "..\\", ";", "..;", "b;x",
    "%3B", "%76ictim", "%252e%252e", "%252F", "%25", "%2541", "%00", "%zz", "%", "%4",
    "caf%C3%A9", "%c3", "%7e", "~", "a%2Fb", "victimXYZ", "%41%42", "{x}", "\"",
]  # fmt: skip
PATHS = st.lists(st.sampled_from(SEGMENTS), max_size=8).map(lambda s: "/" + "/".join(s))


@given(PATHS)
@settings(max_examples=1000, deadline=None)
@example("/orders/fresh/../victim/pay")
@example("/a/%2e%2e/%2e%2e/b")
def test_the_proxy_resolves_a_path_where_nginx_does(raw: str) -> None:
    """Whatever the proxy accepts, nginx accepts and routes to the same place, and the
    form the proxy forwards leaves nginx nothing to resolve: a write fenced for one
    path is applied at that path. The proxy may refuse more than nginx does."""
    expected = resolve_like_nginx(raw.encode("latin-1"))
    try:
        canonical = canonical_path(raw)
    except RequestTargetMalformed:
        event("refused")
        return
    event("accepted")
    assert expected is not None, "nginx refuses this path, the proxy accepted it"
    assert unquote_to_bytes(canonical) == expected
    assert resolve_like_nginx(canonical.encode("ascii")) == expected
    assert canonical_path(canonical) == canonical


@given(PATHS)
@settings(max_examples=300, deadline=None)
def test_the_model_of_nginx_is_nginx(nginx: Nginx, raw: str) -> None:
    assert nginx.uri(raw.encode("latin-1")) == resolve_like_nginx(raw.encode("latin-1"))


@pytest.mark.parametrize("raw", CANONICAL, ids=list(CANONICAL))
def test_nginx_routes_each_canonical_form_to_itself(nginx: Nginx, raw: str) -> None:
    canonical = canonical_path(raw)
    assert nginx.uri(canonical.encode("ascii")) == unquote_to_bytes(canonical)
    assert nginx.uri(raw.encode("utf-8", "surrogateescape")) == unquote_to_bytes(canonical)
