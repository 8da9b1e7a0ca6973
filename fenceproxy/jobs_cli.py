"""``fenceproxy jobs show JOB`` and ``fenceproxy jobs list``: what the store holds of
jobs, asked of a running proxy's admin listener (:mod:`fenceproxy.ops.admin`), never of
the database itself. Human-readable by default, the admin API's JSON with ``--json``.

Exit 0 when answered, 1 when the admin listener refuses (an unknown job, say; its
problem is printed), 3 when it cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from typing import Any
from urllib.parse import quote

__all__ = ["add_jobs_parser", "run_jobs"]

_TIMEOUT = 10.0


def add_jobs_parser(commands: Any) -> None:
    jobs = commands.add_parser(
        "jobs",
        help="show a job or list jobs, from a running proxy's admin listener",
        description="Ask a running proxy's admin listener what its store holds: a job's "
        "generation, lease, in-flight write and recent idempotency keys (show), or the "
        "ids of jobs with a fence or a lease (list). Exit 0 when answered, 1 when "
        "refused (the problem is printed), 3 when the admin listener cannot be reached.",
    )
    jobs.add_argument("action", choices=["show", "list"])
    jobs.add_argument("job", nargs="?", help="the job id (show)")
    jobs.add_argument(
        "--admin",
        default="http://127.0.0.1:9901",
        metavar="URL",
        help="the admin listener (default: %(default)s)",
    )
    jobs.add_argument("--prefix", default="", help="list: only ids that start with this")
    jobs.add_argument("--after", default="", help="list: only ids after this one")
    jobs.add_argument("--limit", type=int, default=100, help="list: at most this many")
    jobs.add_argument("--json", action="store_true", help="print the admin API's JSON")


def run_jobs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    base = args.admin.rstrip("/")
    if "://" not in base:
        parser.error(f"--admin {args.admin}: give a URL, such as http://127.0.0.1:9901")
    if args.action == "show":
        if not args.job:
            parser.error("jobs show needs a JOB")
        try:
            # Dots too: a path segment "." or ".." would be resolved away on the way.
            url = f"{base}/jobs/{quote(args.job, safe='').replace('.', '%2E')}"
        except UnicodeEncodeError:
            parser.error("jobs show: the job id is not valid UTF-8")
        params: dict[str, str] = {}
    else:
        url = f"{base}/jobs"
        params = {"prefix": args.prefix, "after": args.after, "limit": str(args.limit)}
    import httpx  # only this command needs it

    try:
        answer = httpx.get(url, params=params, timeout=_TIMEOUT)
        body = answer.json()
        ok = answer.status_code == 200
        if not isinstance(body, dict) or (ok and not _answers(args.action, body)):
            raise ValueError("that is not a fenceproxy admin listener's answer")
    except (httpx.HTTPError, ValueError) as exc:
        print(f"fenceproxy: cannot ask {base}: {exc or type(exc).__name__}", file=sys.stderr)
        return 3
    if not ok:
        print(json.dumps(body, indent=2))
        return 1
    if args.json:
        print(json.dumps(body, indent=2))
    elif args.action == "show":
        print(format_job(body))
    else:
        print("\n".join(body["jobs"]) if body["jobs"] else "(no jobs)")
        if body["next"] is not None:
            print(f"(more: --after {shlex.quote(body['next'])})", file=sys.stderr)
    return 0


def _answers(action: str, body: dict[str, Any]) -> bool:
    keys = (
        {"job", "now", "generation", "lease", "in_flight", "keys"}
        if action == "show"
        else {
            "jobs",
            "next",
        }
    )
    return keys <= body.keys()


def format_job(job: dict[str, Any]) -> str:
    """A job as the admin listener shows it, for a person: times are on the store's
    clock, given as how long ago or from now."""
    now, keys = job["now"], job["keys"]
    rows = (
        ("job", job["job"]),
        ("generation", _generation(job, now)),
        ("lease", _lease(job["lease"])),
        ("in flight", _in_flight(job["in_flight"], now)),
        ("keys", len(keys) or "none"),
    )
    lines = [f"{label:<12}{value}" for label, value in rows]
    for key in keys:
        status = "-" if key["status"] is None else key["status"]
        lines.append(
            f"  {key['key']}  {key['state']}  route {key['route']}  generation "
            f"{key['generation']}  status {status}  {_ago(now - key['created_at'])}"
        )
    return "\n".join(lines)


def _generation(job: dict[str, Any], now: float) -> str:
    if job["generation"] is None:
        return "none yet (no fenced write)"
    set_at = job["generation_set_at"]
    return f"{job['generation']}, set {_ago(now - set_at)} ({_utc(set_at)})"


def _lease(lease: dict[str, Any] | None) -> str:
    if lease is None:
        return "none"
    live = f"live, {lease['expires_in']:.1f} s left" if lease["live"] else "not live"
    return f"{lease['owner']}, generation {lease['generation']}, {lease['state']}, {live}"


def _in_flight(flight: dict[str, Any] | None, now: float) -> str:
    if flight is None:
        return "nothing"
    left = max(0.0, flight["expires_at"] - now)
    return f"{flight['state']} (holder {flight['holder']}), record expires in {left:.1f} s"


def _ago(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _utc(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))
