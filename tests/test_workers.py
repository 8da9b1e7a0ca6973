"""``workers: N``: real worker processes sharing one port (SO_REUSEPORT) and one
PostgreSQL store, reloaded, stopped and killed with real signals."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fenceproxy.config import parse_config
from fenceproxy.errors import PROBLEM_BASE, ConfigError
from fenceproxy.fence.tokens import generate_key
from fenceproxy.server.workers import merge_metrics
from fenceproxy.testing import ProxyProcess, RecordingUpstream, eventually, free_port

from .postgres import sql
from .test_admin import samples
from .test_tls import eventually_async

# Connections opened one after another land on one worker or the other as the
# kernel hashes them; this many leave each worker unvisited with odds of 2^-39.
CONNECTIONS = 40

pytestmark = pytest.mark.slow


def write_config(
    path: Path,
    database: str,
    upstream: RecordingUpstream,
    prefix: str,
    workers: int = 2,
    **top: Any,
) -> None:
    path.write_text(
        f"store: '{database}?pool=2'\nworkers: {workers}\nleases: {{}}\nshutdown_timeout: 5s\n"
        f"routes:\n  - {{name: billing, path: {prefix}, upstream: '{upstream.url}'}}\n"
        + (yaml.safe_dump(top) if top else "")
    )


@pytest.fixture
async def supervisor(
    tmp_path: Path, database: str, upstream: RecordingUpstream
) -> AsyncIterator[ProxyProcess]:
    config = tmp_path / "fenceproxy.yaml"
    write_config(config, database, upstream, "/billing")
    process = ProxyProcess(config, free_port(), "--log-level", "INFO")
    await process.start()
    yield process
    print(process.output())  # shown when a test fails
    await process.stop()  # its workers die with it


def workers_of(process: ProxyProcess) -> list[int]:
    """The supervisor's child processes: its workers."""
    assert process.process is not None
    pid = process.process.pid
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


async def write(
    url: str, job: str, generation: int, key: str | None = None, path: str = "/billing/x"
) -> tuple[int, str]:
    """One write on a connection of its own: the status and the problem's last word."""
    headers = {"Fencing-Job": job, "Fencing-Token": str(generation)}
    if key is not None:
        headers["Idempotency-Key"] = key
    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as http,
        http.post(url + path, json={"g": generation}, headers=headers) as response,
    ):
        body = await response.json(content_type=None)
        kind = str(body.get("type", "")).rsplit(":", 1)[-1] if isinstance(body, dict) else ""
        return response.status, kind


async def decisions_by_worker(process: ProxyProcess) -> dict[str, float]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(process.admin_url + "/metrics") as response,
    ):
        assert response.status == 200
        text = await response.text()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "fenceproxy_decisions":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels["outcome"] == "forwarded":
                    worker = sample.labels["worker"]
                    counts[worker] = counts.get(worker, 0) + sample.value
    return counts


async def test_two_workers_share_the_port_the_store_and_the_metrics(
    supervisor: ProxyProcess, upstream: RecordingUpstream
) -> None:
    assert len(workers_of(supervisor)) == 2
    answers = await asyncio.gather(
        *(write(supervisor.url, f"job-{n}", 1) for n in range(CONNECTIONS))
    )
    assert answers == [(200, "")] * CONNECTIONS
    counts = await decisions_by_worker(supervisor)
    assert set(counts) == {"0", "1"}, counts  # both served, each labelled
    assert sum(counts.values()) == CONNECTIONS

    # The store decides, whichever worker a write meets.
    assert await write(supervisor.url, "shared", 5) == (200, "")
    stale = await asyncio.gather(*(write(supervisor.url, "shared", 4) for _ in range(20)))
    assert stale == [(409, "stale-generation")] * 20
    replays = await asyncio.gather(
        *(write(supervisor.url, "keyed", 1, key="charge-1") for _ in range(20))
    )
    assert {status for status, _ in replays} <= {200, 409}
    assert [r.job for r in upstream.received].count("keyed") == 1


async def test_probes_answer_for_every_worker(supervisor: ProxyProcess) -> None:
    async with aiohttp.ClientSession() as http:
        for probe in ("/healthz", "/readyz"):
            async with http.get(supervisor.admin_url + probe) as response:
                assert response.status == 200
        async with http.get(supervisor.admin_url + "/jobs/job-1?worker=1") as response:
            assert response.status in (200, 404)
            assert response.content_type.startswith("application/")
        async with http.get(supervisor.admin_url + "/jobs?worker=7") as response:
            assert response.status == 400
            assert (await response.json())["type"].endswith("request-malformed")


async def test_sighup_reloads_every_worker(
    supervisor: ProxyProcess, tmp_path: Path, database: str, upstream: RecordingUpstream
) -> None:
    write_config(tmp_path / "fenceproxy.yaml", database, upstream, "/payments")
    supervisor.signal(signal.SIGHUP)
    await eventually(lambda: supervisor.output().count("reloaded") >= 2)
    answers = await asyncio.gather(
        *(write(supervisor.url, f"r-{n}", 1, path="/payments/x") for n in range(CONNECTIONS))
    )
    assert answers == [(200, "")] * CONNECTIONS


async def restarts(process: ProxyProcess) -> dict[str, float]:
    """``fenceproxy_worker_restarts_total`` by worker, from the supervisor's metrics."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(process.admin_url + "/metrics") as response,
    ):
        text = await response.text()
    return {
        dict(labels)["worker"]: value
        for (name, labels), value in samples(text).items()
        if name == "fenceproxy_worker_restarts_total"
    }


async def test_a_killed_worker_is_started_again(supervisor: ProxyProcess) -> None:
    """The port keeps its workers, and the restart is counted, for an alert."""
    assert await restarts(supervisor) == {"0": 0, "1": 0}
    first, second = workers_of(supervisor)
    os.kill(first, signal.SIGKILL)
    await eventually(
        lambda: len(workers_of(supervisor)) == 2 and first not in workers_of(supervisor)
    )
    assert second in workers_of(supervisor)
    await eventually(lambda: "exited with SIGKILL; starting it again" in supervisor.output())
    await eventually(lambda: supervisor.output().count("fenceproxy on http") >= 3)
    answers = await asyncio.gather(*(write(supervisor.url, f"k-{n}", 1) for n in range(20)))
    assert answers == [(200, "")] * 20
    assert sorted((await restarts(supervisor)).values()) == [0, 1]


async def test_sigterm_stops_every_worker_cleanly(supervisor: ProxyProcess) -> None:
    children = workers_of(supervisor)
    supervisor.signal(signal.SIGTERM)
    assert await supervisor.wait() == 0
    assert not any(alive(pid) for pid in children)


async def test_workers_die_with_their_supervisor(supervisor: ProxyProcess) -> None:
    children = workers_of(supervisor)
    supervisor.signal(signal.SIGKILL)
    await supervisor.wait()
    await eventually(lambda: not any(alive(pid) for pid in children))


def test_several_workers_on_sqlite_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"store": "sqlite:///f.db", "workers": 2, "leases": {}}, "f.yaml")
    line = caught.value.lines[0]
    assert line.startswith("f.yaml: workers: 2 needs a PostgreSQL store")
    assert "exclusive locking mode" in line


def test_workers_auto_is_one_per_core() -> None:
    store = "postgresql://u@127.0.0.1:5432/db"
    config = parse_config({"store": store, "workers": "auto", "leases": {}}, "f.yaml")
    assert config.workers == len(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match=r"workers: expected a number of processes"):
        parse_config({"store": store, "workers": "many", "leases": {}}, "f.yaml")


def test_merged_metrics_label_every_sample_with_its_worker() -> None:
    page = (
        "# HELP fenceproxy_decisions_total Fenced writes\n"
        "# TYPE fenceproxy_decisions_total counter\n"
        'fenceproxy_decisions_total{route="a",outcome="forwarded"} %d\n'
    )
    merged = merge_metrics([(0, page % 3), (1, page % 4)]).decode()
    assert merged.count("# TYPE fenceproxy_decisions_total counter") == 1
    assert 'fenceproxy_decisions_total{outcome="forwarded",route="a",worker="0"} 3.0' in merged
    assert 'fenceproxy_decisions_total{outcome="forwarded",route="a",worker="1"} 4.0' in merged


# -- the admin listener, served by the process or by the supervisor -------------------

BROWSERS = {
    "fetch-metadata": {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"},
    "origin": {"Origin": "http://evil.example"},
}
READS = ("/", "/jobs", "/events", "/metrics", "/page/feed")


@pytest.fixture(params=[1, 2], ids=["one-process", "supervisor"])
def workers(request: pytest.FixtureRequest) -> int:
    """``workers: 1`` (the process serves its admin listener) or ``workers: 2`` (the
    supervisor serves it for its workers): what an operator relies on of the listener
    holds of both."""
    value: int = request.param
    return value


@pytest.fixture
async def serving(
    tmp_path: Path, database: str, upstream: RecordingUpstream, workers: int
) -> AsyncIterator[tuple[ProxyProcess, Path]]:
    """A proxy process with ``workers``, and its config file (start it yourself)."""
    config = tmp_path / "fenceproxy.yaml"
    write_config(config, database, upstream, "/billing", workers)
    process = ProxyProcess(config, free_port())
    yield process, config
    print(process.output())  # shown when a test fails
    await process.stop()


async def test_the_start_line_names_the_operator_page(
    serving: tuple[ProxyProcess, Path], workers: int
) -> None:
    """The line that says the proxy serves names where its operator page is, for an
    operator who just started it: the process that serves the admin listener says so
    (the proxy itself, or the supervisor of its workers), and no worker names a page
    it does not serve."""
    process = await serving[0].start()
    page = f"operator page: {process.admin_url}/"
    said = "workers serve" if workers > 1 else "fenceproxy on http"
    await eventually(lambda: said in process.output())
    lines = process.output().splitlines()
    [line] = [line for line in lines if said in line]
    assert line.endswith(f", {page}")
    served = [line for line in lines if "fenceproxy on http" in line]
    assert len(served) == workers
    assert sum(page in line for line in served) == (workers == 1)


async def test_a_browser_sent_to_the_admin_listener_under_another_name_reads_nothing(
    serving: tuple[ProxyProcess, Path],
) -> None:
    """DNS rebinding: a page at evil.example points its own name at the admin listener,
    and the browser's requests come with that name as their Host. They are refused
    (421) whether one process or a supervisor serves the listener, and answered under
    the listener's own name; the page keeps its Content-Security-Policy either way."""
    process = await serving[0].start()
    own = process.admin_url.removeprefix("http://")
    answers: dict[tuple[str, str, str], tuple[int, str]] = {}
    async with aiohttp.ClientSession() as http:
        for path in READS:
            for host in ("evil.example", "evil.example:80", own):
                for kind, fields in BROWSERS.items():
                    headers = {"Host": host, **fields}
                    async with http.get(process.admin_url + path, headers=headers) as response:
                        body = await response.read()
                        problem = response.status >= 400 and json.loads(body)["type"]
                        answers[path, host, kind] = response.status, problem or ""
        async with http.get(process.admin_url + "/", headers={"Host": own}) as page:
            assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
            assert page.headers["X-Content-Type-Options"] == "nosniff"
        async with http.post(process.admin_url + "/jobs") as posted:
            assert posted.status == 404  # the listener reads; nothing is posted to it
    refused = (421, PROBLEM_BASE + "misdirected-request")
    assert answers == {
        (path, host, kind): (200, "") if host == own else refused
        for path in READS
        for host in ("evil.example", "evil.example:80", own)
        for kind in BROWSERS
    }


async def test_the_admin_listener_takes_its_credentials_again_on_sighup(
    serving: tuple[ProxyProcess, Path],
    database: str,
    upstream: RecordingUpstream,
    workers: int,
    tmp_path: Path,
) -> None:
    """An operator revokes an admin credential, or closes the probes, by editing the
    file and sending SIGHUP: the listener follows, whether one process or a
    supervisor serves it."""
    process, config = serving
    old, new = generate_key(), generate_key()
    clients = {}
    for secret in (old, new):
        (tmp_path / secret[:8]).write_text(secret)
        clients[secret] = [{"name": "ops", "file": str(tmp_path / secret[:8])}]
    write_config(config, database, upstream, "/billing", workers, admin_clients=clients[old])
    await process.start()

    async with aiohttp.ClientSession() as http:

        async def status(path: str, secret: str | None) -> int:
            headers = {} if secret is None else {"Authorization": f"Bearer {secret}"}
            async with http.get(process.admin_url + path, headers=headers) as response:
                return response.status

        assert [await status("/jobs", old), await status("/jobs", None)] == [200, 401]
        assert await status("/healthz", None) == 200
        write_config(config, database, upstream, "/billing", workers,
                     admin_clients=clients[new], admin_probes="closed")  # fmt: skip
        process.signal(signal.SIGHUP)

        async def revoked() -> bool:
            return await status("/jobs", old) == 401

        await eventually_async(revoked)
        assert await status("/jobs", new) == 200
        assert [await status("/healthz", None), await status("/healthz", new)] == [401, 200]


# What differs between two runs of the same requests: the clock, and the refusals of
# the last minute (a minute may end between a write and its reading).
_UNSTEADY = [
    (re.compile(rb'"(at|ms|now|generation_set_at|lease_until|expires_in|created_at|'
                rb'expires_at|connections)": [-+.e0-9]+'), rb'"\1": 0'),
    (re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"), b"DATE"),
    (re.compile(rb"\d\d:\d\d:\d\d\.\d{3}"), b"TIME"),
    (re.compile(rb"live, [.0-9]+ s left"), b"live, s left"),
    (re.compile(rb'(": \[)\d+(, \d+, \d+\])'), rb"\1_\2"),
    (re.compile(rb"(<tr><td>[a-z-]+</td><td>)\d+(</td>)"), rb"\1_\2"),
    (re.compile(rb"<td>[.0-9]+ (\xc2\xb5|\\u00b5|m)?s</td>"), b"<td>TOOK</td>"),
]  # fmt: skip
_SHOWN_FIELDS = (
    "Content-Type", "Content-Security-Policy", "X-Content-Type-Options", "Referrer-Policy",
    "Cache-Control", "Retry-After", "WWW-Authenticate",
)  # fmt: skip


async def admin_answers(process: ProxyProcess, secret: str, worker: int) -> dict[str, Any]:
    """What an operator's requests get from the admin listener: each answer's status,
    fields and body, the clock taken out; the metrics as their samples, the
    ``worker`` label taken out and summed over."""
    granted = {"Authorization": f"Bearer {secret}"}
    browser = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors"}
    w = f"worker={worker}"
    asked: list[tuple[str, str, dict[str, str]]] = [
        ("GET", path, granted)
        for path in (
            f"/?{w}", f"/?job=inv-1&{w}", f"/page/feed?after=0&job=inv-1&{w}", f"/events?{w}",
            f"/events?job=inv-1&after=1&{w}", f"/jobs?{w}", f"/jobs?prefix=inv&limit=1&{w}",
            f"/jobs/inv-1?{w}", f"/jobs/nobody?{w}", "/jobs/%01", "/jobs?limit=0",
            "/events?after=x", "/healthz", "/readyz", "/nothing-here", "/static/page.js",
        )
    ]  # fmt: skip
    asked += [
        ("GET", "/jobs", {}),  # no credential
        ("GET", "/jobs", {"Authorization": "Bearer not-it"}),
        ("GET", "/healthz", {}),  # the probes are open
        ("GET", f"/?{w}", {**granted, **browser, "Host": "evil.example"}),  # rebinding
        ("POST", "/jobs", granted),
    ]
    answers: dict[str, Any] = {}
    async with aiohttp.ClientSession() as http:
        for method, path, headers in asked:
            async with http.request(method, process.admin_url + path, headers=headers) as got:
                body = await got.read()
                for pattern, steady in _UNSTEADY:
                    body = pattern.sub(steady, body)
                fields = {f: got.headers[f] for f in _SHOWN_FIELDS if f in got.headers}
                answers[f"{method} {path} {sorted(headers.items())}"] = got.status, fields, body
        async with http.get(process.admin_url + "/metrics", headers=granted) as got:
            assert got.status == 200
            answers["content-type of /metrics"] = got.headers["Content-Type"]
            text = await got.text()
    summed: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for (name, labels), value in samples(text).items():
        if name == "fenceproxy_worker_restarts_total":
            continue  # the supervisor's own: one process has no workers to start again
        key = name, tuple((k, v) for k, v in labels if k != "worker")
        summed[key] = summed.get(key, 0.0) + value
    counted = ("fenceproxy_decisions_total", "fenceproxy_lease_calls_total")
    answers["metrics"] = {
        key: value if key[0] in counted else None for key, value in summed.items()
    }
    return answers


async def test_the_admin_listener_answers_alike_for_one_process_and_for_workers(
    tmp_path: Path, database: str, upstream: RecordingUpstream
) -> None:
    """An operator's pages, scrapers, probes and tools get the same answers whether the
    proxy runs as one process or as workers under a supervisor: the same requests,
    after the same writes and lease calls, read the same (the clock aside). Under
    workers, ``?worker=i`` reads the worker that served them (one process ignores it)
    and the metrics, each sample labelled by its worker, sum to one process's."""
    config = tmp_path / "fenceproxy.yaml"
    secret = generate_key()
    (tmp_path / "ops.secret").write_text(secret)
    clients = [{"name": "ops", "file": str(tmp_path / "ops.secret")}]
    port = free_port()
    seen: dict[int, dict[str, Any]] = {}
    worker = 0
    for workers in (2, 1):
        await sql(database, "TRUNCATE fences, idempotency_keys, leases, inflight")
        write_config(config, database, upstream, "/billing", workers, admin_clients=clients)
        process = await ProxyProcess(config, port).start()
        try:
            # One connection, so one worker sees it all.
            connector = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(process.url, connector=connector) as http:
                async with http.post("/_leases/inv-1/claim", json={"owner": "w1"}) as claim:
                    assert claim.status == 200
                for generation, status in ((1, 200), (0, 409)):
                    fields = {"Fencing-Job": "inv-1", "Fencing-Token": str(generation),
                              "Idempotency-Key": f"k-{generation}"}  # fmt: skip
                    async with http.post("/billing/x", json={}, headers=fields) as write:
                        assert write.status == status
            if workers > 1:
                worker = await the_worker_that_served(process, secret)
            seen[workers] = await admin_answers(process, secret, worker)
        finally:
            print(process.output())  # shown when the test fails
            await process.stop()
    assert seen[2] == seen[1]
    decisions = ("fenceproxy_decisions_total", (("outcome", "forwarded"), ("route", "billing")))
    assert seen[1]["metrics"][decisions] == 1


async def the_worker_that_served(process: ProxyProcess, secret: str) -> int:
    """The worker whose ``/events`` lists decisions."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {secret}"}) as http:
        for worker in (0, 1):
            async with http.get(f"{process.admin_url}/events?worker={worker}") as events:
                if (await events.json())["events"]:
                    return worker
    raise AssertionError("no worker saw the writes")
