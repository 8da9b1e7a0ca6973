"""``fenceproxy stand-in``, the API a newcomer puts behind the proxy to try it: it
answers every request, prints each write it receives on one line of its own, and
stops cleanly; run as a user runs it, a real process on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fenceproxy.testing import eventually, free_port

from .conftest import raw_request
from .test_examples import as_a_user_runs_it, start

pytestmark = pytest.mark.slow


def request(method: str, target: str, *fields: str, body: bytes = b"") -> bytes:
    head = [f"{method} {target} HTTP/1.1", "Host: api", *fields, "Connection: close"]
    if body:
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def test_the_stand_in_answers_every_request_and_prints_each_write_on_one_line(
    tmp_path: Path,
) -> None:
    """Every request gets 200 and a JSON body; each write (not a read) is printed on
    one line: its method, path, fencing headers and body, what a terminal would act on
    escaped (a hostile body cannot rewrite the screen or forge a line of its own) and
    cut short. SIGTERM stops it, exit 0."""
    port, log = free_port(), tmp_path / "stand-in.log"
    stand_in = await start(f"fenceproxy stand-in --listen 127.0.0.1:{port}", tmp_path, log, port)
    try:
        read = await raw_request(port, request("GET", "/billing/charges"))
        hostile = b'{"a": "\x1b[2J"}\nPOST /forged\xff' + b"x" * 300
        token = "t" * 100
        fenced = request(
            "POST", "/billing/charges?retry=1",
            "Fencing-Job: invoice-42", f"Fencing-Token: {token}", "Idempotency-Key: k-1",
            body=hostile,
        )  # fmt: skip
        write = await raw_request(port, fenced)
        bare = await raw_request(port, request("DELETE", "/billing/charges/7"))
    finally:
        stand_in.terminate()
        assert await stand_in.wait() == 0
    for answer, path in ((read, "/billing/charges"), (write, "/billing/charges?retry=1"),
                         (bare, "/billing/charges/7")):  # fmt: skip
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        assert json.loads(body) == {"applied": True, "path": path}
    shown = '{"a": "\\x1b[2J"}\\nPOST /forged\\xff' + "x" * 300
    started, *printed = log.read_text().splitlines()
    assert started == (
        f"stand-in API on http://127.0.0.1:{port}: answers every request 200, prints each write"
    )
    assert printed == [
        "POST /billing/charges?retry=1 (Fencing-Job: invoice-42, "
        f"Fencing-Token: {token[:77]}..., Idempotency-Key: k-1) {shown[:197]}...",
        "DELETE /billing/charges/7",
    ]


async def test_the_stand_in_on_ipv6_says_where_it_listens_as_a_url(tmp_path: Path) -> None:
    """Its first line gives an address to copy into a config's ``upstream`` or a
    browser: an IPv6 one in brackets."""
    port, log = free_port(), tmp_path / "stand-in.log"
    with log.open("wb") as out:
        stand_in = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fenceproxy", "stand-in", "--listen", f"[::1]:{port}",
            env=as_a_user_runs_it(), stdout=out,
        )  # fmt: skip
    try:
        await eventually(lambda: log.read_text().endswith("\n"))
    finally:
        stand_in.terminate()
        await stand_in.wait()
    assert log.read_text().startswith(f"stand-in API on http://[::1]:{port}: ")


def test_the_stand_in_says_in_one_line_why_it_cannot_start(tmp_path: Path) -> None:
    """An address taken, or not an address: one line naming it, exit 2, no traceback."""
    command = [sys.executable, "-m", "fenceproxy", "stand-in", "--listen"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        busy = subprocess.run(
            [*command, address], capture_output=True, text=True, env=as_a_user_runs_it(), timeout=30
        )
    assert (busy.returncode, busy.stderr) == (
        2,
        f"fenceproxy: cannot start: cannot listen on {address}: address already in use\n",
    )
    wrong = subprocess.run(
        [*command, "9000"], capture_output=True, text=True, env=as_a_user_runs_it(), timeout=30
    )
    assert wrong.returncode == 2
    assert wrong.stderr.splitlines()[-1] == (
        "fenceproxy stand-in: error: --listen: expected HOST:PORT, such as 127.0.0.1:8080 "
        "or [::1]:8080"
    )
