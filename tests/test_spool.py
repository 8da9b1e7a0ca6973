"""Fenced bodies beyond ``limits.body_buffer``, kept on disk: real files in a real
folder, real HTTP over loopback, real proxy processes where a crash or a full disk
is the point. Each body is sent over a raw socket and held one byte short until its
file is seen in the folder, so every test knows the body went to disk."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient

from fenceproxy.config import load_config, parse_config
from fenceproxy.errors import ConfigError, KeyReused
from fenceproxy.fence.fencing import FencedWrite, Replay, fingerprint, fingerprint_digest, scope
from fenceproxy.server.app import FenceProxy
from fenceproxy.testing import (
    DiscardingUpstream,
    ProxyProcess,
    ProxyTestServer,
    RawUpstream,
    RecordingUpstream,
    eventually,
    free_port,
)

from .conftest import ProxyFactory, admit
from .test_edge import answer_of, kind, rss_of

Client = TestClient[Any, Any]
MiB = 1024 * 1024
PATH = "/billing/x"


def body_of(size: int, seed: int = 0) -> bytes:
    """``size`` bytes that differ from place to place, so a piece sent twice, lost or
    out of order changes them."""
    block = hashlib.sha256(str(seed).encode()).digest() * (MiB // 32)
    return (block * (size // len(block) + 1))[:size]


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def head(size: int, job: str = "j", token: int = 1, key: str | None = None) -> bytes:
    fields = f"Fencing-Job: {job}\r\nFencing-Token: {token}\r\n"
    if key is not None:
        fields += f"Idempotency-Key: {key}\r\n"
    return (
        f"POST /billing/x HTTP/1.1\r\nHost: a\r\n{fields}Content-Length: {size}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()


async def send_held(
    port: int, folder: Path, body: bytes, **fields: Any
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send all of ``body`` but its last byte, and wait until its file is in ``folder``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head(len(body), **fields))
    view = memoryview(body)[:-1]
    for start in range(0, len(view), MiB):
        writer.write(view[start : start + MiB])
        await writer.drain()
    await eventually(lambda: len(files_in(folder)) == 1)
    return reader, writer


async def upload(port: int, folder: Path, body: bytes, **fields: Any) -> bytes:
    """The whole answer to a fenced write of ``body`` that was seen going to disk."""
    reader, writer = await send_held(port, folder, body, **fields)
    writer.write(body[-1:])
    try:
        async with asyncio.timeout(30):
            return await reader.read()
    finally:
        writer.close()


@pytest.fixture
def bodies(tmp_path: Path) -> Path:
    return tmp_path / "bodies"


@pytest.fixture
def spooling(aiohttp_client: Any, tmp_path: Path, bodies: Path) -> Any:
    """Start a proxy whose fenced bodies above 1 MiB go to ``bodies``."""

    async def start(upstream_url: str, **route: Any) -> Client:
        config = parse_config(
            {
                "store": f"sqlite:///{tmp_path / 'fences.db'}",
                "limits": {"body_buffer": "1MiB", "body_temp_path": str(bodies)},
                "routes": [
                    {"name": "billing", "path": "/billing/", "upstream": upstream_url,
                     "max_body": "64MiB", **route}
                ],
            },
            "test.yaml",
        )  # fmt: skip
        client: Client = await aiohttp_client(ProxyTestServer(FenceProxy(config)))
        return client

    return start


@pytest.fixture
async def raw() -> AsyncIterator[RawUpstream]:
    async with RawUpstream.serve() as up:
        yield up


async def test_a_20_mib_body_reaches_the_upstream_byte_identical_from_its_file(
    spooling: Any, raw: RawUpstream, bodies: Path
) -> None:
    proxy = await spooling(raw.url)
    budget = proxy.server.proxy.bodies  # type: ignore[attr-defined]
    body = body_of(20 * MiB)
    reader, writer = await send_held(proxy.port, bodies, body)
    assert budget.held < MiB  # on disk, not in memory: only what waits to be written
    assert os.stat(bodies).st_mode & 0o777 == 0o700
    [name] = files_in(bodies)
    assert os.stat(bodies / name).st_mode & 0o777 == 0o600
    writer.write(body[-1:])
    async with asyncio.timeout(30):
        answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    [got] = raw.received
    assert got.body == body
    assert got.values("Content-Length") == [str(len(body))]  # framed as a buffered body is
    assert got.values("Transfer-Encoding") == []
    assert files_in(bodies) == []
    assert budget.held == 0


def test_the_fingerprint_fed_in_pieces_is_the_fingerprint_of_the_whole() -> None:
    body = body_of(3 * MiB + 7)
    for cut in (0, 1, 65536, len(body)):
        digest = fingerprint_digest("POST", "/billing/x?a=1", "PUT")
        digest.update(body[:cut])
        digest.update(body[cut:])
        assert digest.digest() == fingerprint("POST", "/billing/x?a=1", body, "PUT")


async def test_a_keyed_retry_of_a_body_on_disk_is_replayed_and_its_fingerprint_is_the_same(
    spooling: Any, upstream: RecordingUpstream, bodies: Path
) -> None:
    proxy = await spooling(upstream.url)
    body = body_of(5 * MiB)
    first = await upload(proxy.port, bodies, body, key="k1")
    assert first.startswith(b"HTTP/1.1 200 "), first[:300]
    retry = await upload(proxy.port, bodies, body, key="k1")
    assert retry.startswith(b"HTTP/1.1 200 "), retry[:300]
    assert b"\r\nIdempotent-Replayed: true\r\n" in retry
    # The same key with another body of the same size is another request.
    other = await upload(proxy.port, bodies, body_of(5 * MiB, seed=1), key="k1")
    assert answer_of(other)[0] == 422
    assert [r.body == body for r in upstream.received] == [True]
    # The store holds what a body held in memory would have been given: the same
    # write with that fingerprint is a replay, with another one a reuse of the key.
    store = proxy.server.proxy.store  # type: ignore[attr-defined]
    same = FencedWrite(
        "billing", "j", 1, key="k1", fingerprint=fingerprint("POST", "/billing/x", body),
        scope=scope([("Authorization", []), ("Cookie", [])]),  # the uploads send neither
    )  # fmt: skip
    assert isinstance(await admit(store, same), Replay)
    changed = dataclasses.replace(same, fingerprint=fingerprint("POST", "/billing/x", body + b" "))
    assert isinstance(await admit(store, changed), KeyReused)
    assert files_in(bodies) == []


async def test_a_body_beyond_body_buffer_that_came_whole_with_its_head_goes_to_disk(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, bodies: Path
) -> None:
    """However it arrives: a body of a few KiB comes in the same read as its head,
    whole, and beyond ``body_buffer`` it is written to its file all the same, not held
    in memory against the cap and its client's share while its write is under way."""
    proxy = await start_proxy(limits={"body_buffer": "1KiB", "body_temp_path": str(bodies)})
    budget = proxy.server.proxy.bodies  # type: ignore[attr-defined]
    body = body_of(8 * 1024)
    release = upstream.hold()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(head(len(body)) + body)  # one write, read with its head
        await upstream.wait_for(1)  # sent from its file, kept until the answer
        assert len(files_in(bodies)) == 1
        assert budget.held == 0
    finally:
        release()
    async with asyncio.timeout(10):
        answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert [r.body for r in upstream.received] == [body]
    await eventually(lambda: files_in(bodies) == [])


async def test_a_body_refused_as_stale_leaves_no_file(
    spooling: Any, upstream: RecordingUpstream, bodies: Path
) -> None:
    proxy = await spooling(upstream.url)
    assert (await upload(proxy.port, bodies, body_of(2 * MiB), token=5)).startswith(
        b"HTTP/1.1 200 "
    )
    stale = await upload(proxy.port, bodies, body_of(3 * MiB), token=4)
    assert (answer_of(stale)[0], kind(answer_of(stale)[1])) == (409, "stale-generation")
    assert len(upstream.received) == 1
    assert files_in(bodies) == []


async def test_a_client_that_leaves_mid_body_leaves_no_file(
    spooling: Any, upstream: RecordingUpstream, bodies: Path
) -> None:
    proxy = await spooling(upstream.url)
    budget = proxy.server.proxy.bodies  # type: ignore[attr-defined]
    _, writer = await send_held(proxy.port, bodies, body_of(8 * MiB))
    writer.close()
    await eventually(lambda: files_in(bodies) == [])
    await eventually(lambda: budget.held == 0)
    assert upstream.received == []


async def test_an_upstream_that_does_not_answer_in_time_leaves_no_file(
    spooling: Any, upstream: RecordingUpstream, bodies: Path
) -> None:
    proxy = await spooling(upstream.url, timeout="500ms")
    release = upstream.hold()
    body = body_of(6 * MiB)
    try:
        answer = await upload(proxy.port, bodies, body)
    finally:
        release()
    assert (answer_of(answer)[0], kind(answer_of(answer)[1])) == (504, "upstream-timeout")
    assert [r.body == body for r in upstream.received] == [True]
    assert files_in(bodies) == []


def process_config(tmp_path: Path, name: str, upstream: str, bodies: Path) -> Path:
    path = tmp_path / f"{name}.yaml"
    config = {
        "store": f"sqlite:///{tmp_path / (name + '.db')}",
        "limits": {"body_buffer": "1MiB", "body_temp_path": str(bodies)},
        "routes": [
            {"name": "billing", "path": "/billing/", "upstream": upstream, "max_body": "2GiB"}
        ],
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def test_a_file_left_by_a_killed_proxy_is_removed_at_start_and_a_live_ones_kept(
    tmp_path: Path, upstream: RecordingUpstream, bodies: Path
) -> None:
    """Two proxies share the folder: one is killed mid-body, the other is still
    reading one. The killed one, started again, removes its own leftover only."""
    killed = ProxyProcess(process_config(tmp_path, "a", upstream.url, bodies), free_port())
    alive = ProxyProcess(process_config(tmp_path, "b", upstream.url, bodies), free_port())
    unrelated = bodies / "notes.txt"
    writers = []
    try:
        await killed.start()
        await alive.start()
        _, w = await send_held(alive.port, bodies, body_of(3 * MiB))
        writers.append(w)
        [held] = files_in(bodies)
        _, w = await asyncio.open_connection("127.0.0.1", killed.port)
        writers.append(w)
        w.write(head(3 * MiB) + body_of(2 * MiB))
        await w.drain()
        await eventually(lambda: len(files_in(bodies)) == 2)
        [left] = [n for n in files_in(bodies) if n != held]
        await killed.stop()  # SIGKILL: nothing of it runs to clean up
        assert files_in(bodies) == sorted([held, left])
        unrelated.write_text("not the proxy's")
        restarted = ProxyProcess(process_config(tmp_path, "a", upstream.url, bodies), free_port())
        try:
            await restarted.start()
            assert sorted(files_in(bodies)) == sorted([held, "notes.txt"])
            assert "removed 1 request body file(s)" in restarted.output()
        finally:
            await restarted.stop()
    finally:
        for w in writers:
            w.close()
        await killed.stop()
        await alive.stop()
    assert upstream.received == []


async def test_a_full_disk_is_507_with_nothing_forwarded_and_no_file(
    tmp_path: Path, upstream: RecordingUpstream, bodies: Path
) -> None:
    """The proxy may write files of 4 MiB at most (RLIMIT_FSIZE: the kernel refuses
    the write past it, as a full disk does)."""
    proxy = ProxyProcess(
        process_config(tmp_path, "a", upstream.url, bodies), free_port(), fsize=4 * MiB
    )
    try:
        await proxy.start()
        # Sent whole, not held one byte short: the file may be refused, and removed,
        # before the client has sent the rest.
        answer = await upload_whole(proxy.port, body_of(8 * MiB))
        status, problem = answer_of(answer)
        assert (status, kind(problem)) == (507, "insufficient-storage")
        assert b"\r\nRetry-After: " in answer
        assert files_in(bodies) == []
        small = await upload_small(proxy.port)
        assert small.startswith(b"HTTP/1.1 200 ")  # one that fits in memory still goes
        log = proxy.output()
    finally:
        await proxy.stop()
    assert "Traceback" not in log
    assert len(upstream.received) == 1


async def upload_whole(port: int, body: bytes) -> bytes:
    """The whole answer to a fenced write of ``body``, sent as fast as it is taken;
    the proxy may answer, and close, before it was all sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head(len(body)) + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        async with asyncio.timeout(30):
            return await reader.read()
    finally:
        writer.close()


async def upload_small(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head(2, token=2) + b"{}")
    try:
        return await reader.read()
    finally:
        writer.close()


async def test_a_200_mib_body_moves_the_proxys_memory_by_far_less_than_its_size(
    tmp_path: Path, bodies: Path
) -> None:
    """Memory, not time: the peak resident size while a 200 MiB fenced body goes
    through a proxy process stays within 64 MiB of its size before."""
    size = 200 * MiB
    async with DiscardingUpstream.serve() as up:
        proxy = ProxyProcess(process_config(tmp_path, "a", up.url, bodies), free_port())
        try:
            await proxy.start()
            assert proxy.process is not None
            idle, _ = rss_of(proxy.process.pid)
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(head(size))
            block = body_of(MiB)
            for _ in range(size // MiB):
                writer.write(block)
                await writer.drain()
            async with asyncio.timeout(60):
                answer = await reader.read()
            writer.close()
            _, peak = rss_of(proxy.process.pid)
        finally:
            await proxy.stop()
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
        [got] = up.received
        assert got.length == size
        assert got.sha256 == hashlib.sha256(block * (size // MiB)).hexdigest()
    assert peak - idle < 64 * 1024, (idle, peak)  # KiB
    assert files_in(bodies) == []


# -- the config ----------------------------------------------------------------------


def write(tmp_path: Path, limits: dict[str, Any]) -> Path:
    path = tmp_path / "proxy.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "store": "sqlite:///fences.db",
                "limits": limits,
                "routes": [{"name": "a", "path": "/a/", "upstream": "http://127.0.0.1:1"}],
            }
        )
    )
    return path


@pytest.mark.parametrize(
    ("limits", "key", "says"),
    [
        ({"body_buffer": "lots"}, "limits.body_buffer", "size"),
        ({"body_buffer": -1}, "limits.body_buffer", "greater than or equal to 0"),
        ({"body_buffer": "2MiB", "max_buffered": "1MiB"}, "limits", "above max_buffered"),
        ({"body_temp_path": ""}, "limits.body_temp_path", "path of a folder"),
        ({"body_temp_path": "proxy.yaml"}, "limits.body_temp_path", "is not a folder"),
    ],
    ids=["not-a-size", "negative", "above-max-buffered", "empty", "a-file"],
)
def test_bad_body_settings_name_the_file_and_key(
    tmp_path: Path, limits: dict[str, Any], key: str, says: str
) -> None:
    path = write(tmp_path, limits)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    [line] = caught.value.lines
    assert line.startswith(f"{path}: {key}: "), line
    assert says in line, line


def test_a_folder_others_may_write_to_or_a_link_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, {"body_temp_path": "shared"}))
    assert "limits.body_temp_path: " in str(caught.value)
    assert "may be written by other users" in str(caught.value)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, {"body_temp_path": "link"}))
    assert "limits.body_temp_path: " in str(caught.value)
    assert "is not a folder (a link or a file)" in str(caught.value)
    assert not (tmp_path / "elsewhere").exists()  # nothing made through the link


def test_a_relative_folder_is_the_config_files_and_is_made_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir("/")
    config = load_config(write(tmp_path, {"body_temp_path": "spool/bodies"}))
    assert config.limits.body_temp_path == str(tmp_path / "spool" / "bodies")
    assert os.stat(tmp_path / "spool" / "bodies").st_mode & 0o777 == 0o700
