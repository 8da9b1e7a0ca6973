"""The benchmark's upstream: a minimal aiohttp application (one catch-all route that
reads the request and answers ``200 ok``) on uvloop when it is installed, the
"direct" baseline the targets are ratios of.

    python bench/upstream.py PORT
"""

import asyncio
import sys

from aiohttp import web


async def ok(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(text="ok")


async def main(port: int) -> None:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:
        asyncio.run(main(int(sys.argv[1])))
    else:
        uvloop.run(main(int(sys.argv[1])))
