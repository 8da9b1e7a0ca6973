"""The upstream client against a raw-socket upstream that answers exactly the bytes a
test scripts: chunked, truncated, malformed, interim and ``Connection: close``
answers, silence and hang-ups. Every failure it can meet becomes one documented
answer, and a connection goes back to the pool only when it is safe to reuse."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from multidict import CIMultiDict
from yarl import URL

from fenceproxy.config import RouteSpec
from fenceproxy.errors import UpstreamError, UpstreamFailed, UpstreamTimeout, UpstreamUnreachable
from fenceproxy.http.http1 import Origin
from fenceproxy.http.routes import Route
from fenceproxy.http.upstream import UpstreamPool
from fenceproxy.testing import RawRequest, free_port, listening

from .conftest import ProxyFactory, raw_request

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
# What the scripted upstream does with the n-th request it reads (from 0, over every
# connection): the bytes it sends back, and whether it then hangs up. None: say nothing.
Script = Callable[[int], tuple[bytes | None, bool]]


@dataclass
class ScriptedUpstream:
    script: Script
    connections: int = 0
    received: list[RawRequest] = field(default_factory=list)
    url: str = ""

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n"))[:-4]
                request = RawRequest(head, b"")
                if request.values("Transfer-Encoding"):
                    body = bytearray()
                    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                        body += await reader.readexactly(size)
                        await reader.readexactly(2)
                    await reader.readexactly(2)
                else:
                    lengths = request.values("Content-Length")
                    body = bytearray(await reader.readexactly(int(lengths[0])) if lengths else b"")
                self.received.append(RawRequest(head, bytes(body)))
                answer, hang_up = self.script(len(self.received) - 1)
                if answer is None and not hang_up:
                    await asyncio.Event().wait()  # silence until the client gives up
                if answer:
                    writer.write(answer)
                    await writer.drain()
                if hang_up:
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client hung up, or the test is over
        finally:
            writer.close()


@asynccontextmanager
async def scripted(script: Script) -> AsyncIterator[ScriptedUpstream]:
    upstream = ScriptedUpstream(script)
    async with listening(upstream._connection) as upstream.url:
        yield upstream


def always(answer: bytes | None, hang_up: bool = False) -> Script:
    return lambda n: (answer, hang_up)


async def post(
    origin: Origin,
    body: bytes | AsyncIterator[bytes] | None = b"{}",
    *,
    method: str = "POST",
    within: float = 5.0,
) -> tuple[int, bytes]:
    """One exchange read to its end, the way the proxy does it."""
    response = await origin.request(
        method, "/x", CIMultiDict(), body, connect_timeout=within, read_timeout=within
    )
    try:
        return response.status, b"".join([chunk async for chunk in response.chunks()])
    finally:
        response.release()


async def test_a_connection_is_reused_after_a_complete_answer() -> None:
    async with scripted(always(OK)) as upstream:
        origin = Origin(URL(upstream.url))
        for _ in range(3):
            assert await post(origin) == (200, b"{}")
        assert (upstream.connections, origin.opened, origin.idle) == (1, 1, 1)
        origin.close()


async def test_a_reload_retires_an_origin_no_route_names_and_keeps_the_others() -> None:
    async with scripted(always(OK)) as kept, scripted(always(OK)) as dropped:
        a, b = (
            Route.compile(RouteSpec(name=n, path=f"/{n}/", upstream=up.url))
            for n, up in (("a", kept), ("b", dropped))
        )
        pool = UpstreamPool([a, b])
        for route in (a, b):
            (await pool.send(route, "GET", "/", CIMultiDict(), None)).release()
        old_a, old_b = pool.origin(a), pool.origin(b)
        assert (old_a.idle, old_b.idle) == (1, 1)
        pool.update([a])
        # The kept origin keeps its warm connection; the dropped one closes its idle
        # one now, still serves a request routed before the reload, and closes the
        # connection it used once the answer is in.
        assert pool.origin(a) is old_a
        assert old_a.idle == 1
        assert old_b.retired
        assert old_b.idle == 0
        (await pool.send(b, "GET", "/", CIMultiDict(), None)).release()
        assert (old_b.idle, old_b.opened) == (0, 2)
        # Named again, it is taken back.
        pool.update([a, b])
        assert pool.origin(b) is old_b
        assert not old_b.retired
        await pool.close()


async def test_the_request_carries_host_and_its_framing_and_nothing_else() -> None:
    async with scripted(always(OK)) as upstream:
        origin = Origin(URL(upstream.url))
        headers = CIMultiDict([("X-A", "1"), ("x-b", "2")])
        response = await origin.request(
            "POST", "/p?q", headers, b"hello", connect_timeout=5, read_timeout=5
        )
        await response.read_capped(10)
        response.release()
        [received] = upstream.received
        port = URL(upstream.url).port
        assert received.request_line == b"POST /p?q HTTP/1.1"
        assert received.fields == [
            ("Host", f"127.0.0.1:{port}"),
            ("X-A", "1"),
            ("x-b", "2"),
            ("Content-Length", "5"),
        ]
        assert received.body == b"hello"
        origin.close()


async def test_a_streamed_body_goes_chunked() -> None:
    async def body() -> AsyncIterator[bytes]:
        for part in (b"ab", b"", b"cd"):
            yield part

    async with scripted(always(OK)) as upstream:
        origin = Origin(URL(upstream.url))
        assert await post(origin, body()) == (200, b"{}")
        [received] = upstream.received
        assert received.values("Transfer-Encoding") == ["chunked"]
        assert received.body == b"abcd"
        assert origin.idle == 1
        origin.close()


async def test_an_empty_write_says_content_length_0_and_a_get_says_nothing() -> None:
    async with scripted(always(OK)) as upstream:
        origin = Origin(URL(upstream.url))
        await post(origin, None, method="DELETE")
        await post(origin, None, method="GET")
        delete, get = upstream.received
        assert delete.values("Content-Length") == ["0"]
        assert get.values("Content-Length") == []
        assert get.values("Transfer-Encoding") == []
        origin.close()


async def test_a_chunked_answer_is_read_whole_and_the_connection_kept() -> None:
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    async with scripted(always(answer)) as upstream:
        origin = Origin(URL(upstream.url))
        assert await post(origin) == (200, b"hello")
        assert await post(origin) == (200, b"hello")
        assert upstream.connections == 1
        origin.close()


EARLY_HINTS = b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"


@pytest.mark.parametrize(
    "interim",
    [b"HTTP/1.1 100 Continue\r\n\r\n", EARLY_HINTS, b"HTTP/1.1 100 Continue\r\n\r\n" + EARLY_HINTS],
    ids=["100-continue", "103-early-hints", "both"],
)
async def test_an_interim_answer_is_skipped(interim: bytes) -> None:
    async with scripted(always(interim + OK)) as upstream:
        origin = Origin(URL(upstream.url))
        assert await post(origin) == (200, b"{}")
        assert await post(origin) == (200, b"{}")  # and the connection goes on
        assert upstream.connections == 1
        origin.close()


async def test_a_head_answer_has_no_body_and_keeps_the_connection() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n"
    async with scripted(always(head)) as upstream:
        origin = Origin(URL(upstream.url))
        assert await post(origin, None, method="HEAD") == (200, b"")
        assert await post(origin, None, method="HEAD") == (200, b"")
        assert upstream.connections == 1
        origin.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}",
        OK + b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",  # one answer too many
    ],
    ids=["connection-close", "http-1.0", "unasked-answer"],
)
async def test_a_connection_the_upstream_will_not_go_on_with_is_not_reused(
    answer: bytes,
) -> None:
    async with scripted(always(answer)) as upstream:
        origin = Origin(URL(upstream.url))
        assert await post(origin) == (200, b"{}")
        assert await post(origin) == (200, b"{}")
        assert (upstream.connections, origin.opened) == (2, 2)
        origin.close()


async def test_an_answer_left_unfinished_closes_its_connection() -> None:
    started = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 20
    async with scripted(lambda n: (started if n == 0 else OK, False)) as upstream:
        origin = Origin(URL(upstream.url))
        response = await origin.request(
            "POST", "/", CIMultiDict(), b"", connect_timeout=5, read_timeout=5
        )
        await response.read_capped(10)
        response.release()  # 80 bytes of it are still to come
        assert origin.idle == 0
        assert await post(origin) == (200, b"{}")
        assert upstream.connections == 2
        origin.close()


async def test_an_answer_received_whole_but_not_read_keeps_its_connection() -> None:
    async with scripted(always(b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\n" + b"x" * 20)) as up:
        origin = Origin(URL(up.url))
        response = await origin.request(
            "POST", "/", CIMultiDict(), b"", connect_timeout=5, read_timeout=5
        )
        while not response._payload.is_eof():  # every byte of it is in
            await asyncio.sleep(0.001)
        response.release()
        assert origin.idle == 1
        origin.close()


async def test_an_idle_connection_the_upstream_closed_is_not_used() -> None:
    async with scripted(always(OK, hang_up=True)) as upstream:
        origin = Origin(URL(upstream.url))
        assert await post(origin) == (200, b"{}")
        [(idle, _)] = origin._idle
        while idle.is_connected():  # the upstream's keep-alive timeout, say
            await asyncio.sleep(0.001)
        assert await post(origin) == (200, b"{}")  # not sent on the closed one
        assert upstream.connections == 2
        origin.close()


async def test_an_idle_connection_is_reused_within_4_s_and_not_after() -> None:
    """An idle connection is kept for at most 4 s (docs/forwarding.md), under the
    shortest common upstream keep-alive (Node's 5 s), so a write is seldom sent on a
    connection the upstream is closing. Its idle time is moved on, not waited for."""
    async with scripted(always(OK)) as upstream:
        origin = Origin(URL(upstream.url))
        for idle_for, opened in ((3.9, 1), (4.0, 2)):
            assert await post(origin) == (200, b"{}")
            [(conn, since)] = origin._idle
            origin._idle[0] = (conn, since - idle_for)  # as if idle that long
            assert await post(origin) == (200, b"{}")
            assert (origin.opened, upstream.connections) == (opened, opened)
        origin.close()


# Every way the upstream can fail a request, and the error each becomes.
FAILURES = {
    "refused": (None, UpstreamUnreachable, False),
    "hang-up before answering": (always(None, hang_up=True), UpstreamFailed, True),
    "malformed status line": (always(b"HTTP/1.1 abc\r\n\r\n"), UpstreamFailed, True),
    "not http": (always(b"SSH-2.0-OpenSSH\r\n\r\n"), UpstreamFailed, True),
    "bad header": (
        always(b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"),
        UpstreamFailed,
        True,
    ),
    "switching protocols": (
        always(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n"),
        UpstreamFailed,
        True,
    ),
    "silence": (always(None), UpstreamTimeout, True),
}


@pytest.mark.parametrize("case", FAILURES)
async def test_each_failure_before_the_answer_is_one_upstream_error(case: str) -> None:
    script, error, sent = FAILURES[case]
    if script is None:
        origin = Origin(URL(f"http://127.0.0.1:{free_port()}"))
        with pytest.raises(error) as raised:
            await post(origin)
    else:
        async with scripted(script) as upstream:
            origin = Origin(URL(upstream.url))
            with pytest.raises(error) as raised:
                await post(origin, within=0.3)
    assert raised.value.sent is sent
    assert origin.idle == 0


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf!",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n",
    ],
    ids=["short", "unterminated-chunks", "bad-chunk-size"],
)
async def test_an_answer_cut_short_fails_its_body_and_closes(answer: bytes) -> None:
    async with scripted(always(answer, hang_up=True)) as upstream:
        origin = Origin(URL(upstream.url))
        with pytest.raises(UpstreamFailed):
            await post(origin)
        assert origin.idle == 0


async def test_a_body_that_fails_passes_its_error_and_closes() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"ab"
        raise ValueError("the client went away")

    async with scripted(always(OK)) as upstream:
        origin = Origin(URL(upstream.url))
        with pytest.raises(ValueError, match="went away"):
            await post(origin, body())
        assert origin.idle == 0
        assert upstream.received == []  # the chunked body never ended


async def test_a_cancelled_exchange_closes_its_connection() -> None:
    async with scripted(always(None)) as upstream:
        origin = Origin(URL(upstream.url))
        task = asyncio.create_task(post(origin))
        while not upstream.received:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert origin.idle == 0


async def test_an_upstream_that_closes_mid_exchange_fails_it_at_once() -> None:
    """A clean close before the answer, or in the middle of its body, fails the
    exchange as it happens (UpstreamFailed, 502), not once the read deadline is
    over (which would be a 504, 30 s later on a route's default timeout)."""
    cut_short = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf!"
    for answer in (None, cut_short):
        async with scripted(always(answer, hang_up=True)) as upstream:
            origin = Origin(URL(upstream.url))
            async with asyncio.timeout(5):
                with pytest.raises(UpstreamFailed, match="ConnectionResetError"):
                    await post(origin, within=60)
            assert origin.idle == 0


async def test_a_read_deadline_let_go_while_the_request_goes_out_is_set_again() -> None:
    """The read deadline of a connection outlives a quick exchange; when it fires
    while the next request on that connection is still going out, it lets go, and is
    set again once the request is out: an upstream that then says nothing is timed
    out, not waited on for the rest of the connection's life."""

    async def upload() -> AsyncIterator[bytes]:
        for _ in range(5):  # 1 s of upload, past the 0.5 s read timeout
            yield b"ab"
            await asyncio.sleep(0.2)

    async with scripted(lambda n: (OK if n == 0 else None, False)) as upstream:
        origin = Origin(URL(upstream.url))
        assert await post(origin, within=0.5) == (200, b"{}")
        async with asyncio.timeout(5):
            with pytest.raises(UpstreamTimeout):
                await post(origin, upload(), within=0.5)
        assert upstream.connections == 1  # the same connection
        assert [r.body for r in upstream.received] == [b"{}", b"ababababab"]


async def test_a_read_deadline_let_go_while_the_reader_is_behind_is_set_again() -> None:
    """A reader behind the upstream stops the connection's reading: the deadline lets
    go meanwhile (the upstream is not late), and is set again when the reader catches
    up, so an upstream that then stops in the middle of its answer is timed out."""
    stalls = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (2 * 1024 * 1024)
    async with scripted(always(stalls + b"x" * 400 * 1024)) as upstream:
        origin = Origin(URL(upstream.url))
        response = await origin.request(
            "GET", "/x", CIMultiDict(), None, connect_timeout=5, read_timeout=0.3
        )
        await asyncio.sleep(0.6)  # a reader slower than the read timeout
        received = 0
        async with asyncio.timeout(5):
            with pytest.raises(UpstreamTimeout):
                async for chunk in response.chunks():
                    received += len(chunk)
        response.release()
        assert received == 400 * 1024  # every byte that came, then the deadline
        assert origin.idle == 0


# Through the proxy: each failure is the answer the README documents for it.
ANSWERS = {
    "hang-up before answering": (502, "upstream-failed"),
    "malformed status line": (502, "upstream-failed"),
    "switching protocols": (502, "upstream-failed"),
    "silence": (504, "upstream-timeout"),
}


@pytest.mark.parametrize("case", ANSWERS)
@pytest.mark.parametrize("fenced", [False, True], ids=["pass-through", "fenced"])
async def test_each_failure_is_a_problem_answer_from_the_proxy(
    start_proxy: ProxyFactory, case: str, fenced: bool
) -> None:
    script = FAILURES[case][0]
    assert script is not None
    async with scripted(script) as upstream:
        fence = {"fence": {}} if fenced else {"fence": False}
        route = {"name": "r", "path": "/", "upstream": upstream.url, "timeout": 0.3, **fence}
        client = await start_proxy([route])
        assert client.port is not None
        headers = "Fencing-Job: j\r\nFencing-Token: 1\r\n" if fenced else ""
        raw = await raw_request(
            client.port,
            b"POST /x HTTP/1.1\r\nHost: p\r\nContent-Length: 0\r\n"
            + headers.encode()
            + b"Connection: close\r\n\r\n",
        )
        status, slug = ANSWERS[case]
        assert raw.startswith(b"HTTP/1.1 %d " % status), raw[:200]
        assert slug.encode() in raw


async def test_fenced_writes_give_their_connection_back(start_proxy: ProxyFactory) -> None:
    async with scripted(always(OK)) as upstream:
        route = {"name": "r", "path": "/", "upstream": upstream.url, "fence": {}}
        client = await start_proxy([route])
        for n, key in enumerate([None, None, "k1", "k2"]):
            headers = {"Fencing-Job": "j", "Fencing-Token": "1"}
            if key is not None:
                headers["Idempotency-Key"] = key
            async with client.post(f"/w{n}", data=b"{}", headers=headers) as answer:
                assert answer.status == 200
        assert len(upstream.received) == 4
        assert upstream.connections == 1  # one connection, given back after each write


async def test_a_keyed_write_after_early_hints_keeps_and_replays_the_final_answer(
    start_proxy: ProxyFactory,
) -> None:
    """103 Early Hints is not the answer: the client gets the final one, and that is
    what its key keeps for a retry, never the hints."""
    final = b'HTTP/1.1 201 Created\r\nContent-Length: 8\r\n\r\n{"id":7}'
    async with scripted(always(EARLY_HINTS + final)) as upstream:
        route = {"name": "r", "path": "/", "upstream": upstream.url, "fence": {}}
        client = await start_proxy([route])
        headers = {"Fencing-Job": "j", "Fencing-Token": "1", "Idempotency-Key": "k"}
        for replayed in (None, "true"):
            async with (
                asyncio.timeout(10),
                client.post("/w", data=b"{}", headers=headers) as answer,
            ):
                assert (answer.status, await answer.read()) == (201, b'{"id":7}')
                assert answer.headers.get("Idempotent-Replayed") == replayed
                assert "Link" not in answer.headers
        assert len(upstream.received) == 1


@pytest.mark.parametrize(
    "cap", [1024, 1024 * 1024], ids=["arriving-with-its-head", "read-as-it-comes"]
)
async def test_an_answer_of_max_response_is_kept_for_its_key_and_one_byte_more_is_not(
    start_proxy: ProxyFactory, cap: int
) -> None:
    """``idempotency.max_response`` is the largest answer kept: a retry of its key is
    answered with it; one byte more and the client still gets all of it, but a retry
    is 409 ``duplicate-not-stored``. The same whether the answer came whole with its
    head or is read as it comes (1 MiB, the default, is more than is read ahead)."""

    def answer(n: int) -> tuple[bytes, bool]:
        size = cap if n == 0 else cap + 1
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size, False

    async with scripted(answer) as upstream:
        route = {"name": "r", "path": "/", "upstream": upstream.url, "fence": {}}
        client = await start_proxy([route], idempotency={"max_response": cap})
        for key, size, retried in (("at", cap, 200), ("over", cap + 1, 409)):
            headers = {"Fencing-Job": "j", "Fencing-Token": "1", "Idempotency-Key": key}
            async with client.post("/w", data=b"{}", headers=headers) as first:
                assert (first.status, await first.read()) == (200, b"x" * size)
            async with client.post("/w", data=b"{}", headers=headers) as retry:
                assert retry.status == retried
                if retried == 200:
                    assert retry.headers["Idempotent-Replayed"] == "true"
                    assert await retry.read() == b"x" * size
                else:
                    assert (await retry.json())["type"].endswith("duplicate-not-stored")
        assert len(upstream.received) == 2


async def test_an_upstream_that_hangs_up_is_502_at_once_whatever_the_timeout(
    start_proxy: ProxyFactory,
) -> None:
    """An upstream gone before its answer is a 502 as soon as it is gone, not a 504
    once the route's timeout (30 s by default) is over."""
    async with scripted(always(None, hang_up=True)) as upstream:
        route = {"name": "r", "path": "/", "upstream": upstream.url, "fence": {}}
        client = await start_proxy([route])  # the route's timeout: 30 s
        headers = {"Fencing-Job": "j", "Fencing-Token": "1"}
        async with asyncio.timeout(5), client.post("/w", data=b"{}", headers=headers) as answer:
            assert answer.status == 502
            assert (await answer.json())["type"].endswith("upstream-failed")


async def test_an_unreachable_upstream_is_refused_before_anything_is_sent(
    start_proxy: ProxyFactory,
) -> None:
    route = {"name": "r", "path": "/", "upstream": f"http://127.0.0.1:{free_port()}", "fence": {}}
    client = await start_proxy([route])
    headers = {"Fencing-Job": "j", "Fencing-Token": "1"}
    async with client.post("/w", data=b"{}", headers=headers) as answer:
        assert answer.status == 502
        assert (await answer.json())["type"].endswith("upstream-unreachable")
    async with client.post("/w", data=b"{}", headers=headers) as answer:
        assert answer.status == 502  # not quarantined: the first write never left


def test_every_upstream_error_is_documented() -> None:
    documented = {error.slug for _, error, _ in FAILURES.values()}
    assert documented == {cls.slug for cls in UpstreamError.__subclasses__()}
