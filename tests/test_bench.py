"""``make bench`` works: a short run of the benchmark drives the bare upstream, nginx
and the fenced proxy with wrk, and reports every request answered 2xx."""

from __future__ import annotations

import http.server
import json
import re
import shutil
import statistics
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from .nginx import NGINX
from .postgres import postgres_bin

ROOT = Path(__file__).resolve().parent.parent


def bench(
    script: str, *args: str, figures: Path, timeout: int = 170
) -> tuple[subprocess.CompletedProcess[str], Any]:
    """Run ``bench/<script>`` with ``args``, writing its figures to ``figures``: its
    output, and the figures, once it has exited 0."""
    command = [sys.executable, str(ROOT / "bench" / script), *args, "--json", str(figures)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result, json.loads(figures.read_text())


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("wrk") is None or NGINX is None, reason="wrk or nginx missing")
def test_a_short_benchmark_run_measures_each_setup(tmp_path: Path) -> None:
    setups = ["direct", "nginx", "pass-through", "fenced", "fenced tls", "fenced traced", "raising"]
    result, runs = bench(
        "run.py", "--rounds", "1", "--seconds", "1", "--warmup", "0", "--no-postgres",
        "--only", ",".join(setups), figures=tmp_path / "bench.json",
    )  # fmt: skip
    # At light load, one request at a time, each of direct, pass-through and fenced
    # has its median latency, and the fenced write's over direct's is judged.
    light = runs.pop("light load p50 ms")
    assert sorted(light) == ["direct", "fenced", "pass-through"]
    assert all(len(p50s) == 1 and 0 < p50s[0] < 100 for p50s in light.values()), light
    added = light["fenced"][0] - light["direct"][0]
    judged = re.search(r"^(PASS|MISS) +fenced latency at light load <= 0.5 ms over direct's: "
                       r"(-?[0-9.]+) ms$", result.stdout, re.M)  # fmt: skip
    assert judged is not None, result.stdout
    assert float(judged[2]) == pytest.approx(added, abs=0.001)
    assert list(runs) == setups
    for name, run in runs.items():
        (figure,) = run["runs"]
        assert figure["requests"] > 10, name  # served at all: a second on a loaded machine
        assert figure["failed"] == 0, name
        assert figure["cpu_us"] > 0, name
        assert run["peak_rss_mib"] > 0, name
    # The targets are judged, each a PASS or a MISS, whatever their bound.
    assert re.search(r"^(PASS|MISS) +fenced req/s >= [0-9.]+x direct: ", result.stdout, re.M)
    # Which build it measured: this checkout's modules, from their source.
    server = ROOT / "fenceproxy" / "http" / "server.py"
    assert f"the package measured: pure Python, fenceproxy.http.server from {server}" in (
        result.stdout
    )


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk missing")
def test_postgres_rows_count_the_database_apart_and_pgbench_runs_beside(tmp_path: Path) -> None:
    if postgres_bin() is None:
        pytest.skip("PostgreSQL is not installed")
    setups = ["fenced", "pg fenced", "pgbench"]
    result, figures = bench(
        "run.py", "--rounds", "1", "--seconds", "1", "--warmup", "0",
        "--only", ",".join(setups), figures=tmp_path / "bench.json",
    )  # fmt: skip
    runs = {name: run["runs"][0] for name, run in figures.items()}
    assert list(runs) == setups
    for name, figure in runs.items():
        assert figure["requests"] > 10, name  # served at all: a second on a loaded machine
        assert figure["failed"] == 0, name
    # SQLite lives in the proxy; PostgreSQL's CPU is its own column, and the total.
    assert runs["fenced"]["database_cpu_us"] == 0
    pg = runs["pg fenced"]
    assert pg["proxy_cpu_us"] > 0
    assert pg["database_cpu_us"] > 0
    assert pg["cpu_us"] == pytest.approx(pg["proxy_cpu_us"] + pg["database_cpu_us"])
    assert runs["pgbench"]["proxy_cpu_us"] == 0
    assert runs["pgbench"]["database_cpu_us"] > 0
    assert "pg fenced req/s >= 0.5x pgbench's" in result.stdout


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk missing")
def test_the_capacity_model_is_fitted_and_checked_on_the_runs_it_made(tmp_path: Path) -> None:
    if postgres_bin() is None:
        pytest.skip("PostgreSQL is not installed")
    result, figures = bench(
        "capacity.py", "--rounds", "1", "--seconds", "1", "--warmup", "0",
        "--sweep", "4,16,32", figures=tmp_path / "capacity.json",
    )  # fmt: skip
    runs = {name: run[0] for name, run in figures.items()}
    assert set(runs) == {
        "one proxy c4", "one proxy c16", "one proxy c32", "two proxies c32", "pgbench c32"
    }  # fmt: skip
    for name, run in runs.items():
        assert run["failed"] == 0, name
        assert run["database_cpu_us"] > 0, name
    # Batches grow with the writes that arrive together: four connections have at
    # most four admissions a batch, so at least one commit per four writes (less a
    # little at the run's edges); thirty-two commit far less often.
    few = runs["one proxy c4"]["commits_per_write"]
    many = runs["one proxy c32"]["commits_per_write"]
    assert few >= 0.2
    assert many < few
    # Two proxies each commit their own batches: more commits per write than one.
    assert runs["two proxies c32"]["commits_per_write"] > many
    assert re.search(r"proxy +p\(k\) = \d+ \+ -?\d+ k µs per write", result.stdout)
    assert re.search(r"database d\(k\) = \d+ \+ -?\d+ k µs per write", result.stdout)
    checks = re.findall(r"([\d,]+) req/s measured, ([\d,]+) predicted", result.stdout)
    assert len(checks) == 2  # one proxy at 32, two at 16 each
    assert "the primary saturates at N = C x p(k) / d(k)" in result.stdout


@pytest.mark.timeout(120)
def test_the_wake_benchmark_times_a_waiting_claim_from_each_release() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "wake.py"), "--rounds", "5", "--no-postgres"],
        capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("| SQLite")]
    releases, *figures = (float(cell) for cell in row.strip("|").split("|")[1:])
    assert releases == 5
    assert 0 < figures[0] <= figures[-1]  # the median, at most the worst


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk missing")
def test_the_tracing_cost_check_runs_this_tree_against_a_revision(tmp_path: Path) -> None:
    """``bench/tracing_cost.py`` drives this tree and a revision's package in turn and
    judges the ratio of their CPU per request."""
    result, runs = bench(
        "tracing_cost.py", "--baseline", "HEAD", "--rounds", "2", "--seconds", "1",
        "--warmup", "0", figures=tmp_path / "cost.json", timeout=110,
    )  # fmt: skip
    for name in ("this", "baseline"):
        assert len(runs[name]) == 2, name  # one run each round
        for figure in runs[name]:
            assert figure["requests"] > 10, name
            assert figure["failed"] == 0, name
    ratio = statistics.median(r["cpu_us"] for r in runs["this"]) / statistics.median(
        r["cpu_us"] for r in runs["baseline"]
    )
    assert runs["ratio"] == pytest.approx(ratio)
    assert re.search(r"^(PASS|MISS) +tracing off, CPU/request vs the baseline", result.stdout, re.M)


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk missing")
def test_the_compiled_builds_check_drives_each_build_in_turn(tmp_path: Path) -> None:
    """``bench/compiled.py`` drives the pure package and each compiled copy of it in
    rotating order and gives each one's CPU per request against the pure one's. Here
    with no compiler (a build takes minutes): the pure build alone, against itself;
    a compiler that is not one is refused."""
    figures = tmp_path / "compiled.json"
    command = [sys.executable, str(ROOT / "bench" / "compiled.py"), "--rounds", "2",
               "--seconds", "1", "--warmup", "0", "--json", str(figures)]  # fmt: skip
    result = subprocess.run(
        [*command, "--with", ""], capture_output=True, text=True, timeout=110, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    runs = json.loads(figures.read_text())
    assert list(runs) == ["pure"]
    assert [figure["failed"] for figure in runs["pure"]] == [0, 0]
    assert all(figure["requests"] > 10 for figure in runs["pure"])
    assert re.search(r"^pure +[0-9.]+ +1\.000 +[0-9,]+ +1\.000$", result.stdout, re.M)
    refused = subprocess.run(
        [*command, "--with", "nuitka"], capture_output=True, text=True, timeout=30, check=False
    )
    assert refused.returncode != 0
    assert "no such compiler ['nuitka'] (mypyc, cython)" in refused.stderr


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    shutil.which("wrk") is None or shutil.which("strace") is None or NGINX is None,
    reason="wrk, strace or nginx missing",
)
def test_the_syscall_count_divides_each_servers_calls_by_its_requests(tmp_path: Path) -> None:
    """``bench/syscalls.py`` counts every thread of each server under load (a fenced
    write's commit syncs on the store's thread) and gives the calls per request, and
    each setup's against nginx's."""
    result, runs = bench(
        "syscalls.py", "--seconds", "1", "--warmup", "0", figures=tmp_path / "syscalls.json",
        timeout=110,
    )  # fmt: skip
    assert list(runs) == ["nginx", "pass-through", "fenced"]
    for name, run in runs.items():
        assert run["requests"] > 10, name  # served at all: a second on a loaded machine
        assert run["failed"] == 0, name
        calls = run["calls"]
        # Two reads and two writes a request at the least: the client's and the upstream's.
        assert run["total_per_request"] >= 4 * 0.9, name
        assert run["total_per_request"] == pytest.approx(sum(calls.values()) / run["requests"])
        assert run["vs_nginx"] == pytest.approx(
            run["total_per_request"] / runs["nginx"]["total_per_request"]
        )
    # A fenced write is on disk before it is forwarded; a pass-through never syncs.
    assert runs["fenced"]["calls"].get("fdatasync", 0) > 0
    assert "fdatasync" not in runs["pass-through"]["calls"]
    assert re.search(r"^fenced: [0-9.]+ per request \(.*x nginx's\)$", result.stdout, re.M)


@pytest.mark.timeout(60)
@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk missing")
def test_the_load_gives_each_job_a_new_holder_every_so_many_of_its_writes() -> None:
    """``raise:BASE:EVERY``: each job's token starts at BASE and rises by one every
    EVERY writes of that job, as holders taking over a job in turn send."""
    seen: dict[str, list[int]] = {}

    class Recorder(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            job, token = self.headers["Fencing-Job"], int(self.headers["Fencing-Token"])
            seen.setdefault(job, []).append(token)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with http.server.HTTPServer(("127.0.0.1", 0), Recorder) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        lua = str(ROOT / "bench" / "load.lua")
        args = ["/w/x", "3", "0", "raise:1000:4", "-"]
        command = ["wrk", "-t1", "-c1", "-d1s", "-s", lua, url, "--", *args]
        subprocess.run(command, capture_output=True, timeout=30, check=True)
        server.shutdown()
    assert sorted(seen) == ["job-0", "job-1", "job-2"]
    for job, tokens in seen.items():
        assert len(tokens) > 8, job
        # Four writes a holder: 1000 x4 (fewer for the job the first write skipped), 1001 x4, ...
        assert tokens == sorted(tokens), job
        assert tokens[-1] - tokens[0] >= 2, job
        runs = [tokens.count(token) for token in sorted(set(tokens))]
        assert all(run == 4 for run in runs[1:-1]), (job, runs)
