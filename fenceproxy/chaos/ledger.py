"""The fault-injection run's upstream: a "legacy API" that appends every write it
applies to a durable ledger file (one JSON line each, flushed before it answers),
and misbehaves on purpose, seeded:

* ``--slow``: applies the write only after ``--slow-seconds`` (above the proxy's
  timeout), then answers; the proxy has long given up;
* ``--drop``: closes the connection without answering, half the time after
  applying the write, half the time before;
* ``--error``: answers 503 without applying anything.

    python -m fenceproxy.chaos.ledger --port 9000 --ledger ledger.jsonl --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import IO

from aiohttp import web

from .. import hdrs

__all__ = ["Ledger", "main"]


class Ledger:
    def __init__(self, out: IO[str], rng: random.Random, args: argparse.Namespace) -> None:
        self._out = out
        self._rng = rng
        self._args = args
        self._seq = 0

    def apply(self, request: web.Request, body: bytes) -> int:
        self._seq += 1
        try:
            payload = json.loads(body)
        except ValueError:
            payload = {}
        entry = {
            "seq": self._seq,
            "op": payload.get("op"),
            "worker": payload.get("worker"),
            "job": request.headers.get(hdrs.DEFAULT_JOB),
            "generation": int(request.headers.get(hdrs.DEFAULT_TOKEN, "-1")),
            "key": request.headers.get(hdrs.DEFAULT_KEY),
            "t": time.monotonic(),
        }
        self._out.write(json.dumps(entry) + "\n")
        self._out.flush()
        return self._seq

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method == "GET":
            return web.json_response({"ok": True})
        roll = self._rng.random()
        a = self._args
        if roll < a.error:
            return web.json_response({"error": "injected"}, status=503)
        if roll < a.error + a.drop:
            if self._rng.random() < 0.5:
                self.apply(request, body)
            assert request.transport is not None
            request.transport.close()
            raise asyncio.CancelledError
        if roll < a.error + a.drop + a.slow:
            await asyncio.sleep(a.slow_seconds)
        seq = self.apply(request, body)
        return web.json_response({"applied": seq})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slow", type=float, default=0.0, help="share of writes applied late")
    parser.add_argument("--slow-seconds", type=float, default=1.0)
    parser.add_argument("--drop", type=float, default=0.0, help="share of connections dropped")
    parser.add_argument("--error", type=float, default=0.0, help="share answered 503")
    args = parser.parse_args()
    with open(args.ledger, "a", encoding="utf-8") as out:
        ledger = Ledger(out, random.Random(args.seed), args)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", ledger.handle)
        web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
