"""The tools people already use, through a real proxy process, as docs/tools.md
writes them: rclone (Debian's) to moto's S3 server and to a WebDAV server (WsgiDAV),
and the ``caldav`` library to a CalDAV server (Radicale).

rclone's writes arrive fenced by its ``--header`` flags, run by ``fenceproxy run``; a
stale holder's ``rclone sync`` fails after one attempt, with ``--retries 1``, and
sends nothing; a WebDAV or CalDAV client lists and discovers (PROPFIND, REPORT) with
no token, while its writes need the lease's fields and a stale one is refused."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import caldav
import pytest
import yaml
from caldav.lib.error import PutError

from fenceproxy.client import SyncLeaseClient
from fenceproxy.testing import ProxyProcess, accepting, free_port

from .conftest import run_under_lease, write_decisions
from .s3 import WRITES, Moto, route, tool_env

pytestmark = pytest.mark.slow  # moto, WsgiDAV, Radicale and a proxy, each a process

BUCKET = "exports"
RCLONE = shutil.which("rclone")
ONE_ATTEMPT = ("--retries", "1", "--low-level-retries", "1")
"""docs/tools.md's flags: a refused sync is not run again, nor a write sent again."""
FENCED = '--header "Fencing-Job: $FENCING_JOB" --header "Fencing-Token: $FENCING_TOKEN"'
"""rclone's fencing flags, as a command under ``fenceproxy run`` writes them."""


@dataclass
class Tools:
    proxy: ProxyProcess
    moto: Moto
    files: Path
    """The folder WsgiDAV serves as ``/files``."""
    folder: Path

    def env(self) -> dict[str, str]:
        """rclone's environment: its config file, never the user's (and none of the
        AWS variables: rclone 1.60's S3 backend fails on ``AWS_CA_BUNDLE``)."""
        return {**tool_env(), "RCLONE_CONFIG": str(self.folder / "rclone.conf")}

    def rclone(self, *args: str) -> subprocess.CompletedProcess[str]:
        assert RCLONE is not None
        return subprocess.run(
            [RCLONE, *args], env=self.env(), capture_output=True, text=True, timeout=60
        )

    def run(self, job: str, script: str) -> subprocess.CompletedProcess[str]:
        """The shell ``script`` under ``fenceproxy run JOB``."""
        return run_under_lease(self.proxy, job, script, self.env())


@contextlib.contextmanager
def serving(runner: asyncio.Runner, port: int, *argv: str) -> Iterator[None]:
    """A server process, until it accepts connections on ``port`` (20 s at most)."""
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def gone() -> str | None:
        return None if process.poll() is None else f"{argv} exited {process.returncode}"

    try:
        runner.run(asyncio.wait_for(accepting(port, gone), 20))
        yield
    finally:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def tools(moto: Moto, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tools]:
    """One proxy for the module: ``/exports`` to moto, ``/files`` to WsgiDAV, the rest
    to Radicale; each test its own job and paths."""
    if RCLONE is None:
        if os.environ.get("CI"):
            pytest.fail("rclone is not installed, and CI must run every test")
        pytest.skip("rclone is not installed (make test installs it when run as root)")
    folder = tmp_path_factory.mktemp("tools")
    files = folder / "files"
    files.mkdir()
    dav, cal = free_port(), free_port()
    (folder / "wsgidav.yaml").write_text(yaml.safe_dump({
        "host": "127.0.0.1", "port": dav, "verbose": 0, "logging": {"enable": False},
        "provider_mapping": {"/files": str(files)},
        "simple_dc": {"user_mapping": {"*": True}},  # anonymous
    }))  # fmt: skip
    moto.client().create_bucket(Bucket=BUCKET)
    routes = [
        route(BUCKET, moto.url),
        {"name": "files", "path": "/files", "upstream": f"http://127.0.0.1:{dav}"},
        {"name": "calendars", "path": "/", "upstream": f"http://127.0.0.1:{cal}"},
    ]
    config = folder / "proxy.yaml"
    store = f"sqlite:///{folder / 'fences.db'}"
    config.write_text(yaml.safe_dump({"store": store, "leases": {}, "routes": routes}))
    proxy = ProxyProcess(config, free_port())
    key, secret = moto.credentials["aws_access_key_id"], moto.credentials["aws_secret_access_key"]
    (folder / "rclone.conf").write_text(
        f"[s3]\ntype = s3\nprovider = Other\nendpoint = {proxy.url}\nforce_path_style = true\n"
        f"access_key_id = {key}\nsecret_access_key = {secret}\n\n"
        f"[dav]\ntype = webdav\nurl = {proxy.url}/files\n"
    )
    wsgidav = [sys.executable, "-m", "wsgidav.server.server_cli"]
    radicale = [sys.executable, "-m", "radicale", "--config", "/dev/null", "--server-hosts",
                f"127.0.0.1:{cal}", "--auth-type", "none", "--storage-filesystem-folder",
                str(folder / "calendars"), "--logging-level", "error"]  # fmt: skip
    moto.record()
    with (
        asyncio.Runner() as runner,
        serving(runner, dav, *wsgidav, "--config", str(folder / "wsgidav.yaml")),
        serving(runner, cal, *radicale),
    ):
        runner.run(proxy.start())
        try:
            yield Tools(proxy, moto, files, folder)
        finally:
            runner.run(proxy.stop())


def test_rclone_copy_and_sync_to_s3_arrive_fenced(tools: Tools, tmp_path: Path) -> None:
    """Every write of ``rclone copy`` and ``rclone sync`` (its PUTs, and the DELETE
    of what the source no longer has) carries the lease, which the proxy recorded."""
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    for name in ("a.csv", "b.csv", "sub/c.csv"):
        (out / name).write_text(name)
    copied = tools.run("export-s3", f"rclone copy {out} s3:{BUCKET}/fresh {FENCED}")
    assert copied.returncode == 0, copied.stderr
    (out / "b.csv").unlink()
    (out / "d.csv").write_text("d")
    synced = tools.run(
        "export-s3", f"rclone sync {out} s3:{BUCKET}/fresh {FENCED} {' '.join(ONE_ATTEMPT)}"
    )
    assert synced.returncode == 0, synced.stderr
    assert tools.moto.keys(BUCKET, "fresh/") == ["fresh/a.csv", "fresh/d.csv", "fresh/sub/c.csv"]

    writes = [w for w in tools.moto.received(f"/{BUCKET}/fresh/") if w["method"] in WRITES]
    assert sorted(w["method"] for w in writes) == ["DELETE"] + ["PUT"] * 4
    decisions = write_decisions(tools.proxy, "export-s3")
    assert [d["outcome"] for d in decisions] == ["forwarded"] * 5
    tokens = {(w["headers"]["Fencing-Job"], w["headers"]["Fencing-Token"]) for w in writes}
    generations = sorted({d["generation"] for d in decisions})  # a run's lease each
    assert tokens == {("export-s3", str(g)) for g in generations}
    assert len(generations) == 2


def test_a_stale_rclone_sync_to_s3_stops_after_one_attempt(tools: Tools, tmp_path: Path) -> None:
    """With ``--retries 1`` a refused sync is not run again (rclone's default runs it
    three times), and nothing reaches S3. rclone's S3 backend shows the status only
    (``409``): the proxy's reason is in its log and on its operator page."""
    with SyncLeaseClient(tools.proxy.url) as leases:
        old = leases.claim("export-stale", "worker-a")
        leases.release("export-stale", "worker-a", old.generation)
        leases.claim("export-stale", "worker-b")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("a.csv", "b.csv"):
        (out / name).write_text(name)
    fenced = ("--header", "Fencing-Job: export-stale", "--header", f"Fencing-Token: {old.token}")
    refused = tools.rclone("sync", str(out), f"s3:{BUCKET}/stale", *fenced, *ONE_ATTEMPT)
    assert refused.returncode != 0
    assert "Attempt 1/1 failed with 2 errors" in refused.stderr
    assert "status code: 409" in refused.stderr
    decisions = write_decisions(tools.proxy, "export-stale")
    assert [d["outcome"] for d in decisions] == ["stale-generation"] * 2  # each file once
    assert tools.moto.keys(BUCKET, "stale/") == []
    assert [w for w in tools.moto.received(f"/{BUCKET}/stale") if w["method"] in WRITES] == []


def test_rclone_lists_webdav_without_a_token_and_its_writes_are_fenced(
    tools: Tools, tmp_path: Path
) -> None:
    """``rclone lsf`` (PROPFIND) needs no lease; ``rclone copy`` under one arrives; a
    stale ``rclone sync`` fails after one attempt, with the proxy's reason, and
    writes nothing."""
    (tools.files / "shared").mkdir()
    (tools.files / "shared" / "readme.txt").write_text("there")
    listed = tools.rclone("lsf", "-R", "dav:shared")
    assert (listed.returncode, listed.stdout.split()) == (0, ["readme.txt"]), listed.stderr

    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "a.csv").write_text("a")
    (out / "sub" / "b.csv").write_text("b")
    copied = tools.run("export-dav", f"rclone copy {out} dav:fresh {FENCED}")
    assert copied.returncode == 0, copied.stderr
    assert (tools.files / "fresh" / "sub" / "b.csv").read_text() == "b"
    decisions = write_decisions(tools.proxy, "export-dav")
    assert {d["outcome"] for d in decisions} == {"forwarded"}
    assert len(decisions) >= 2  # the two PUTs, and the MKCOLs rclone needed

    (out / "c.csv").write_text("c")
    stale = ("--header", "Fencing-Job: export-dav", "--header", "Fencing-Token: 0")
    refused = tools.rclone("sync", str(out), "dav:fresh", *stale, *ONE_ATTEMPT)
    assert refused.returncode != 0
    assert "Attempt 1/1 failed with 1 errors" in refused.stderr
    generation = decisions[0]["generation"]
    assert f"generation 0 is older than generation {generation}" in refused.stderr
    assert sorted(p.name for p in (tools.files / "fresh").iterdir()) == ["a.csv", "sub"]


EVENT = """BEGIN:VCALENDAR
VERSION:2.0
PRODID:-//fenceproxy//tests//EN
BEGIN:VEVENT
UID:{uid}
DTSTAMP:20260101T000000Z
DTSTART:20260105T090000Z
DTEND:20260105T093000Z
SUMMARY:{uid}
END:VEVENT
END:VCALENDAR
"""


def test_caldav_discovers_and_lists_without_a_token_and_its_writes_are_fenced(
    tools: Tools,
) -> None:
    """The caldav library finds the principal, its calendars and their events
    (PROPFIND, REPORT) with no lease; creating a calendar or an event needs the
    lease's fields, and a stale holder's event is refused and never stored."""
    url = f"{tools.proxy.url}/"
    reader = caldav.DAVClient(url, username="alice", password="unused")
    with SyncLeaseClient(tools.proxy.url) as leases:
        old = leases.claim("calendar", "worker-a")

        def fenced(token: str) -> caldav.DAVClient:
            headers = {"Fencing-Job": "calendar", "Fencing-Token": token}
            return caldav.DAVClient(url, username="alice", password="unused", headers=headers)

        fenced(old.token).principal().make_calendar(name="Work", cal_id="work")
        (calendar,) = reader.principal().calendars()
        assert calendar.events() == []
        with pytest.raises(PutError, match="fencing-header-missing"):
            calendar.save_event(EVENT.format(uid="unfenced"))
        fenced(old.token).calendar(url=calendar.url).save_event(EVENT.format(uid="standup"))

        leases.release("calendar", "worker-a", old.generation)
        new = leases.claim("calendar", "worker-b")
        fenced(new.token).calendar(url=calendar.url).save_event(EVENT.format(uid="review"))
        with pytest.raises(PutError, match="stale-generation"):
            fenced(old.token).calendar(url=calendar.url).save_event(EVENT.format(uid="late"))

    found = calendar.search(start=datetime(2026, 1, 5), end=datetime(2026, 1, 6), event=True)
    assert sorted(e.icalendar_component["uid"] for e in found) == ["review", "standup"]
    decisions = write_decisions(tools.proxy, "calendar")
    forwarded = [d["generation"] for d in decisions if d["outcome"] == "forwarded"]
    # MKCALENDAR and the PROPPATCH naming it, then each holder's PUT.
    assert forwarded == [old.generation] * 3 + [new.generation]
    refused = {(d["outcome"], d["generation"]) for d in decisions if d["outcome"] != "forwarded"}
    assert refused == {("stale-generation", old.generation)}
