"""``fenceproxy run JOB -- COMMAND``: a command holds a job's lease while it runs, with
the lease in its environment; it is stopped when the lease is lost, its write then
refused at the proxy; signals reach it, and run's exit code says what happened. Each
test runs ``fenceproxy run`` as a real process against a real proxy process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from fenceproxy.testing import ProxyProcess, RecordingUpstream, eventually, free_port

from .test_logs import config_file
from .test_packaging import WITHOUT_SERVER
from .test_proxy import problem

pytestmark = pytest.mark.slow  # a proxy, and run with its commands, each a process

# run's own exit codes, as docs/workers.md gives them: scripts test for these numbers.
USAGE, NOT_CLAIMED, COMPLETED, LEASE_LOST = 64, 75, 79, 80

# A write through the proxy under the lease the command was given, in Python's standard
# library: write(body) is the answer's status.
WRITE = """
import os, urllib.error, urllib.request
def write(body):
    request = urllib.request.Request(
        os.environ["FENCEPROXY_URL"] + "/billing/charges", data=body, method="POST",
        headers={os.environ["FENCING_JOB_HEADER"]: os.environ["FENCING_JOB"],
                 os.environ["FENCING_TOKEN_HEADER"]: os.environ["FENCING_TOKEN"],
                 "Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as refused:
        return refused.code
"""

# Notes its start in ARGV[1]/order, tells the test its pid (ARGV[1]/NAME.pid), waits for
# ARGV[1]/NAME.go, notes its end and exits 0; on SIGTERM it writes NAME.term, and waits
# the same way.
WAITER = """
import os, pathlib, signal, sys, time
here, name = pathlib.Path(sys.argv[1]), sys.argv[2]
def tell(what, text):
    (here / f"{name}.tmp").write_text(text)
    os.replace(here / f"{name}.tmp", here / f"{name}.{what}")
signal.signal(signal.SIGTERM, lambda *_: tell("term", ""))
with open(here / "order", "a") as order:
    order.write(f"{name} start {os.environ['FENCING_GENERATION']}\\n")
tell("pid", str(os.getpid()))
while not (here / f"{name}.go").exists():
    time.sleep(0.01)
with open(here / "order", "a") as order:
    order.write(f"{name} end\\n")
"""

# Ignores SIGTERM (only SIGKILL ends it), tells its pid, and once resumed (SIGCONT)
# sends one write and writes its status to ARGV[1]/a.status.
PAUSED = (
    WRITE
    + """
import pathlib, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
resumed = []
signal.signal(signal.SIGCONT, lambda *_: resumed.append(True))
here = pathlib.Path(sys.argv[1])
def tell(what, text):
    (here / "a.tmp").write_text(text)
    os.replace(here / "a.tmp", here / what)
tell("a.pid", str(os.getpid()))
while not resumed:
    time.sleep(0.01)
tell("a.status", str(write(b'{"from": "a"}')))
while True:
    time.sleep(1)
"""
)


class Runs:
    """``fenceproxy run`` processes against ``proxy``; any still running at the end is
    killed, with the commands that told their pid and their groups."""

    def __init__(self, proxy: ProxyProcess, folder: Path) -> None:
        self.proxy = proxy
        self.folder = folder
        self.started: list[asyncio.subprocess.Process] = []
        self.commands: list[int] = []
        self.groups: list[int] = []

    async def start(
        self,
        job: str,
        *args: str,
        env: dict[str, str] | None = None,
        fenceproxy: tuple[str, ...] = (sys.executable, "-m", "fenceproxy"),
    ) -> asyncio.subprocess.Process:
        """``fenceproxy run JOB --url PROXY ARGS`` (``ARGS`` ending ``-- COMMAND``)."""
        process = await asyncio.create_subprocess_exec(
            *fenceproxy, "run", job, "--url", self.proxy.url, *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=None if env is None else {**os.environ, **env},
        )  # fmt: skip
        self.started.append(process)
        return process

    async def waiter(self, job: str, name: str, *args: str) -> asyncio.subprocess.Process:
        """run with :data:`WAITER` as its command."""
        command = (sys.executable, "-c", WAITER, str(self.folder), name)
        return await self.start(job, *args, "--", *command)

    async def pid(self, name: str) -> int:
        """The pid a command wrote to ``name.pid``, once it did; its group is killed at
        the end."""
        path = self.folder / f"{name}.pid"
        await eventually(path.exists, within=20)
        pid = int(path.read_text())
        self.commands.append(pid)
        if (group := os.getpgid(pid)) != os.getpgrp():  # never this test's own
            self.groups.append(group)
        return pid

    def go(self, name: str) -> None:
        (self.folder / f"{name}.go").touch()

    def order(self) -> list[str]:
        path = self.folder / "order"
        return path.read_text().splitlines() if path.exists() else []

    async def close(self) -> None:
        # The commands first: one left running holds run's output open, and asyncio
        # tells of run's exit only once its output is closed.
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        for pid in self.commands:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for process in self.started:
            if process.returncode is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
                await process.wait()


def ended_for_good(pid: int) -> bool:
    """Whether process ``pid`` is gone, or dead and waiting for its parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


async def ended(process: asyncio.subprocess.Process, within: float = 30) -> tuple[int, str, str]:
    """Its exit code, stdout and stderr, once it exited."""
    async with asyncio.timeout(within):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.fixture
async def proxy(tmp_path: Path, upstream: RecordingUpstream) -> AsyncIterator[ProxyProcess]:
    process = await ProxyProcess(config_file(tmp_path, upstream, leases={}), free_port()).start()
    yield process
    await process.stop()


@pytest.fixture
async def runs(proxy: ProxyProcess, tmp_path: Path) -> AsyncIterator[Runs]:
    folder = tmp_path / "commands"
    folder.mkdir()
    started = Runs(proxy, folder)
    yield started
    await started.close()


async def claim(
    http: aiohttp.ClientSession, proxy: ProxyProcess, job: str, owner: str = "next"
) -> aiohttp.ClientResponse:
    """Another worker's claim of ``job``, answered at once (it does not wait)."""
    async with http.post(
        f"{proxy.url}/_leases/{job}/claim", json={"owner": owner, "ttl": 30}
    ) as answer:
        await answer.read()
        return answer


async def connections(http: aiohttp.ClientSession, proxy: ProxyProcess) -> float:
    """The proxy's open client connections (its metric): a run waiting for a job, or
    renewing its lease, holds one."""
    async with http.get(f"{proxy.admin_url}/metrics") as page:
        text = await page.text()
    (line,) = (x for x in text.splitlines() if x.startswith("fenceproxy_client_connections "))
    return float(line.split()[1])


async def test_run_gives_the_command_the_lease_and_its_curl_write_reaches_the_upstream(
    runs: Runs, proxy: ProxyProcess, upstream: RecordingUpstream, http: aiohttp.ClientSession
) -> None:
    """A shell command sends its write with curl and the variables run gave it, as the
    docs show: the proxy forwards it at the lease's generation. The lease API's
    credential stays with run, and the lease is released when the command is done."""
    if shutil.which("curl") is None:
        if os.environ.get("CI"):
            pytest.fail("curl is not installed, and CI must run every test")
        pytest.skip("curl is not installed (make servers installs it)")
    script = (
        'printf "%s\\n" "$FENCING_JOB" "$FENCING_GENERATION" "$FENCING_TOKEN" '
        '"$FENCING_JOB_HEADER" "$FENCING_TOKEN_HEADER" "$FENCEPROXY_URL" '
        '"${FENCEPROXY_LEASE_TOKEN-unset}"; '
        "curl -sS --noproxy '*' -o /dev/null -w '%{http_code}\\n' "
        '-H "$FENCING_JOB_HEADER: $FENCING_JOB" -H "$FENCING_TOKEN_HEADER: $FENCING_TOKEN" '
        '-H "Content-Type: application/json" -d \'{"amount": 10}\' '
        '"$FENCEPROXY_URL/billing/charges"'
    )
    run = await runs.start(
        "invoice-42", "--", "sh", "-c", script, env={"FENCEPROXY_LEASE_TOKEN": "s3cret"}
    )
    code, out, err = await ended(run)
    assert (code, err) == (0, "")
    job, generation, token, job_header, token_header, url, credential, status = out.split("\n")[:8]
    assert (job, generation, token) == ("invoice-42", "1", "1")
    assert (job_header, token_header, url) == ("Fencing-Job", "Fencing-Token", proxy.url)
    assert credential == "unset"
    assert status == "200"
    (applied,) = upstream.received
    assert (applied.job, applied.generation, applied.body) == ("invoice-42", 1, b'{"amount": 10}')
    # Released, by its owner: HOST:PID of run.
    async with http.get(f"{proxy.url}/_leases/invoice-42") as shown:
        record = await shown.json()
    assert (record["state"], record["owner"]) == ("released", f"{socket.gethostname()}:{run.pid}")
    assert (await claim(http, proxy, "invoice-42")).status == 200


async def test_run_needs_only_the_clients_library(runs: Runs) -> None:
    """Where ``pip install fenceproxy`` put the clients alone, run runs: none of the
    proxy's libraries is imported."""
    cli = WITHOUT_SERVER + "from fenceproxy.cli import main; sys.exit(main(sys.argv[1:]))"
    command = ("--", "sh", "-c", 'echo "$FENCING_JOB $FENCING_GENERATION"')
    run = await runs.start("j", *command, fenceproxy=(sys.executable, "-c", cli))
    assert await ended(run) == (0, "j 1\n", "")


async def test_run_paused_past_its_lease_is_refused_and_stopped_when_it_wakes(
    runs: Runs, proxy: ProxyProcess, upstream: RecordingUpstream, tmp_path: Path
) -> None:
    """The paused worker, whole: run and its command stopped past the lease's ttl.
    Another run takes the job and writes; the first, woken, has its write refused
    (409, never at the upstream), its command killed within --grace (it ignores
    SIGTERM), and exits with the lease-lost code."""
    grace = 1.0
    command = ("--", sys.executable, "-c", PAUSED, str(runs.folder))
    # A ttl a loaded machine renews in time until the pause (renewed every ttl/3, lost
    # 0.9 ttl after the last renewal sent): a slow start-up is no pause.
    a = await runs.start("nightly", "--ttl", "2", "--grace", f"{grace}", *command)
    a_command = await runs.pid("a")
    a_group = os.getpgid(a_command)
    assert a_group not in (os.getpgid(a.pid), os.getpgrp())  # a group of its own
    a.send_signal(signal.SIGSTOP)
    os.killpg(a_group, signal.SIGSTOP)

    b_script = WRITE + 'print(write(b\'{"from": "b"}\'))'
    b = await runs.start("nightly", "--wait", "20", "--", sys.executable, "-c", b_script)
    assert (await ended(b))[:2] == (0, "200\n")
    assert [(r.generation, r.body) for r in upstream.received] == [(2, b'{"from": "b"}')]

    resumed = time.monotonic()
    os.killpg(a_group, signal.SIGCONT)
    a.send_signal(signal.SIGCONT)
    status = runs.folder / "a.status"
    await eventually(status.exists, within=20)
    assert status.read_text() == "409"
    code, _, err = await ended(a)
    took = time.monotonic() - resumed
    assert code == LEASE_LOST, err
    lines = err.splitlines()
    assert lines[0].startswith("fenceproxy run: lease of 'nightly' at generation 1 lost: ")
    assert lines[1:] == [
        f"fenceproxy run: job 'nightly' at generation 1: lease lost: SIGTERM to the command, "
        f"SIGKILL after {grace:g}s",
        f"fenceproxy run: job 'nightly' at generation 1: the command did not exit within "
        f"{grace:g}s: SIGKILL",
    ]
    with pytest.raises(ProcessLookupError):
        os.kill(a_command, 0)
    assert took < grace + 5  # the grace, and a busy machine's slack: not a hang
    assert [(r.generation, r.body) for r in upstream.received] == [(2, b'{"from": "b"}')]


async def test_run_exits_with_the_commands_code(runs: Runs) -> None:
    """A script's caller reads the command's own exit code through run."""
    code, _, err = await ended(await runs.start("j", "--", "sh", "-c", "exit 3"))
    assert (code, err) == (3, "")


async def test_run_exits_128_plus_n_when_a_signal_ends_the_command(runs: Runs) -> None:
    """As a shell reports it: 143 for a command ended by SIGTERM."""
    code, _, err = await ended(await runs.start("j", "--", "sh", "-c", "kill -TERM $$"))
    assert (code, err) == (128 + signal.SIGTERM, "")


async def test_what_the_command_leaves_running_is_stopped_before_the_lease_is_released(
    runs: Runs, proxy: ProxyProcess, http: aiohttp.ClientSession
) -> None:
    """A child the command left in the background (which would write on with the
    token after the lease is given back) gets SIGTERM, then SIGKILL after --grace,
    before run releases the lease."""
    left = runs.folder / "left.pid"
    # The command exits once its child is under way (it told its pid, SIGTERM ignored).
    command = (
        f"sh -c 'trap \"\" TERM; echo $$ > {left}.tmp; mv {left}.tmp {left}; exec sleep 60' &"
        f" while [ ! -s {left} ]; do sleep 0.01; done; exit 0"
    )
    process = await runs.start("bg", "--grace", "0.2", "--", "sh", "-c", command)
    code, _, err = await ended(process)
    assert code == 0
    assert "the command left processes running: SIGTERM to them, SIGKILL after 0.2s" in err
    assert ended_for_good(int(left.read_text()))  # though it ignored SIGTERM
    assert (await claim(http, proxy, "bg")).status == 200  # and the lease released


async def test_run_exits_127_and_releases_when_the_command_is_not_found(
    runs: Runs, proxy: ProxyProcess, http: aiohttp.ClientSession
) -> None:
    """As a shell: 127, said on stderr; the job is free again at once."""
    code, _, err = await ended(await runs.start("j", "--", "/nonexistent/command"))
    assert code == 127
    assert err == (
        "fenceproxy run: job 'j' at generation 1: cannot run '/nonexistent/command': "
        "No such file or directory\n"
    )
    assert (await claim(http, proxy, "j")).status == 200


async def test_run_exits_not_claimed_when_the_wait_runs_out(
    runs: Runs, proxy: ProxyProcess, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """While another worker holds the job past --wait, the command never runs and run
    exits 75 (EX_TEMPFAIL: try later), naming the refusal."""
    assert (await claim(http, proxy, "busy", owner="other")).status == 200
    ran = tmp_path / "ran"
    run = await runs.start("busy", "--wait", "0.3", "--", "touch", str(ran))
    code, _, err = await ended(run)
    assert code == NOT_CLAIMED
    assert err.startswith(
        "fenceproxy run: job 'busy': not claimed within --wait 0.3s: 409 lease-held"
    )
    assert not ran.exists()


async def test_run_ended_by_a_signal_while_it_waits_never_runs_the_command(
    runs: Runs, proxy: ProxyProcess, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """SIGTERM while run waits for a busy job ends the wait: the command never runs,
    and run exits 143, as a process ended by SIGTERM."""
    assert (await claim(http, proxy, "held", owner="other")).status == 200
    before = await connections(http, proxy)
    ran = tmp_path / "ran"
    run = await runs.start("held", "--wait", "30", "--", "touch", str(ran))
    async with asyncio.timeout(20):
        while await connections(http, proxy) <= before:  # its claim is waiting
            await asyncio.sleep(0.02)
    run.send_signal(signal.SIGTERM)
    code, _, err = await ended(run)
    assert code == 128 + signal.SIGTERM
    assert err == "fenceproxy run: job 'held': SIGTERM before the command started: not run\n"
    assert not ran.exists()


async def test_run_exits_lease_lost_when_a_renewal_is_refused(
    runs: Runs, proxy: ProxyProcess, http: aiohttp.ClientSession
) -> None:
    """The job taken from under the command (here completed by its owner elsewhere):
    the next renewal is refused, the command stopped with SIGTERM, and run exits 80."""
    # Renewed every ttl/3: a ttl a loaded machine renews in time until the job is taken,
    # so that the refused renewal, not the local deadline, is what ends the lease.
    run = await runs.waiter("taken", "w", "--owner", "w", "--ttl", "3")
    await runs.pid("w")
    body = {"owner": "w", "generation": 1}
    async with http.post(f"{proxy.url}/_leases/taken/complete", json=body) as answer:
        assert answer.status == 200
    await eventually((runs.folder / "w.term").exists, within=20)
    runs.go("w")  # it exits when told, once it has had SIGTERM
    code, _, err = await ended(run)
    assert code == LEASE_LOST
    assert "lease of 'taken' at generation 1 lost: renewal refused: 409 job-completed" in err
    assert "job 'taken' at generation 1: lease lost: SIGTERM to the command" in err


async def test_run_exits_usage_when_an_option_is_wrong(runs: Runs) -> None:
    """64 (EX_USAGE), never 2, which the command could exit with: no command, or a URL
    without a scheme."""
    code, _, err = await ended(await runs.start("j"))
    assert code == USAGE
    assert err.startswith("usage: fenceproxy run JOB ")
    code, _, err = await ended(await runs.start("j", "--url", "127.0.0.1:1", "--", "true"))
    assert code == USAGE
    assert err.endswith(
        "error: --url: the lease API's URL needs a scheme, such as http://127.0.0.1:1\n"
    )


async def test_run_passes_sigterm_on_and_holds_the_lease_while_the_command_drains(
    runs: Runs, proxy: ProxyProcess, http: aiohttp.ClientSession
) -> None:
    """SIGTERM to run reaches the command; while the command finishes, the job is still
    held; once it exits, the lease is released and the next claim gets it at once."""
    run = await runs.waiter("drain", "w")
    await runs.pid("w")
    run.send_signal(signal.SIGTERM)
    await eventually((runs.folder / "w.term").exists, within=20)
    await problem(await claim(http, proxy, "drain"), 409, "lease-held")
    runs.go("w")
    code, _, err = await ended(run)
    assert code == 0
    assert err == "fenceproxy run: job 'drain' at generation 1: SIGTERM passed on to the command\n"
    assert (await claim(http, proxy, "drain")).status == 200


async def test_run_under_nohup_leaves_sighup_ignored_for_the_command(runs: Runs) -> None:
    """``nohup fenceproxy run ...``: the command ignores SIGHUP, as it would under nohup
    without run, rather than being handed one run passes on."""
    probe = "import signal; print(signal.getsignal(signal.SIGHUP) == signal.SIG_IGN)"
    nohup = ("nohup", sys.executable, "-m", "fenceproxy")
    run = await runs.start("j", "--", sys.executable, "-c", probe, fenceproxy=nohup)
    assert (await ended(run))[:2] == (0, "True\n")


async def test_run_complete_on_success_completes_the_job(
    runs: Runs, proxy: ProxyProcess, http: aiohttp.ClientSession
) -> None:
    """A command that exits 0 completes the job: a later run of it does not run its
    command, exiting 79, and a claim is refused job-completed."""
    code, _, err = await ended(await runs.start("once", "--complete-on-success", "--", "true"))
    assert (code, err) == (0, "")
    code, _, err = await ended(await runs.start("once", "--", "sh", "-c", "exit 5"))
    assert code == COMPLETED
    assert err.startswith(
        "fenceproxy run: job 'once': not run: the job was completed (409 job-completed"
    )
    await problem(await claim(http, proxy, "once"), 409, "job-completed")


async def test_run_complete_on_success_releases_on_failure(
    runs: Runs, proxy: ProxyProcess, http: aiohttp.ClientSession
) -> None:
    """A command that fails leaves the job to be done again: released, not completed."""
    code, _, _ = await ended(await runs.start("retry", "--complete-on-success", "--", "false"))
    assert code == 1
    answer = await claim(http, proxy, "retry")
    assert answer.status == 200


async def test_run_waiting_gets_the_job_after_the_holder_releases(
    runs: Runs, proxy: ProxyProcess, http: aiohttp.ClientSession
) -> None:
    """Two runs wait for a job another run holds: each gets it in turn, only after the
    one before it let it go, at the next generation."""
    holder = await runs.waiter("queue", "h", "--ttl", "3")
    await runs.pid("h")
    first = await runs.waiter("queue", "w1", "--wait", "30")
    second = await runs.waiter("queue", "w2", "--wait", "30")

    # The holder's renewals and both waiting claims are at the lease API.
    async with asyncio.timeout(20):
        while await connections(http, proxy) < 3:
            await asyncio.sleep(0.02)
    assert runs.order() == ["h start 1"]
    runs.go("w1")
    runs.go("w2")
    runs.go("h")
    assert (await ended(holder))[0] == 0
    assert [(await ended(first))[0], (await ended(second))[0]] == [0, 0]
    order = runs.order()
    a, b = order[2].split()[0], order[4].split()[0]
    assert {a, b} == {"w1", "w2"}
    assert order == ["h start 1", "h end", f"{a} start 2", f"{a} end", f"{b} start 3", f"{b} end"]
