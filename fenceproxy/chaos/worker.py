"""A fault-injection worker process: claims jobs through the lease API, writes
through the proxy with its lease's headers, retries some writes with the same
``Idempotency-Key``, completes, and records every operation and its answer in a
history file (one JSON line each, flushed at once).

Faults it brings itself, seeded: its wall clock is off by ``--clock-offset``
seconds (``time.time`` is patched: nothing may depend on it); ``--stall`` is the
share of writes before which the whole event loop is blocked past the lease (a
GC pause), after which the write is sent anyway with the old headers, as a
request already on its way would be; ``--dup`` is the share of keyed writes sent
twice, in sequence or at once.

    python -m fenceproxy.chaos.worker --id w1 --url http://127.0.0.1:8080 --history w1.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import aiohttp

from .. import hdrs
from ..client import LeaseClient, LeaseLost, LeaseRefused, LeaseServiceError
from ..errors import PROBLEM_BASE

__all__ = ["main"]


class _Worker:
    def __init__(self, args: argparse.Namespace, history: IO[str]) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self._history = history
        self._ops = 0
        self._rounds = [0] * args.jobs
        self._sends: set[asyncio.Task[None]] = set()

    def record(self, **event: Any) -> None:
        event["worker"] = self.args.id
        event["t"] = time.monotonic()
        self._history.write(json.dumps(event) + "\n")
        self._history.flush()

    async def run(self) -> None:
        a = self.args
        end = time.monotonic() + a.duration
        timeout = aiohttp.ClientTimeout(total=10)
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            LeaseClient(a.url, request_timeout=2) as leases,
        ):
            while time.monotonic() < end:
                slot = self.rng.randrange(a.jobs)
                job = f"{a.job_prefix}job-{slot}-{self._rounds[slot]}"
                try:
                    await self._hold(http, leases, slot, job)
                except LeaseRefused as refused:
                    self.record(ev="claim", job=job, ok=False, slug=refused.slug)
                    if refused.slug == "job-completed":
                        self._rounds[slot] += 1
                    wait = float(refused.problem.get("expires_in", 0.05))
                    await asyncio.sleep(min(max(wait, 0.01), 0.2))
                except LeaseLost as lost:
                    self.record(ev="lost", job=job, why=str(lost))
                except LeaseServiceError as exc:
                    self.record(ev="service-error", job=job, why=str(exc)[:200])
                    await asyncio.sleep(0.05)
            if self._sends:
                await asyncio.wait(self._sends, timeout=15)

    async def _hold(
        self, http: aiohttp.ClientSession, leases: LeaseClient, slot: int, job: str
    ) -> None:
        a = self.args
        async with leases.hold(job, owner=a.id, ttl=a.ttl) as lease:
            with _marker(a.history, ".holding"):
                self.record(ev="claim", job=job, ok=True, owner=a.id, generation=lease.generation)
                for _ in range(self.rng.randint(1, 4)):
                    await asyncio.sleep(self.rng.uniform(0, 0.2 * a.ttl))  # the work itself
                    headers = lease.headers()
                    if self.rng.random() < a.stall:
                        pause = a.ttl * self.rng.uniform(1.5, 3.0)
                        self.record(ev="stall", job=job, seconds=pause)
                        with _marker(a.history, ".stalling"):
                            time.sleep(pause)  # noqa: ASYNC251 -- on purpose: the loop stalls
                    await self._write(http, job, headers)
                await lease.complete()
                self.record(
                    ev="complete", job=job, ok=True, owner=a.id, generation=lease.generation
                )
                self._rounds[slot] += 1

    async def _write(self, http: aiohttp.ClientSession, job: str, headers: dict[str, str]) -> None:
        """Send one write (and maybe its duplicate). The sends run in their own tasks,
        so a lost lease that cancels the worker's body cannot un-send them: like a
        request already on the wire, they reach the proxy and are recorded."""
        self._ops += 1
        op = f"{self.args.id}-{self._ops}"
        key = op if self.rng.random() < 0.5 else None
        body = json.dumps({"op": op, "worker": self.args.id}).encode()
        copies = 1
        concurrent = False
        if key is not None and self.rng.random() < self.args.dup:
            copies, concurrent = 2, self.rng.random() < 0.5
        if concurrent:
            tasks = [self._spawn(http, job, headers, key, body, op, n) for n in range(copies)]
            await asyncio.shield(asyncio.gather(*tasks))
        else:
            for n in range(copies):
                await asyncio.shield(self._spawn(http, job, headers, key, body, op, n))

    def _spawn(self, *args: Any) -> asyncio.Task[None]:
        task = asyncio.create_task(self._send(*args))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)
        return task

    async def _send(
        self,
        http: aiohttp.ClientSession,
        job: str,
        headers: dict[str, str],
        key: str | None,
        body: bytes,
        op: str,
        attempt: int,
    ) -> None:
        h = dict(headers)
        if key is not None:
            h[hdrs.DEFAULT_KEY] = key
        status, slug, replayed = 0, "connection-error", False
        try:
            async with http.post(f"{self.args.url}/ledger/{job}", data=body, headers=h) as r:
                status = r.status
                replayed = r.headers.get(hdrs.IDEMPOTENT_REPLAYED) == "true"
                answer = await r.json(content_type=None) if status >= 400 else None
                slug = ""
                if isinstance(answer, dict):
                    slug = str(answer.get("type", "")).removeprefix(PROBLEM_BASE)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        self.record(
            ev="write",
            op=op,
            attempt=attempt,
            job=job,
            generation=int(headers[hdrs.DEFAULT_TOKEN]),
            key=key,
            status=status,
            slug=slug,
            replayed=replayed,
        )


@contextlib.contextmanager
def _marker(history: str, suffix: str) -> Iterator[None]:
    """A marker file beside the history while a lease is held (``.holding``) or the
    worker stalls (``.stalling``): the runner pauses holders that are not stalled,
    so each pause outlives a lease of its own."""
    marker = Path(history).with_suffix(suffix)
    marker.touch()
    try:
        yield
    finally:
        marker.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--id", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--history", required=True)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--job-prefix", default="", help="names this run's jobs apart")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock-offset", type=float, default=0.0)
    parser.add_argument("--stall", type=float, default=0.0)
    parser.add_argument("--dup", type=float, default=0.0)
    args = parser.parse_args()
    real_time = time.time
    time.time = lambda: real_time() + args.clock_offset  # this worker's wrong wall clock
    with open(args.history, "a", encoding="utf-8") as history:
        asyncio.run(_Worker(args, history).run())


if __name__ == "__main__":
    main()
