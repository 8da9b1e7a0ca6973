"""``fenceproxy demo``: the worked example, end to end on loopback, with real parts.

A small "legacy API" that records every write in a ledger; the proxy in front of
it with its lease API, on a temporary SQLite store; two workers. Worker A (using
the bare lease API, as a worker in any language would) claims the job, writes,
and pauses past its lease. Worker B (using the Python client, which renews for
it) claims the next generation. A wakes up: its renewal and completion are
refused by the lease store, and its late write by the proxy, before B has even
written. B writes, retries a write whose answer it "lost" (replayed, not applied
twice) and completes. Exits 0 only when every expectation held.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from .client import LeaseClient, LeaseRefused
from .config import parse_config
from .http.server import Listener
from .server.app import FenceProxy
from .testing import RecordingUpstream, free_port

__all__ = ["run_demo"]

JOB = "invoice-42"


@dataclass
class _Timeline:
    out: TextIO
    start: float = field(default_factory=time.monotonic)
    failures: list[str] = field(default_factory=list)

    def say(self, who: str, what: str) -> None:
        print(f"  {time.monotonic() - self.start:5.2f}s  {who:<9} {what}", file=self.out)

    def expect(self, ok: bool, what: str) -> None:
        print(f"  {'':6} {'ok' if ok else 'FAILED':<9} {what}", file=self.out)
        if not ok:
            self.failures.append(what)


async def _write(
    http: aiohttp.ClientSession, base: str, headers: dict[str, str], body: dict[str, Any]
) -> tuple[int, dict[str, str], Any]:
    async with http.post(f"{base}/billing/charges", json=body, headers=headers) as response:
        return response.status, dict(response.headers), await response.json(content_type=None)


async def run_demo(out: TextIO = sys.stdout, ttl: float = 1.0) -> int:
    """Run the worked example; 0 when every expectation held, 1 otherwise.
    ``ttl`` is worker A's lease, which the demo waits out once."""
    t = _Timeline(out)
    with tempfile.TemporaryDirectory(prefix="fenceproxy-demo-") as tmp:
        async with RecordingUpstream.serve() as ledger:
            config = parse_config(
                {
                    "store": f"sqlite:///{Path(tmp) / 'fenceproxy.db'}",
                    "leases": {},
                    "routes": [{"name": "billing", "path": "/billing/", "upstream": ledger.url}],
                },
                "demo",
            )
            async with FenceProxy(config) as proxy:
                listener = Listener(proxy.server())
                port = free_port()
                await listener.listen("127.0.0.1", port)
                base = f"http://127.0.0.1:{port}"
                print(f"legacy API (ledger) on {ledger.url}", file=out)
                print(f"fenceproxy with its lease API on {base}\n", file=out)
                try:
                    async with aiohttp.ClientSession() as http, LeaseClient(base) as leases:
                        at_b_claim = await _story(t, http, leases, base, ttl, ledger)
                finally:
                    await listener.close()
            print("\nledger of the legacy API:", file=out)
            for n, received in enumerate(ledger.received, 1):
                print(
                    f"  {n}. generation {received.generation}: {received.body.decode()}", file=out
                )
            writers = [json.loads(r.body)["by"] for r in ledger.received]
            t.expect(writers == ["A", "B"], "the ledger holds A's first write, then B's, once")
            t.expect(
                "A" not in writers[at_b_claim:],
                "no write of A's reached the ledger after B's claim",
            )
    print("\nall expectations held" if not t.failures else f"\n{len(t.failures)} FAILED", file=out)
    return 0 if not t.failures else 1


async def _story(
    t: _Timeline,
    http: aiohttp.ClientSession,
    leases: LeaseClient,
    base: str,
    ttl: float,
    ledger: RecordingUpstream,
) -> int:
    """The two workers; returns how many writes the ledger held when B claimed."""
    a = await leases.claim(JOB, "worker-a", ttl=ttl)
    t.say("worker A", f"claims {JOB}: generation {a.generation}, ttl {ttl}s")
    a_headers = {"Fencing-Job": JOB, "Fencing-Token": a.token}
    status, _, _ = await _write(http, base, a_headers, {"by": "A", "charge": "a-1"})
    t.say("worker A", f"writes charge a-1 -> {status}")
    t.expect(status == 200, "A's write under its lease is forwarded")
    t.say("worker A", "pauses (a long GC, a SIGSTOP): no renewals, no writes")

    while True:
        try:
            async with leases.hold(JOB, owner="worker-b", ttl=30) as b:
                at_b_claim = len(ledger.received)
                t.say("worker B", f"claims {JOB}: generation {b.generation}")
                t.expect(b.generation > a.generation, "B's claim gets a higher generation")
                await _a_wakes_up(t, http, leases, base, a_headers, a.generation)
                keyed = {**b.headers(), "Idempotency-Key": "b-1"}
                status, _, _ = await _write(http, base, keyed, {"by": "B", "charge": "b-1"})
                t.say("worker B", f"writes charge b-1 with Idempotency-Key b-1 -> {status}")
                t.expect(status == 200, "B's write is forwarded")
                status, headers, _ = await _write(http, base, keyed, {"by": "B", "charge": "b-1"})
                replayed = headers.get("Idempotent-Replayed") == "true"
                t.say("worker B", f"retries b-1 (its answer was lost) -> {status}, replayed")
                t.expect(status == 200 and replayed, "B's retry is replayed, not applied twice")
                await b.complete()
                t.say("worker B", "completes the job -> 200")
                return at_b_claim
        except LeaseRefused as refused:
            wait = float(refused.problem.get("expires_in", 0.1))
            t.say("worker B", f"tries to claim -> 409 held by {refused.problem.get('owner')}")
            await asyncio.sleep(wait + 0.01)  # the lease's own time: nothing to poll


async def _a_wakes_up(
    t: _Timeline,
    http: aiohttp.ClientSession,
    leases: LeaseClient,
    base: str,
    a_headers: dict[str, str],
    generation: int,
) -> None:
    t.say("worker A", "wakes up")
    try:
        await leases.renew(JOB, "worker-a", generation)
        t.expect(False, "A's renewal is refused by the lease store")
    except LeaseRefused as exc:
        t.say("worker A", f"renews -> {exc.status} {exc.slug}")
        t.expect(exc.slug == "lease-superseded", "A's renewal is refused by the lease store")
    status, _, problem = await _write(http, base, a_headers, {"by": "A", "charge": "a-late"})
    t.say("worker A", f"sends its late write (generation {generation}) -> {status}")
    t.say("", f"          {problem.get('detail')}")
    t.expect(status == 409, "A's late write is refused by the proxy, before B even wrote")
    try:
        await leases.complete(JOB, "worker-a", generation)
        t.expect(False, "A's completion is refused by the lease store")
    except LeaseRefused as exc:
        t.say("worker A", f"completes -> {exc.status} {exc.slug}")
        t.expect(exc.status == 409, "A's completion is refused by the lease store")
