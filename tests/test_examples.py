"""The worked examples run as a user runs them, against a real proxy process: the
README's client examples, and a pool of synchronous workers in real processes where
one is paused (SIGSTOP) past its lease and its job is taken over."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from fenceproxy.testing import ProxyProcess, RecordingUpstream, free_port

ROOT = Path(__file__).resolve().parent.parent


def readme_examples() -> list[str]:
    """The Python blocks of the README's section on the clients."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### The Python clients", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


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


async def test_the_readmes_client_examples_run_and_check_every_write(
    proxy: ProxyProcess, upstream: RecordingUpstream
) -> None:
    examples = readme_examples()
    assert len(examples) == 2
    for example in examples:
        assert "raise_for_status()" in example  # a refused write is never a success
        run = example.replace("http://127.0.0.1:8080", proxy.url)
        exit_code, _, err = await python("-c", run)
        assert exit_code == 0, err
    writes = [(r.job, r.headers["Fencing-Token"], r.headers["Idempotency-Key"], json.loads(r.body))
              for r in upstream.received]  # fmt: skip
    assert writes == [
        ("invoice-42", "1", "invoice-42-10", {"amount": 10}),
        ("invoice-42", "1", "invoice-42-20", {"amount": 20}),
        ("invoice-43", "1", "invoice-43-10", {"amount": 10}),
    ]


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
            # Pause the first worker to claim, once it has written once: it stays
            # stopped past its lease (ttl 1 s) while the others go on.
            if paused is None and event["ev"] == "wrote" and n == 0:
                paused = (n, event["job"], event["generation"])
                worker.send_signal(signal.SIGSTOP)
                asyncio.get_running_loop().call_later(3, worker.send_signal, signal.SIGCONT)

    await asyncio.wait_for(asyncio.gather(*(read(n, w) for n, w in enumerate(workers))), timeout=90)
    assert [await w.wait() for w in workers] == [0, 0, 0]
    assert paused is not None
    _, job, generation = paused

    # Every job was completed exactly once.
    completed = [e for e in events if e["ev"] == "completed"]
    assert sorted(e["job"] for e in completed) == jobs
    # The paused worker's job went to another worker, at the next generation; the
    # paused worker found its lease lost when it woke (or was refused: never applied).
    taken = next(e for e in completed if e["job"] == job)
    assert (taken["worker"], taken["generation"]) != ("w0", generation)
    assert taken["generation"] == generation + 1
    assert any(e["ev"] == "lost" and e["worker"] == "w0" and e["job"] == job for e in events)
    # At the API: each step of each job applied once, the generations of a job never
    # going down in the order they arrived.
    steps = [(r.job, json.loads(r.body)["step"]) for r in upstream.received]
    assert sorted(steps) == sorted((j, s) for j in jobs for s in range(4))
    seen: dict[str | None, int] = defaultdict(int)
    for received in upstream.received:
        token = int(received.headers["Fencing-Token"])
        assert token >= seen[received.job]
        seen[received.job] = token
