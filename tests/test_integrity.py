"""The write the proxy fences is exactly the write the upstream receives: one
path, read one way, one value per fencing field, every write method fenced, nothing
added or dropped. Raw bytes in over a socket, raw bytes recorded at the upstream.

Paths are checked in each route ``paths`` mode: ``normalize`` forwards the canonical
form, ``refuse`` refuses what is not canonical, ``exact`` forwards the bytes sent."""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import unquote_to_bytes

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fenceproxy.errors import PROBLEM_BASE
from fenceproxy.testing import RawUpstream

from .conftest import ProxyFactory, raw_request
from .nginx import Nginx, resolve_like_nginx
from .test_target import SEGMENTS

pytestmark = pytest.mark.both_stores


@pytest.fixture
async def raw_upstream() -> AsyncIterator[RawUpstream]:
    async with RawUpstream.serve() as upstream:
        yield upstream


def request(
    method: str,
    target: str | bytes,
    fields: list[tuple[str, str]] = (),  # type: ignore[assignment]
    body: bytes = b"{}",
) -> bytes:
    raw_target = target if isinstance(target, bytes) else target.encode("latin-1")
    lines = [
        method.encode() + b" " + raw_target + b" HTTP/1.1",
        b"Host: proxy.test",
        *(f"{name}: {value}".encode("latin-1") for name, value in fields),
        b"Content-Length: %d" % len(body),
        b"Connection: close",
    ]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def fence(job: str | None, token: int | str, key: str | None = None) -> list[tuple[str, str]]:
    fields = [("Fencing-Token", str(token))]
    if job is not None:
        fields.append(("Fencing-Job", job))
    if key is not None:
        fields.append(("Idempotency-Key", key))
    return fields


class Answer:
    def __init__(self, raw: bytes) -> None:
        head, _, self.body = raw.partition(b"\r\n\r\n")
        self.status = int(head.split(b" ", 2)[1]) if head else 0
        self.head = head.decode("latin-1").lower()

    @property
    def slug(self) -> str:
        problem = json.loads(self.body)
        assert self.status == problem["status"]
        return str(problem["type"]).removeprefix(PROBLEM_BASE)


async def send(port: int, data: bytes) -> Answer:
    return Answer(await raw_request(port, data))


async def refused(
    port: int, raw_upstream: RawUpstream, data: bytes, status: int, slug: str
) -> None:
    """``data`` is answered ``status`` with the problem ``slug``, and nothing reaches
    the upstream."""
    answer = await send(port, data)
    assert (answer.status, answer.slug) == (status, slug)
    assert raw_upstream.received == []


async def serving(start_proxy: ProxyFactory, routes: list[dict[str, Any]]) -> int:
    """A proxy with ``routes``; the port to send it raw bytes on."""
    proxy = await start_proxy(routes)
    assert proxy.port is not None
    return proxy.port


ROUTES = [
    {"name": "orders", "path": "/orders/{job}/", "upstream": "UP"},
    {"name": "billing", "path": "/billing", "upstream": "UP"},
    {"name": "health", "path": "/health", "upstream": "UP", "fence": False},
]


async def proxy_in_front_of(start_proxy: ProxyFactory, url: str, paths: str = "normalize") -> int:
    """A proxy with ROUTES to ``url``, each with ``paths``, the victim job at
    generation 10; its port."""
    port = await serving(start_proxy, [{**r, "upstream": url, "paths": paths} for r in ROUTES])
    victim = await send(port, request("POST", "/orders/victim/pay", fence(None, 10)))
    assert victim.status == 200
    return port


@pytest.fixture
async def port(start_proxy: ProxyFactory, raw_upstream: RawUpstream) -> int:
    """ROUTES with ``paths: normalize``."""
    port = await proxy_in_front_of(start_proxy, raw_upstream.url)
    raw_upstream.received.clear()
    return port


@pytest.fixture(params=["refuse", "normalize", "exact"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def mode_port(start_proxy: ProxyFactory, raw_upstream: RawUpstream, mode: str) -> int:
    """ROUTES with ``paths: <mode>``."""
    port = await proxy_in_front_of(start_proxy, raw_upstream.url, mode)
    raw_upstream.received.clear()
    return port


# -- one canonical path ---------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "/orders/fresh/../victim/pay",
        "/orders/fresh/%2e%2e/victim/pay",
        "/orders/fresh/%2E%2E/victim/pay",
        "/orders/fresh/.%2e/victim/pay",
        "/orders//fresh/./../victim/pay",
        "/orders/%76ictim/pay",
        "/health/../orders/victim/pay",
    ],
)
async def test_a_dot_segment_cannot_move_a_stale_write_to_another_job(
    mode_port: int, raw_upstream: RawUpstream, mode: str, target: str
) -> None:
    answer = await send(mode_port, request("POST", target, fence(None, 3)))
    if mode == "normalize" or "%76" in target:  # fenced where it resolves: the victim's
        assert (answer.status, answer.slug) == (409, "stale-generation")
        assert b'"job": "victim"' in answer.body
        assert raw_upstream.received == []
    elif mode == "refuse" or target.startswith("/health/") or "//" in target:
        # Refused, saying which form would be taken; in exact mode because the raw
        # path is not under the route its canonical form is.
        assert (answer.status, answer.slug) == (400, "request-target-not-canonical")
        assert json.loads(answer.body)["canonical"] == "/orders/victim/pay"
        assert raw_upstream.received == []
    else:  # exact: the key "fresh/../victim/pay", of job fresh, byte for byte
        assert answer.status == 200
        [received] = raw_upstream.received
        assert received.target == target


async def test_an_absolute_form_target_meets_the_path_rules_as_sent(
    mode_port: int, raw_upstream: RawUpstream, mode: str
) -> None:
    """``POST http://host/a/../b`` is read as ``POST /a/../b`` is: its path is not
    resolved nor its escapes respelled before the route's ``paths`` sees it, so
    ``refuse`` refuses it, ``normalize`` forwards the path it resolves to, and
    ``exact`` forwards the key byte for byte; the query goes as sent."""
    target = "/orders/fresh/../victim/pay/%7e"
    answer = await send(
        mode_port, request("POST", "http://proxy.test" + target + "?q=%7e", fence(None, 10))
    )
    forwarded = [r.target for r in raw_upstream.received]
    if mode == "refuse":
        assert (answer.status, answer.slug) == (400, "request-target-not-canonical")
        assert json.loads(answer.body)["canonical"] == "/orders/victim/pay/~"
        assert forwarded == []
    else:
        assert answer.status == 200
        sent = "/orders/victim/pay/~" if mode == "normalize" else target
        assert forwarded == [sent + "?q=%7e"]


async def test_the_resolved_path_is_what_the_upstream_receives(
    port: int, raw_upstream: RawUpstream
) -> None:
    answer = await send(
        port, request("POST", "/orders/fresh/%2e%2e/victim//pay/.?x=%2e%2e", fence(None, 11))
    )
    assert answer.status == 200
    [received] = raw_upstream.received
    assert received.target == "/orders/victim/pay/?x=%2e%2e"  # the query is not touched


async def test_a_dot_segment_cannot_leave_an_unfenced_route(
    port: int, raw_upstream: RawUpstream
) -> None:
    answer = await send(port, request("POST", "/health/../billing/charge"))
    assert (answer.status, answer.slug) == (428, "fencing-header-missing")
    assert raw_upstream.received == []


@pytest.mark.parametrize(
    "target",
    [
        "/..",
        "/orders/../../x",
        "/orders/a%2Fb/pay",
        "/orders/a%2fb/pay",
        "/health/..%2F..%2Fbilling",
        "/health/%5c../billing",
        "/health/..;/billing/x",
        "/orders/victim;x/pay",
        "/orders/%252e%252e/victim/pay",
        "/billing/%00",
        "/billing/%zz",
    ],
)
@pytest.mark.parametrize("paths", ["refuse", "normalize"])
async def test_a_path_an_upstream_could_read_otherwise_is_400(
    start_proxy: ProxyFactory, raw_upstream: RawUpstream, target: str, paths: str
) -> None:
    port = await proxy_in_front_of(start_proxy, raw_upstream.url, paths)
    raw_upstream.received.clear()
    for method, fields in (("POST", fence("victim", 11)), ("GET", [])):
        answer = await send(port, request(method, target, fields))
        assert (answer.status, answer.slug) == (400, "request-target-malformed")
    assert raw_upstream.received == []


async def test_routes_match_at_segment_boundaries(port: int, raw_upstream: RawUpstream) -> None:
    assert (await send(port, request("GET", "/billingXYZ"))).slug == "no-route"
    assert (await send(port, request("GET", "/healthz"))).slug == "no-route"
    assert (await send(port, request("GET", "/orders"))).slug == "no-route"
    assert raw_upstream.received == []
    assert (await send(port, request("POST", "/billing", fence("j", 1)))).status == 200
    assert (await send(port, request("POST", "/billing/x", fence("j", 1)))).status == 200
    assert (await send(port, request("GET", "/health"))).status == 200
    assert (await send(port, request("POST", "/orders/j", fence(None, 1)))).slug == "no-route"
    assert (await send(port, request("POST", "/orders/j/", fence(None, 1)))).status == 200
    assert [r.target for r in raw_upstream.received] == [
        "/billing", "/billing/x", "/health", "/orders/j/",
    ]  # fmt: skip


# -- exactly one of each fencing field --------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        [("Fencing-Job", "j"), ("Fencing-Token", "999"), ("Fencing-Token", "4")],
        [("Fencing-Job", "j"), ("Fencing-Token", "4, 999")],
        [("Fencing-Job", "j"), ("Fencing-Job", "k"), ("Fencing-Token", "4")],
        [("Fencing-Job", "j,k"), ("Fencing-Token", "4")],
        [
            ("Fencing-Job", "j"),
            ("Fencing-Token", "4"),
            ("Idempotency-Key", "a"),
            ("idempotency-key", "b"),
        ],
        [("Fencing-Job", "j"), ("Fencing-Token", "4"), ("Idempotency-Key", "a,b")],
        [("Fencing-Job", "j"), ("FENCING-TOKEN", "4"), ("fencing-token", "4")],
    ],
    ids=[
        "token-twice",
        "token-list",
        "job-twice",
        "job-list",
        "key-twice",
        "key-list",
        "same-value-twice",
    ],
)
async def test_a_fencing_field_sent_twice_or_as_a_list_is_400(
    port: int, raw_upstream: RawUpstream, fields: list[tuple[str, str]]
) -> None:
    await refused(
        port, raw_upstream, request("POST", "/billing/x", fields), 400, "fencing-header-malformed"
    )


async def test_a_path_job_and_a_job_header_must_agree(port: int, raw_upstream: RawUpstream) -> None:
    answer = await send(port, request("POST", "/orders/fresh/pay", fence("victim", 11)))
    assert (answer.status, answer.slug) == (400, "fencing-header-malformed")
    assert raw_upstream.received == []
    assert (await send(port, request("POST", "/orders/fresh/pay", fence("fresh", 1)))).status == 200


# -- every write is seen as a write -------------------------------------------------------


@pytest.mark.parametrize(
    "method",
    ["POST", "PUT", "PATCH", "DELETE", "MKCOL", "PROPPATCH", "MOVE", "COPY", "LOCK", "UNLOCK",
     "PURGE", "MERGE", "QUERY", "TRACE", "LINK", "UNLINK", "MKCALENDAR", "ACL", "BIND"],
)  # fmt: skip
async def test_every_method_but_the_safe_ones_is_fenced_by_default(
    port: int, raw_upstream: RawUpstream, method: str
) -> None:
    answer = await send(port, request(method, "/billing/x"))
    assert (answer.status, answer.slug) == (428, "fencing-header-missing")
    stale = await send(port, request(method, "/orders/victim/x", fence(None, 9)))
    assert (stale.status, stale.slug) == (409, "stale-generation")
    assert raw_upstream.received == []


PROPFIND = b'<?xml version="1.0"?><propfind xmlns="DAV:"><allprop/></propfind>'


async def test_the_safe_methods_pass_unfenced_with_their_bodies(
    port: int, raw_upstream: RawUpstream
) -> None:
    """A WebDAV or CalDAV client lists (PROPFIND, REPORT, SEARCH: reads with a body)
    with no token; a read that names a write in a method override is fenced."""
    safe = ["GET", "HEAD", "OPTIONS", "PROPFIND", "REPORT", "SEARCH"]
    for method in safe:
        body = PROPFIND if method in ("PROPFIND", "REPORT", "SEARCH") else b""
        assert (await send(port, request(method, "/billing/x", body=body))).status == 200
    assert [r.method for r in raw_upstream.received] == safe
    assert [r.body for r in raw_upstream.received[3:]] == [PROPFIND] * 3
    override = [("X-HTTP-Method-Override", "DELETE")]
    answer = await send(port, request("PROPFIND", "/billing/x", override, body=PROPFIND))
    assert (answer.status, answer.slug) == (428, "fencing-header-missing")
    assert len(raw_upstream.received) == len(safe)


async def test_a_route_can_name_its_own_methods(
    start_proxy: ProxyFactory, raw_upstream: RawUpstream
) -> None:
    fenced = {"methods": ["POST", "PROPFIND"]}
    route = {"name": "r", "path": "/r", "upstream": raw_upstream.url, "fence": fenced}
    port = await serving(start_proxy, [route])
    assert (await send(port, request("PUT", "/r/x"))).status == 200
    assert (await send(port, request("POST", "/r/x"))).status == 428
    assert (await send(port, request("PROPFIND", "/r/x", body=PROPFIND))).status == 428


@pytest.mark.parametrize("name", ["X-HTTP-Method-Override", "X-HTTP-Method", "x-method-override"])
async def test_a_method_override_is_fenced_as_the_method_it_names(
    port: int, raw_upstream: RawUpstream, name: str
) -> None:
    answer = await send(
        port, request("GET", "/orders/victim/x", [(name, "DELETE"), *fence(None, 3)])
    )
    assert (answer.status, answer.slug) == (409, "stale-generation")
    answer = await send(port, request("GET", "/billing/x", [(name, "delete")]))
    assert (answer.status, answer.slug) == (428, "fencing-header-missing")
    assert raw_upstream.received == []
    fresh = await send(
        port, request("GET", "/orders/victim/x", [(name, "DELETE"), *fence(None, 10)])
    )
    assert fresh.status == 200
    [received] = raw_upstream.received
    assert (received.method, received.values(name)) == ("GET", ["DELETE"])


async def test_a_method_override_naming_a_safe_method_does_not_unfence_a_write(
    port: int, raw_upstream: RawUpstream
) -> None:
    answer = await send(
        port,
        request("POST", "/orders/victim/x", [("X-HTTP-Method-Override", "GET"), *fence(None, 3)]),
    )
    assert (answer.status, answer.slug) == (409, "stale-generation")
    assert (
        await send(port, request("GET", "/billing/x", [("X-HTTP-Method-Override", "GET")]))
    ).status == 200


@pytest.mark.parametrize(
    "fields",
    [
        [("X-HTTP-Method-Override", "DELETE"), ("X-HTTP-Method-Override", "GET")],
        [("X-HTTP-Method-Override", "GET"), ("X-HTTP-Method", "DELETE")],
        [("X-HTTP-Method-Override", "GET, DELETE")],
        [("X-Method-Override", "")],
        [("X-HTTP-Method", "DE LETE")],
    ],
    ids=["twice", "two-names", "list", "empty", "not-a-method"],
)
async def test_an_ambiguous_method_override_is_400(
    port: int, raw_upstream: RawUpstream, fields: list[tuple[str, str]]
) -> None:
    await refused(
        port, raw_upstream, request("GET", "/billing/x", fields), 400, "method-override-malformed"
    )


# -- the upstream sees what the client sent -------------------------------------------------


@pytest.mark.parametrize(
    ("target", "fields"),
    [("/billing/x", fence("j", 1, key="k1")), ("/health/x", [])],
    ids=["fenced", "pass-through"],
)
async def test_the_upstream_receives_the_clients_fields_and_only_the_documented_changes(
    port: int, raw_upstream: RawUpstream, target: str, fields: list[tuple[str, str]]
) -> None:
    sent = [
        *fields,
        ("X-App", "kept"),
        ("x-app", "twice, in order"),
        ("connection", "close, X-Hop, x-other-hop"),
        ("x-hop", "dropped"),
        ("X-Other-Hop", "dropped"),
        ("keep-alive", "timeout=5"),
        ("proxy-authorization", "Basic eA=="),
        ("te", "trailers"),
        ("x-forwarded-for", "6.6.6.6"),
        ("forwarded", "for=6.6.6.6"),
        ("x-real-ip", "6.6.6.6"),
    ]
    answer = await send(port, request("POST", target, sent, body=b"raw bytes, no type"))
    assert answer.status == 200
    [received] = raw_upstream.received
    upstream_host = raw_upstream.url.removeprefix("http://")
    expected = [
        ("Host", upstream_host),
        *[(n.lower(), v) for n, v in fields],
        ("x-app", "kept"),
        ("x-app", "twice, in order"),
        ("content-length", "18"),
        ("x-forwarded-for", "127.0.0.1"),
        ("x-forwarded-proto", "http"),
        ("x-forwarded-host", "proxy.test"),
        ("via", "1.1 fenceproxy"),
    ]
    got = [(n.lower(), v) for n, v in received.fields]
    assert sorted(got) == sorted((n.lower(), v) for n, v in expected)
    assert [v for n, v in got if n == "x-app"] == ["kept", "twice, in order"]
    assert received.body == b"raw bytes, no type"


async def test_fencing_fields_named_in_connection_still_reach_the_upstream(
    port: int, raw_upstream: RawUpstream
) -> None:
    fields = [
        *fence("j", 5, key="k"),
        ("Connection", "Fencing-Job, fencing-token, Idempotency-Key, X-Hop"),
        ("X-Hop", "dropped"),
    ]
    assert (await send(port, request("POST", "/billing/x", fields))).status == 200
    [received] = raw_upstream.received
    assert received.values("Fencing-Job") == ["j"]
    assert received.values("Fencing-Token") == ["5"]
    assert received.values("Idempotency-Key") == ["k"]
    assert received.values("X-Hop") == []


# -- what an idempotency key identifies ----------------------------------------------------


async def test_one_key_for_two_requests_split_differently_between_target_and_body_is_422(
    port: int, raw_upstream: RawUpstream
) -> None:
    first = await send(port, request("POST", "/billing/x?a=1", fence("j", 1, key="k"), body=b"b"))
    assert first.status == 200
    second = await send(port, request("POST", "/billing/x?a=1b", fence("j", 1, key="k"), body=b""))
    assert (second.status, second.slug) == (422, "idempotency-key-reused")
    assert len(raw_upstream.received) == 1


async def test_one_key_over_two_spellings_of_one_path_is_the_same_request(
    port: int, raw_upstream: RawUpstream
) -> None:
    assert (
        await send(port, request("POST", "/billing/a/../x", fence("j", 1, key="k")))
    ).status == 200
    replay = await send(port, request("POST", "/billing//x", fence("j", 1, key="k")))
    assert replay.status == 200
    assert "idempotent-replayed: true" in replay.head
    assert len(raw_upstream.received) == 1


# -- a property: no write reaches a job other than the one it was fenced for -------------

FRONT = st.sampled_from(["/orders", "/health", "/billing", "/orders/victim", "/orders/fresh", ""])
TAIL = st.lists(st.sampled_from(SEGMENTS), max_size=6).map("/".join)


@given(front=FRONT, tail=TAIL, job=st.sampled_from([None, "victim", "fresh"]))
@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@pytest.mark.timeout(300)
async def test_no_stale_write_reaches_the_victim_whatever_the_path(
    mode_port: int, raw_upstream: RawUpstream, mode: str, front: str, tail: str, job: str | None
) -> None:
    """Generation 3 writes, victim at 10: for any path built of segments, dots,
    escapes, slashes and semicolons, never a 5xx, and

    * normalize, refuse: whatever the upstream receives, resolved as nginx would, is
      where the proxy routed it, has nothing left to resolve, and is never under
      /orders/victim/; refuse forwards only a path nginx would not resolve;
    * exact: the upstream receives the bytes sent, and the key it reads (decoded)
      is never under /orders/victim/."""
    target = (front + "/" + tail).encode("latin-1")
    before = len(raw_upstream.received)
    answer = await send(mode_port, request("POST", target, fence(job, 3)))
    assert 200 <= answer.status < 500 or answer.status == 0, answer.body
    if len(raw_upstream.received) == before:
        event(f"refused {answer.status} {answer.slug if answer.body else ''}")
        if mode == "refuse" and answer.status == 400:
            assert answer.slug != "request-target-not-canonical" or (
                resolve_like_nginx(target) != unquote_to_bytes(target)
            ), "a path nginx reads as sent was refused as not canonical"
        return
    event("forwarded")
    [received] = raw_upstream.received[before:]
    if mode == "exact":
        assert received.target.encode("latin-1") == target
        assert not unquote_to_bytes(target).startswith(b"/orders/victim/")
        return
    applied = resolve_like_nginx(received.target.encode("latin-1"))
    assert applied == unquote_to_bytes(received.target), "the upstream would resolve it again"
    assert applied == resolve_like_nginx(target), "the upstream would read the raw path elsewhere"
    assert not applied.startswith(b"/orders/victim/")
    if mode == "refuse":
        assert applied == unquote_to_bytes(target), "a path the upstream resolves went through"


# -- against a real nginx --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "resolved"),
    [
        ("/orders/fresh/../victim/pay", b"/orders/victim/pay"),
        ("/orders/fresh/%2e%2e/victim/pay", b"/orders/victim/pay"),
        ("/health/./../billing//charge/", b"/billing/charge/"),
        ("/billing/caf%c3%a9/%7e", "/billing/café/~".encode()),
    ],
)
async def test_nginx_behind_the_proxy_applies_the_write_where_it_was_fenced(
    start_proxy: ProxyFactory, nginx: Nginx, target: str, resolved: bytes
) -> None:
    port = await proxy_in_front_of(start_proxy, nginx.url)
    answer = await send(port, request("POST", target, fence("victim", 10)))
    assert answer.status == 200
    assert answer.body == resolved
    # nginx, given the raw path itself, resolves it to the same place.
    assert nginx.uri(target.encode("latin-1")) == resolved


async def test_nginx_fenced_job_from_a_dotted_path_is_the_job_nginx_applies(
    start_proxy: ProxyFactory, nginx: Nginx
) -> None:
    routes = [{**r, "upstream": nginx.url, "paths": "normalize"} for r in ROUTES]
    port = await serving(start_proxy, routes)
    assert (await send(port, request("POST", "/orders/victim/pay", fence(None, 10)))).status == 200
    stale = await send(port, request("POST", "/orders/fresh/../victim/pay", fence(None, 3)))
    assert (stale.status, stale.slug) == (409, "stale-generation")


# -- what the attacker's review found ----------------------------------------------------


async def test_an_escaped_sub_delimiter_is_the_same_path_as_the_character(
    start_proxy: ProxyFactory, raw_upstream: RawUpstream
) -> None:
    """nginx reads /charges%3Arefund as /charges:refund: so must the routes and jobs."""
    routes: list[dict[str, Any]] = [
        {"name": "refund", "path": "/billing/charges:refund", "upstream": raw_upstream.url},
        {"name": "orders", "path": "/orders/{job}", "upstream": raw_upstream.url},
        {"name": "rest", "path": "/", "upstream": raw_upstream.url, "fence": False},
    ]
    port = await serving(start_proxy, routes)
    answer = await send(port, request("POST", "/billing/charges%3Arefund"))
    assert (answer.status, answer.slug) == (428, "fencing-header-missing")
    assert (await send(port, request("POST", "/orders/a:b/pay", fence(None, 10)))).status == 200
    stale = await send(port, request("POST", "/orders/a%3Ab/pay", fence(None, 3)))
    assert (stale.status, stale.slug) == (409, "stale-generation")
    assert [r.target for r in raw_upstream.received] == ["/orders/a:b/pay"]


async def test_a_route_for_a_case_insensitive_upstream_matches_any_case(
    start_proxy: ProxyFactory, raw_upstream: RawUpstream
) -> None:
    routes: list[dict[str, Any]] = [
        {"name": "b", "path": "/Billing", "upstream": raw_upstream.url, "match_case": False},
        {"name": "o", "path": "/orders/{job}", "upstream": raw_upstream.url, "match_case": False},
        {"name": "strict", "path": "/strict", "upstream": raw_upstream.url},
    ]
    port = await serving(start_proxy, routes)
    for target in ("/BILLING/x", "/billing", "/bIlLiNg/y"):
        answer = await send(port, request("POST", target))
        assert (answer.status, answer.slug) == (428, "fencing-header-missing"), target
    assert (await send(port, request("POST", "/ORDERS/Victim", fence(None, 10)))).status == 200
    stale = await send(port, request("POST", "/orders/Victim/x", fence(None, 3)))
    assert (stale.status, stale.slug) == (409, "stale-generation")  # the job keeps its case
    assert (await send(port, request("POST", "/STRICT/x"))).slug == "no-route"
    assert len(raw_upstream.received) == 1


@pytest.mark.parametrize(
    ("target", "fields"),
    [("/billing/x", fence("j", 1)), ("/health/x", [])],
    ids=["fenced", "pass-through"],
)
async def test_a_compressed_body_reaches_the_upstream_as_it_came(
    port: int, raw_upstream: RawUpstream, target: str, fields: list[tuple[str, str]]
) -> None:
    body = gzip.compress(b'{"note": "' + b"A" * 300 + b'"}')
    sent = [*fields, ("Content-Encoding", "gzip")]
    assert (await send(port, request("POST", target, sent, body=body))).status == 200
    not_gzip = await send(port, request("POST", target, sent, body=b"abc"))
    assert not_gzip.status == 200  # the upstream's to judge, never a 500 here
    assert [(r.body, r.values("Content-Encoding")) for r in raw_upstream.received] == [
        (body, ["gzip"]),
        (b"abc", ["gzip"]),
    ]


@pytest.mark.parametrize(
    ("fields", "slug"),
    [
        (
            [("Fencing-Job", "j"), ("Fencing-Token", "30"), ("Fencing_Token", "3")],
            "fencing-header-malformed",
        ),
        (
            [("Fencing-Job", "j"), ("fencing_job", "k"), ("Fencing-Token", "3")],
            "fencing-header-malformed",
        ),
        (
            [("X-HTTP-Method-Override", "PUT"), ("X_HTTP_METHOD_OVERRIDE", "DELETE")],
            "method-override-malformed",
        ),
    ],
    ids=["token", "job", "override"],
)
async def test_an_underscore_spelling_counts_as_the_field_it_spells(
    port: int, raw_upstream: RawUpstream, fields: list[tuple[str, str]], slug: str
) -> None:
    """CGI and WSGI servers read Fencing_Token as Fencing-Token."""
    await refused(port, raw_upstream, request("POST", "/billing/x", fields), 400, slug)


async def test_an_underscore_method_override_is_fenced(
    port: int, raw_upstream: RawUpstream
) -> None:
    answer = await send(port, request("GET", "/billing/x", [("X_HTTP_METHOD_OVERRIDE", "DELETE")]))
    assert (answer.status, answer.slug) == (428, "fencing-header-missing")
    assert raw_upstream.received == []


async def test_a_header_value_that_is_not_utf8_is_refused_not_altered(
    port: int, raw_upstream: RawUpstream
) -> None:
    raw = request("POST", "/billing/x", [*fence("j", 1), ("X-Name", "caf\xe9")])
    answer = await send(port, raw)
    assert (answer.status, answer.slug) == (400, "request-header-malformed")
    assert b"caf" not in answer.body  # the value is never echoed
    assert raw_upstream.received == []
    utf8 = request("POST", "/billing/x", fence("j", 1)).replace(
        b"Host: proxy.test", "Host: proxy.test\r\nX-Name: café".encode()
    )
    assert (await send(port, utf8)).status == 200
    assert raw_upstream.received[0].values("X-Name") == ["cafÃ©"]  # the same bytes, read as latin-1


# -- what each route's paths: setting does ------------------------------------------------


async def test_by_default_a_path_with_dot_or_empty_segments_is_refused_naming_its_canonical_form(
    start_proxy: ProxyFactory, raw_upstream: RawUpstream
) -> None:
    route = {"name": "files", "path": "/files", "upstream": raw_upstream.url}
    port = await serving(start_proxy, [route])
    for target, canonical in [
        ("/files/a//b", "/files/a/b"),
        ("/files/a/./b", "/files/a/b"),
        ("/files/x/../y", "/files/y"),
        ("/files/x/%2E%2e/%22y", "/files/%22y"),
    ]:
        answer = await send(port, request("PUT", target, fence("j", 1)))
        assert (answer.status, answer.slug) == (400, "request-target-not-canonical")
        assert "content-type: application/problem+json" in answer.head
        problem = json.loads(answer.body)
        assert (problem["canonical"], problem["route"]) == (canonical, "files")
        assert canonical in problem["detail"]
    assert raw_upstream.received == []
    # Escapes spelled otherwise are the same path to every upstream: taken.
    answer = await send(port, request("PUT", '/files/%7e/%3b/"', fence("j", 1)))
    assert answer.status == 200
    assert [r.target for r in raw_upstream.received] == ["/files/~/%3B/%22"]


EXACT = {"name": "bucket", "path": "/bucket/", "paths": "exact"}


@pytest.mark.parametrize(
    "target",
    ["/bucket/a//b", "/bucket/a/./b", "/bucket/x/../y", "/bucket//", "/bucket/a%2Fb;v=1\\c"],
)
async def test_an_exact_route_forwards_an_object_key_byte_for_byte(
    start_proxy: ProxyFactory, raw_upstream: RawUpstream, target: str
) -> None:
    port = await serving(start_proxy, [{**EXACT, "upstream": raw_upstream.url, "fence": False}])
    answer = await send(port, request("PUT", target + "?x=%2e%2e"))
    assert answer.status == 200
    assert [r.target for r in raw_upstream.received] == [target + "?x=%2e%2e"]


@pytest.mark.parametrize(
    ("target", "phrase"),
    [("/bucket/%zz", "malformed percent-escape"), ("/bucket/a%00", "encoded NUL")],
)
async def test_an_exact_route_still_refuses_what_is_never_a_path(
    start_proxy: ProxyFactory, raw_upstream: RawUpstream, target: str, phrase: str
) -> None:
    port = await serving(start_proxy, [{**EXACT, "upstream": raw_upstream.url, "fence": False}])
    answer = await send(port, request("PUT", target))
    assert (answer.status, answer.slug) == (400, "request-target-malformed")
    assert phrase in json.loads(answer.body)["detail"]
    assert raw_upstream.received == []


async def test_an_exact_route_fences_the_job_and_the_key_of_the_bytes_sent(
    start_proxy: ProxyFactory, raw_upstream: RawUpstream
) -> None:
    route = {"name": "b", "path": "/bucket/{job}", "upstream": raw_upstream.url, "paths": "exact"}
    port = await serving(start_proxy, [route])
    assert (await send(port, request("PUT", "/bucket/victim/k", fence(None, 10)))).status == 200
    # The victim's key, spelled with an escape or an encoded slash: the victim's job.
    for target in ["/bucket/%76ictim/k", "/bucket/victim%2Fk"]:
        stale = await send(port, request("PUT", target, fence(None, 3)))
        assert (stale.status, stale.slug) == (409, "stale-generation")
    # a//b and a/b are two objects: one key for both is two requests.
    first = await send(port, request("PUT", "/bucket/j/a//b", fence(None, 1, key="k")))
    assert first.status == 200
    second = await send(port, request("PUT", "/bucket/j/a/b", fence(None, 1, key="k")))
    assert (second.status, second.slug) == (422, "idempotency-key-reused")
    assert [r.target for r in raw_upstream.received] == ["/bucket/victim/k", "/bucket/j/a//b"]


@pytest.mark.parametrize(
    ("public", "private", "target", "outcome"),
    [
        # canonically the private route's, which refuses what is not canonical
        ("exact", "refuse", "/public/../private/x", "400 request-target-not-canonical"),
        # canonically the private route's, but the bytes are under /public
        ("exact", "exact", "/public/../private/x", "400 request-target-not-canonical"),
        # canonically the public route's, but the bytes are under /private
        ("exact", "exact", "/private/../public/x", "400 request-target-not-canonical"),
        ("normalize", "exact", "/private/../public/x", "200 /public/x"),
        ("exact", "normalize", "/public/../private/x", "428 fencing-header-missing"),
        # no canonical form: only an exact route takes it, by its bytes
        ("normalize", "exact", "/public/..;/private/x", "400 request-target-malformed"),
        ("exact", "normalize", "/private/..;/public/x", "400 request-target-malformed"),
        ("exact", "normalize", "/public/..;/private/x", "200 /public/..;/private/x"),
    ],
)
async def test_a_path_is_never_checked_under_one_route_and_forwarded_under_another(
    start_proxy: ProxyFactory,
    raw_upstream: RawUpstream,
    public: str,
    private: str,
    target: str,
    outcome: str,
) -> None:
    """One upstream serves both: what the private route fences must never reach it
    as a path the public route took."""
    url = raw_upstream.url
    routes: list[dict[str, Any]] = [
        {"name": "public", "path": "/public", "upstream": url, "paths": public, "fence": False},
        {"name": "private", "path": "/private", "upstream": url, "paths": private},
    ]
    port = await serving(start_proxy, routes)
    answer = await send(port, request("PUT", target))
    status, what = outcome.split(" ")
    assert answer.status == int(status)
    if answer.status == 200:  # a pass-through of the public route
        assert [r.target for r in raw_upstream.received] == [what]
    else:
        assert answer.slug == what
        assert raw_upstream.received == []


# -- which Host the upstream receives ---------------------------------------------------------

PRESERVE = {"name": "s3", "path": "/", "host": "preserve"}


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "pass-through"])
@pytest.mark.parametrize("host", ["preserve", "upstream", None])
async def test_host_preserve_forwards_the_clients_host(
    start_proxy: ProxyFactory, raw_upstream: RawUpstream, host: str | None, fenced: bool
) -> None:
    route: dict[str, object] = {"name": "s3", "path": "/", "upstream": raw_upstream.url}
    if host is not None:
        route["host"] = host
    if not fenced:
        route["fence"] = False
    port = await serving(start_proxy, [route])
    answer = await send(port, request("PUT", "/bucket/k", fence("j", 1)))
    assert answer.status == 200
    [received] = raw_upstream.received
    expected = "proxy.test" if host == "preserve" else raw_upstream.url.removeprefix("http://")
    assert received.values("Host") == [expected]
    assert received.values("X-Forwarded-Host") == ["proxy.test"]


async def test_host_preserve_without_a_host_sends_the_upstreams(
    start_proxy: ProxyFactory, raw_upstream: RawUpstream
) -> None:
    """HTTP/1.0 needs no Host: the upstream then gets its own authority."""
    port = await serving(start_proxy, [{**PRESERVE, "upstream": raw_upstream.url}])
    head = b"PUT /bucket/k HTTP/1.0\r\nFencing-Job: j\r\nFencing-Token: 1\r\nContent-Length: 0"
    answer = await send(port, head + b"\r\n\r\n")
    assert answer.status == 200
    [received] = raw_upstream.received
    assert received.values("Host") == [raw_upstream.url.removeprefix("http://")]


@pytest.mark.parametrize(
    "value", [b"bucket.s3.test\xff", b"a b", b"evil.test/x", b"[::1"], ids=repr
)
async def test_host_preserve_refuses_a_host_it_could_not_forward_unchanged(
    start_proxy: ProxyFactory, raw_upstream: RawUpstream, value: bytes
) -> None:
    port = await serving(start_proxy, [{**PRESERVE, "upstream": raw_upstream.url}])
    head = b"PUT /bucket/k HTTP/1.1\r\nHost: " + value
    head += b"\r\nFencing-Job: j\r\nFencing-Token: 1\r\nContent-Length: 0"
    head += b"\r\nConnection: close\r\n\r\n"
    answer = await send(port, head)
    assert answer.status == 400
    assert raw_upstream.received == []


async def test_host_preserve_refuses_before_admission_and_holds_nothing(
    start_proxy: ProxyFactory, raw_upstream: RawUpstream
) -> None:
    """A Host that cannot be forwarded, or an absolute-form target (whose authority
    would win over Host), is refused before the write is admitted: the job is not
    held and the key is free for the corrected request."""
    port = await serving(start_proxy, [{**PRESERVE, "upstream": raw_upstream.url}])
    fields = b"\r\nFencing-Job: j\r\nFencing-Token: 1\r\nIdempotency-Key: k\r\nContent-Length: 1"
    close = b"\r\nConnection: close\r\n\r\nx"
    for head in (
        b"PUT /bucket/k HTTP/1.1\r\nHost: bad/host",
        b"PUT http://evil.test/bucket/k HTTP/1.1\r\nHost: bucket.s3.test",
    ):
        assert (await send(port, head + fields + close)).status == 400
    good = b"PUT /bucket/k HTTP/1.1\r\nHost: bucket.s3.test"
    assert (await send(port, good + fields + close)).status == 200
    assert [r.values("Host") for r in raw_upstream.received] == [["bucket.s3.test"]]


async def test_host_preserve_makes_the_host_part_of_the_idempotency_fingerprint(
    start_proxy: ProxyFactory, raw_upstream: RawUpstream
) -> None:
    """On a virtual-hosted upstream the Host names the resource: one key sent to two
    buckets is two requests, and the second is refused, not answered as the first."""
    port = await serving(start_proxy, [{**PRESERVE, "upstream": raw_upstream.url}])
    fields = b"\r\nFencing-Job: j\r\nFencing-Token: 1\r\nIdempotency-Key: k\r\nContent-Length: 1"
    close = b"\r\nConnection: close\r\n\r\nx"
    first = b"PUT /obj HTTP/1.1\r\nHost: bucket-a.s3.test"
    assert (await send(port, first + fields + close)).status == 200
    again = await send(port, first + fields + close)
    assert (again.status, "idempotent-replayed: true" in again.head) == (200, True)
    other = await send(port, b"PUT /obj HTTP/1.1\r\nHost: bucket-b.s3.test" + fields + close)
    assert other.status == 422
    assert [r.values("Host") for r in raw_upstream.received] == [["bucket-a.s3.test"]]
