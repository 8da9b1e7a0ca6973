"""``FenceProxy``: the proxy and its lease API behind one request handler, on the
data plane (:mod:`fenceproxy.http.server`), and ``serve`` to run it until a signal.

The data plane gives the handler each parsed request with no web framework between
them: the proxy matches its own routes, once, on the path as its route reads it
(:mod:`fenceproxy.http.target`), and the lease API's prefix is dispatched to it
before any route is looked at. The admin listener is an aiohttp application on a
port of its own (:mod:`fenceproxy.ops.admin`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import resource
import signal
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from ..config import (
    Config,
    LimitsSpec,
    Presented,
    Reader,
    TlsContexts,
    admin_credentials,
    is_loopback,
    lease_credentials,
    parse_listen,
    presented,
    restart_only,
    setting,
    signing_keys,
    tls_contexts,
    tracing_headers,
)
from ..errors import ConfigError, InvariantError, ListenError, Refusal
from ..http.answer import Answer, problem_answer
from ..http.edge import Bodies, connection_cap, log_accept_errors
from ..http.request import Request
from ..http.routes import Router
from ..http.server import DataPlane, Limits, Listener
from ..http.upstream import TrustedProxies, UpstreamPool
from ..log import configure_logging, proxy_log, server_log
from ..ops.admin import admin_app
from ..ops.data import ProcessData, data_app
from ..ops.metrics import Metrics
from ..spool import SpoolFolder, default_folder
from ..store import Store, open_store
from ..store.url import parse_store_url
from ..tls import reload_server, server_context
from .lease_api import LeaseService
from .proxy import Proxy, ProxySettings
from .turn import JobLocks
from .workers import Seat

if TYPE_CHECKING:
    from ..ops.tracing import Tracing

__all__ = ["FenceProxy", "notify_systemd", "serve"]

_Part = TypeVar("_Part")
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


class FenceProxy:
    """The proxy of ``config``: its store, routes, upstream pools and lease API.

    ``async with FenceProxy(config) as proxy:`` opens the store named in ``config``
    (unless ``store`` is given, which the caller then owns) and closes it on exit;
    :meth:`handle` answers requests in between, :meth:`server` is the data plane
    that serves it. ``clock`` is the store's wall clock. Opening fails with
    StoreError when the store cannot be opened.
    """

    def __init__(
        self,
        config: Config,
        *,
        store: Store | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._given_store = store
        self._clock = clock
        self._bodies = Bodies(
            config.limits.max_buffered,
            config.limits.body_timeout,
            in_memory=config.limits.body_buffer,
            spool=SpoolFolder(config.limits.body_temp_path or default_folder()),
        )
        self.metrics = Metrics()
        """What this proxy counts, served by the admin listener (:mod:`fenceproxy.ops.admin`)."""
        self.locks = JobLocks()
        """This process's queue per job, in front of the store's in-flight records."""
        self._store: Store | None = None
        self._proxy: Proxy | None = None
        self._upstreams: UpstreamPool | None = None
        self._server: DataPlane | None = None
        self._tls: TlsContexts | None = None
        self._tracing: Tracing | None = None
        self._take(config)

    def restart_only(self, config: Config) -> dict[str, Any]:
        """What ``config`` changes that only a restart can: each dotted key (``store``,
        ``idempotency.ttl``, ...) with its running value, to keep on a reload."""
        return restart_only(self.config, config)

    def reconfigure(self, config: Config) -> None:
        """Serve ``config`` from the next request on (a reload), without dropping one
        in flight: a request already routed keeps its route (its upstream, fencing,
        timeouts and body limit); the proxy-wide limits apply at their next use.
        Routes, fencing, timeouts, limits, signing keys and lease credentials change;
        ``config`` must keep what changes only with a restart (:meth:`restart_only`).
        Raises ConfigError, with nothing changed, when a secret cannot be read."""
        if self.restart_only(config):
            raise ValueError("a reload cannot change what takes a restart")
        self._take(config)

    def _take(self, config: Config) -> None:
        # Everything that can fail first; then nothing but assignments.
        router = Router(config.routes)
        keys = signing_keys(config.signing, "config")
        admin_clients = admin_credentials(config, "config")
        leases = (
            LeaseService(
                config.leases,
                self._bodies,
                self.metrics,
                keys,
                lease_credentials(config.leases, "config"),
            )
            if config.leases is not None
            else None
        )
        certificates = presented(config, "config")
        if self._tls is None:
            tls = tls_contexts(config, "config")
        else:
            tls = self._tls
            _reload_certificates(tls, config)  # the last that can fail: all or none
        self.config = config
        self._tls = tls
        self.metrics.certificates = certificates
        self.admin_clients = admin_clients
        self._router = router
        self._keys = keys
        self._leases = leases
        self._lease_prefix = config.leases.prefix if config.leases is not None else None
        limits = config.limits
        self._bodies.cap = limits.max_buffered
        self._bodies.timeout = limits.body_timeout
        self._bodies.in_memory = limits.body_buffer
        self._bodies.per_client = limits.buffered_per_client
        self._bodies.min_rate = limits.body_min_rate
        self._bodies.trusted = TrustedProxies(config.trusted_proxies)
        if self._store is not None:
            self._bind(self._store)
        if self._server is not None:
            self._server.reconfigure(_door(config.limits), self._bodies.trusted)

    def _bind(self, store: Store) -> None:
        """Put the open store to work under the current settings."""
        config = self.config
        if self._leases is not None:
            self._leases.store = store
            self._leases.tracing = self._tracing
        settings = ProxySettings(
            trusted=TrustedProxies(config.trusted_proxies),
            max_stored_response=config.idempotency.max_response,
            keys=self._keys,
        )
        if self._proxy is None:
            answered, tracing = self.metrics.upstream_answered, self._tracing
            self._upstreams = (
                UpstreamPool(self._router, answered)
                if tracing is None
                else tracing.upstreams(self._router, answered)
            )
            self._proxy = Proxy(
                self._router,
                settings,
                store,
                self._upstreams,
                bodies=self._bodies,
                metrics=self.metrics,
                locks=self.locks,
                tracing=tracing,
            )
        else:
            assert self._upstreams is not None
            self._upstreams.update(self._router)
            self._proxy.reconfigure(self._router, settings)

    def _prepare_spool(self) -> None:
        """Make the folder of bodies kept on disk, and remove what a killed proxy left
        in it; ConfigError naming ``limits.body_temp_path`` when it cannot be used."""
        spool = self._bodies.spool
        assert spool is not None
        try:
            spool.prepare()
        except ValueError as exc:
            raise ConfigError("config", [("limits.body_temp_path", str(exc))]) from None
        removed = spool.sweep()
        if removed:
            server_log.info(
                "removed %d request body file(s) left in %s by a proxy that stopped",
                len(removed),
                spool.path,
            )

    @property
    def tls(self) -> TlsContexts:
        """The listeners' TLS contexts: made at start, their certificates loaded again
        on each reload."""
        assert self._tls is not None
        return self._tls

    @property
    def store(self) -> Store:
        return _opened(self._store)

    @property
    def bodies(self) -> Bodies:
        """The request bodies held in memory (``held`` bytes of ``cap``)."""
        return self._bodies

    @property
    def upstreams(self) -> UpstreamPool:
        return _opened(self._upstreams)

    async def __aenter__(self) -> FenceProxy:
        config = self.config
        self._prepare_spool()
        self._store = self._given_store or await open_store(
            parse_store_url(config.store), key_ttl=config.idempotency.ttl, clock=self._clock
        )
        self._store.on_commit = self.metrics.committed
        if config.tracing is not None:
            self._tracing = _start_tracing(config)
            self._store.on_commit = self._tracing.watch_commits(self.metrics.committed)
        self.metrics.store.server = self._store.server
        self._bind(self._store)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._proxy is not None:
            await self._proxy.close()
        if self._upstreams is not None:
            await self._upstreams.close()
        if self._store is not None and self._given_store is None:
            await self._store.close()
        if self._tracing is not None:  # last: the spans of what was cut above go too
            await self._tracing.close()
        self._proxy = self._upstreams = self._store = self._tracing = None

    def server(self, **kwargs: Any) -> DataPlane:
        """The data plane for :meth:`handle`, with the config's limits at the door
        (:mod:`fenceproxy.http.server`); ``kwargs`` go to it (``access_log``,
        ``max_connections``, ``handler_cancellation``). With ``tracing:``, each request
        is a span: chosen here, once, so a proxy without it never looks."""
        tracing = self._tracing
        handler = self.handle if tracing is None else tracing.handler(self.handle)
        server = self._server = DataPlane(
            handler, _door(self.config.limits), trusted=self._bodies.trusted, **kwargs
        )
        self.metrics.watch(
            bodies_held=lambda: self._bodies.held,
            connections=lambda: server.open_connections,
        )
        return server

    def admin(self) -> web.Application:
        """The admin listener's application (:mod:`fenceproxy.ops.admin`), on this
        process's data (:meth:`admin_data`)."""
        return admin_app(lambda: self.config, self.admin_data(), lambda: self.admin_clients)

    def admin_data(self) -> ProcessData:
        """What the admin listener shows of this process: its store, its metrics and
        decisions, its running config (:mod:`fenceproxy.ops.data`)."""
        return ProcessData(lambda: self.config, lambda: self.store, self.metrics)

    async def handle(self, request: Request) -> Answer:
        """Answer one request: the lease API under its prefix, a route otherwise.
        Refusals become RFC 9457 problem answers, each logged once."""
        proxy = _opened(self._proxy)
        try:
            raw = request.path
            prefix = self._lease_prefix
            if prefix is not None and raw.startswith(prefix) and _under(raw, prefix):
                # Nothing under the prefix is ever forwarded, so the lease API reads
                # the path as sent: a job id may hold any character, `/` included.
                assert self._leases is not None
                return await self._leases.handle(request, raw)
            return await proxy.handle(request, raw)
        except Refusal as refusal:
            if self._tracing is not None:
                self._tracing.refused(refusal)
            if not refusal.logged and proxy_log.isEnabledFor(logging.INFO):
                proxy_log.info(
                    "refused %s %s: %s (%d) %s",
                    request.method,
                    request.path,
                    refusal.slug,
                    refusal.status,
                    refusal.detail,
                )
            return problem_answer(refusal)


def _start_tracing(config: Config) -> Tracing:
    """The traces ``config.tracing`` asks for; its headers' secrets read again.
    OpenTelemetry (the ``otel`` extra) is imported here, and only here: the config's
    validation has made sure it is installed."""
    from ..ops.tracing import Tracing

    assert config.tracing is not None
    headers = tracing_headers(config.tracing, "config")
    return Tracing(config.tracing, headers, config.listen)


def _return_freed_memory() -> None:
    """Have glibc's malloc serve every block of 128 KiB or more from its own mapping,
    given back to the system when freed. By default the threshold rises after such a
    block is freed, and bodies held by a flood of clients stay in the heap afterwards:
    150 bodies held open left 267 MiB resident, against 66 MiB with this."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(libc_name).mallopt(_M_MMAP_THRESHOLD, 128 * 1024)


def _connection_cap(configured: int) -> int:
    """Raise this process's descriptor limit to its hard limit (as Go's runtime and
    nginx's worker_rlimit_nofile do), then fit the connection cap below it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    cap = connection_cap(configured)
    if cap < configured:
        server_log.info(
            "limits.max_connections lowered from %d to %d: the descriptor limit is %d "
            "(each client connection may need an upstream one too)",
            configured,
            cap,
            resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        )
    return cap


def _reload_certificates(tls: TlsContexts, config: Config) -> None:
    """Load the listeners' certificates again, from the same files (renewed where they
    are); ConfigError naming the key when one cannot be loaded, the rest as they were."""
    pairs = [
        (key, context, spec.server())
        for key, context in (("tls", tls.listener), ("admin_tls", tls.admin))
        if context is not None and (spec := getattr(config, key)) is not None
    ]
    problems = []
    for key, _, spec in pairs:  # every pair tried before any is put in place
        try:
            server_context(spec)
        except ValueError as exc:
            problems.append((key, str(exc)))
    if problems:
        raise ConfigError("config", problems)
    for key, context, spec in pairs:
        try:
            reload_server(context, spec)
        except ValueError as exc:  # a file that changed since its trial: the rest as they were
            raise ConfigError("config", [(key, str(exc))]) from None


def _door(limits: LimitsSpec) -> Limits:
    """The data plane's limits at the door, as the config sets them."""
    return Limits(
        header_timeout=limits.header_timeout,
        keepalive_timeout=limits.keepalive_timeout,
        send_timeout=limits.send_timeout,
        max_connections=limits.max_connections,
        max_connections_per_client=limits.max_connections_per_client,
    )


def _opened(part: _Part | None) -> _Part:
    """A part the proxy makes as it opens (its store, upstreams, handler)."""
    if part is None:
        raise InvariantError("the proxy is not open")
    return part


def _under(path: str, prefix: str) -> bool:
    return len(path) == len(prefix) or path[len(prefix)] == "/"


async def serve(
    config: Config,
    *,
    access_log: logging.Logger | None = None,
    ready: Callable[[], object] = lambda: None,
    reload: tuple[str, Reader] | None = None,
    seat: Seat | None = None,
) -> None:
    """Run the proxy of ``config`` until SIGINT or SIGTERM, then stop taking new
    connections, let requests in flight finish for up to ``shutdown_timeout``, and
    close the store. ``ready`` is called once it listens. Raises StoreError when the
    store cannot be opened, ListenError when the address cannot be listened on.

    With ``reload`` (the config file's name, and what reads it again), SIGHUP
    reloads the config (:func:`_reload`); one that comes while it starts is done
    once it serves. With ``seat`` it is one of several workers
    (:mod:`fenceproxy.server.workers`): it shares its port with the others, and
    serves its admin data on the seat's own socket for the supervisor."""
    if seat is None or seat.index == 0:
        _warn_open_lease_api(config)
        _warn_unverified_upstreams(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    serving: list[FenceProxy] = []  # the proxy, once it serves
    asked: list[bool] = []  # a reload asked for while starting, done once serving

    def hup() -> None:
        if reload is None:
            return
        if serving:
            _reload(serving[0], *reload)
        else:
            asked.append(True)

    loop.add_signal_handler(signal.SIGHUP, hup)
    log_accept_errors(loop)
    _return_freed_memory()
    max_connections = _connection_cap(config.limits.max_connections)
    async with FenceProxy(config) as proxy:
        if seat is None or seat.index == 0:
            _warn_certificates(proxy.metrics.certificates)
        listener = Listener(
            proxy.server(access_log=access_log, max_connections=max_connections),
            config.shutdown_timeout,
        )
        # A worker serves its data to its supervisor, which serves the admin listener.
        app = proxy.admin() if seat is None else data_app(proxy.admin_data())
        admin = web.AppRunner(app, access_log=None, handle_signals=False)
        await admin.setup()
        try:
            await _listen_plane(
                listener, config.listen, reuse_port=seat is not None, tls=proxy.tls.listener
            )
            if seat is not None:
                await web.UnixSite(admin, seat.admin_socket).start()
            elif config.admin is not None:
                await _listen(admin, config.admin, tls=proxy.tls.admin)
            ready()
            serving.append(proxy)
            if asked:
                hup()
            await stop.wait()
        finally:
            proxy.store.wakes.close()  # waiting claims answer now, not at their end
            await admin.cleanup()
            await listener.close()


def _reload(proxy: FenceProxy, source: str, read: Reader) -> None:
    """Read the config again and serve it from the next request on; one line says
    what happened. A file that is not valid, alone or with what takes a restart kept
    as it runs, is refused whole, naming its file and key; the running config stays."""
    kept: dict[str, Any] = {}
    try:
        config = read(None)
        kept = proxy.restart_only(config)
        if kept:
            config = read(kept)
        proxy.reconfigure(config)
    except ConfigError as exc:
        also = f" (checked with {', '.join(kept)} as running: a restart changes those)"
        server_log.error(
            "reload refused, the running config stays: %s%s",
            "; ".join(exc.lines),
            also if kept else "",
        )
        return
    configure_logging(config.log_format, config.log_levels)
    _warn_open_lease_api(config)
    _warn_certificates(proxy.metrics.certificates)
    if kept:
        server_log.warning(
            "reloaded %s: %d route(s); not changed until a restart: %s",
            source,
            len(config.routes),
            ", ".join(f"{name} (still {_shown(config, name)})" for name in kept),
        )
    else:
        server_log.info("reloaded %s: %d route(s)", source, len(config.routes))


def _warn_unverified_upstreams(config: Config) -> None:
    for route in config.routes:
        if route.tls is not None and not route.tls.verify:
            server_log.warning(
                "route %r does not verify its upstream's TLS certificate (tls.verify: false): "
                "anyone who can reach the path to %s can read and change its writes",
                route.name,
                route.upstream,
            )


def _warn_certificates(certificates: Iterable[Presented]) -> None:
    """A line for each certificate clients will refuse, now or within
    :data:`~fenceproxy.tls.ENDING` (one expired is served only with allow_expired)."""
    now = time.time()
    for each in certificates:
        cert = each.certificate
        if (concern := cert.concern(now)) is not None:
            server_log.warning("%s %s (%s) %s", each, cert.file, cert.subject, concern)


def _warn_open_lease_api(config: Config) -> None:
    host = parse_listen(config.listen)[0]
    if config.leases is not None and not config.leases.clients and not is_loopback(host):
        server_log.warning(
            "the lease API on %s takes no credentials: anyone who reaches it can claim, "
            "renew, complete or release any lease (set leases.clients)",
            config.listen,
        )


def _shown(config: Config, name: str) -> str:
    value = setting(config, name)
    if name == "store":
        return parse_store_url(value).describe()
    if name == "tracing":  # its headers may hold a secret
        return "off" if value is None else f"to {value.endpoint}"
    if isinstance(value, float):  # a duration
        return f"{value:g}s"
    return "off" if value is None else str(value)


def notify_systemd(state: str) -> None:
    """Tell systemd ``state`` (``READY=1``) when it runs this process as a
    ``Type=notify`` service (``NOTIFY_SOCKET`` is set); nothing otherwise."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address.startswith(("/", "@")):
        return
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(state.encode())


async def _listen(
    runner: web.BaseRunner, address: str, *, tls: ssl.SSLContext | None = None
) -> None:
    host, port = parse_listen(address)
    with _listening(address):
        await web.TCPSite(runner, host, port, ssl_context=tls).start()


async def _listen_plane(
    listener: Listener, address: str, *, reuse_port: bool, tls: ssl.SSLContext | None
) -> None:
    host, port = parse_listen(address)
    with _listening(address):
        await listener.listen(host, port, reuse_port=reuse_port, tls=tls)


@contextlib.contextmanager
def _listening(address: str) -> Iterator[None]:
    """ListenError, naming ``address``, when it cannot be listened on."""
    try:
        yield
    except OSError as exc:
        reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        raise ListenError(f"cannot listen on {address}: {reason}") from None
