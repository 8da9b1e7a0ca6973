"""The worked examples run as a user runs them, against a real proxy process: every
Python block of README.md and docs/ (tests/test_docs.py checks the other blocks), the
README's quick start with the answers it shows, and a pool of synchronous workers in
real processes where one is paused (SIGSTOP) past its lease and its job is taken
over."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from fenceproxy.testing import ProxyProcess, RecordingUpstream, free_port

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


def quick_start() -> list[Block]:
    """The blocks of the README's quick start, in order."""
    readme = ROOT / "README.md"
    text = readme.read_text()
    start = text.index("\n## Quick start\n")
    end = text.index("\n## ", start + 1)
    first, last = text.count("\n", 0, start), text.count("\n", 0, end)
    return [b for b in BLOCKS if b.path == readme and first < b.line <= last]


async def curl(http: httpx.AsyncClient, argv: list[str], proxy: ProxyProcess) -> httpx.Response:
    """A curl command of the docs (-s, -X, -H, -d and a URL on localhost:8080), sent
    to ``proxy``."""
    method, data, url = "GET", None, None
    headers: dict[str, str] = {}
    words = iter(argv[1:])
    for word in words:
        if word == "-X":
            method = next(words)
        elif word == "-H":
            name, _, value = next(words).partition(":")
            headers[name] = value.strip()
        elif word == "-d":
            data = next(words)
        elif word != "-s":
            assert url is None, f"curl {word}: not understood here"
            url = word
    assert url is not None
    assert url.startswith("localhost:8080/"), url
    target = proxy.url + url.removeprefix("localhost:8080")
    return await http.request(method, target, headers=headers, content=data)


async def test_the_readmes_quick_start_gets_the_answers_it_shows(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    blocks = quick_start()
    assert [b.lang for b in blocks] == ["yaml", "sh", "sh", "json", "sh", "sh", "json"]
    config, serve, claim, lease, write, late, problem = blocks
    assert commands(serve) == [["fenceproxy", "serve", "-c", "fenceproxy.yaml"]]
    (tmp_path / "fenceproxy.yaml").write_text(
        config.code.replace("http://127.0.0.1:9000", upstream.url)
    )
    proxy = await ProxyProcess(tmp_path / "fenceproxy.yaml", free_port(), cwd=tmp_path).start()
    try:
        async with httpx.AsyncClient() as http:
            # Worker A claims, with a lease of a second rather than 30, to outlive it soon.
            [claim_a] = commands(claim)
            claim_a = [word.replace('"ttl": 30', '"ttl": 1') for word in claim_a]
            got, shown = (await curl(http, claim_a, proxy)).json(), json.loads(lease.code)
            assert got.keys() == shown.keys()
            varying = ("ttl", "lease_until", "expires_in")  # the store's clock, the ttl
            assert {**got, **{k: shown[k] for k in varying}} == shown
            [write_a] = commands(write)
            assert (await curl(http, write_a, proxy)).status_code == 200
            await asyncio.sleep(1.2)  # A pauses past its lease
            claim_b, late_write = commands(late)
            assert (await curl(http, claim_b, proxy)).json()["generation"] == 2
            refused = await curl(http, late_write, proxy)
            assert refused.status_code == 409
            assert refused.json() == json.loads(problem.code)
            # A's first write, retried with its key: answered from it, not forwarded.
            again = await curl(http, write_a, proxy)
            assert (again.status_code, again.headers["Idempotent-Replayed"]) == (200, "true")
    finally:
        await proxy.stop()
    assert [json.loads(r.body) for r in upstream.received] == [{"amount": 10}]


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
