"""Test helpers shipped with the package, for fenceproxy's tests and yours.

* :class:`RecordingUpstream`: a real HTTP server on loopback that records every
  request it receives in full (what the API "applied") and answers as told.
* :class:`RawUpstream`: an upstream that records the very bytes it receives, before
  any HTTP library reads them, for asserting exactly what the proxy sent.
* :class:`SlowUpstream`: an upstream that reads request bodies at a fixed rate, as
  an overloaded API does, and applies a request only once its whole body arrived.
* :class:`DiscardingUpstream`: an upstream that reads each request's body and keeps
  only its length and SHA-256, for bodies larger than memory.
* :class:`FakeClock`: a clock tests move by hand instead of sleeping.
* :class:`ProxyTestServer`: a :class:`~fenceproxy.server.app.FenceProxy` on loopback, for
  aiohttp's test client (``aiohttp_client(ProxyTestServer(FenceProxy(config)))``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import resource
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Self

from aiohttp import web
from aiohttp.test_utils import BaseTestServer
from multidict import CIMultiDictProxy
from yarl import URL

from . import hdrs
from .errors import InvariantError
from .http.server import Listener
from .server.app import FenceProxy

__all__ = [
    "Arrival",
    "Discarded",
    "DiscardingUpstream",
    "FakeClock",
    "ProxyProcess",
    "ProxyTestServer",
    "RawRequest",
    "RawUpstream",
    "Received",
    "RecordingUpstream",
    "SlowUpstream",
    "drop_connection",
    "eventually",
    "free_port",
    "listening",
    "status",
]

Responder = Callable[[web.Request, "Received"], Awaitable[web.StreamResponse]]


class ProxyTestServer(BaseTestServer):
    """``proxy`` served on loopback, for aiohttp's test client: opened when the server
    starts, closed after it. ``runner`` is its :class:`Listener`, whose ``server`` is
    the data plane.

    It runs as ``fenceproxy serve`` does: a handler is not cancelled when its client
    leaves, unless ``handler_cancellation``."""

    def __init__(
        self, proxy: FenceProxy, *, handler_cancellation: bool = False, **kwargs: Any
    ) -> None:
        self.proxy = proxy
        self.handler_cancellation = handler_cancellation
        super().__init__(host="127.0.0.1", **kwargs)

    async def start_server(self, loop: asyncio.AbstractEventLoop | None = None, **_: Any) -> None:
        if self.runner is not None:
            return
        await self.proxy.__aenter__()
        plane = self.proxy.server(handler_cancellation=self.handler_cancellation)
        listener = Listener(plane, shutdown_timeout=self.proxy.config.shutdown_timeout)
        await listener.listen(self.host, self.port or 0)
        self.runner = listener  # type: ignore[assignment]  # not an aiohttp runner
        self.port = listener.ports[0]
        self.scheme = self.scheme or "http"
        self._root = URL(f"{self.scheme}://{self.host}:{self.port}")

    async def _make_runner(self, **kwargs: Any) -> web.ServerRunner:
        raise NotImplementedError("the proxy's data plane is not an aiohttp server")

    async def close(self) -> None:
        if self.runner is None or self.closed:
            return
        listener: Listener = self.runner  # type: ignore[assignment]
        try:
            await listener.close()
        finally:
            self._root = None
            self.port = None
            self._closed = True
            await self.proxy.__aexit__(None, None, None)


@dataclass(frozen=True, slots=True)
class Received:
    """One request as the upstream received it, body complete."""

    method: str
    path_qs: str
    headers: CIMultiDictProxy[str]
    body: bytes

    @property
    def job(self) -> str | None:
        return self.headers.get(hdrs.DEFAULT_JOB)

    @property
    def generation(self) -> int | None:
        token = self.headers.get(hdrs.DEFAULT_TOKEN)
        return int(token) if token is not None and token.isdigit() else None

    @property
    def key(self) -> str | None:
        return self.headers.get(hdrs.DEFAULT_KEY)


async def _ok(request: web.Request, received: Received) -> web.StreamResponse:
    return web.json_response({"applied": True, "path": received.path_qs}, status=200)


class RecordingUpstream:
    """An upstream that records what it receives, then answers with ``respond``.

    A request is recorded once its whole body has arrived, before ``respond`` runs,
    so a hanging or failing ``respond`` still counts as received. Set ``respond``
    to change the answer; :meth:`hold` makes requests wait until released.
    """

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.respond: Responder = _ok
        self.latency: Callable[[], float] | None = None
        """Seconds a request spends between arriving and being applied (recorded):
        a slow API, under which concurrent requests can overtake each other."""
        self._changed = asyncio.Condition()
        self._gate: asyncio.Event | None = None
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", r"/{tail:[\s\S]*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if self.latency is not None:
            await asyncio.sleep(self.latency())
        received = Received(request.method, request.rel_url.raw_path_qs, request.headers, body)
        async with self._changed:
            self.received.append(received)
            self._changed.notify_all()
        if self._gate is not None:
            await self._gate.wait()
        return await self.respond(request, received)

    def hold(self) -> Callable[[], None]:
        """Make requests wait after being recorded; call the returned function to
        let every waiting and later request through."""
        gate = self._gate = asyncio.Event()

        def release() -> None:
            gate.set()
            if self._gate is gate:
                self._gate = None

        return release

    async def wait_for(self, count: int, within: float = 10.0) -> list[Received]:
        """Wait until ``count`` requests were received; return them all."""
        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(lambda: len(self.received) >= count)
        return list(self.received)

    def bodies(self) -> list[object]:
        return [json.loads(r.body) if r.body else None for r in self.received]

    @classmethod
    @asynccontextmanager
    async def serve(
        cls, host: str = "127.0.0.1", port: int = 0, *, tls: ssl.SSLContext | None = None
    ) -> AsyncIterator[RecordingUpstream]:
        """Run one on loopback for the duration of the block (over TLS, given its
        context); ``url`` says where."""
        upstream = cls()
        runner = web.AppRunner(upstream.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=tls)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        scheme = "http" if tls is None else "https"
        name = f"[{host}]" if ":" in host else host  # an IPv6 address
        upstream.url = f"{scheme}://{name}:{sock.getsockname()[1]}"
        try:
            yield upstream
        finally:
            await runner.cleanup()


@dataclass(frozen=True, slots=True)
class RawRequest:
    """One request as its bytes arrived: the head (request line and fields, without
    the blank line) and the body, de-chunked if it was chunked."""

    head: bytes
    body: bytes

    @property
    def request_line(self) -> bytes:
        return self.head.split(b"\r\n", 1)[0]

    @property
    def method(self) -> str:
        return self.request_line.split(b" ")[0].decode("ascii")

    @property
    def target(self) -> str:
        """The request target exactly as sent, percent-encoding and all."""
        return self.request_line.split(b" ")[1].decode("latin-1")

    @property
    def fields(self) -> list[tuple[str, str]]:
        """Every header field in the order sent, names as sent."""
        out = []
        for line in self.head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            out.append((name.decode("latin-1"), value.strip().decode("latin-1")))
        return out

    def values(self, name: str) -> list[str]:
        """Every value of the field ``name`` (any case), in order."""
        return [v for n, v in self.fields if n.lower() == name.lower()]


@asynccontextmanager
async def listening(
    connection: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[str]:
    """A server on a free loopback port whose every connection ``connection`` serves,
    for the block; yields its URL."""
    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


class _StreamServer:
    """An upstream on loopback whose every connection ``_connection`` serves."""

    url: str

    @classmethod
    @asynccontextmanager
    async def serve(cls) -> AsyncIterator[Self]:
        upstream = cls()
        async with listening(upstream._connection) as upstream.url:
            yield upstream

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Each request in turn, its head read here and its body by :meth:`_take`,
        answered ``200 {}`` (no body to a HEAD), until the connection ends."""
        try:
            while True:
                head = RawRequest((await reader.readuntil(b"\r\n\r\n"))[:-4], b"")
                if not await self._take(reader, head):
                    return
                answer = b"" if head.method == "HEAD" else b"{}"
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n" + answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _take(self, reader: asyncio.StreamReader, head: RawRequest) -> bool:
        """Read and record one request's body; False if the connection ended first."""
        raise NotImplementedError


class RawUpstream(_StreamServer):
    """An HTTP/1.1 upstream on loopback that records each request's bytes as they
    arrive and answers ``200 {}``, keeping the connection open. It understands only
    what a proxy sends it: ``Content-Length`` or chunked bodies."""

    def __init__(self) -> None:
        self.received: list[RawRequest] = []
        self.url = ""

    async def _take(self, reader: asyncio.StreamReader, head: RawRequest) -> bool:
        if any(v.lower() == "chunked" for v in head.values("Transfer-Encoding")):
            body = await _read_chunked(reader)
        else:
            lengths = head.values("Content-Length")
            body = await reader.readexactly(int(lengths[0])) if lengths else b""
        self.received.append(RawRequest(head.head, body))
        return True


@dataclass(frozen=True, slots=True)
class Discarded:
    """One request as a :class:`DiscardingUpstream` received it: its head, and its
    body's length and SHA-256 (hex)."""

    head: RawRequest
    length: int
    sha256: str


class DiscardingUpstream(_StreamServer):
    """An HTTP/1.1 upstream on loopback that reads each request's body, keeps only its
    length and SHA-256, and answers ``200 {}``. Bodies must come with a
    ``Content-Length``, as the proxy sends a fenced write's."""

    def __init__(self) -> None:
        self.received: list[Discarded] = []
        self.url = ""

    async def _take(self, reader: asyncio.StreamReader, head: RawRequest) -> bool:
        lengths = head.values("Content-Length")
        remaining = int(lengths[0]) if lengths else 0
        digest, length = hashlib.sha256(), 0
        while remaining:
            data = await reader.read(min(remaining, 1024 * 1024))
            if not data:
                return False
            digest.update(data)
            length += len(data)
            remaining -= len(data)
        self.received.append(Discarded(head, length, digest.hexdigest()))
        return True


@dataclass(frozen=True, slots=True)
class Arrival:
    """A request as :class:`SlowUpstream` saw it end: whole (applied) or cut short."""

    job: str | None
    generation: int | None
    received: int
    """Bytes of the body that arrived."""
    at: float
    """When it ended, on ``time.monotonic()``."""


class SlowUpstream:
    """An HTTP/1.1 upstream on loopback that reads request bodies at ``rate`` bytes a
    second and its kernel buffers kept small, so a large body stays on the proxy's
    side of the wire for a while. A request is *applied* (and answered ``200``) only
    once its whole ``Content-Length`` body arrived; one whose connection ended first
    is *cut*. What arrived but not whole is never applied, as an API would not."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.url = ""
        self.applied: list[Arrival] = []
        self.cut: list[Arrival] = []
        self.receiving: list[tuple[str | None, int | None]] = []
        """Requests whose head arrived, in order."""
        self._open: set[asyncio.Transport] = set()

    @classmethod
    @asynccontextmanager
    async def serve(cls, rate: float) -> AsyncIterator[SlowUpstream]:
        upstream = cls(rate)
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Inherited by every accepted socket, before the window is agreed.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        sock.bind(("127.0.0.1", 0))
        server = await loop.create_server(lambda: _SlowReader(upstream), sock=sock)
        upstream.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        try:
            yield upstream
        finally:
            server.close()
            for transport in upstream._open:
                transport.abort()
            await server.wait_closed()

    def ended(self) -> list[Arrival]:
        """Every request that ended, applied or cut."""
        return [*self.applied, *self.cut]


class _SlowReader(asyncio.Protocol):
    def __init__(self, upstream: SlowUpstream) -> None:
        self._up = upstream
        self._buffer = bytearray()
        self._head: RawRequest | None = None
        self._length = 0
        self._transport: asyncio.Transport | None = None
        self._started = time.monotonic()
        self._taken = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._up._open.add(transport)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._taken += len(data)
        self._advance()
        ahead = self._taken / self._up.rate - (time.monotonic() - self._started)
        if ahead > 0 and self._transport is not None:
            self._transport.pause_reading()
            asyncio.get_running_loop().call_later(ahead, self._resume)

    def _resume(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    def _advance(self) -> None:
        while True:
            if self._head is None:
                end = self._buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                self._head = RawRequest(bytes(self._buffer[:end]), b"")
                del self._buffer[: end + 4]
                lengths = self._head.values("Content-Length")
                self._length = int(lengths[0]) if lengths else 0
                self._up.receiving.append(self._identity())
            if len(self._buffer) < self._length:
                return
            del self._buffer[: self._length]
            self._up.applied.append(self._arrival(self._length))
            self._head = None
            if self._transport is not None:
                self._transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    def _identity(self) -> tuple[str | None, int | None]:
        assert self._head is not None
        jobs = self._head.values(hdrs.DEFAULT_JOB)
        tokens = self._head.values(hdrs.DEFAULT_TOKEN)
        generation = int(tokens[0]) if tokens and tokens[0].isdigit() else None
        return (jobs[0] if jobs else None), generation

    def _arrival(self, received: int) -> Arrival:
        job, generation = self._identity()
        return Arrival(job, generation, received, time.monotonic())

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head is not None:
            self._up.cut.append(self._arrival(len(self._buffer)))
        if self._transport is not None:
            self._up._open.discard(self._transport)
        self._transport = None


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")  # no trailers from a proxy
            return bytes(body)
        body += await reader.readexactly(size)
        await reader.readexactly(2)


async def drop_connection(request: web.Request, received: Received) -> web.StreamResponse:
    """A ``respond`` that closes the connection without answering."""
    assert request.transport is not None
    request.transport.close()
    raise asyncio.CancelledError


def status(code: int, body: bytes = b"") -> Responder:
    """A ``respond`` that answers ``code`` with ``body``."""

    async def respond(request: web.Request, received: Received) -> web.StreamResponse:
        return web.Response(status=code, body=body)

    return respond


class FakeClock:
    """A wall clock that moves only when told to."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


async def eventually(predicate: Callable[[], bool], within: float = 10.0) -> None:
    """Poll ``predicate`` until it holds, for at most ``within`` seconds (then
    TimeoutError). For state no event announces.

    It is polled on every turn of the event loop at first, which catches what this
    process does at once, then every few milliseconds: a wait on another process
    (a proxy's log, a file it writes) must not spin, taking the CPU that process
    needs, as it would on a machine whose cores are all busy."""
    async with asyncio.timeout(within):
        turns = 0
        while not predicate():
            turns += 1
            await asyncio.sleep(0 if turns < 100 else 0.005)


async def accepting(port: int, gone: Callable[[], str | None] = lambda: None) -> None:
    """Poll until 127.0.0.1:``port`` accepts a connection (the caller bounds the wait);
    RuntimeError as soon as ``gone`` says why the server never will."""
    while True:
        if (why := gone()) is not None:
            raise RuntimeError(why)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.02)
            continue
        writer.close()
        return


class ProxyProcess:
    """``fenceproxy serve`` in a real child process, for crash and signal tests.

    Its output goes to a file (a pipe nobody reads would fill and stall it).
    """

    def __init__(
        self,
        config: str | os.PathLike[str],
        port: int,
        *args: str,
        env: dict[str, str] | None = None,
        log: str | os.PathLike[str] | None = None,
        command: Sequence[str] = (sys.executable, "-m", "fenceproxy"),
        cwd: str | os.PathLike[str] | None = None,
        nofile: int | None = None,
        fsize: int | None = None,
    ) -> None:
        """``log`` keeps its output in that file (appended); by default a temporary one.
        ``command`` runs the proxy (``serve -c ...`` is appended): another build's, say.
        ``cwd`` is its working directory (by default this process's); ``nofile`` its
        descriptor limit, soft and hard; ``fsize`` the largest file it may write, in
        bytes (a disk that fills up)."""
        self.port = port
        self._cwd = cwd
        self._nofile = nofile
        self._fsize = fsize
        self._env = None if env is None else {**os.environ, **env}
        self.url = f"http://127.0.0.1:{port}"
        self.admin_url = f"http://127.0.0.1:{free_port()}"
        """Its admin listener (a port of its own, so several can run at once)."""
        self._argv = [
            *command, "serve", "-c", os.fspath(config),
            "--listen", f"127.0.0.1:{port}", "--admin", self.admin_url.removeprefix("http://"),
            *args,
        ]  # fmt: skip
        self._ports = [port] if "--admin" in args else [port, int(self.admin_url.rsplit(":", 1)[1])]
        """What start() waits for: the proxy's port, and its admin's unless args set one."""
        self._log = (  # closed by stop()
            tempfile.TemporaryFile() if log is None else open(log, "a+b")  # noqa: SIM115
        )
        self.process: asyncio.subprocess.Process | None = None

    async def start(self, within: float = 20.0) -> ProxyProcess:
        """Start it and wait until both its listeners accept connections (the admin
        one opens last); RuntimeError if it exits."""
        nofile, fsize = self._nofile, self._fsize

        def limits() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
            if fsize is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

        self.process = await asyncio.create_subprocess_exec(
            *self._argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self._env,
            cwd=self._cwd,
            preexec_fn=None if nofile is None and fsize is None else limits,
        )
        process = self.process

        def gone() -> str | None:
            code = process.returncode
            return None if code is None else f"fenceproxy exited {code}: {self.output()}"

        async with asyncio.timeout(within):
            for port in self._ports:
                await accepting(port, gone)
        return self

    async def restart(self, within: float = 20.0) -> ProxyProcess:
        """Start it again, same port and store, after it exited."""
        if self.process is not None and self.process.returncode is None:
            raise InvariantError("restart() needs the proxy to have exited")
        return await self.start(within)

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def output(self) -> str:
        """Everything it printed so far. Read at an offset: the child shares the
        file's position, and moving it would have the child write over its own lines."""
        fd = self._log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode("utf-8", "replace")

    async def wait(self, within: float = 30.0) -> int:
        """Wait for it to exit; its exit code."""
        assert self.process is not None
        async with asyncio.timeout(within):
            return await self.process.wait()

    async def stop(self) -> None:
        """SIGKILL it if it still runs, and drop its output."""
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        self._log.close()


_PORTS_PER_WORKER = 1000
_next_port = [os.getpid() % _PORTS_PER_WORKER]  # children of a test start elsewhere


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that no other test process hands out.

    Not the kernel's pick (port 0): that comes from the ephemeral range, which the
    client side of every connection draws from too, and another test process running
    beside this one (pytest-xdist) could be handed it a moment later. Each process
    takes its ports from its own block below the ephemeral range, in turn.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    first = 20000 + (index % 12) * _PORTS_PER_WORKER
    for _ in range(_PORTS_PER_WORKER):
        port = first + _next_port[0] % _PORTS_PER_WORKER
        _next_port[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + _PORTS_PER_WORKER - 1}")
