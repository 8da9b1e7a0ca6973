"""A fair share under abuse, on default limits unless a test says otherwise: bodies
trickled in by one client hold at most its share of the memory for bodies, and no
longer than the minimum rate allows; many clients together cannot take the slice
kept for the lease API; one client's connections beyond its share close its own idle
ones, never another's; behind a trusted proxy, the share is the forwarded client's;
and a pass-through upload to an upstream that stops reading is cut. Meanwhile
another client's fenced writes and lease calls are served."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient

from fenceproxy.config import LimitsSpec
from fenceproxy.http.edge import Bodies
from fenceproxy.http.server import DataPlane
from fenceproxy.http.upstream import TrustedProxies
from fenceproxy.testing import (
    ProxyProcess,
    RecordingUpstream,
    eventually,
    free_port,
    listening,
)

from .certs import Certificates
from .conftest import ProxyFactory, fenced
from .test_edge import answer_of, kind

Client = TestClient[Any, Any]

MIB = 1024 * 1024
BURST = MIB - 1024
"""What a trickler sends at once of its 1 MiB body: the rest comes a byte a second."""
HEAD = (
    b"POST /billing/x HTTP/1.1\r\nHost: api\r\nFencing-Job: %s\r\nFencing-Token: 1\r\n"
    b"Content-Length: %d\r\n\r\n"
)
"""A fenced write's head, for its job and its body's length."""


def bodies_of(proxy: Client) -> Bodies:
    bodies: Bodies = proxy.server.proxy.bodies  # type: ignore[attr-defined]
    return bodies


class Trickler:
    """One fenced upload from ``source`` that sends ``burst`` bytes of its ``length``
    at once, then (once ``go`` is set, if given) a byte a second, for as long as the
    proxy keeps the connection; ``answer`` is what the proxy said (empty if it said
    nothing before closing)."""

    def __init__(
        self,
        port: int,
        source: str,
        job: str,
        fields: bytes = b"",
        *,
        length: int = MIB,
        burst: int = BURST,
        go: asyncio.Event | None = None,
    ) -> None:
        self.answer = b""
        self.sent = asyncio.Event()
        head = (
            b"POST /billing/x HTTP/1.1\r\nHost: api\r\nFencing-Job: %s\r\n"
            b"Fencing-Token: 1\r\n%sContent-Length: %d\r\n\r\n" % (job.encode(), fields, length)
        )
        self._task = asyncio.ensure_future(self._run(port, source, head + b"t" * burst, go))

    async def _run(self, port: int, source: str, data: bytes, go: asyncio.Event | None) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        try:
            writer.write(data)
            await writer.drain()
            self.sent.set()
            while not reader.at_eof():
                try:
                    async with asyncio.timeout(1.0):
                        self.answer += await reader.read(65536)
                except TimeoutError:
                    if go is None or go.is_set():
                        writer.write(b"t")
        except ConnectionError:
            pass
        finally:
            self.sent.set()
            writer.close()

    def status(self) -> tuple[int, str] | None:
        """The answer's status and problem type, once it came."""
        if not self.answer.startswith(b"HTTP/"):
            return None
        status, problem = answer_of(self.answer)
        return status, kind(problem) if problem is not None else ""

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await self._task


@asynccontextmanager
async def tricklers(
    port: int, sources: list[str], fields: bytes = b"", **kwargs: Any
) -> AsyncIterator[list[Trickler]]:
    """One trickler from each of ``sources`` (``kwargs`` for each), once each has
    sent its burst."""
    started = [
        Trickler(port, source, f"trickle-{n}", fields, **kwargs) for n, source in enumerate(sources)
    ]
    try:
        async with asyncio.timeout(60):
            for trickler in started:
                await trickler.sent.wait()
        yield started
    finally:
        await asyncio.gather(*(trickler.stop() for trickler in started))


async def served_meanwhile(proxy: Client, jobs: int = 20) -> list[int]:
    """A client's fenced writes (4 KiB each) and a lease's whole life: every status."""
    writes = await asyncio.gather(
        *(fenced(proxy, f"honest-{n}", 1, body={"pad": "h" * 4096}) for n in range(jobs))
    )
    claim = await proxy.post("/_leases/honest-lease/claim", json={"owner": "w", "ttl": 30})
    grant = await claim.json()
    lease = {"owner": "w", "generation": grant.get("generation")}
    renew = await proxy.post("/_leases/honest-lease/renew", json={**lease, "ttl": 30})
    complete = await proxy.post("/_leases/honest-lease/complete", json=lease)
    return [r.status for r in (*writes, claim, renew, complete)]


@pytest.mark.parametrize("count", [26, 100, 300])
async def test_tricklers_from_one_client_leave_another_client_served(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, count: int
) -> None:
    """``count`` uploads of 1 MiB, each left a byte short and then sent a byte a
    second (which the body timeout alone never cuts), from one address: the proxy
    holds that client's quarter of its 256 MiB for bodies and refuses the rest of its
    uploads; another client's writes and lease calls all go through."""
    proxy = await start_proxy(leases={})
    bodies = bodies_of(proxy)
    held = min(count, bodies.per_client // BURST)
    async with tricklers(proxy.port, ["127.0.0.2"] * count) as attack:
        refusals = count - held
        await eventually(
            lambda: (
                sum(t.status() is not None for t in attack) == refusals
                and bodies.held >= held * BURST
            )
        )
        assert bodies.held < held * MIB  # what has trickled in since is a byte a second
        assert set(await served_meanwhile(proxy)) == {200}
        refused = [t.status() for t in attack if t.status() is not None]
        assert refused == [(503, "proxy-busy")] * refusals
        assert all(b"max_buffered_per_client" in t.answer for t in attack if t.answer)
    assert {r.job for r in upstream.received} == {f"honest-{n}" for n in range(20)}


async def test_tricklers_from_many_clients_leave_the_lease_api_served_and_are_cut(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """40 clients with an upload each, and one more that takes what is left, fill the
    memory for bodies up to the slice kept for the lease API: a client's write is
    refused meanwhile, its lease calls are not. Trickling at under ``body_min_rate``,
    the uploads are cut within two windows (the body timeout, 3 s here), and the
    write goes through."""
    proxy = await start_proxy(leases={}, limits={"max_buffered": "32MiB", "body_timeout": "3s"})
    bodies = bodies_of(proxy)
    sources = [str(ipaddress.ip_address("127.0.1.1") + n) for n in range(41)]
    go = asyncio.Event()
    async with tricklers(proxy.port, sources[:40], go=go) as attack:
        budget = bodies.cap - bodies.cap // 16
        held = budget // BURST
        await eventually(
            lambda: (
                sum(t.status() is not None for t in attack) == 40 - held
                and bodies.held == held * BURST
            )
        )
        room = budget - bodies.held
        filler = [sources[40]]
        async with tricklers(proxy.port, filler, length=room + 1024, burst=room, go=go) as last:
            await eventually(lambda: bodies.held == budget)
            assert (await fenced(proxy, "honest", 1)).status == 503
            statuses = await served_meanwhile(proxy, jobs=0)
            assert statuses == [200, 200, 200]  # the slice kept for the lease API
            go.set()
            attack += last
            await eventually(lambda: all(t.status() is not None for t in attack), within=15)
        assert bodies.held == 0
    cut = [t.status() for t in attack]
    assert set(cut) == {(408, "body-timeout"), (503, "proxy-busy")}
    assert all(b"body_min_rate" in t.answer for t in attack if t.status()[0] == 408)  # type: ignore[index]
    assert (await fenced(proxy, "honest", 1)).status == 200
    assert [r.job for r in upstream.received] == ["honest"]


@pytest.mark.parametrize(("min_rate", "expected"), [("1KiB", 408), (0, 200)])
async def test_a_body_slower_than_the_minimum_rate_is_408(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, min_rate: Any, expected: int
) -> None:
    """100 bytes every 0.2 s (500 bytes a second) never pauses as long as the body
    timeout, 2 s; it is cut when it falls under 1 KiB a second over those 2 s, and
    served when there is no minimum. 8 KiB every 0.2 s is served either way."""
    limits = {"body_timeout": "2s", "body_min_rate": min_rate}
    proxy = await start_proxy(limits=limits)

    async def upload(piece: int, pieces: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            writer.write(
                b"POST /billing/x HTTP/1.1\r\nHost: api\r\nFencing-Job: j\r\nFencing-Token: 1\r\n"
                b"Content-Length: %d\r\n\r\n" % (piece * pieces)
            )
            for _ in range(pieces):
                if reader.at_eof() or writer.is_closing():
                    break
                writer.write(b"s" * piece)
                await asyncio.sleep(0.2)
            async with asyncio.timeout(10):
                return await reader.readuntil(b"\r\n\r\n") + await reader.read(4096)
        finally:
            writer.close()

    slow, fast = await asyncio.gather(upload(100, 15), upload(8192, 15))
    status, problem = answer_of(slow)
    assert status == expected
    if expected == 408:
        assert problem is not None
        assert kind(problem) == "body-timeout"
        assert "less than 1024 bytes a second over 2s (limits.body_min_rate)" in problem["detail"]
    assert answer_of(fast)[0] == 200
    assert sorted(len(r.body) for r in upstream.received) == (
        [8192 * 15] if expected == 408 else [100 * 15, 8192 * 15]
    )


async def idle(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def test_a_clients_connections_beyond_its_share_close_its_own_idle_ones(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(limits={"max_connections_per_client": 3})
    other = [await idle(proxy.port, "127.0.0.3") for _ in range(3)]
    mine = [await idle(proxy.port, "127.0.0.2") for _ in range(3)]
    await eventually(lambda: proxy.server.runner.server.open_connections == 6)  # type: ignore[union-attr]
    mine.append(await idle(proxy.port, "127.0.0.2"))
    async with asyncio.timeout(10):
        assert await mine[0][0].read() == b""  # its least recently active, closed for it
    for reader, writer in (*other, *mine[1:]):
        writer.write(b"GET /billing/x HTTP/1.1\r\nHost: api\r\n\r\n")
        async with asyncio.timeout(10):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
        writer.close()
    mine[0][1].close()


async def test_a_client_whose_connections_are_all_busy_is_refused_and_not_another(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(limits={"max_connections_per_client": 2})
    release = upstream.hold()
    busy = []
    for n in range(2):
        reader, writer = await idle(proxy.port, "127.0.0.2")
        writer.write(b"GET /billing/%d HTTP/1.1\r\nHost: api\r\n\r\n" % n)
        busy.append((reader, writer))
    await upstream.wait_for(2)  # both at the upstream: the proxy works for them
    reader, writer = await idle(proxy.port, "127.0.0.2")
    async with asyncio.timeout(10):
        status, problem = answer_of(await reader.read())
    writer.close()
    assert (status, kind(problem)) == (503, "proxy-busy")
    assert problem is not None
    assert "limits.max_connections_per_client" in problem["detail"]
    reader, writer = await idle(proxy.port, "127.0.0.3")
    writer.write(b"GET /billing/other HTTP/1.1\r\nHost: api\r\n\r\n")
    release()
    async with asyncio.timeout(10):
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
    writer.close()
    for _, w in busy:
        w.close()


async def test_behind_a_trusted_proxy_the_share_is_the_forwarded_clients(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """127.0.0.2 is a trusted proxy: it may hold any number of connections, and each
    client it forwards (the first untrusted hop of X-Forwarded-For, from the right)
    has a share of its own; naming another client further left changes nothing."""
    proxy = await start_proxy(
        trusted_proxies=["127.0.0.2/32"],
        limits={"max_buffered_per_client": "2MiB", "max_connections_per_client": 1},
    )
    bodies = bodies_of(proxy)
    a = b"X-Forwarded-For: 10.0.0.1\r\n"
    async with tricklers(proxy.port, ["127.0.0.2"] * 2, a):
        await eventually(lambda: bodies.held == 2 * BURST)
        spoofed = b"X-Forwarded-For: 10.0.0.2, 10.0.0.1\r\n"
        async with tricklers(proxy.port, ["127.0.0.2"], spoofed) as (third,):
            await eventually(lambda: third.status() is not None)
            assert third.status() == (503, "proxy-busy")
            assert b"max_buffered_per_client" in third.answer
        reader, writer = await idle(proxy.port, "127.0.0.2")
        body = json.dumps({"pad": "b" * (512 * 1024)}).encode()
        writer.write(
            b"POST /billing/x HTTP/1.1\r\nHost: api\r\nFencing-Job: b\r\nFencing-Token: 1\r\n"
            b"X-Forwarded-For: 10.0.0.2\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        async with asyncio.timeout(10):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
        writer.close()
    assert [r.job for r in upstream.received] == ["b"]


@pytest.mark.parametrize(
    ("forwarded", "client"),
    [
        (b"203.0.113.7, 10.0.0.1", "10.0.0.1"),
        (b"203.0.113.7:5151", "203.0.113.7"),  # a port, as some balancers add
        (b"[2001:db8::0:7]:443", "2001:db8::7"),  # one client, however it is spelled
        (b"203.0.113.7, 127.0.0.9", "203.0.113.7"),  # the trusted hop is passed over
        (b"203.0.113.7, ::ffff:127.0.0.9", "203.0.113.7"),  # a trusted hop, IPv4-mapped
        (b"::ffff:203.0.113.7", "203.0.113.7"),
        (b"203.0.113.7, unknown", "127.0.0.2"),  # not an address: the peer
        (b"", "127.0.0.2"),
    ],
)
def test_the_client_behind_a_trusted_proxy_is_its_first_untrusted_address(
    forwarded: bytes, client: str
) -> None:
    """Whom a share belongs to, behind a trusted proxy: the first address from the
    right of X-Forwarded-For that is not a trusted proxy, in one spelling, so that a
    port or another form of the same address is not a new client with a new share;
    an entry that is not an address ends what can be believed, and the peer stands."""
    trusted = TrustedProxies(["127.0.0.0/8"])
    assert trusted.client("127.0.0.2", [(b"X-Forwarded-For", forwarded)]) == client
    assert TrustedProxies([]).client("127.0.0.2", [(b"X-Forwarded-For", forwarded)]) == "127.0.0.2"


def test_a_clients_share_of_connections_is_a_tenth_of_the_cap_as_lowered() -> None:
    """Unset, one client may hold a tenth of the connections the proxy will really
    take (the cap lowered to fit the descriptor limit), not of the configured one."""
    handler: Any = None
    assert DataPlane(handler, LimitsSpec(), max_connections=300).connections_per_client == 30
    assert DataPlane(handler, LimitsSpec(), max_connections=5).connections_per_client == 1
    limits = LimitsSpec(max_connections_per_client=7)
    assert DataPlane(handler, limits, max_connections=300).connections_per_client == 7


async def test_a_clients_share_of_bodies_in_memory_is_a_quarter_of_max_buffered(
    start_proxy: ProxyFactory,
) -> None:
    """Unset, one client's bodies may hold a quarter of ``max_buffered`` (docs/limits.md:
    64 MiB of the default 256 MiB), following it when only it is set; set, its own."""
    assert LimitsSpec().buffered_per_client == 64 * MIB
    proxy = await start_proxy(limits={"max_buffered": "8MiB"})
    assert bodies_of(proxy).per_client == 2 * MIB
    limits = LimitsSpec(max_buffered=8 * MIB, max_buffered_per_client=3 * MIB)
    assert limits.buffered_per_client == 3 * MIB


async def test_a_pass_through_upload_to_an_upstream_that_stops_reading_is_cut(
    start_proxy: ProxyFactory,
) -> None:
    """The upstream reads the head and nothing more: once the sockets between are
    full, the upload waits for the upstream at most the route's timeout, then the
    client gets 504 and the upstream's connection is closed."""
    answered, closed = asyncio.Event(), asyncio.Event()

    async def stops_reading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await answered.wait()  # reads nothing until the client has its answer
        try:
            while await reader.read(MIB):  # then what was left, to the proxy's close
                pass
        except ConnectionError:
            pass  # the proxy's cut, as an abort
        closed.set()
        writer.close()

    async with listening(stops_reading) as url:
        route = {"name": "files", "path": "/files/", "upstream": url, "fence": False}
        proxy = await start_proxy([{**route, "timeout": "2s", "max_body": "1GiB"}])
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        size = 512 * MIB
        writer.write(b"PUT /files/big HTTP/1.1\r\nHost: api\r\nContent-Length: %d\r\n\r\n" % size)

        async def send() -> None:
            piece = b"u" * MIB
            for _ in range(size // MIB):
                writer.write(piece)
                await writer.drain()

        sending = asyncio.ensure_future(send())
        try:
            async with asyncio.timeout(20):
                head = await reader.readuntil(b"\r\n\r\n")
                body = await reader.read(4096)
        finally:
            sending.cancel()
            writer.close()
        status, problem = answer_of(head + body)
        assert (status, kind(problem)) == (504, "upstream-timeout")
        assert problem is not None
        assert "took none of the request body for 2s" in problem["detail"]
        answered.set()
        async with asyncio.timeout(10):
            await closed.wait()


async def test_tls_handshakes_that_never_end_are_counted_and_make_room(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    """50 connections to a TLS listener that never send a ClientHello, from one
    address: counted from the moment they are accepted, so that client keeps its 5
    (the least recently active closed for each newcomer), and a client from another
    address still shakes hands and is served."""
    certs = Certificates(tmp_path / "tls")
    cert, key = certs.server()
    config = tmp_path / "proxy.yaml"
    route = {"name": "billing", "path": "/billing/", "upstream": upstream.url}
    config.write_text(
        yaml.safe_dump(
            {
                "store": f"sqlite:///{tmp_path / 'fences.db'}",
                "routes": [route],
                "tls": {"cert": str(cert), "key": str(key)},
                "limits": {"max_connections_per_client": 5},
            }
        )
    )
    proxy = await ProxyProcess(config, free_port()).start()
    silent = [await idle(proxy.port, "127.0.0.2") for _ in range(50)]
    try:
        async with asyncio.timeout(20):
            ended = await asyncio.gather(*(reader.read() for reader, _ in silent[:45]))
        assert ended == [b""] * 45  # closed by the proxy, never answered in clear
        context = ssl.create_default_context(cafile=str(certs.ca_file))
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", proxy.port, ssl=context, server_hostname="localhost"
        )
        writer.write(
            b"POST /billing/x HTTP/1.1\r\nHost: api\r\nFencing-Job: j\r\nFencing-Token: 1\r\n"
            b"Content-Length: 2\r\n\r\n{}"
        )
        async with asyncio.timeout(10):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
        writer.close()
    finally:
        for _, writer in silent:
            writer.close()
        await proxy.stop()
    assert len(upstream.received) == 1


async def test_every_read_of_one_client_counts_against_one_share(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """Reads waiting for their bodies, a write of the same client that ends between,
    and reads begun after it: all of them one share, however the share came and went
    with the bytes it held."""
    proxy = await start_proxy(limits={"max_buffered_per_client": "1MiB"})
    bodies = bodies_of(proxy)
    size = 600 * 1024
    waiting = []
    for n in range(2):
        waiting.append(await idle(proxy.port, "127.0.0.2"))
        waiting[-1][1].write(HEAD % (b"w%d" % n, size))
    await eventually(lambda: bodies._shares["127.0.0.2"].reading == 2)
    _, between = await idle(proxy.port, "127.0.0.2")  # a write that ends meanwhile
    between.write(HEAD % (b"between", 2) + b"{}")
    await upstream.wait_for(1)
    await eventually(lambda: bodies.held == 0)
    for n in range(2, 4):
        waiting.append(await idle(proxy.port, "127.0.0.2"))
        waiting[-1][1].write(HEAD % (b"w%d" % n, size))
    for _, writer in waiting:  # all but the last byte: each body stays held as it came
        writer.write(b"w" * (size - 1))
    reads = [asyncio.ensure_future(reader.read()) for reader, _ in waiting]
    answered: set[asyncio.Future[bytes]] = set()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(10):
            while len(answered) < 3:
                pending = set(reads) - answered
                done, _ = await asyncio.wait(pending, return_when="FIRST_COMPLETED")
                answered |= done
    # Two bodies do not fit the client's 1 MiB: three refused, whichever came first,
    # and one held whole but its last byte.
    answers = [answer_of(read.result()) for read in answered]
    assert [(status, kind(problem)) for status, problem in answers] == [(503, "proxy-busy")] * 3
    assert bodies.held == size - 1
    for read in reads:
        read.cancel()
    for _, writer in (*waiting, (None, between)):
        writer.close()
    await eventually(lambda: bodies.held == 0)
    assert [r.job for r in upstream.received] == ["between"]


async def test_a_body_given_back_late_leaves_its_clients_newer_share_alone(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """An empty body holds nothing, and its share is gone before the body is given
    back (once the upstream has it): giving it back must not drop the share the
    client's later reads made, or the client could start over at nothing."""
    proxy = await start_proxy(limits={"max_buffered_per_client": "1MiB"})
    bodies = bodies_of(proxy)
    size = 600 * 1024
    release = upstream.hold()
    empty_reader, empty = await idle(proxy.port, "127.0.0.2")
    empty.write(HEAD % (b"empty", 0))
    await upstream.wait_for(1)  # upstream, its body not yet given back
    _, first = await idle(proxy.port, "127.0.0.2")
    first.write(HEAD % (b"first", size) + b"f" * (size - 1))
    await eventually(lambda: bodies.held == size - 1)
    release()
    async with asyncio.timeout(10):
        assert (await empty_reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
    second_reader, second = await idle(proxy.port, "127.0.0.2")
    second.write(HEAD % (b"second", size) + b"s" * (size - 1))
    async with asyncio.timeout(10):
        status, problem = answer_of(await second_reader.read())
    assert (status, kind(problem)) == (503, "proxy-busy")
    assert problem is not None
    assert "max_buffered_per_client" in problem["detail"]
    assert bodies.held == size - 1
    for writer in (empty, first, second):
        writer.close()
    await eventually(lambda: bodies.held == 0 and not bodies._shares)


async def test_a_clients_share_outlives_its_reads_while_it_holds_a_body_then_goes(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """A body read whole is held until the upstream has it, its read long over: its
    client's share stays meanwhile, so the client's next body counts with it (503
    beyond its share, not a fresh share). Once the body is given back the share is
    gone: the proxy keeps none for each client it ever served."""
    proxy = await start_proxy(limits={"max_buffered_per_client": "1MiB"})
    bodies = bodies_of(proxy)
    size = 600 * 1024
    release = upstream.hold()
    try:
        held_reader, held = await idle(proxy.port, "127.0.0.2")
        held.write(HEAD % (b"held", size) + b"h" * size)
        await upstream.wait_for(1)  # its read over, its body held until the answer
        more_reader, more = await idle(proxy.port, "127.0.0.2")
        more.write(HEAD % (b"more", size) + b"m" * size)
        async with asyncio.timeout(10):
            status, problem = answer_of(await more_reader.read())
    finally:
        release()
    assert (status, kind(problem)) == (503, "proxy-busy")
    assert problem is not None
    assert "max_buffered_per_client" in problem["detail"]
    async with asyncio.timeout(10):
        assert (await held_reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
    for writer in (held, more):
        writer.close()
    await eventually(lambda: bodies.held == 0 and not bodies._shares)
    assert [r.job for r in upstream.received] == ["held"]


async def test_with_a_minimum_rate_a_pause_is_still_held_to_the_body_timeout(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """A body that met the rate and then stops is cut by ``body_timeout`` (1 s), not
    when a window later finds it too slow."""
    proxy = await start_proxy(limits={"body_timeout": "1s", "body_min_rate": 1})
    reader, writer = await idle(proxy.port, "127.0.0.2")
    writer.write(
        b"POST /billing/x HTTP/1.1\r\nHost: api\r\nFencing-Job: j\r\nFencing-Token: 1\r\n"
        b"Content-Length: 100\r\n\r\n" + b"p" * 50
    )
    async with asyncio.timeout(10):
        status, problem = answer_of(await reader.read())
    writer.close()
    assert (status, kind(problem)) == (408, "body-timeout")
    assert problem is not None
    assert problem["detail"].startswith("no part of the body arrived for 1s")
    assert upstream.received == []


async def test_an_upload_to_an_upstream_that_resets_is_answered_without_reading_the_rest(
    start_proxy: ProxyFactory,
) -> None:
    """The upstream resets the connection after the head: the client is answered 502
    while it is still sending, not after its whole body was read into a dead socket."""

    async def resets(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.transport.abort()

    async with listening(resets) as url:
        route = {"name": "files", "path": "/files/", "upstream": url, "fence": False}
        proxy = await start_proxy([route])
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        pieces = 150  # 9.4 MiB, within the route's 10 MiB max_body
        writer.write(
            b"PUT /files/x HTTP/1.1\r\nHost: api\r\nContent-Length: %d\r\n\r\n" % (pieces * 65536)
        )
        answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
        sent = 0
        while not answer.done() and sent < pieces:
            writer.write(b"r" * 65536)
            sent += 1
            await asyncio.sleep(0.01)
        async with asyncio.timeout(10):
            head = await answer
        writer.close()
    assert head.startswith(b"HTTP/1.1 502 ")
    assert sent < pieces
