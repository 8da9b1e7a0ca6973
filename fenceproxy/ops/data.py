"""Where the admin listener's answers come from: an :class:`AdminData`, read from
this process (:class:`ProcessData`) or, under ``workers:``, from the workers (the
supervisor's :class:`~fenceproxy.server.workers.WorkersData`). The listener
(:mod:`fenceproxy.ops.admin`) and the operator page (:mod:`fenceproxy.ops.page`)
render their answers from it by one code, whichever it is.

What it gives: the metrics' text, the probes' answers, the last hour's series
(:mod:`fenceproxy.ops.series`, every worker's added up), and for one process
(:meth:`AdminData.one`) the store's view of a job and its job ids (the same from
every process on the store), the decisions it saw (:mod:`fenceproxy.ops.recent`),
and what the page shows of it (:class:`About`).

A worker serves its own as JSON on its supervisor's Unix socket (:func:`data_app`),
read back by a :class:`WorkerData`::

    GET /metrics                      the metrics' text
    GET /health                       {"status": "serving"}
    GET /ready                        the readiness answer (the store's primary, ...)
    GET /job?job=                     the store's view of the job, or null
    GET /jobs?prefix=&after=&limit=   job ids
    GET /events?after=&job=&limit=    the events, the last number, the refusals by kind
    GET /about                        the page's header, routes and certificates
    GET /series                       the last hour's buckets, to be added up

A store that fails answers 503 ``{"store_error": ...}``, raised on the reader's side
as the StoreError it was; a worker that does not answer is ProxyBusy (503, with
Retry-After), one that fails otherwise InternalError.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import aiohttp
from aiohttp import web

from ..config import Config, Presented, RouteSpec
from ..errors import InternalError, ProxyBusy, StoreError
from ..fence.write import SAFE_METHODS
from ..store import Store
from ..store.base import JobView
from ..store.url import parse_store_url
from .metrics import Metrics
from .recent import Event
from .series import Hour

__all__ = [
    "About",
    "AdminData",
    "CertificateRow",
    "Events",
    "ProcessData",
    "Reads",
    "RouteRow",
    "WorkerData",
    "data_app",
]

# How long a reader waits for a worker's answer.
_ASK_TIMEOUT = 10.0


class RouteRow(NamedTuple):
    """A route as the page lists it."""

    name: str
    path: str
    upstream: str
    fenced: str
    """The methods it fences and how, or ``pass-through``."""
    timeout: float
    """Seconds."""
    max_body: int | None


class CertificateRow(NamedTuple):
    """A certificate the process presents, as the page lists it."""

    of: str
    """Whose: ``listener proxy``, ``listener admin``, ``route billing``."""
    file: str
    subject: str
    ends: str
    days_left: int
    concern: str | None
    """What clients make of it when it has ended, is not valid yet or ends soon."""


@dataclass(frozen=True, slots=True)
class About:
    """What the page shows of a process: where it listens, its store (and the primary
    it reached last), its routes and the certificates it presents (as last loaded)."""

    listen: str
    store: str
    routes: list[RouteRow]
    certificates: list[CertificateRow]

    def json(self) -> dict[str, Any]:
        return {
            "listen": self.listen,
            "store": self.store,
            "routes": [list(r) for r in self.routes],
            "certificates": [list(c) for c in self.certificates],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> About:
        return cls(
            data["listen"],
            data["store"],
            [RouteRow(*r) for r in data["routes"]],
            [CertificateRow(*c) for c in data["certificates"]],
        )


@dataclass(frozen=True, slots=True)
class Events:
    """Events a process kept (oldest first), the number of the newest it kept, and its
    refusals by kind over the last minute, 5 and 15 minutes: ``/events``'s answer."""

    events: list[Event]
    last: int
    refusals: dict[str, list[int]]

    def json(self) -> dict[str, Any]:
        return {
            "events": [e.json() for e in self.events],
            "last": self.last,
            "refusals": self.refusals,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Events:
        return cls([Event(**e) for e in data["events"]], data["last"], data["refusals"])


class Reads(Protocol):
    """One process's reads. Each raises StoreError when the store fails, or a Refusal
    when the process cannot be asked."""

    async def job(self, job: str) -> dict[str, Any] | None:
        """What the store holds of ``job`` (``/jobs/{job}``'s answer); None when it
        holds nothing of it."""

    async def jobs(self, prefix: str, after: str, limit: int) -> list[str]:
        """Up to ``limit`` job ids with a fence or a lease, starting with ``prefix``,
        after ``after``."""

    async def events(self, after: int, job: str | None, limit: int) -> Events:
        """The newest ``limit`` events numbered after ``after`` (of ``job``, if given)."""

    async def about(self) -> About:
        """What the page shows of the process: its address, store, routes and
        certificates."""


class AdminData(Protocol):
    """Where the admin listener's answers come from."""

    async def metrics(self) -> bytes:
        """The Prometheus text format."""

    async def health(self) -> dict[str, Any]:
        """``/healthz``'s answer; a Refusal when a process does not serve."""

    async def ready(self) -> dict[str, Any]:
        """``/readyz``'s answer; StoreError when the store is not ready."""

    async def series(self) -> Hour:
        """The last hour's series: under ``workers:``, every worker's added up."""

    def one(self, worker: str | None) -> Reads:
        """The process ``?worker=`` names (the first when None); RequestMalformed
        when it names none. A single process ignores it."""


class ProcessData:
    """This process's: its store, its metrics and what it saw, and its running config
    (``config``, which changes on a reload)."""

    def __init__(
        self, config: Callable[[], Config], store: Callable[[], Store], metrics: Metrics
    ) -> None:
        self._config = config
        self._store = store
        self._metrics = metrics

    def one(self, worker: str | None) -> ProcessData:
        return self

    async def metrics(self) -> bytes:
        await self._metrics.store.read(self._store())
        return self._metrics.render()

    async def health(self) -> dict[str, Any]:
        return {"status": "serving"}

    async def series(self) -> Hour:
        return self._metrics.series.hour()

    async def ready(self) -> dict[str, Any]:
        store = self._store()
        await store.check()
        server = store.server
        if server.address is None:
            return {"status": "ready"}
        return {
            "status": "ready",
            "primary": server.address,
            "connections": server.connections,
            "failovers": server.changes,
        }

    async def job(self, job: str) -> dict[str, Any] | None:
        view = await self._store().inspect(job)
        return _job_json(view) if view.known else None

    async def jobs(self, prefix: str, after: str, limit: int) -> list[str]:
        return await self._store().jobs(prefix, after, limit)

    async def events(self, after: int, job: str | None, limit: int) -> Events:
        recent = self._metrics.recent
        return Events(recent.after(after, job=job, limit=limit), recent.last, recent.refusals())

    async def about(self) -> About:
        config = self._config()
        now = time.time()
        return About(
            config.listen,
            _store_shown(config.store, self._store()),
            [_route_row(r) for r in config.routes],
            [_certificate_row(each, now) for each in self._metrics.certificates],
        )


def _job_json(view: JobView) -> dict[str, Any]:
    lease = view.lease
    return {
        "job": view.job,
        "now": view.now,
        "generation": view.generation,
        "generation_set_at": view.generation_set_at,
        "lease": None
        if lease is None
        else {
            "owner": lease.owner,
            "generation": lease.generation,
            "state": lease.state.value,
            "live": lease.live(view.now),
            "lease_until": lease.lease_until,
            "expires_in": max(0.0, lease.lease_until - view.now),
        },
        "in_flight": None
        if view.in_flight is None
        else dict(zip(("holder", "state", "expires_at"), view.in_flight, strict=True)),
        "keys": [
            {
                "route": k.route,
                "key": k.key,
                "state": k.state,
                "generation": k.generation,
                "status": k.status,
                "created_at": k.created_at,
                "expires_at": k.expires_at,
            }
            for k in view.keys
        ],
    }


def _store_shown(url: str, store: Store) -> str:
    """The store as configured and, for a database, the server it reached last."""
    where = parse_store_url(url).describe()
    primary = store.server.address
    return where if primary is None else f"{where}, primary {primary}"


def _route_row(route: RouteSpec) -> RouteRow:
    fence = route.fence
    if fence is None:
        fenced = "pass-through"
    else:
        methods = (
            ", ".join(fence.methods)
            if fence.methods
            else "all but " + ", ".join(sorted(SAFE_METHODS))
        )
        extra = [f"tokens {fence.tokens}"]
        if fence.check_lease:
            extra.append("lease-checked")
        fenced = f"{methods} ({'; '.join(extra)})"
    return RouteRow(route.name, route.path, route.upstream, fenced, route.timeout, route.max_body)


def _certificate_row(each: Presented, now: float) -> CertificateRow:
    cert = each.certificate
    return CertificateRow(
        f"{each.label} {each.name}",
        cert.file,
        cert.subject,
        when(cert.not_after),
        cert.days_left(now),
        cert.concern(now),
    )


def when(at: float) -> str:
    """A Unix time as the page and the listener write it: ``2026-12-04T07:01:10Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


# -- a worker's data, served to its supervisor and read there ----------------------


def data_app(data: ProcessData) -> web.Application:
    """``data`` as JSON, for the supervisor (on its Unix socket: no credentials)."""

    def serve(read: Callable[[web.Request], Awaitable[Any]]) -> Any:
        async def handler(request: web.Request) -> web.Response:
            try:
                found = await read(request)
            except StoreError as exc:
                return web.json_response({"store_error": str(exc)}, status=503)
            if isinstance(found, bytes):
                return web.Response(body=found)
            return web.json_response(found)

        return handler

    def number(request: web.Request, name: str) -> int:
        return int(request.query[name])

    async def events(request: web.Request) -> dict[str, Any]:
        job = request.query.get("job") or None
        found = await data.events(number(request, "after"), job, number(request, "limit"))
        return found.json()

    async def jobs(request: web.Request) -> list[str]:
        query = request.query
        return await data.jobs(query["prefix"], query["after"], number(request, "limit"))

    async def about(request: web.Request) -> dict[str, Any]:
        return (await data.about()).json()

    async def series(request: web.Request) -> dict[str, Any]:
        return (await data.series()).json()

    app = web.Application()
    for path, read in (
        ("/metrics", lambda request: data.metrics()),
        ("/health", lambda request: data.health()),
        ("/ready", lambda request: data.ready()),
        ("/job", lambda request: data.job(request.query["job"])),
        ("/jobs", jobs),
        ("/events", events),
        ("/about", about),
        ("/series", series),
    ):
        app.router.add_get(path, serve(read))
    return app


class WorkerData:
    """A worker's data, asked of its :func:`data_app` on the Unix socket ``socket``."""

    def __init__(self, index: int, socket: str) -> None:
        self.index = index
        self.socket = socket
        self._session: aiohttp.ClientSession | None = None

    def one(self, worker: str | None) -> WorkerData:
        return self

    async def _get(self, path: str, query: Mapping[str, str | int] | None = None) -> bytes:
        """The body of the worker's answer to GET ``path``: StoreError when its store
        failed, ProxyBusy when it does not answer, InternalError when it fails."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket),
                timeout=aiohttp.ClientTimeout(total=_ASK_TIMEOUT),
            )
        try:
            async with self._session.get(f"http://worker{path}", params=query) as answer:
                body = await answer.read()
                status = answer.status
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise ProxyBusy(
                f"worker {self.index} does not answer ({exc or type(exc).__name__}): it "
                "is starting or stopping",
                retry_after=1.0,
            ) from None
        if status == 503:
            raise StoreError(json.loads(body)["store_error"])
        if status != 200:
            raise InternalError(
                f"worker {self.index} failed to answer {path} ({status}): see its log"
            )
        return body

    async def _json(self, path: str, query: Mapping[str, str | int] | None = None) -> Any:
        return json.loads(await self._get(path, query))

    async def metrics(self) -> bytes:
        return await self._get("/metrics")

    async def health(self) -> dict[str, Any]:
        found: dict[str, Any] = await self._json("/health")
        return found

    async def ready(self) -> dict[str, Any]:
        found: dict[str, Any] = await self._json("/ready")
        return found

    async def job(self, job: str) -> dict[str, Any] | None:
        found: dict[str, Any] | None = await self._json("/job", {"job": job})
        return found

    async def jobs(self, prefix: str, after: str, limit: int) -> list[str]:
        found: list[str] = await self._json(
            "/jobs", {"prefix": prefix, "after": after, "limit": limit}
        )
        return found

    async def events(self, after: int, job: str | None, limit: int) -> Events:
        query: dict[str, str | int] = {"after": after, "limit": limit}
        if job is not None:
            query["job"] = job
        return Events.from_json(await self._json("/events", query))

    async def about(self) -> About:
        return About.from_json(await self._json("/about"))

    async def series(self) -> Hour:
        return Hour.from_json(await self._json("/series"))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
