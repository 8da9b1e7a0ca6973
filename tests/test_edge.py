"""Hostile input at the door, with raw sockets against a real proxy and an upstream
that records what it receives: versions the proxy does not speak, bytes behind an
Upgrade, the parser's own refusals as problems, slow heads and bodies, clients that
leave mid-body, bodies held open to exhaust memory, and connection floods (in a real
process, with its descriptor limit lowered). Each gets its 4xx, 503 or closed
connection, and nothing of it reaches the upstream."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestClient

from fenceproxy.http.edge import LINGER_FOR, log_accept_errors
from fenceproxy.testing import ProxyProcess, RecordingUpstream, eventually, free_port, status

from .conftest import ProxyFactory, fenced, raw_request

Client = TestClient[Any, Any]

FENCE = b"Fencing-Job: j\r\nFencing-Token: 1\r\n"


def answer_of(raw: bytes) -> tuple[int, dict[str, Any] | None]:
    """The status of a raw answer, and its problem body if it has one."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    problem = json.loads(body) if b"application/problem+json" in head else None
    return status, problem


def kind(problem: dict[str, Any] | None) -> str:
    assert problem is not None
    return str(problem["type"]).rsplit(":", 1)[1]


async def open_raw(port: int, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    return reader, writer


# -- what the proxy does not speak ----------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [b"POST /billing/x HTTP/2.0", b"POST /billing/x HTTP/0.9", b"GET /billing/x HTTP/2.0"],
)
async def test_another_http_version_is_505_and_reaches_nothing(
    proxy: Client, upstream: RecordingUpstream, line: bytes
) -> None:
    raw = await raw_request(
        proxy.port, line + b"\r\nHost: a\r\n" + FENCE + b"Content-Length: 2\r\n\r\n{}"
    )
    assert raw.startswith(b"HTTP/1.1 505 "), raw  # answered in HTTP/1.1, whatever was sent
    assert kind(answer_of(raw)[1]) == "http-version-not-supported"
    assert upstream.received == []


@pytest.mark.parametrize(
    "data",
    [b"GET /billing/x\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"],
    ids=["http-0.9-simple-request", "http2-preface"],
)
async def test_http_09_and_the_http2_preface_are_505(
    proxy: Client, upstream: RecordingUpstream, data: bytes
) -> None:
    status, problem = answer_of(await raw_request(proxy.port, data))
    assert (status, kind(problem)) == (505, "http-version-not-supported")
    assert upstream.received == []


@pytest.mark.parametrize(
    "upgrade",
    [b"Connection: Upgrade\r\nUpgrade: websocket\r\n",
     b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABk\r\n"],
    ids=["websocket", "h2c"],
)  # fmt: skip
async def test_bytes_behind_an_upgrade_request_are_never_read_as_a_request(
    proxy: Client, upstream: RecordingUpstream, upgrade: bytes
) -> None:
    """The Upgrade is ignored (RFC 9110 §7.8 lets a server), the request answered as
    HTTP/1.1, and the connection closed: nothing hangs, and the bytes sent behind it,
    a request included, reach no upstream."""
    behind = b"POST /billing/y HTTP/1.1\r\nHost: a\r\n" + FENCE + b"Content-Length: 2\r\n\r\n{}"
    data = (
        b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE + upgrade
        + b"Content-Length: 2\r\n\r\n{}" + behind
    )  # fmt: skip
    async with asyncio.timeout(10):
        raw = await raw_request(proxy.port, data)
    assert raw.startswith(b"HTTP/1.1 200 "), raw
    assert raw.count(b"HTTP/1.1 ") == 1
    assert b"\r\nConnection: close\r\n" in raw
    assert [r.path_qs for r in upstream.received] == ["/billing/x"]
    assert "Upgrade" not in upstream.received[0].headers


async def test_a_target_whose_host_is_not_a_name_is_400_not_a_hang(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    async with asyncio.timeout(10):
        raw = await raw_request(
            proxy.port, b"POST http://xn--/billing/x HTTP/1.1\r\nHost: a\r\n\r\n"
        )
    status, problem = answer_of(raw)
    assert (status, kind(problem)) == (400, "request-target-malformed")
    assert upstream.received == []


# -- the parser's refusals ------------------------------------------------------------

PARSER_CASES = {
    "more than 100 headers": (
        b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
        + b"".join(b"X-H%d: v\r\n" % i for i in range(101)) + b"Content-Length: 2\r\n\r\n{}",
        431, "request-head-too-large"),
    "a header over 8190 bytes": (
        b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
        + b"X-Big: " + b"s" * 9000 + b"\r\nContent-Length: 2\r\n\r\n{}",
        431, "request-head-too-large"),
    "a request line over 8190 bytes": (
        b"GET /billing/" + b"s" * 9000 + b" HTTP/1.1\r\nHost: a\r\n\r\n",
        431, "request-head-too-large"),
    "a bare LF": (
        b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
        + b"X-A: 1\nX-B: 2\r\nContent-Length: 2\r\n\r\n{}", 400, "request-malformed"),
    "content-length and transfer-encoding": (
        b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
        + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        400, "request-malformed"),
    "a NUL in a header name": (
        b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE + b"X-\x00s: 1\r\n\r\n",
        400, "request-malformed"),
    "broken chunked framing": (
        b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
        + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nss\r\n0\r\n\r\n", 400, "request-malformed"),
}  # fmt: skip


@pytest.mark.parametrize(("data", "status", "slug"), PARSER_CASES.values(), ids=PARSER_CASES)
async def test_what_the_parser_refuses_is_answered_as_a_problem_without_echo(
    proxy: Client, upstream: RecordingUpstream, data: bytes, status: int, slug: str
) -> None:
    raw = await raw_request(proxy.port, data)
    got, problem = answer_of(raw)
    assert (got, kind(problem)) == (status, slug), raw
    assert b"sss" not in raw  # what the client sent is never quoted back
    assert upstream.received == []
    assert (await fenced(proxy, "j", 1)).status == 200  # and the proxy goes on


# -- slow heads and bodies ------------------------------------------------------------

LIMITS = {"header_timeout": "300ms", "body_timeout": "300ms", "keepalive_timeout": "5s"}


@pytest.fixture
async def strict(start_proxy: ProxyFactory, upstream: RecordingUpstream) -> Client:
    routes = [
        {"name": "billing", "path": "/billing/", "upstream": upstream.url},
        {"name": "files", "path": "/files/", "upstream": upstream.url, "fence": False},
    ]
    return await start_proxy(routes, limits=LIMITS)


@pytest.mark.parametrize(
    "sent", [b"", b"POST /billing/x HTTP/1.1\r\nHost: a\r\n"], ids=["nothing", "half-a-head"]
)
async def test_a_head_that_does_not_arrive_in_time_is_408_and_closed(
    strict: Client, upstream: RecordingUpstream, sent: bytes
) -> None:
    reader, writer = await open_raw(strict.port, sent)
    async with asyncio.timeout(10):
        raw = await reader.read()  # the proxy closes it
    writer.close()
    status, problem = answer_of(raw)
    assert (status, kind(problem)) == (408, "header-timeout")
    assert upstream.received == []


async def test_an_idle_keep_alive_connection_is_not_cut_by_the_head_timeout(
    strict: Client, upstream: RecordingUpstream
) -> None:
    request = b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE + b"Content-Length: 2\r\n\r\n{}"
    reader, writer = await open_raw(strict.port, request)
    first = await reader.readuntil(b'"/billing/x"}')
    assert first.startswith(b"HTTP/1.1 200 ")
    await asyncio.sleep(0.6)  # idle for twice the head timeout, within keep-alive
    writer.write(request)
    second = await reader.readuntil(b'"/billing/x"}')
    assert second.startswith(b"HTTP/1.1 200 ")
    writer.close()
    assert len(upstream.received) == 2


@pytest.mark.parametrize(
    ("path", "length", "sent"),
    [("/billing/x", 100, 10), ("/files/big", 1024 * 1024, 200 * 1024)],
    ids=["fenced-buffered", "unfenced-streamed"],
)
async def test_a_body_that_stops_arriving_is_408_and_never_reaches_the_upstream_whole(
    strict: Client, upstream: RecordingUpstream, path: str, length: int, sent: int
) -> None:
    head = f"POST {path} HTTP/1.1\r\nHost: a\r\nContent-Length: {length}\r\n".encode()
    reader, writer = await open_raw(strict.port, head + FENCE + b"\r\n" + b"x" * sent)
    async with asyncio.timeout(20):
        raw = await reader.read()
    writer.close()
    status, problem = answer_of(raw)
    assert (status, kind(problem)) == (408, "body-timeout")
    assert upstream.received == []  # a cut body is never a complete request upstream


async def test_bodies_held_in_memory_are_capped_across_requests(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    # One client: its share is the whole cap (the shares are test_fairness.py's).
    proxy = await start_proxy(
        limits={"max_buffered": "1MiB", "max_buffered_per_client": "1MiB", "body_timeout": "30s"}
    )
    bodies = proxy.server.proxy.bodies  # type: ignore[union-attr]
    part = 300 * 1024
    head = b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE + b"Content-Length: 400000\r\n\r\n"
    held = [await open_raw(proxy.port, head + b"x" * part) for _ in range(3)]
    await eventually(lambda: bodies.held == 3 * part)
    # A fourth body would take the total above the cap: refused, and it holds nothing.
    reader, writer = await open_raw(proxy.port, head + b"x" * part)
    async with asyncio.timeout(20):
        raw = await reader.read()
    writer.close()
    status, problem = answer_of(raw)
    assert (status, kind(problem)) == (503, "proxy-busy")
    assert b"\r\nRetry-After: 1\r\n" in raw
    # A small write still fits, and is forwarded.
    assert (await fenced(proxy, "j", 1)).status == 200
    # The stalled clients leave: what they held is given back.
    for _, w in held:
        w.close()
    await eventually(lambda: bodies.held == 0)
    assert [r.body for r in upstream.received] == [b"{}"]


LONG_ANSWER = 32 * 1024 * 1024  # beyond what loopback's socket buffers take


async def test_a_body_is_given_back_once_the_upstream_has_it(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """A client that sends its write and then reads nothing of a long answer holds no
    share of the body budget meanwhile."""
    upstream.respond = status(200, b"a" * LONG_ANSWER)
    proxy = await start_proxy(limits={"send_timeout": "60s"})
    bodies = proxy.server.proxy.bodies  # type: ignore[union-attr]
    request = b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE + b"Content-Length: 2\r\n\r\n{}"
    _, writer = await open_raw(proxy.port, request)
    await upstream.wait_for(1)
    await eventually(lambda: bodies.held == 0)  # while the answer waits for the client
    writer.close()


async def test_a_client_that_does_not_read_its_answer_is_cut_after_the_send_timeout(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """Its connection is being worked for, so the cap cannot take it back: the send
    timeout does."""
    upstream.respond = status(200, b"a" * LONG_ANSWER)
    proxy = await start_proxy(limits={"send_timeout": "500ms"})
    request = b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE + b"Content-Length: 2\r\n\r\n{}"
    reader, writer = await open_raw(proxy.port, request)
    await upstream.wait_for(1)
    got = 0
    async with asyncio.timeout(20):
        await asyncio.sleep(1.5)  # reads nothing for three times the send timeout
        while chunk := await reader.read(1024 * 1024):
            got += len(chunk)
    writer.close()
    assert got < LONG_ANSWER  # cut short: the proxy closed the connection


async def test_an_answer_before_the_body_closes_and_reads_nothing_behind_it(
    strict: Client, upstream: RecordingUpstream
) -> None:
    """A write refused before its body was read says ``Connection: close`` and the
    proxy closes its side at once: the body sent after the answer, and a request
    behind it, are never read as a request, and no 408 follows either."""
    head = b"POST /billing/x HTTP/1.1\r\nHost: a\r\nFencing-Job: j\r\nContent-Length: 100\r\n\r\n"
    reader, writer = await open_raw(strict.port, head)
    async with asyncio.timeout(5):
        refused = await reader.readuntil(b"}")
        writer.write(b"x" * 100 + WRITE)
        behind = await reader.read()  # the proxy's side is closed: EOF
    writer.close()
    assert refused.startswith(b"HTTP/1.1 428 "), refused
    assert b"\r\nConnection: close\r\n" in refused
    assert behind == b""
    assert upstream.received == []


# -- Expect: 100-continue ----------------------------------------------------------------

WRITE = b"PUT /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE + b"Content-Length: 2\r\n\r\n{}"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def expecting(path: str, length: int, fields: bytes = b"", method: str = "PUT") -> bytes:
    """The head of a request that waits for 100 Continue before sending its body."""
    return (
        f"{method} {path} HTTP/1.1\r\nHost: a\r\nContent-Length: {length}\r\n".encode()
        + fields + b"Expect: 100-continue\r\n\r\n"
    )  # fmt: skip


@pytest.mark.parametrize("size", [2 * 1024, 1024 * 1024], ids=["2KiB", "1MiB"])
@pytest.mark.parametrize(
    ("path", "fields"), [("/files/x", b""), ("/billing/x", FENCE)], ids=["pass-through", "fenced"]
)
async def test_a_client_that_expects_100_continue_gets_it_before_sending_its_body(
    strict: Client, upstream: RecordingUpstream, path: str, fields: bytes, size: int
) -> None:
    """The 100 comes with nothing of the body sent (a client waits for it: botocore a
    second, curl a second above 1 KiB); then the body, the answer, and the
    connection goes on. ``Expect`` never reaches the upstream."""
    body = b"b" * size
    reader, writer = await open_raw(strict.port, expecting(path, len(body), fields))
    async with asyncio.timeout(5):
        interim = await reader.readuntil(b"\r\n\r\n")  # before any byte of the body
        assert interim == CONTINUE
        writer.write(body)
        head = await reader.readuntil(b"\r\n\r\n")
        status, length = head.split(b" ", 2)[1], _content_length(head)
        await reader.readexactly(length)
        writer.write(WRITE)  # the connection goes on
        again = await reader.readuntil(b"\r\n\r\n")
    writer.close()
    assert status == b"200", head
    assert CONTINUE not in head + again
    assert again.startswith(b"HTTP/1.1 200 "), again
    assert [len(r.body) for r in upstream.received] == [size, 2]
    assert all("Expect" not in r.headers for r in upstream.received)


async def test_a_lease_call_that_expects_100_continue_gets_it(start_proxy: ProxyFactory) -> None:
    proxy = await start_proxy(leases={})
    body = json.dumps({"owner": "w", "ttl": 30}).encode()
    head = expecting("/_leases/j/claim", len(body), method="POST")
    reader, writer = await open_raw(proxy.port, head)
    async with asyncio.timeout(5):
        interim = await reader.readuntil(b"\r\n\r\n")
        writer.write(body)
        head = await reader.readuntil(b"\r\n\r\n")
        claimed = json.loads(await reader.readexactly(_content_length(head)))
    writer.close()
    assert interim == CONTINUE
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert claimed["generation"] == 1


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    raise AssertionError(head)


EARLY = {
    "fencing header missing": ("/billing/x", 100, b"Fencing-Job: j\r\n", 428),
    "fenced, above max_body": ("/billing/x", 64 * 1024, FENCE, 413),
    "pass-through, above max_body": ("/files/x", 64 * 1024, b"", 413),
    "no route": ("/nowhere/x", 100, b"", 404),
}


@pytest.mark.parametrize(("path", "length", "fields", "code"), EARLY.values(), ids=EARLY)
async def test_a_refusal_before_the_body_of_an_expect_request_closes_the_connection(
    start_proxy: ProxyFactory,
    upstream: RecordingUpstream,
    path: str,
    length: int,
    fields: bytes,
    code: int,
) -> None:
    """No 100: the final answer, with ``Connection: close``, and the proxy's side
    closed at once. The client, which never sends the body, sends its next request:
    it is not read as the body nor as a request (it would have been 400 ``Invalid
    method``, or a stall while the body was waited for)."""
    routes = [
        {"name": "billing", "path": "/billing/", "upstream": upstream.url, "max_body": "32KiB"},
        {"name": "files", "path": "/files/", "upstream": upstream.url, "fence": False,
         "max_body": "32KiB"},
    ]  # fmt: skip
    proxy = await start_proxy(routes)
    reader, writer = await open_raw(proxy.port, expecting(path, length, fields))
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
        answer = await reader.readexactly(_content_length(head))
        writer.write(WRITE)
        behind = await reader.read()  # EOF: the proxy closed its side
    writer.close()
    assert head.startswith(b"HTTP/1.1 %d " % code), head
    assert b"\r\nConnection: close\r\n" in head
    assert json.loads(answer)["status"] == code  # a problem
    assert behind == b""
    assert upstream.received == []
    assert (await fenced(proxy, "j", 1)).status == 200  # and the proxy goes on


@pytest.mark.parametrize(
    "expect", [b"200-ok", b"100-continue, x-also", b"100-continue\r\nExpect: nope"]
)
async def test_any_expectation_but_100_continue_is_417(
    proxy: Client, upstream: RecordingUpstream, expect: bytes
) -> None:
    data = (
        b"PUT /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE + b"Expect: " + expect
        + b"\r\nContent-Length: 2\r\n\r\n{}"
    )  # fmt: skip
    async with asyncio.timeout(5):
        raw = await raw_request(proxy.port, data)
    status, problem = answer_of(raw)
    assert (status, kind(problem)) == (417, "expectation-failed")
    assert b"x-also" not in raw  # never quoted back
    assert b"nope" not in raw
    assert upstream.received == []


async def test_100_continue_in_an_http_10_request_is_ignored(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    """RFC 9110 §10.1.1: such a client sends its body without waiting."""
    data = (
        b"PUT /billing/x HTTP/1.0\r\nHost: a\r\n" + FENCE
        + b"Expect: 100-continue\r\nContent-Length: 2\r\n\r\n{}"
    )  # fmt: skip
    async with asyncio.timeout(5):
        raw = await raw_request(proxy.port, data)
    assert raw.startswith(b"HTTP/1.0 200 "), raw
    assert CONTINUE not in raw
    assert [r.body for r in upstream.received] == [b"{}"]


CURL = shutil.which("curl")


async def curl(*args: str) -> tuple[str, str]:
    """curl's ``-w`` output and its ``-v`` trace. With ``--expect100-timeout 30`` a
    proxy that never sends 100 Continue holds curl beyond the test's deadline."""
    if CURL is None:
        if os.environ.get("CI"):
            pytest.fail("curl is not installed, and CI must run every test")
        pytest.skip("curl is not installed")
    process = await asyncio.create_subprocess_exec(
        CURL, "-sS", "-v", "--expect100-timeout", "30", "-H", "Expect: 100-continue",
        "-o", "/dev/null", "-w", "%{http_code} %{size_upload}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(20):
        out, err = await process.communicate()
    return out.decode(), err.decode()


@pytest.mark.parametrize("size", [2 * 1024, 1024 * 1024], ids=["2KiB", "1MiB"])
@pytest.mark.parametrize("path", ["/files/x", "/billing/x"], ids=["pass-through", "fenced"])
async def test_curl_uploads_through_the_proxy_get_100_continue(
    strict: Client, upstream: RecordingUpstream, tmp_path: Path, path: str, size: int
) -> None:
    body = tmp_path / "body"
    body.write_bytes(b"c" * size)
    url = f"http://127.0.0.1:{strict.port}{path}"
    out, trace = await curl("-T", str(body), "-H", "Fencing-Job: j", "-H", "Fencing-Token: 1", url)
    assert out == f"200 {size}", trace
    assert "< HTTP/1.1 100 Continue" in trace
    assert [len(r.body) for r in upstream.received] == [size]


async def test_curl_refused_before_its_body_sends_none_and_is_told_to_close(
    strict: Client, upstream: RecordingUpstream, tmp_path: Path
) -> None:
    body = tmp_path / "body"
    body.write_bytes(b"c" * 4096)
    url = f"http://127.0.0.1:{strict.port}/billing/x"
    out, trace = await curl("-T", str(body), "-H", "Fencing-Job: j", url)
    assert out == "428 0", trace
    assert "< Connection: close" in trace
    assert "100 Continue" not in trace
    assert upstream.received == []


REFUSED_MID_BODY = {
    "408": (b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
            + b"Content-Length: 100\r\n\r\n" + b"x" * 10, 408),
    "408 after 100 Continue": (expecting("/billing/x", 100, FENCE), 408),
    "503": (b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
            + b"Content-Length: 100000\r\n\r\n" + b"x" * 80000, 503),
}  # fmt: skip


@pytest.mark.parametrize(("data", "code"), REFUSED_MID_BODY.values(), ids=REFUSED_MID_BODY)
async def test_a_connection_refused_mid_body_is_gone_soon_even_if_the_client_stays(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, data: bytes, code: int
) -> None:
    """The answer ends with the proxy's FIN; the connection lingers at most
    ``LINGER_FOR`` for the client to close (aiohttp's own lingering held it, and its
    slot under the connection cap, for 10 s), then the proxy closes it."""
    proxy = await start_proxy(limits={"body_timeout": "300ms", "max_buffered": "64KiB"})
    server = proxy.server.runner.server  # type: ignore[union-attr]
    reader, writer = await open_raw(proxy.port, data)
    async with asyncio.timeout(5):
        raw = await reader.read()  # EOF right after the answer; the client stays
    await eventually(lambda: server.open_connections == 0, within=LINGER_FOR + 2)
    writer.close()
    status, problem = answer_of(raw.removeprefix(CONTINUE))
    assert (status, kind(problem)) == (code, "body-timeout" if code == 408 else "proxy-busy")
    assert b"\r\nConnection: close\r\n" in raw
    assert upstream.received == []


async def test_a_connection_closed_after_a_bodiless_request_is_forgotten(
    start_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A request without a body has aiohttp's shared empty payload: closing its
    connection frees the connection as any other, with nothing logged."""
    proxy = await start_proxy()
    server = proxy.server.runner.server  # type: ignore[union-attr]
    for _ in range(3):
        reader, writer = await open_raw(proxy.port, b"GET /billing/x HTTP/1.1\r\nHost: a\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        writer.close()
    await eventually(lambda: not server.connections and server.open_connections == 0)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# -- clients that leave, floods ---------------------------------------------------------


def write_config(tmp_path: Path, upstream: RecordingUpstream, **limits: Any) -> Path:
    path = tmp_path / "proxy.yaml"
    config = {
        "store": f"sqlite:///{tmp_path / 'fences.db'}",
        "routes": [{"name": "billing", "path": "/billing/", "upstream": upstream.url}],
        "limits": limits,
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def test_a_client_that_leaves_mid_body_is_one_log_line(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    proxy = ProxyProcess(write_config(tmp_path, upstream), free_port(), "--access-log")
    try:
        await proxy.start()
        head = b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE + b"Content-Length: 100\r\n\r\n"
        _, writer = await open_raw(proxy.port, head + b"abc")
        writer.close()
        await eventually(lambda: "client-closed-request" in proxy.output())
        await eventually(lambda: '" 499 ' in proxy.output())
        log = proxy.output()
    finally:
        await proxy.stop()
    assert "Traceback" not in log
    assert " 500 " not in log
    assert sum("client-closed-request" in line for line in log.splitlines()) == 1  # one line
    assert upstream.received == []


def rss_of(pid: int) -> tuple[int, int]:
    """VmRSS and VmHWM of a process, in KiB."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


async def test_uploads_held_open_one_byte_short_keep_memory_bounded(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    """150 fenced uploads declaring 4 MiB each stop one byte short (600 MiB in all):
    the proxy holds at most its 16 MiB cap of them, refuses the rest with 503, and
    the body timeout cuts those it holds. Its memory grows by the cap plus what each
    connection buffers while it streams (measured: about 0.8 MiB at full speed), and
    goes back down once they are gone."""
    config = write_config(tmp_path, upstream, max_buffered="16MiB", body_timeout="2s")
    proxy = ProxyProcess(config, free_port())
    size = 4 * 1024 * 1024
    try:
        await proxy.start()
        assert proxy.process is not None
        before, _ = rss_of(proxy.process.pid)
        head = (
            b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
            + f"Content-Length: {size}\r\n\r\n".encode()
        )  # fmt: skip

        async def upload() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            try:
                writer.write(head)
                chunk = b"x" * (256 * 1024)
                sent = 0
                while sent < size - 1:
                    part = chunk[: size - 1 - sent]
                    writer.write(part)
                    sent += len(part)
                    await writer.drain()
                return await reader.read()
            except ConnectionError:
                return b"closed"
            finally:
                writer.close()

        async with asyncio.timeout(120):
            answers = await asyncio.gather(*(upload() for _ in range(150)))
        _, peak = rss_of(proxy.process.pid)
        # KiB: the cap, plus what each connection buffers while it streams.
        assert peak - before < 16 * 1024 + 150 * 1024, (before, peak)
        # And given back once they are gone: the client saw its connections end, the
        # proxy may still be tearing the last of them down.
        pid = proxy.process.pid
        await eventually(lambda: rss_of(pid)[0] - before < 16 * 1024, within=15)
    finally:
        await proxy.stop()
    statuses = [answer_of(a)[0] if a.startswith(b"HTTP/") else 0 for a in answers]
    assert set(statuses) <= {408, 503, 0}, statuses
    assert statuses.count(408) >= 1, statuses  # held, then cut by the body timeout
    assert statuses.count(503) >= 1, statuses  # beyond the cap
    assert upstream.received == []


async def test_a_flood_of_stalled_connections_still_lets_a_client_through(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    """With its descriptor limit at 256, the proxy caps itself at 96 connections. 400
    connections that stall mid-head take them all; a client that comes after is still
    served (the least recently active stalled ones are closed for it), and the log
    says so in a few lines, without a traceback."""
    proxy = ProxyProcess(write_config(tmp_path, upstream), free_port(), nofile=256)
    stalled: list[asyncio.StreamWriter] = []
    try:
        await proxy.start()
        assert "lowered from 10000 to 96" in proxy.output()
        for _ in range(400):
            try:
                _, writer = await open_raw(proxy.port, b"POST /billing/x HTTP/1.1\r\nHost: a\r\n")
            except OSError:
                continue  # the proxy closed it before it was even written to
            stalled.append(writer)
        async with aiohttp.ClientSession() as session:
            for n in range(5):
                async with session.post(
                    f"{proxy.url}/billing/x",
                    json={"n": n},
                    headers={"Fencing-Job": "j", "Fencing-Token": "1"},
                ) as response:
                    assert response.status == 200
        log = proxy.output()
    finally:
        for writer in stalled:
            writer.close()
        await proxy.stop()
    assert "Traceback" not in log
    assert log.count("limits.max_connections") <= 3, log
    assert len(upstream.received) == 5


async def test_a_connection_beyond_a_cap_of_busy_ones_is_refused_with_503(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(limits={"max_connections": 2, "max_connections_per_client": 2})
    release = upstream.hold()
    busy = [asyncio.ensure_future(fenced(proxy, f"job-{n}", 1)) for n in range(2)]
    await upstream.wait_for(2)  # both are at the upstream: the proxy works for them
    status, problem = answer_of(await raw_request(proxy.port, b"GET /billing/x HTTP/1.1\r\n\r\n"))
    assert (status, kind(problem)) == (503, "proxy-busy")
    release()
    assert [r.status for r in await asyncio.gather(*busy)] == [200, 200]


def test_accept_errors_are_logged_once_in_a_while_not_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.new_event_loop()
    try:
        log_accept_errors(loop)
        with caplog.at_level(logging.ERROR, logger="fenceproxy.server"):
            for _ in range(10_000):
                loop.call_exception_handler(
                    {
                        "message": "socket.accept() out of system resource",
                        "exception": OSError(24, os.strerror(24)),
                    }
                )
    finally:
        loop.close()
    lines = [r for r in caplog.records if r.name == "fenceproxy.server"]
    assert len(lines) == 1
    assert "Too many open files" in lines[0].getMessage()
    assert lines[0].exc_info is None
