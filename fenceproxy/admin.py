"""The admin listener, on its own address (``admin:``, loopback by default), never on
the proxy's port: what operators and their tools ask of a running proxy.

    GET /healthz   200 while the process serves (a liveness probe)
    GET /readyz    200 when the store answers and its schema is current; 503 with the
                   reason otherwise (a readiness probe, a load balancer's check)
    GET /metrics   the Prometheus text format (prometheus-client)

The metrics are :class:`fenceproxy.metrics.Metrics`.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from .edge import problem_response
from .errors import NoRoute, StoreError, StoreNotReady
from .log import server_log
from .metrics import Metrics
from .store import Store

__all__ = ["admin_app"]


def admin_app(store: Callable[[], Store], metrics: Metrics) -> web.Application:
    """The admin listener's application; ``store`` gives the proxy's open store."""

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "serving"})

    async def readyz(request: web.Request) -> web.Response:
        try:
            await store().check()
        except StoreError as exc:
            server_log.warning("not ready: %s", exc)
            return problem_response(StoreNotReady(str(exc), retry_after=1.0))
        return web.json_response({"status": "ready"})

    async def metrics_page(request: web.Request) -> web.Response:
        response = web.Response(body=metrics.render())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def unknown(request: web.Request) -> web.Response:
        return problem_response(
            NoRoute(f"the admin listener has no {request.path}: see /healthz, /readyz, /metrics")
        )

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_page)
    app.router.add_route("*", "/{tail:.*}", unknown)
    return app
