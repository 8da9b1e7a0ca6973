"""``make_app``: the aiohttp application and its typed state."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from .config import Config, parse_store_url
from .lease_api import LeaseService
from .proxy import Proxy, problem_middleware
from .routes import Router
from .store import Store, open_store
from .upstream import TrustedProxies, UpstreamPool

__all__ = ["CONFIG_KEY", "PROXY_KEY", "STORE_KEY", "make_app"]

CONFIG_KEY = web.AppKey("config", Config)
STORE_KEY = web.AppKey("store", Store)
PROXY_KEY = web.AppKey("proxy", Proxy)


def make_app(
    config: Config,
    *,
    store: Store | None = None,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
) -> web.Application:
    """The proxy as an aiohttp application.

    The store named in ``config`` is opened at start-up and closed at clean-up,
    unless ``store`` is given, which the caller then owns. ``clock`` is the store's
    wall clock (key expiry), ``monotonic`` the proxy's (quarantines). Start-up fails
    with StoreError when the store cannot be opened.
    """
    # auto_decompress off: a compressed request body is forwarded as it came, with
    # its Content-Encoding, never decoded on the way.
    app = web.Application(
        middlewares=[problem_middleware],
        handler_args={"max_headers": 100, "auto_decompress": False},
    )
    app[CONFIG_KEY] = config
    router = Router(config.routes)
    leases = LeaseService(config.leases) if config.leases is not None else None

    async def resources(app: web.Application) -> AsyncIterator[None]:
        owned = store is None
        opened = store or await open_store(
            parse_store_url(config.store),
            key_ttl=config.idempotency.ttl,
            clock=clock,
        )
        upstreams = UpstreamPool(router)
        app[STORE_KEY] = opened
        if leases is not None:
            leases.store = opened
        app[PROXY_KEY] = proxy = Proxy(
            router,
            opened,
            upstreams,
            trusted=TrustedProxies(config.trusted_proxies),
            max_stored_response=config.idempotency.max_response,
            monotonic=monotonic,
        )
        try:
            yield
        finally:
            await proxy.close()
            await upstreams.close()
            if owned:
                await opened.close()

    async def handle(request: web.Request) -> web.StreamResponse:
        return await request.app[PROXY_KEY].handle(request)

    app.cleanup_ctx.append(resources)
    if leases is not None:
        app.router.add_routes(leases.routes())  # before the catch-all: the prefix wins
    app.router.add_route("*", r"/{tail:[\s\S]*}", handle)  # any path, newlines included
    return app
