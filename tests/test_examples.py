"""The worked examples run as a user runs them, against a real proxy process: every
Python block of README.md and docs/ (tests/test_docs.py checks the other blocks), the
README's quick start with the answers it shows, and a pool of synchronous workers in
real processes where one is paused (SIGSTOP) past its lease and its job is taken
over, and the workers in Node.js and Java (examples/worker.mjs, examples/Worker.java)
on this machine's runtimes: they write at their generation, stop the moment their
lease is lost, and wait for a job another worker holds."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import sys
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from fenceproxy.errors import PROBLEM_BASE
from fenceproxy.testing import ProxyProcess, RecordingUpstream, accepting, free_port

from .test_docs import BLOCKS, Block, commands

ROOT = Path(__file__).resolve().parent.parent


def python_examples() -> list[Block]:
    """The Python blocks of README.md and docs/ that are whole programs: all but those
    marked fragment or skip (which tests/test_docs.py compiles)."""
    return [b for b in BLOCKS if b.lang == "python" and b.marker is None]


@pytest.fixture
async def proxy(tmp_path: Path, upstream: RecordingUpstream) -> Any:
    config = tmp_path / "proxy.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "store": f"sqlite:///{tmp_path / 'fences.db'}",
                "leases": {},
                "routes": [
                    {"name": "billing", "path": "/billing/", "upstream": upstream.url},
                    {"name": "api", "path": "/api/", "upstream": upstream.url},
                ],
            }
        )
    )
    proxy = await ProxyProcess(config, free_port()).start()
    try:
        yield proxy
    finally:
        await proxy.stop()


async def python(*argv: str) -> tuple[int, str, str]:
    child = await asyncio.create_subprocess_exec(
        sys.executable, *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(child.communicate(), 60)
    assert child.returncode is not None
    return child.returncode, out.decode(), err.decode()


async def test_the_docs_python_examples_run_and_check_every_write(
    proxy: ProxyProcess, upstream: RecordingUpstream
) -> None:
    examples = python_examples()
    # The synchronous worker on the front page, and both clients' on the Clients page.
    assert {b.path.name for b in examples} >= {"README.md", "clients.md"}
    written = []
    for n, example in enumerate(examples):
        assert "raise_for_status()" in example.code  # a refused write is never a success
        # Each on a job of its own, so each claims generation 1: the front page and the
        # Clients page show the same worker.
        job = f"example-{n}"
        run = re.sub(r"invoice-\d+", job, example.code.replace("http://127.0.0.1:8080", proxy.url))
        before = len(upstream.received)
        exit_code, _, err = await python("-c", run)
        assert exit_code == 0, f"{example.where}: {err}"
        writes = [(r.job, r.headers["Fencing-Token"], r.headers["Idempotency-Key"],
                   json.loads(r.body)) for r in upstream.received[before:]]  # fmt: skip
        amounts = (10, 20) if "SyncLeaseClient" in example.code else (10,)
        expected = [(job, "1", f"{job}-{amount}", {"amount": amount}) for amount in amounts]
        assert writes == expected, example.where
        written.append(example.where)
    assert len(written) >= 3


def quick_start() -> tuple[str, list[Block]]:
    """The README's quick start: its text, and its blocks in order."""
    readme = ROOT / "README.md"
    text = readme.read_text()
    start = text.index("\n## Quick start\n")
    end = text.index("\n## ", start + 1)
    first, last = text.count("\n", 0, start), text.count("\n", 0, end)
    return text[start:end], [b for b in BLOCKS if b.path == readme and first < b.line <= last]


CURL = shutil.which("curl")


def as_a_user_runs_it() -> dict[str, str]:
    """The environment of the page's commands: ``fenceproxy`` on the PATH, as the
    venv's activate script puts it, running this tree's code."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT)}


async def shell(script: str, cwd: Path) -> str:
    """``script`` run by sh as written; what it printed (it must succeed)."""
    child = await asyncio.create_subprocess_exec(
        "sh", "-c", script, cwd=cwd, env=as_a_user_runs_it(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(child.communicate(), 30)
    assert child.returncode == 0, f"{script}: exit {child.returncode}: {err.decode()}"
    return out.decode()


def answers(out: str) -> list[Any]:
    """The JSON answers curl printed one after another (none ends with a newline)."""
    found, at, decoder = [], 0, json.JSONDecoder()
    while at < len(out):
        value, at = decoder.raw_decode(out, at)
        found.append(value)
        while at < len(out) and out[at].isspace():
            at += 1
    return found


async def start(line: str, cwd: Path, log: Path, port: int) -> asyncio.subprocess.Process:
    """A long-running command of the page, run by sh as written, its output in ``log``;
    returned once ``port`` accepts connections (RuntimeError if it exits first)."""
    with log.open("wb") as out:
        child = await asyncio.create_subprocess_exec(
            "sh", "-c", f"exec {line}", cwd=cwd, env=as_a_user_runs_it(),
            stdout=out, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip

    def gone() -> str | None:
        code = child.returncode
        return None if code is None else f"{line}: exit {code}: {log.read_text()}"

    async with asyncio.timeout(30):
        await accepting(port, gone)
    return child


@pytest.mark.slow
async def test_the_readmes_quick_start_runs_as_written_and_shows_what_it_says(
    tmp_path: Path,
) -> None:
    """A newcomer runs the README's quick start top to bottom: the stand-in API and
    the proxy started by its commands, each curl command run by a shell as written
    (only the ports moved to free ones). Every answer is the JSON it shows (but the
    lease's times), B's waiting claim is granted once A's lease has run out, A's stale
    write is refused, the stand-in printed A's first write and nothing after it, and
    the proxy's first line names its operator page where the page says."""
    if CURL is None:
        if os.environ.get("CI"):
            pytest.fail("curl is not installed, and CI must run every test")
        pytest.skip("curl is not installed")
    text, blocks = quick_start()
    assert [b.lang for b in blocks] == ["yaml", "sh", "sh", "json", "sh", "json", "sh", "json",
                                        "text"]  # fmt: skip
    config, servers, claim, lease, write, applied, late, problem, printed = blocks
    page = re.search(r"operator page, `(http://127\.0\.0\.1:9901/)`", text)
    assert page is not None, "the page names the operator page's address"
    # The page's ports are fixed; here they are free ones, so that runs do not meet.
    moved = {shown: free_port() for shown in (8080, 9000, 9901)}

    def here(code: str) -> str:
        for shown, port in moved.items():
            code = re.sub(rf"\b(127\.0\.0\.1|localhost):{shown}\b", rf"\1:{port}", code)
        return code

    (tmp_path / "fenceproxy.yaml").write_text(here(config.code))
    stand_in_line, serve_line = here(servers.code).splitlines()
    assert commands(servers)[1] == ["fenceproxy", "serve", "-c", "fenceproxy.yaml"]
    admin = f"127.0.0.1:{moved[9901]}"  # the default address, which a test cannot take
    log, proxy_log = tmp_path / "stand-in.log", tmp_path / "proxy.log"
    stand_in = await start(stand_in_line, tmp_path, log, moved[9000])
    proxy = await start(f"{serve_line} --admin {admin}", tmp_path, proxy_log, moved[8080])
    try:
        [a] = answers(await shell(here(claim.code), tmp_path))
        shown = json.loads(lease.code)
        assert list(a) == list(shown)  # in the order curl prints them
        varying = {key: shown[key] for key in ("lease_until", "expires_in")}  # the clock's
        assert {**a, **varying} == shown
        assert 0 < a["expires_in"] <= a["ttl"]
        assert answers(await shell(here(write.code), tmp_path)) == [json.loads(applied.code)]
        b, refused = answers(await shell(here(late.code), tmp_path))
        assert b.get("state") == "held", b  # B's claim is granted, not refused
        assert (b["owner"], b["generation"], b["token"]) == ("worker-b", 2, "2")
        assert b["lease_until"] - b["ttl"] >= a["lease_until"]  # granted once A's ran out
        assert b["waited"] >= 0
        assert refused == json.loads(problem.code)
        # A's first write again, with its key: the stored answer, not forwarded again.
        retried = await shell(here(write.code).replace("curl -s ", "curl -s -i ", 1), tmp_path)
        head, _, body = retried.partition("\r\n\r\n")
        assert "\r\nidempotent-replayed: true\r\n" in head.lower() + "\r\n"
        assert answers(body) == [json.loads(applied.code)]
        address = page[1].replace("9901", str(moved[9901]))
        assert f"operator page: {address}" in proxy_log.read_text()
    finally:
        for child in (proxy, stand_in):
            child.terminate()
            await child.wait()
    assert stand_in.returncode == 0  # SIGTERM stops it cleanly
    start_line, *writes = log.read_text().splitlines()
    assert start_line.startswith(f"stand-in API on http://127.0.0.1:{moved[9000]}:")
    assert writes == printed.code.splitlines()


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_pool_of_workers_takes_over_the_job_of_one_paused_past_its_lease(
    proxy: ProxyProcess, upstream: RecordingUpstream
) -> None:
    jobs = ["invoice-1", "invoice-2", "invoice-3"]
    example = str(ROOT / "examples" / "worker_pool.py")
    pool = [sys.executable, example, "--proxy", proxy.url, "--jobs", ",".join(jobs),
            "--steps", "4", "--step-time", "0.15", "--ttl", "1"]  # fmt: skip
    workers = [
        await asyncio.create_subprocess_exec(
            *pool, "--worker", f"w{n}", "--start", str(n), stdout=asyncio.subprocess.PIPE
        )
        for n in range(3)
    ]
    events: list[dict[str, Any]] = []
    paused: tuple[int, str, int] | None = None

    async def read(n: int, worker: asyncio.subprocess.Process) -> None:
        nonlocal paused
        assert worker.stdout is not None
        async for line in worker.stdout:
            event = json.loads(line)
            events.append(event)
            # Pause the first worker to write, once it has written once: it stays
            # stopped past its lease (ttl 1 s) while the others go on. Not always w0:
            # on a busy machine w0 may start after another worker took its job.
            if paused is None and event["ev"] == "wrote":
                paused = (n, event["job"], event["generation"])
                worker.send_signal(signal.SIGSTOP)
                asyncio.get_running_loop().call_later(3, worker.send_signal, signal.SIGCONT)

    await asyncio.wait_for(asyncio.gather(*(read(n, w) for n, w in enumerate(workers))), timeout=90)
    assert [await w.wait() for w in workers] == [0, 0, 0]
    assert paused is not None
    n, job, generation = paused

    # Every job was completed exactly once.
    completed = [e for e in events if e["ev"] == "completed"]
    assert sorted(e["job"] for e in completed) == jobs
    # The paused worker's job went to another worker, at the next generation; the
    # paused worker found its lease lost when it woke (or was refused: never applied).
    taken = next(e for e in completed if e["job"] == job)
    assert (taken["worker"], taken["generation"]) != (f"w{n}", generation)
    assert taken["generation"] == generation + 1
    assert any(e["ev"] == "lost" and e["worker"] == f"w{n}" and e["job"] == job for e in events)
    # At the API: each step of each job applied once, the generations of a job never
    # going down in the order they arrived.
    steps = [(r.job, json.loads(r.body)["step"]) for r in upstream.received]
    assert sorted(steps) == sorted((j, s) for j in jobs for s in range(4))
    seen: dict[str | None, int] = defaultdict(int)
    for received in upstream.received:
        token = int(received.headers["Fencing-Token"])
        assert token >= seen[received.job]
        seen[received.job] = token


# --- Workers in other languages: examples/worker.mjs and examples/Worker.java -------

WORKERS = {
    "node": ["node", str(ROOT / "examples" / "worker.mjs")],
    # Run from its source, as docs/workers.md shows: compiled in memory at each start.
    "java": ["java", str(ROOT / "examples" / "Worker.java")],
}


class Running:
    """A worker process started by a test, and the events (JSON lines) it printed."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.events: list[dict[str, Any]] = []

    async def until(self, event: str, within: float = 30.0) -> dict[str, Any]:
        """The next event of that name; AssertionError when the worker exits first."""
        assert self.process.stdout is not None
        async with asyncio.timeout(within):
            async for line in self.process.stdout:
                self.events.append(json.loads(line))
                if self.events[-1]["event"] == event:
                    return self.events[-1]
        raise AssertionError(f"it exited without {event}: {self.events} {await self.errors()}")

    async def exit(self, within: float = 30.0) -> int:
        """Its exit status, once it has exited, with every event it printed read."""
        assert self.process.stdout is not None
        async with asyncio.timeout(within):
            self.events += [json.loads(line) async for line in self.process.stdout]
            return await self.process.wait()

    async def errors(self) -> str:
        assert self.process.stderr is not None
        return (await self.process.stderr.read()).decode()

    def names(self) -> list[str]:
        """Its events' names, renewals aside (how many depends on the machine's speed)."""
        return [event["event"] for event in self.events if event["event"] != "renewed"]


StartWorker = Callable[..., Awaitable[Running]]


@pytest.fixture(params=sorted(WORKERS))
async def worker(request: pytest.FixtureRequest, proxy: ProxyProcess) -> AsyncIterator[StartWorker]:
    """Starts a worker in another language on this machine's runtime, on a job, writing
    to /api/{job} through ``proxy``; any still running at the end is killed."""
    command = WORKERS[request.param]
    if shutil.which(command[0]) is None:
        pytest.skip(f"{command[0]} is not installed: {Path(command[1]).name} cannot run")
    started: list[Running] = []

    async def start(job: str, *args: str) -> Running:
        settings = ["--proxy", proxy.url, "--job", job, "--owner", f"{job}-worker",
                    "--path", f"/api/{job}", "--body", '{"amount": 10}', *args]  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            *command, *settings, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        started.append(Running(process))
        return started[-1]

    yield start
    for running in started:
        if running.process.returncode is None:
            running.process.kill()
            await running.process.wait()


async def lease_call(proxy: ProxyProcess, job: str, action: str, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(f"{proxy.url}/_leases/{job}/{action}", json=body)


@pytest.mark.slow
async def test_a_worker_in_another_language_writes_at_its_generation_and_completes(
    worker: StartWorker, proxy: ProxyProcess, upstream: RecordingUpstream
) -> None:
    """A worker copied from examples/worker.mjs or examples/Worker.java sends each write
    with the fencing headers of the lease it was granted, and completes the job: no
    other worker can take it after."""
    job = "invoice-7"
    # An earlier holder gave the job up: the worker's lease is the job's second.
    claimed = (await lease_call(proxy, job, "claim", owner="before", ttl=30)).json()
    await lease_call(proxy, job, "release", owner="before", generation=claimed["generation"])
    running = await worker(job, "--writes", "2", "--ttl", "10")
    assert await running.exit() == 0, (running.events, await running.errors())
    assert running.names() == ["claiming", "claimed", "wrote", "wrote", "completed"]
    assert {e["generation"] for e in running.events if "generation" in e} == {2}
    writes = [(r.job, r.headers["Fencing-Token"], r.headers["Idempotency-Key"],
               json.loads(r.body)) for r in upstream.received]  # fmt: skip
    assert writes == [(job, "2", f"{job}-{step}", {"amount": 10}) for step in (0, 1)]
    again = await lease_call(proxy, job, "claim", owner="after")
    assert (again.status_code, again.json()["type"]) == (409, PROBLEM_BASE + "job-completed")


@pytest.mark.slow
async def test_a_worker_in_another_language_stops_the_moment_its_lease_is_lost(
    worker: StartWorker, proxy: ProxyProcess, upstream: RecordingUpstream
) -> None:
    """A worker whose lease is lost while its write is in flight abandons the write,
    sends no other, and exits 1 saying why: here its lease is released under it, and
    its next renewal is refused."""
    job = "invoice-8"
    answer = upstream.hold()  # the write reaches the API, and waits there for its answer
    try:
        running = await worker(job, "--writes", "3", "--ttl", "3")
        await running.until("claimed")  # a JVM starting on a loaded machine takes its time
        [write] = await upstream.wait_for(1)
        released = await lease_call(proxy, job, "release", owner=f"{job}-worker",
                                    generation=write.generation)  # fmt: skip
        assert released.status_code == 200
        # It exits while its write still waits for the API's answer: it stopped waiting.
        assert await running.exit(within=10) == 1, (running.events, await running.errors())
    finally:
        answer()
    assert running.names() == ["claiming", "claimed", "lost"]
    lost = running.events[-1]
    assert lost["why"] == "renewal refused: lease-released"
    assert lost["generation"] == write.generation
    assert len(upstream.received) == 1


@pytest.mark.slow
async def test_a_worker_in_another_language_waits_while_the_job_is_held(
    worker: StartWorker, proxy: ProxyProcess, upstream: RecordingUpstream
) -> None:
    """A worker started while another holds the job waits for its turn, without
    writing, and gets the job once the holder releases it."""
    job = "invoice-9"
    holder = (await lease_call(proxy, job, "claim", owner="holder", ttl=60)).json()
    running = await worker(job, "--ttl", "3", "--wait", "30")
    assert (await running.until("waiting"))["why"] == "lease-held"
    assert upstream.received == []
    await lease_call(proxy, job, "release", owner="holder", generation=holder["generation"])
    assert await running.exit() == 0, (running.events, await running.errors())
    assert running.names()[-3:] == ["claimed", "wrote", "completed"]
    assert [(r.job, r.generation) for r in upstream.received] == [(job, 2)]
