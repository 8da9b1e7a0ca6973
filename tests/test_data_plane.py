"""The data plane's HTTP/1.1 on raw sockets, against a real proxy and an upstream
that answers exactly the bytes a test scripts: pipelined requests answered in
order without the proxy reading far ahead or holding answers a client does not
read, relayed answers framed as their upstream framed them (HEAD, close-delimited,
to HTTP/1.0 clients), a Date added only where the upstream sent none, the fields
that must come once and Host refused when wrong, and keep-alive deadlines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from multidict import CIMultiDict
from yarl import URL

from fenceproxy.http.http1 import Origin
from fenceproxy.http.request import MAX_HEAD
from fenceproxy.http.server import MAX_AHEAD
from fenceproxy.testing import RawRequest, RawUpstream, RecordingUpstream, eventually, listening

from .conftest import ProxyFactory, raw_request

Client = TestClient[Any, Any]
FENCE = b"Fencing-Job: j\r\nFencing-Token: 1\r\n"


def write(path: bytes = b"/billing/x", body: bytes = b"{}", extra: bytes = b"") -> bytes:
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: a\r\n" + FENCE + extra
        + b"Content-Length: %d\r\n\r\n" % len(body) + body
    )  # fmt: skip


@pytest.fixture
async def raw_upstream() -> AsyncIterator[RawUpstream]:
    async with RawUpstream.serve() as upstream:
        yield upstream


@pytest.fixture
async def raw_proxy(start_proxy: ProxyFactory, raw_upstream: RawUpstream) -> Client:
    return await start_proxy(
        [
            {"name": "billing", "path": "/billing/", "upstream": raw_upstream.url},
            {"name": "open", "path": "/open/", "upstream": raw_upstream.url, "fence": False},
        ]
    )


def answers(raw: bytes) -> list[tuple[int, bytes]]:
    """Each answer on a connection in order: its status and its body (by length)."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = RawRequest(head, b"").values("Content-Length")
        size = int(length[0]) if length else 0
        out.append((status, rest[:size]))
        raw = rest[size:]
    return out


@asynccontextmanager
async def scripted(
    answer: bytes, close: bool = False, seen: list[bytes] | None = None
) -> AsyncIterator[str]:
    """An upstream that answers every request with ``answer`` (closing after it when
    ``close``), each request's head put in ``seen``."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if seen is not None:
                    seen.append(head)
                length = RawRequest(head[:-4], b"").values("Content-Length")
                await reader.readexactly(int(length[0]) if length else 0)
                writer.write(answer)
                await writer.drain()
                if close:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async with listening(serve) as url:
        yield url


# -- pipelining ------------------------------------------------------------------------


async def test_pipelined_requests_are_answered_in_order_each_forwarded_once(
    raw_proxy: Client, raw_upstream: RawUpstream
) -> None:
    paths = [b"/open/a", b"/billing/b", b"/open/c", b"/billing/d"]
    data = b"".join(write(p, b'{"n": %d}' % n) for n, p in enumerate(paths))
    data += b"GET /open/last HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    async with asyncio.timeout(10):
        raw = await raw_request(raw_proxy.port, data)
    assert [status for status, _ in answers(raw)] == [200] * 5
    assert [r.target for r in raw_upstream.received] == [
        *(p.decode() for p in paths),
        "/open/last",
    ]
    assert [r.body for r in raw_upstream.received[:4]] == [b'{"n": %d}' % n for n in range(4)]


async def test_a_client_that_pipelines_and_reads_nothing_has_no_answers_held_for_it(
    start_proxy: ProxyFactory,
) -> None:
    """A client sends requests a few at a time, each few once the upstream has the
    last, and reads none of the 16 KiB answers: once its socket is full the proxy
    answers no more, so it takes no more requests either, and holds neither the
    requests nor their answers in memory; after ``send_timeout`` its connection is
    cut."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 16384\r\n\r\n" + b"a" * 16384
    seen: list[bytes] = []
    async with scripted(answer, seen=seen) as url:
        route = {"name": "open", "path": "/open/", "upstream": url, "fence": False}
        proxy = await start_proxy([route], limits={"send_timeout": "1s"})
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        sent = 0
        async with asyncio.timeout(60):
            while sent < 5000:
                writer.write(b"GET /open/x HTTP/1.1\r\nHost: a\r\n\r\n" * 4)
                sent += 4
                try:
                    await eventually(lambda n=sent: len(seen) == n, within=0.5)
                except TimeoutError:
                    break  # the proxy took no more
            asked = len(seen)
            await asyncio.sleep(2)  # the send timeout runs out; nothing is read meanwhile
            assert len(seen) == asked
            rest = await reader.read()  # what the socket buffers held, then the cut
        writer.close()
    # The socket buffers took some answers; the proxy asked for no more than those.
    assert sent < 5000
    assert asked < 3000, asked
    assert len(rest) < 3000 * 16384


async def sent_while_held(
    proxy: Client, upstream: RecordingUpstream, sent: bytes
) -> tuple[Callable[[], None], asyncio.StreamReader, asyncio.StreamWriter]:
    """A client connection to ``proxy`` that has sent ``sent`` while ``upstream`` holds
    every request, once the first reached it; what releases them, and the connection."""
    release = upstream.hold()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(sent)
    await upstream.wait_for(1)
    return release, reader, writer


async def test_requests_pipelined_behind_a_slow_one_are_not_read_ahead(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """While the upstream holds the first request, the client pipelines 16 MiB more
    (2,000 requests of 8 KiB heads): the proxy reads one request ahead and stops, so
    the client's socket fills and its writes wait. Once the first is answered, those
    it takes are answered in order; should one read bring more than MAX_AHEAD, those
    are answered and the connection closed, the rest never read as requests."""
    route = {"name": "open", "path": "/open/", "upstream": upstream.url, "fence": False}
    proxy = await start_proxy([route])
    release, reader, writer = await sent_while_held(
        proxy, upstream, b"GET /open/first HTTP/1.1\r\nHost: a\r\n\r\n"
    )
    padding = b"X-Pad: " + b"p" * 8000 + b"\r\n"
    behind = b"GET /open/n HTTP/1.1\r\nHost: a\r\n" + padding + b"\r\n"
    writer.write(behind * 2000)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(writer.drain(), 2)  # the proxy stopped reading
    assert len(upstream.received) == 1
    release()
    async with asyncio.timeout(30):
        raw = await reader.read()
    writer.close()
    assert len(upstream.received) > 1
    assert [r.path_qs for r in upstream.received] == [
        "/open/first",
        *["/open/n"] * (len(upstream.received) - 1),
    ]
    assert [status for status, _ in answers(raw)] == [200] * len(upstream.received)


# -- relayed answers, framed as their upstream framed them -------------------------------


Start = Callable[[str], Any]


@pytest.fixture
def open_route(start_proxy: ProxyFactory) -> Start:
    async def start(url: str) -> Client:
        return await start_proxy([{"name": "o", "path": "/o/", "upstream": url, "fence": False}])

    return start


async def test_a_head_answer_keeps_its_length_and_has_no_body(open_route: Start) -> None:
    async with scripted(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\nX-A: 1\r\n\r\n") as url:
        proxy = await open_route(url)
        data = b"HEAD /o/x HTTP/1.1\r\nHost: a\r\n\r\n" * 2
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(data)
        async with asyncio.timeout(5):
            first = await reader.readuntil(b"\r\n\r\n")
            second = await reader.readuntil(b"\r\n\r\n")  # the connection goes on
        writer.close()
    for head in (first, second):
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"\r\nContent-Length: 99\r\n" in head
        assert b"\r\nX-A: 1\r\n" in head


@pytest.mark.parametrize(
    ("version", "framing"),
    [(b"1.1", b"Transfer-Encoding: chunked"), (b"1.0", b"Connection: close")],
)
async def test_an_answer_that_ends_with_its_connection_is_relayed_whole(
    open_route: Start, version: bytes, framing: bytes
) -> None:
    """No length, not chunked: the upstream's close ends the body. An HTTP/1.1
    client gets it chunked on a connection that goes on; an HTTP/1.0 one, ended by
    the proxy's close."""
    body = b"x" * 100_000
    async with scripted(b"HTTP/1.1 200 OK\r\n\r\n" + body, close=True) as url:
        proxy = await open_route(url)
        async with asyncio.timeout(10):
            raw = await raw_request(
                proxy.port,
                b"GET /o/x HTTP/" + version + b"\r\nHost: a\r\nConnection: close\r\n\r\n",
            )
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert framing in head
    if version == b"1.1":
        chunks, size = b"", -1
        while size:
            line, _, rest = rest.partition(b"\r\n")
            size = int(line, 16)
            chunks, rest = chunks + rest[:size], rest[size + 2 :]
        rest = chunks
    assert rest == body


async def test_a_date_is_added_only_where_the_upstream_sent_none(
    start_proxy: ProxyFactory,
) -> None:
    dated = b"Date: Sun, 06 Nov 1994 08:49:37 GMT\r\n"
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n"
    async with scripted(ok + dated + b"\r\n") as with_date, scripted(ok + b"\r\n") as without:
        proxy = await start_proxy(
            [
                {"name": "d", "path": "/d/", "upstream": with_date, "fence": False},
                {"name": "n", "path": "/n/", "upstream": without, "fence": False},
            ]
        )
        kept, added = [
            await raw_request(proxy.port, b"GET /%s/x HTTP/1.1\r\nHost: a\r\n%s\r\n" % (
                route, b"Connection: close\r\n"))
            for route in (b"d", b"n")
        ]  # fmt: skip
    assert kept.count(b"\r\nDate: ") == 1
    assert b"\r\n" + dated in kept
    assert added.count(b"\r\nDate: ") == 1
    assert b"\r\nVia: 1.1 fenceproxy\r\n" in added


# -- the head -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (b"POST /billing/x HTTP/1.1\r\n" + FENCE + b"Content-Length: 2\r\n\r\n{}", b"no Host"),
        (write(extra=b"Content-Type: a/b\r\nContent-Type: c/d\r\n"), b"a second Content-Type"),
        (write(extra=b"User-Agent: a\r\nUser-Agent: b\r\n"), b"a second User-Agent"),
        (b"POST /billing/x HTTP/1.0\r\n" + FENCE + b"Content-Length: 2\r\n\r\n{}", None),
    ],
    ids=["http-1.1-without-host", "two-content-types", "two-user-agents", "http-1.0-without-host"],
)
async def test_fields_that_must_come_once_and_host_are_checked(
    raw_proxy: Client, raw_upstream: RawUpstream, data: bytes, said: bytes | None
) -> None:
    raw = await raw_request(raw_proxy.port, data)
    if said is None:
        assert raw.startswith(b"HTTP/1.0 200 "), raw
        assert [r.body for r in raw_upstream.received] == [b"{}"]
    else:
        assert raw.startswith(b"HTTP/1.0 400 "), raw
        assert said in raw
        assert raw_upstream.received == []
    # A well-formed request still goes through.
    assert (await raw_request(raw_proxy.port, write(extra=b"Connection: close\r\n"))).startswith(
        b"HTTP/1.1 200 "
    )


def get(target: bytes = b"/open/x", fields: tuple[bytes, ...] = ()) -> bytes:
    """A GET of ``target`` with Host, ``fields`` and Connection: close."""
    lines = (b"Host: a", *fields, b"Connection: close")
    return b"GET " + target + b" HTTP/1.1\r\n" + b"".join(f + b"\r\n" for f in lines) + b"\r\n"


def fields_of(total: int) -> tuple[bytes, ...]:
    """Fields that, with Host and Connection, take ``total`` bytes of field lines."""
    fields = [b"X-Pad-%d: " % n + b"p" * 8000 for n in range(8)]
    left = total - len(b"Host: a\r\nConnection: close\r\n") - sum(len(f) + 2 for f in fields)
    return (*fields, b"X-Last: " + b"p" * (left - len(b"X-Last: \r\n")))


# The documented limits (docs/limits.md), each at its edge: the largest taken, then the
# same one byte (or one field) more.
HEAD_LIMITS = {
    "a target of 8190 bytes": (
        get(b"/open/" + b"t" * 8184), get(b"/open/" + b"t" * 8185)),
    "a field value of 8190 bytes": (
        get(fields=(b"X-Big: " + b"v" * 8190,)), get(fields=(b"X-Big: " + b"v" * 8191,))),
    "100 fields": (
        get(fields=tuple(b"X-%d: v" % n for n in range(98))),
        get(fields=tuple(b"X-%d: v" % n for n in range(99)))),
    "fields of 64 KiB in all": (get(fields=fields_of(65536)), get(fields=fields_of(65537))),
}  # fmt: skip


@pytest.mark.parametrize(("taken", "refused"), HEAD_LIMITS.values(), ids=HEAD_LIMITS)
async def test_a_head_at_its_limit_is_taken_and_one_byte_or_field_more_is_431(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, taken: bytes, refused: bytes
) -> None:
    """A client may rely on the limits to the byte: a head at one is forwarded, and
    one past it is refused before anything reaches the upstream."""
    route = {"name": "open", "path": "/open/", "upstream": upstream.url, "fence": False}
    proxy = await start_proxy([route])
    assert (await raw_request(proxy.port, taken)).startswith(b"HTTP/1.1 200 ")
    raw = await raw_request(proxy.port, refused)
    assert raw.startswith(b"HTTP/1.0 431 "), raw[:200]
    assert b"request-head-too-large" in raw
    [received] = upstream.received
    assert received.path_qs.encode() == taken.split(b" ")[1]
    sent = [line.split(b":")[0].decode() for line in taken.split(b"\r\n") if line[:2] == b"X-"]
    assert all(name in received.headers for name in sent)


async def test_trailers_are_read_and_never_forwarded(
    raw_proxy: Client, raw_upstream: RawUpstream
) -> None:
    data = (
        b"POST /open/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n2\r\n{}\r\n0\r\nX-Trailer: sneaky\r\n\r\n"
    )
    raw = await raw_request(raw_proxy.port, data)
    assert raw.startswith(b"HTTP/1.1 200 ")
    [received] = raw_upstream.received
    assert received.body == b"{}"
    assert b"sneaky" not in received.head


async def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(
    start_proxy: ProxyFactory, raw_upstream: RawUpstream
) -> None:
    route = {"name": "open", "path": "/open/", "upstream": raw_upstream.url, "fence": False}
    proxy = await start_proxy([route], limits={"keepalive_timeout": "300ms"})
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    loop = asyncio.get_running_loop()
    # The proxy's idle time starts once it has sent the answer: after the request was
    # sent, before the client has read the answer (a loaded machine may be late to).
    sent = loop.time()
    writer.write(b"GET /open/x HTTP/1.1\r\nHost: a\r\n\r\n")
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(RawRequest(head[:-4], b"").values("Content-Length")[0]))
        answered = loop.time()
        assert await reader.read() == b""  # closed by the proxy, no answer
        closed = loop.time()
    writer.close()
    assert closed - sent > 0.29, closed - sent  # never before its 300 ms
    assert closed - answered < 2.0, closed - answered


# -- found by attacking it ------------------------------------------------------------------


async def test_a_client_pipelining_beyond_the_limit_has_those_taken_answered_then_closed(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """100 requests in one write, the first held at the upstream: the proxy takes the
    first and MAX_AHEAD behind it, answers them in order, then closes; the rest is
    never read as requests, so a client cannot queue requests without bound."""
    route = {"name": "open", "path": "/open/", "upstream": upstream.url, "fence": False}
    proxy = await start_proxy([route])
    release, reader, writer = await sent_while_held(
        proxy,
        upstream,
        b"".join(b"GET /open/%d HTTP/1.1\r\nHost: a\r\n\r\n" % n for n in range(100)),
    )
    release()
    async with asyncio.timeout(10):
        raw = await reader.read()
    writer.close()
    taken = MAX_AHEAD + 1
    assert [status for status, _ in answers(raw)] == [200] * taken
    assert raw.count(b"\r\nConnection: close\r\n") == 1  # on the last answer
    assert [r.path_qs for r in upstream.received] == [f"/open/{n}" for n in range(taken)]


@pytest.mark.parametrize(
    "trailers",
    [
        b"X-T: " + b"a" * (MAX_HEAD + 1024 * 1024),  # a field that never ends
        b"".join(b"X-T%d: v\r\n" % n for n in range(101)) + b"\r\n",  # too many
    ],
    ids=["endless-value", "too-many-fields"],
)
async def test_trailer_fields_are_held_to_the_heads_limits(
    raw_proxy: Client, raw_upstream: RawUpstream, trailers: bytes
) -> None:
    data = (
        b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
        + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n" + trailers
    )  # fmt: skip
    async with asyncio.timeout(10):
        raw = await raw_request(raw_proxy.port, data)
    assert raw.startswith(b"HTTP/1.1 431 "), raw[:100]
    assert raw_upstream.received == []


async def test_the_head_deadline_of_a_request_read_ahead_runs_only_while_reading(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """The third request's head is cut by the network while the proxy holds reading
    behind a slow first one: it is answered, not refused with 408."""
    route = {"name": "open", "path": "/open/", "upstream": upstream.url, "fence": False}
    proxy = await start_proxy([route], limits={"header_timeout": "300ms"})
    release, reader, writer = await sent_while_held(
        proxy,
        upstream,
        b"GET /open/1 HTTP/1.1\r\nHost: a\r\n\r\nGET /open/2 HTTP/1.1\r\nHost: a\r\n\r\n"
        b"GET /open/3 HTT",
    )
    await asyncio.sleep(0.4)
    writer.write(b"P/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    await asyncio.sleep(0.4)  # twice the head timeout since the third head began
    release()
    async with asyncio.timeout(10):
        raw = await reader.read()
    writer.close()
    assert [status for status, _ in answers(raw)] == [200, 200, 200]


@pytest.mark.parametrize(
    "data",
    [
        b"GET /open/x#frag?q=1 HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET http://a/open/x#frag HTTP/1.1\r\nHost: a\r\n\r\n",
        b"CONNECT /open/x HTTP/1.1\r\nHost: a\r\nContent-Length: 35\r\n\r\n"
        b"GET /open/smuggled HTTP/1.1\r\n\r\n\r\n",
        b"CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n",
    ],
    ids=["fragment", "absolute-form-fragment", "connect-origin-form", "connect"],
)
async def test_a_fragment_or_connect_is_refused_never_repaired(
    raw_proxy: Client, raw_upstream: RawUpstream, data: bytes
) -> None:
    async with asyncio.timeout(10):
        raw = await raw_request(raw_proxy.port, data)
    assert raw.startswith(b"HTTP/1.1 400 "), raw
    assert b"request-target-malformed" in raw
    assert raw_upstream.received == []


async def test_an_http_10_request_with_transfer_encoding_closes_its_connection(
    raw_proxy: Client, raw_upstream: RawUpstream
) -> None:
    """RFC 9112 §6.1: its framing is faulty; answered, then closed, so nothing sent
    behind it is read as a request."""
    data = (
        b"POST /open/x HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
        b"GET /open/behind HTTP/1.0\r\nHost: a\r\n\r\n"
    )
    async with asyncio.timeout(10):
        raw = await raw_request(raw_proxy.port, data)
    assert [status for status, _ in answers(raw)] == [200]
    assert [r.target for r in raw_upstream.received] == ["/open/x"]


@pytest.mark.parametrize(
    "coding",
    [b"Transfer-Encoding: gzip, chunked", b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked"],
    ids=["one-field", "split-over-two-fields"],
)
async def test_an_answer_in_a_transfer_coding_the_proxy_does_not_speak_is_502(
    open_route: Start, coding: bytes
) -> None:
    """A coding the proxy would relay undone, and say nothing of, is never relayed:
    its fields read together, however many (RFC 9110 §5.3), say gzip, then chunked."""
    gzipped = b"HTTP/1.1 200 OK\r\n" + coding + b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    async with scripted(gzipped) as url:
        raw = await raw_request(
            (await open_route(url)).port,
            b"GET /o/x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        )
    assert raw.startswith(b"HTTP/1.1 502 "), raw
    assert b"transfer coding other than chunked" in raw


async def test_a_204_goes_without_content_length_and_a_reason_keeps_its_bytes(
    open_route: Start,
) -> None:
    async with scripted(b"HTTP/1.1 204 Fertig \xe9t\xe9\r\nContent-Length: 5\r\n\r\n") as url:
        raw = await raw_request(
            (await open_route(url)).port,
            b"GET /o/x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        )
    assert raw.startswith(b"HTTP/1.1 204 Fertig \xe9t\xe9\r\n"), raw
    assert b"Content-Length" not in raw


# -- found in review ---------------------------------------------------------------------


async def test_an_upstream_connection_whose_answer_was_not_read_whole_is_still_reusable() -> None:
    """An answer (300 KiB) arrives whole, beyond what a body buffers ahead of its
    reader (so the connection stopped reading), and is released unread: the
    connection goes back to the pool reading again, so the next exchange on it is
    answered, not left to time out."""
    big = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (300 * 1024) + b"a" * 300 * 1024
    async with scripted(big) as url:
        origin = Origin(URL(url))
        first = await origin.request("GET", "/a", CIMultiDict(), None, connect_timeout=5,
                                     read_timeout=5)  # fmt: skip
        await eventually(first._payload.is_eof)  # all in, none read
        first.release()
        assert origin.idle == 1
        async with asyncio.timeout(10):
            second = await origin.request("GET", "/b", CIMultiDict(), None, connect_timeout=5,
                                          read_timeout=5)  # fmt: skip
            body, whole = await second.read_capped(1024 * 1024)
        second.release()
        origin.close()
    assert (second.status, len(body), whole) == (200, 300 * 1024, True)
    assert origin.opened == 1


async def test_a_reused_upstream_connection_times_its_answer_from_its_own_request(
    start_proxy: ProxyFactory, raw_upstream: RawUpstream
) -> None:
    """A quick exchange, then on the same upstream connection an upload that takes
    longer than the route's timeout to send: its answer is timed from the end of its
    own request, not from the last exchange's answer."""
    route = {"name": "o", "path": "/o/", "upstream": raw_upstream.url, "fence": False,
             "timeout": "1s"}  # fmt: skip
    proxy = await start_proxy([route])
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    async with asyncio.timeout(10):
        writer.write(b"GET /o/quick HTTP/1.1\r\nHost: a\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(RawRequest(head[:-4], b"").values("Content-Length")[0]))
        writer.write(b"POST /o/slow HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(6):  # 1.5 s of upload
            writer.write(b"2\r\n{}\r\n")
            await asyncio.sleep(0.25)
        writer.write(b"0\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
    writer.close()
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert [r.target for r in raw_upstream.received] == ["/o/quick", "/o/slow"]


async def test_an_http_10_answer_ended_by_the_connection_is_the_last_on_it(
    open_route: Start,
) -> None:
    """To an HTTP/1.0 client an answer with no length ends with the connection: a
    request it pipelined behind is never answered on it (its bytes would be read
    as the first answer's)."""
    seen: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                seen.append((await reader.readuntil(b"\r\n\r\n")).split(b" ")[1])
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                await writer.drain()
                await asyncio.sleep(0.05)  # not whole at once: relayed as it comes
                writer.write(b"5\r\nfirst\r\n0\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async with listening(serve) as url:
        proxy = await open_route(url)
        pipelined = b"GET /o/1 HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n\r\n" + (
            b"GET /o/2 HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n\r\n"
        )
        async with asyncio.timeout(10):
            raw = await raw_request(proxy.port, pipelined)
    assert raw.count(b"HTTP/1.0 200") == 1, raw
    assert raw.endswith(b"first")
    assert seen == [b"/o/1"]


async def test_a_proxy_shutting_down_takes_no_more_requests(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    route = {"name": "open", "path": "/open/", "upstream": upstream.url, "fence": False}
    proxy = await start_proxy([route])
    release, reader, writer = await sent_while_held(
        proxy, upstream, b"GET /open/1 HTTP/1.1\r\nHost: a\r\n\r\n"
    )
    proxy.server.runner.server.pre_shutdown()  # type: ignore[union-attr]
    writer.write(b"GET /open/2 HTTP/1.1\r\nHost: a\r\n\r\n")
    await asyncio.sleep(0.1)
    release()
    async with asyncio.timeout(10):
        raw = await reader.read()
    writer.close()
    assert [status for status, _ in answers(raw)] == [200]
    assert b"\r\nConnection: close\r\n" in raw
    assert [r.path_qs for r in upstream.received] == ["/open/1"]


async def test_an_upstream_head_that_never_ends_is_502_not_held(open_route: Start) -> None:
    endless = b"HTTP/1.1 200 OK\r\nX-A: " + b"a" * (MAX_HEAD + 1024 * 1024)
    async with scripted(endless) as url:
        async with asyncio.timeout(10):
            raw = await raw_request(
                (await open_route(url)).port,
                b"GET /o/x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
            )
    assert raw.startswith(b"HTTP/1.1 502 "), raw[:200]
    assert b"head too large" in raw


async def test_a_streamed_body_other_than_its_declared_length_is_never_sent_whole(
    raw_upstream: RawUpstream,
) -> None:
    async def body(parts: list[bytes]) -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    origin = Origin(URL(raw_upstream.url))
    for parts in ([b"abc", b"defgh"], [b"ab"]):
        with pytest.raises(ValueError, match="declared length"):
            await origin.request(
                "POST", "/x", CIMultiDict(), body(parts), connect_timeout=5, read_timeout=5,
                length=5,
            )  # fmt: skip
        assert origin.idle == 0
    assert raw_upstream.received == []
    origin.close()


async def test_an_idle_upstream_connection_closed_or_stale_is_dropped_from_the_pool(
    raw_upstream: RawUpstream,
) -> None:
    origin = Origin(URL(raw_upstream.url))
    first = await origin.request("GET", "/a", CIMultiDict(), None, connect_timeout=5,
                                 read_timeout=5)  # fmt: skip
    second = await origin.request("GET", "/b", CIMultiDict(), None, connect_timeout=5,
                                  read_timeout=5)  # fmt: skip
    for response in (first, second):
        await response.read_capped(100)
        response.release()
    assert origin.idle == 2
    oldest = origin._idle[0][0]
    oldest.abort()
    await oldest.closed
    (await origin.request("GET", "/c", CIMultiDict(), None, connect_timeout=5,
                          read_timeout=5)).release()  # fmt: skip
    assert origin.idle == 1  # the closed one is gone, the live one reused and back
    origin.close()
