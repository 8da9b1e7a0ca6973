"""``fenceproxy demo``: the worked example, end to end on loopback.

A small "legacy API" that records every write in a ledger, and the proxy in
front of it on a temporary SQLite store. Worker A writes with generation 7 and
pauses; worker B takes the job over with generation 8 and writes; A wakes up and
sends its late write, which the proxy refuses. A retried write is answered from
the record, not applied twice. Exits 0 only when every expectation held.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp
from aiohttp import web

from .app import make_app
from .config import parse_config
from .testing import RecordingUpstream, free_port

__all__ = ["run_demo"]


@dataclass
class _Timeline:
    out: TextIO
    failures: list[str] = field(default_factory=list)

    def say(self, who: str, what: str) -> None:
        print(f"  {who:<10} {what}", file=self.out)

    def expect(self, ok: bool, what: str) -> None:
        print(f"  {'ok' if ok else 'FAILED':<10} {what}", file=self.out)
        if not ok:
            self.failures.append(what)


async def _write(
    http: aiohttp.ClientSession,
    base: str,
    who: str,
    generation: int,
    body: dict[str, Any],
    key: str | None = None,
) -> tuple[int, dict[str, str], Any]:
    headers = {"Fencing-Job": "invoice-42", "Fencing-Token": str(generation)}
    if key is not None:
        headers["Idempotency-Key"] = key
    async with http.post(f"{base}/billing/charges", json=body, headers=headers) as response:
        return response.status, dict(response.headers), await response.json(content_type=None)


async def run_demo(out: TextIO = sys.stdout) -> int:
    """Run the worked example; 0 when every expectation held, 1 otherwise."""
    t = _Timeline(out)
    with tempfile.TemporaryDirectory(prefix="fenceproxy-demo-") as tmp:
        async with RecordingUpstream.serve() as ledger:
            config = parse_config(
                {
                    "store": f"sqlite:///{Path(tmp) / 'fences.db'}",
                    "routes": [{"name": "billing", "path": "/billing/", "upstream": ledger.url}],
                },
                "demo",
            )
            runner = web.AppRunner(make_app(config), access_log=None)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            base = f"http://127.0.0.1:{port}"
            print(f"legacy API (ledger) on {ledger.url}; fenceproxy on {base}\n", file=out)
            try:
                async with aiohttp.ClientSession() as http:
                    await _story(t, http, base)
            finally:
                await runner.cleanup()
            print("\nledger of the legacy API:", file=out)
            for n, received in enumerate(ledger.received, 1):
                print(
                    f"  {n}. generation {received.generation}: {received.body.decode()}", file=out
                )
            applied = [json.loads(r.body)["by"] for r in ledger.received]
            t.expect(applied == ["A", "B"], "the ledger holds A's write, then B's, nothing else")
    print("\nall expectations held" if not t.failures else f"\n{len(t.failures)} FAILED", file=out)
    return 0 if not t.failures else 1


async def _story(t: _Timeline, http: aiohttp.ClientSession, base: str) -> None:
    status, _, _ = await _write(http, base, "A", 7, {"by": "A", "amount": 10}, key="a-1")
    t.say("worker A", f"holds generation 7, writes charge a-1 -> {status}")
    t.expect(status == 200, "A's write with generation 7 is forwarded")

    t.say("worker A", "pauses (a long GC, a SIGSTOP); its lease expires")
    status, _, _ = await _write(http, base, "B", 8, {"by": "B", "amount": 10}, key="b-1")
    t.say("worker B", f"claims generation 8, writes charge b-1 -> {status}")
    t.expect(status == 200, "B's write with generation 8 is forwarded")

    status, _, problem = await _write(http, base, "A", 7, {"by": "A", "amount": 99}, key="a-2")
    t.say("worker A", f"wakes up, sends a late write with generation 7 -> {status}")
    t.say("", f"  {problem.get('detail')}")
    t.expect(status == 409, "A's late write is refused as stale (409) and not forwarded")

    status, headers, _ = await _write(http, base, "B", 8, {"by": "B", "amount": 10}, key="b-1")
    replayed = headers.get("Idempotent-Replayed") == "true"
    t.say("worker B", f"retries b-1 (its answer was lost) -> {status}, replayed={replayed}")
    t.expect(status == 200 and replayed, "B's retry is answered from the record, not re-applied")
