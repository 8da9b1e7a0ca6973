"""The admin listener, on its own address (``admin:``, loopback by default), never on
the proxy's port: what operators and their tools ask of a running proxy.

    GET /healthz   200 while the process serves (a liveness probe)
    GET /readyz    200 when the store answers and its schema is current (and, with
                   ?require_sync=true, the primary has a synchronous standby), with
                   the primary it reached; 503 with the reason otherwise (a readiness
                   probe, a load balancer's check)
    GET /          the operator page (:mod:`fenceproxy.ops.page`)
    GET /metrics   the Prometheus text format (prometheus-client)
    GET /jobs/{job}            what the store holds of one job: its highest generation
                               and when it was set, its lease, its in-flight record and
                               its recent idempotency keys (never their answers)
    GET /jobs?prefix=&after=&limit=   job ids with a fence or a lease, a page at a time
    GET /events?after=&job=&limit=    this proxy's last decisions and lease calls, and
                                      its refusals by kind (:mod:`fenceproxy.ops.recent`)

Its answers come from an :class:`~fenceproxy.ops.data.AdminData`: this process's
(:class:`~fenceproxy.ops.data.ProcessData`), or its workers', read by their
supervisor (:mod:`fenceproxy.server.workers`), which serves this same application;
under ``workers:``, ``?worker=i`` has the page, ``/jobs`` and ``/events`` read worker
``i``. Every refusal is rendered as the data plane renders its own
(:func:`problem_response`, on :func:`fenceproxy.http.answer.problem_answer`).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from ..config import Config, parse_listen
from ..errors import (
    AdminUnauthenticated,
    LeaseUnauthenticated,
    MisdirectedRequest,
    NoRoute,
    Refusal,
    RequestMalformed,
    StoreError,
    StoreNotReady,
    StoreUnavailable,
)
from ..fence.fencing import parse_job
from ..http.answer import problem_answer
from ..leases.auth import LeaseCredentials
from ..log import server_log
from .data import AdminData
from .page import add_page
from .recent import KEPT

__all__ = ["admin_app", "guard", "page_url", "problem_response"]

_MAX_PAGE = 1000


def page_url(config: Config) -> str | None:
    """The operator page's address (``http(s)://ADMIN/``), which the start line names;
    None without an admin listener."""
    if config.admin is None:
        return None
    host, port = parse_listen(config.admin)
    name = f"[{host}]" if ":" in host else host
    return f"{'http' if config.admin_tls is None else 'https'}://{name}:{port}/"


def problem_response(refusal: Refusal) -> web.Response:
    """``refusal`` as an RFC 9457 problem, as the data plane answers it (its status
    line, ``Content-Type``, ``Retry-After``, ``WWW-Authenticate`` and body, all from
    :func:`~fenceproxy.http.answer.problem_answer`), for aiohttp."""
    answer = problem_answer(refusal)
    return web.Response(
        status=answer.status, reason=answer.reason, headers=answer.headers, body=answer.body
    )


def admin_app(
    config: Callable[[], Config],
    data: AdminData,
    credentials: Callable[[], LeaseCredentials | None] = lambda: None,
) -> web.Application:
    """The admin listener's application; ``config`` gives the running config (it
    changes on a reload), ``data`` what it shows, ``credentials`` the bearer
    credentials every request needs (but the probes, when ``admin_probes`` is open),
    if any."""

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response(await data.health())

    async def readyz(request: web.Request) -> web.Response:
        try:
            return web.json_response(await data.ready())
        except StoreError as exc:
            server_log.warning("not ready: %s", exc)
            return problem_response(StoreNotReady(str(exc), retry_after=1.0))

    async def metrics_page(request: web.Request) -> web.Response:
        response = web.Response(body=await data.metrics())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def job(request: web.Request) -> web.Response:
        job_id = parse_job(request.match_info["job"], "path")
        view = await data.one(request.query.get("worker")).job(job_id)
        if view is None:
            return problem_response(NoRoute(f"the store holds nothing of job {job_id!r}"))
        return web.json_response(view)

    async def jobs(request: web.Request) -> web.Response:
        query = request.query
        limit = _number(query, "limit", 100, 1, _MAX_PAGE)
        reads = data.one(query.get("worker"))
        found = await reads.jobs(query.get("prefix", ""), query.get("after", ""), limit)
        return web.json_response(
            {"jobs": found, "next": found[-1] if len(found) == limit else None}
        )

    async def events(request: web.Request) -> web.Response:
        query = request.query
        after = _number(query, "after", 0, 0, None)
        limit = _number(query, "limit", 100, 1, KEPT)
        reads = data.one(query.get("worker"))
        found = await reads.events(after, query.get("job") or None, limit)
        return web.json_response(found.json())

    async def unknown(request: web.Request) -> web.Response:
        return problem_response(
            NoRoute(
                f"the admin listener has no {request.path}: see /, /healthz, /readyz, /metrics, "
                "/jobs, /events"
            )
        )

    @web.middleware
    async def refusals(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            guard(request, config(), credentials())
            response: web.StreamResponse = await handler(request)
        except Refusal as refusal:  # a job id that is not one, say
            return problem_response(refusal)
        except StoreError as exc:
            return problem_response(StoreUnavailable(f"the store could not be read: {exc}"))
        return response

    app = web.Application(middlewares=[refusals])
    add_page(app, data)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/jobs", jobs)
    app.router.add_get("/jobs/{job:.+}", job)
    app.router.add_get("/events", events)
    app.router.add_route("*", "/{tail:.*}", unknown)
    return app


def _number(query: Mapping[str, str], name: str, default: int, low: int, high: int | None) -> int:
    """A whole-number query parameter from ``low`` up to ``high`` (None: no bound);
    RequestMalformed (400) otherwise."""
    try:
        value = int(query.get(name, str(default)))
    except ValueError:
        value = low - 1
    if value < low or (high is not None and value > high):
        bounds = f"from {low} to {high}" if high is not None else f"of {low} or more"
        raise RequestMalformed(f"{name} must be a whole number {bounds}")
    return value


def _from_a_browser(request: web.Request) -> bool:
    """Whether a browser sent it: they say so (Fetch Metadata), probes and scrapers
    do not."""
    headers = request.headers
    return "Sec-Fetch-Site" in headers or "Sec-Fetch-Mode" in headers or "Origin" in headers


def _own_name(host: str, admin: str | None) -> bool:
    """Whether ``host`` (a Host header) names this listener: an IP address, localhost,
    this machine's name (no DNS asked) or the admin address's own host. A browser tricked into
    sending a request here under another name (DNS rebinding) must not read the
    answer: job ids, holders and keys."""
    name = urlsplit(f"//{host}").hostname or ""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        own = {"localhost", socket.gethostname().lower()}
        if admin is not None:
            own.add((urlsplit(f"//{admin}").hostname or "").lower())
        return name.lower() in own
    return True


_PROBES = frozenset({"/healthz", "/readyz"})


def guard(request: web.Request, config: Config, credentials: LeaseCredentials | None) -> None:
    """What an admin listener refuses before it answers, the same whether the process
    serves it or a supervisor does for its workers: AdminUnauthenticated (401) without
    one of ``credentials`` (the probes open with ``admin_probes: open``), then
    MisdirectedRequest (421) for a browser's request under a name not this listener's
    (DNS rebinding)."""
    _authenticate(request, credentials, config.admin_probes == "open")
    if _from_a_browser(request) and not _own_name(request.host, config.admin):
        raise MisdirectedRequest(
            f"this admin listener answers browsers at an IP address, localhost or "
            f"{socket.gethostname()}, not at {request.host!r}: a page elsewhere "
            "may have pointed that name here (DNS rebinding)"
        )


def _authenticate(
    request: web.Request, credentials: LeaseCredentials | None, open_probes: bool
) -> None:
    """AdminUnauthenticated unless the request carries one of ``credentials`` (none
    configured: the listener is open; the probes are open when ``open_probes``)."""
    if credentials is None or (open_probes and request.path in _PROBES):
        return
    try:
        credentials.authenticate(request.headers.get("Authorization"))
    except LeaseUnauthenticated:
        raise AdminUnauthenticated(
            "the admin listener needs a credential: Authorization: Bearer <secret> (admin_clients)"
        ) from None
