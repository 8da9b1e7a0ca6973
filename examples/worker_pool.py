"""A pool of synchronous workers, as RQ or Celery run them: several processes take the
same list of jobs, and each job is done by whichever worker holds its lease.

    python examples/worker_pool.py --proxy http://127.0.0.1:8080 --workers 3 \\
        --jobs invoice-1,invoice-2,invoice-3 --steps 4

Each worker, for each job in turn: holds the job's lease (waiting while another
worker holds it), sends one write per step through the proxy with the lease's
fencing headers and an idempotency key per step, and completes the job. A worker
that is paused past its lease (SIGSTOP it) finds the lease lost when it wakes: its
next step raises LeaseLost and it goes on to the next job, while the worker that took
the job over redid its steps, the ones already applied answered from their keys
without reaching the API again.

Every worker prints one JSON line per event to stdout (``claimed``, ``wrote``,
``completed``, ``lost``, ``skipped``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import httpx

from fenceproxy.client import LeaseLost, LeaseRefused, SyncLeaseClient


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def work(proxy: str, name: str, jobs: list[str], steps: int, step_time: float, ttl: float) -> None:
    """One worker: every job in turn, each step a write through the proxy."""
    with SyncLeaseClient(proxy) as leases, httpx.Client(timeout=10) as http:
        for job in jobs:
            try:
                with leases.hold(job, owner=name, ttl=ttl, wait=30) as lease:
                    say(ev="claimed", worker=name, job=job, generation=lease.generation)
                    for step in range(steps):
                        time.sleep(step_time)  # the work itself
                        lease.check()  # stop here once the lease is gone
                        answer = lease.request(
                            http, "POST", f"{proxy}/api/{job}/steps",
                            json={"job": job, "step": step},
                            headers={"Idempotency-Key": f"{job}-step-{step}"},
                        )  # fmt: skip
                        replayed = answer.headers.get("Idempotent-Replayed") == "true"
                        say(ev="wrote", worker=name, job=job, step=step, replayed=replayed,
                            generation=lease.generation, status=answer.status_code)  # fmt: skip
                        if answer.status_code >= 400:
                            raise LeaseLost(f"the proxy refused step {step}: {answer.text}")
                    lease.complete()
                    say(ev="completed", worker=name, job=job, generation=lease.generation)
            except LeaseRefused as refused:  # completed by another worker, say
                say(ev="skipped", worker=name, job=job, why=refused.slug)
            except LeaseLost as lost:
                say(ev="lost", worker=name, job=job, why=str(lost))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proxy", required=True, help="the proxy's URL")
    parser.add_argument("--jobs", required=True, help="job ids, comma-separated")
    parser.add_argument("--workers", type=int, default=3, help="processes to start")
    parser.add_argument("--worker", help="run as this one worker (the pool starts them so)")
    parser.add_argument("--start", type=int, default=0, help="the job this worker starts at")
    parser.add_argument("--steps", type=int, default=4, help="writes per job")
    parser.add_argument("--step-time", type=float, default=0.2, help="seconds per step")
    parser.add_argument("--ttl", type=float, default=1.0, help="the leases' ttl, seconds")
    args = parser.parse_args()
    jobs = args.jobs.split(",")
    if args.worker is not None:
        start = args.start % len(jobs)  # each starts elsewhere, then goes round them all
        work(args.proxy, args.worker, jobs[start:] + jobs[:start], args.steps,
             args.step_time, args.ttl)  # fmt: skip
        return 0
    pool = [
        subprocess.Popen(
            [sys.executable, __file__, *sys.argv[1:], "--worker", f"worker-{n}", "--start", str(n)]
        )
        for n in range(args.workers)
    ]
    return max(worker.wait() for worker in pool)


if __name__ == "__main__":
    sys.exit(main())
