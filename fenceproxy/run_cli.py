"""``fenceproxy run JOB -- COMMAND``: a command run under a job's lease, for shell and
cron jobs and any program that reads its environment (curl, rclone, the AWS CLI).

``run`` claims the job (waiting up to ``--wait`` while another worker holds it),
starts the command in a process group of its own with the lease in its environment
(:func:`environment`), and renews the lease in the background, by the async lease
client's rules. When the command exits, it releases the lease, or completes the job
(``--complete-on-success``, on exit 0). SIGINT, SIGTERM and SIGHUP sent to ``run``
are passed on to the command's group, and the lease is held while the command
drains; what the command leaves running in its group when it exits is stopped
(SIGTERM, then SIGKILL after ``--grace``) before the lease is given back. When the
lease is lost (a renewal refused, or none confirmed before the lease's local
deadline), the group gets SIGTERM, then SIGKILL after ``--grace``:
nothing of the job outlives its lease by more than that.

It exits with the command's code, or 128+N when signal N ended the command (as shells
report it), 127 or 126 when the command could not be started (not found, not
executable: as shells), or one of its own (:data:`USAGE` and those after it), none a
shell's or a failed command's usual 1 or 2. Every message is one line on stderr,
prefixed ``fenceproxy run:``, naming the job and why (its own: ``job 'JOB' at
generation N: why``).

Only the clients' library (httpx) is needed: ``pip install fenceproxy``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import InvariantError, LeaseLost, LeaseRefused, LeaseServiceError
from .log import lease_log
from .units import parse_duration

if TYPE_CHECKING:  # imported when run runs: the proxy's own commands never load httpx
    from .client import HeldLease, LeaseClient

__all__ = [
    "COMPLETED",
    "LEASE_LOST",
    "NOT_CLAIMED",
    "REFUSED",
    "UNAVAILABLE",
    "USAGE",
    "RunSpec",
    "add_run_parser",
    "duration",
    "environment",
    "run_spec",
    "run_under_lease",
    "ttl",
]

# run's own exit codes (docs/workers.md has the table): sysexits' where one fits, and
# none a shell's (126, 127, 128+N) or a failed command's usual 1 or 2.
USAGE = 64  # EX_USAGE: an option is wrong, or --token-file cannot be read
UNAVAILABLE = 69  # EX_UNAVAILABLE: the lease service unreachable, to claim or to complete
NOT_CLAIMED = 75  # EX_TEMPFAIL: another worker held the job past --wait
REFUSED = 78  # EX_CONFIG: the claim refused (credential, scope, ttl bounds)
COMPLETED = 79  # the job was already completed
LEASE_LOST = 80  # lost while the command ran, or before --complete-on-success completed

GRACE = 5.0
"""Seconds between SIGTERM and SIGKILL to the command's group once its lease is lost."""

_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PREFIX = "fenceproxy run:"
_CREDENTIAL = "FENCEPROXY_LEASE_TOKEN"


def duration(text: str) -> float:
    """A duration option as the config takes durations: ``30``, ``30s``, ``500ms``,
    ``5m`` (0 allowed: a ``--wait`` or ``--grace``)."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def ttl(text: str) -> float:
    """A ``--ttl``: a duration above 0."""
    seconds = duration(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError("must be above 0")
    return seconds


def add_run_parser(commands: Any) -> None:
    """``run``'s parser, among ``commands``."""
    run = commands.add_parser(
        "run",
        usage="%(prog)s JOB [--url URL] [--prefix P] [--owner NAME] [--token-file FILE] "
        "[--ttl D] [--wait D] [--grace D] [--complete-on-success] -- COMMAND [ARGS...]",
        help="run a command under a job's lease (for shell and cron jobs)",
        description="Claim JOB, run COMMAND in a process group of its own with FENCING_JOB, "
        "FENCING_TOKEN, FENCING_GENERATION, FENCING_JOB_HEADER, FENCING_TOKEN_HEADER and "
        "FENCEPROXY_URL in its environment while the lease is renewed, then release the "
        "lease (or complete the job). When the lease is lost the command gets SIGTERM, then "
        "SIGKILL after --grace. SIGINT, SIGTERM and SIGHUP are passed on to the command. "
        "Exit: the command's code (128+N when signal N ended it, 126 or 127 when it could "
        f"not be started); {USAGE} usage error; {UNAVAILABLE} lease service unreachable; "
        f"{NOT_CLAIMED} not claimed within --wait; {REFUSED} claim refused; {COMPLETED} job "
        f"already completed; {LEASE_LOST} lease lost. The credential is read from "
        "FENCEPROXY_LEASE_TOKEN or --token-file, never from the command line, and not "
        "passed on to the command.",
    )
    run.add_argument("job", metavar="JOB")
    run.add_argument("command", nargs="+", metavar="COMMAND", help="the command, after --")
    run.add_argument("--url", default="http://127.0.0.1:8080", help="the proxy's address")
    run.add_argument("--prefix", default="/_leases", metavar="P")
    run.add_argument(
        "--owner",
        metavar="NAME",
        help="who holds the lease (default: HOST:PID, this host's name and run's pid)",
    )
    run.add_argument("--token-file", metavar="FILE", help="a file holding the credential")
    run.add_argument(
        "--ttl",
        type=ttl,
        metavar="D",
        help="how long the lease lasts unrenewed: 30, 30s, 500ms, 5m (default: the API's)",
    )
    run.add_argument(
        "--wait",
        type=duration,
        default=0.0,
        metavar="D",
        help="wait this long for a job another worker holds (default 0)",
    )
    run.add_argument(
        "--grace",
        type=duration,
        default=GRACE,
        metavar="D",
        help=f"from SIGTERM to SIGKILL once the lease is lost (default {GRACE:g}s)",
    )
    run.add_argument(
        "--complete-on-success",
        action="store_true",
        help="complete the job when the command exits 0 (release it otherwise)",
    )


@dataclass(frozen=True, slots=True)
class RunSpec:
    """What ``run`` was asked to do."""

    job: str
    command: tuple[str, ...]
    client: LeaseClient
    url: str
    owner: str
    ttl: float | None
    wait: float
    grace: float
    complete_on_success: bool


def run_spec(
    parser: argparse.ArgumentParser, args: argparse.Namespace, token: str | None
) -> RunSpec:
    """The parsed ``run`` command; a usage error (``parser.error``) for a bad --url."""
    from .client import LeaseClient

    try:
        client = LeaseClient(args.url, prefix=args.prefix, token=token)
    except ValueError as exc:
        parser.error(f"--url: {exc}")
    return RunSpec(
        job=args.job,
        command=tuple(args.command),
        client=client,
        url=args.url.rstrip("/"),
        owner=args.owner or f"{socket.gethostname()}:{os.getpid()}",
        ttl=args.ttl,
        wait=args.wait,
        grace=args.grace,
        complete_on_success=args.complete_on_success,
    )


def environment(base: Mapping[str, str], lease: HeldLease, url: str) -> dict[str, str]:
    """The command's environment: ``base`` and the lease, for a write such as
    ``curl -H "$FENCING_TOKEN_HEADER: $FENCING_TOKEN"``. The lease API's credential is
    left out: the command writes under this lease, and has no use for taking others."""
    from .client.core import JOB_HEADER, TOKEN_HEADER

    env = {name: value for name, value in base.items() if name != _CREDENTIAL}
    env.update(
        FENCING_JOB=lease.job_id,
        FENCING_TOKEN=lease.token,
        FENCING_GENERATION=str(lease.generation),
        FENCING_JOB_HEADER=JOB_HEADER,
        FENCING_TOKEN_HEADER=TOKEN_HEADER,
        FENCEPROXY_URL=url,
    )
    return env


def run_under_lease(spec: RunSpec) -> int:
    """Run ``spec``: the exit code (see the module's docstring)."""
    # The client's own warnings (a renewal retried, a lease lost and why), run's way.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{_PREFIX} %(message)s"))
    lease_log.addHandler(handler)
    try:
        return asyncio.run(_Run(spec).run())
    finally:
        lease_log.removeHandler(handler)


def _say(line: str) -> None:
    print(f"{_PREFIX} {line}", file=sys.stderr, flush=True)


def _signal_group(group: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # every process of the group is gone
        os.killpg(group, signum)


def _alive(group: int) -> bool:
    """Whether any process of ``group`` is left."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _exit_code(returncode: int) -> int:
    """A process's exit code as shells report it: 128+N when signal N ended it."""
    return 128 - returncode if returncode < 0 else returncode


class _Run:
    """One run: the claim, the command, and the end of the lease."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.lease: HeldLease | None = None
        self.code: int | None = None
        """The command's exit code, once it exited on its own (or never started)."""
        self.group: int | None = None
        self.ended_by: int | None = None
        """The signal that ended run before the command started."""

    def say(self, why: str) -> None:
        where = "" if self.lease is None else f" at generation {self.lease.generation}"
        _say(f"job {self.spec.job!r}{where}: {why}")

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        if task is None:
            raise InvariantError("run in a task")
        # A signal ignored when run started (nohup's SIGHUP) stays ignored, the
        # command's too, as it would be without run.
        handled = [s for s in _FORWARDED if signal.getsignal(s) is not signal.SIG_IGN]
        for signum in handled:
            loop.add_signal_handler(signum, self._received, signum, task)
        try:
            return await self._held()
        except LeaseRefused as refused:  # only a claim raises it: the others, LeaseLost
            return self._not_claimed(refused)
        except LeaseServiceError as exc:
            return self._unreachable(exc)
        except LeaseLost as exc:
            return self._lost(exc)
        except asyncio.CancelledError:
            if self.ended_by is None:
                raise
            self.say(f"{signal.Signals(self.ended_by).name} before the command started: not run")
            return 128 + self.ended_by
        finally:
            for signum in handled:
                loop.remove_signal_handler(signum)

    async def _held(self) -> int:
        spec = self.spec
        async with (
            spec.client as leases,
            leases.hold(spec.job, owner=spec.owner, ttl=spec.ttl, wait=spec.wait) as lease,
        ):
            self.lease = lease
            self.code = code = await self._command(lease)
            if spec.complete_on_success and code == 0:
                await lease.complete()
            else:
                await lease.release()
        return code

    def _received(self, signum: int, task: asyncio.Task[int]) -> None:
        """Before the command starts, a signal ends run (the claim cancelled, a lease
        taken released); once it runs, each is the command's."""
        if self.group is not None:
            self.say(f"{signal.Signals(signum).name} passed on to the command")
            _signal_group(self.group, signum)
        elif self.ended_by is None:
            self.ended_by = signum
            task.cancel()

    async def _command(self, lease: HeldLease) -> int:
        """Run the command to its end: its exit code. When run is cancelled (the lease
        lost), the command is stopped first."""
        spec = self.spec
        try:
            process = await asyncio.create_subprocess_exec(
                *spec.command, env=environment(os.environ, lease, spec.url), process_group=0
            )
        except OSError as exc:
            self.say(f"cannot run {spec.command[0]!r}: {exc.strerror or exc}")
            return 127 if isinstance(exc, FileNotFoundError) else 126
        self.group = process.pid
        try:
            code = _exit_code(await process.wait())
            await self._stop_left(process.pid)
            self.group = None
            return code
        except asyncio.CancelledError:
            why = "lease lost" if lease.lost else "cancelled"
            self.say(f"{why}: SIGTERM to the command, SIGKILL after {spec.grace:g}s")
            await self._stop(process)
            raise

    async def _stop_left(self, group: int) -> None:
        """What the command left running in its group (a child in the background) is
        stopped before the lease is given back, as the command would be: SIGTERM, then
        SIGKILL after ``--grace``. Nothing of the job writes on without a lease."""
        if not _alive(group):
            return
        grace = self.spec.grace
        self.say(f"the command left processes running: SIGTERM to them, SIGKILL after {grace:g}s")
        _signal_group(group, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        until = loop.time() + grace
        # No event says a group emptied: it is asked every 20 ms.
        while _alive(group) and loop.time() < until:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        _signal_group(group, signal.SIGKILL)

    async def _stop(self, process: asyncio.subprocess.Process) -> None:
        """SIGTERM to the command's group, then SIGKILL once it exited or ``--grace``
        ran out, to whatever is left in its group too."""
        _signal_group(process.pid, signal.SIGTERM)
        exited = asyncio.ensure_future(process.wait())
        done, _ = await asyncio.wait({exited}, timeout=self.spec.grace)
        if not done:
            self.say(f"the command did not exit within {self.spec.grace:g}s: SIGKILL")
        _signal_group(process.pid, signal.SIGKILL)
        await exited

    # -- how it ended ------------------------------------------------------------

    def _not_claimed(self, refused: LeaseRefused) -> int:
        if refused.slug == "job-completed":
            self.say(f"not run: the job was completed ({refused})")
            return COMPLETED
        if refused.slug in ("lease-held", "write-in-flight"):
            self.say(f"not claimed within --wait {self.spec.wait:g}s: {refused}")
            return NOT_CLAIMED
        self.say(f"the lease API refused the claim: {refused}")
        return REFUSED

    def _unreachable(self, exc: LeaseServiceError) -> int:
        if self.code is None:
            self.say(f"not claimed: {exc}")
            return UNAVAILABLE
        return self._not_ended(exc)

    def _lost(self, exc: LeaseLost) -> int:
        if self.lease is None:  # the claim's grant came after its own deadline
            self.say(f"not claimed: {exc}")
            return UNAVAILABLE
        if self.code is None:  # the command was stopped, and said so
            return LEASE_LOST
        return self._not_ended(exc)

    def _not_ended(self, exc: LeaseLost | LeaseServiceError) -> int:
        """The command exited by itself, and then the lease could not be ended: a
        release matters little (the lease runs out by itself), a completion does."""
        assert self.code is not None
        if self.spec.complete_on_success and self.code == 0:
            self.say(f"the command exited 0, but the job was not completed: {exc}")
            return LEASE_LOST if isinstance(exc, LeaseLost) else UNAVAILABLE
        self.say(f"the command exited {self.code}; the lease was not released: {exc}")
        return self.code
