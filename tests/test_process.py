"""The proxy as operators run it: a real process, killed with real signals."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from fenceproxy.testing import ProxyProcess, RecordingUpstream, free_port

from .conftest import refused_start, running

pytestmark = pytest.mark.slow


def write_config(
    directory: Path, upstream: RecordingUpstream, *, shutdown: str = "20s", route: str = ""
) -> Path:
    """A config with one fenced route to ``upstream``; ``route`` adds route keys."""
    path = directory / "fenceproxy.yaml"
    path.write_text(
        f"store: sqlite:///{directory / 'fences.db'}\n"
        f"shutdown_timeout: {shutdown}\n"
        "routes:\n"
        f"  - {{name: billing, path: /billing/, upstream: '{upstream.url}'{route}}}\n"
    )
    return path


@pytest.fixture
def config_file(tmp_path: Path, upstream: RecordingUpstream) -> Path:
    return write_config(tmp_path, upstream)


@pytest.fixture
async def spawn(config_file: Path) -> AsyncIterator[Callable[..., ProxyProcess]]:
    started: list[ProxyProcess] = []
    port = free_port()

    def make(*args: str) -> ProxyProcess:
        process = ProxyProcess(config_file, port, *args)
        started.append(process)
        return process

    yield make
    for process in started:
        await process.stop()


async def write(
    http: aiohttp.ClientSession,
    proxy: ProxyProcess,
    generation: int,
    key: str | None = None,
    job: str = "invoice-42",
) -> tuple[int, dict[str, object]]:
    headers = {"Fencing-Job": job, "Fencing-Token": str(generation)}
    if key:
        headers["Idempotency-Key"] = key
    async with http.post(
        proxy.url + "/billing/charges", json={"g": generation}, headers=headers
    ) as response:
        return response.status, await response.json(content_type=None)


async def killed_with_a_write_at_the_upstream(
    proxy: ProxyProcess, upstream: RecordingUpstream, sent: Awaitable[object]
) -> Callable[[], None]:
    """Send a write (``sent``) and SIGKILL the proxy once the upstream has received it,
    before it is answered: the client's connection is cut. Returns the upstream's
    release, which lets the held write land, late, as a slow API's would."""
    release = upstream.hold()
    in_flight = asyncio.ensure_future(sent)
    await upstream.wait_for(len(upstream.received) + 1)
    proxy.signal(signal.SIGKILL)
    await proxy.wait()
    with pytest.raises(aiohttp.ClientError):
        await in_flight
    return release


async def test_fence_survives_kill_9(
    spawn: Callable[..., ProxyProcess], http: aiohttp.ClientSession, upstream: RecordingUpstream
) -> None:
    proxy = await spawn().start()
    assert (await write(http, proxy, 8))[0] == 200
    proxy.signal(signal.SIGKILL)
    assert await proxy.wait() == -signal.SIGKILL

    restarted = await spawn().start()
    status, body = await write(http, restarted, 7)
    assert status == 409
    assert body["current_generation"] == 8
    assert [r.generation for r in upstream.received] == [8]


async def test_write_in_flight_at_kill_9_reads_as_unknown_after_restart(
    tmp_path: Path, http: aiohttp.ClientSession, upstream: RecordingUpstream
) -> None:
    config = write_config(tmp_path, upstream, route=", timeout: 500ms, quarantine: 500ms")
    async with running(config) as proxy:
        sent = write(http, proxy, 3, key="charge-1")
        release = await killed_with_a_write_at_the_upstream(proxy, upstream, sent)
        release()

        await proxy.restart()
        # While the dead proxy's in-flight record lives, the key is in flight; then
        # its outcome is unknown. Never sent twice.
        status, body = await write(http, proxy, 3, key="charge-1")
        assert (status, body["type"]) == (409, "urn:fenceproxy:problem:duplicate-in-flight")
        async with asyncio.timeout(10):
            while body["type"] == "urn:fenceproxy:problem:duplicate-in-flight":
                await asyncio.sleep(0.1)
                status, body = await write(http, proxy, 3, key="charge-1")
        assert (status, body["type"]) == (409, "urn:fenceproxy:problem:duplicate-outcome-unknown")
        assert len(upstream.received) == 1


async def test_restart_after_kill_9_holds_writes_until_old_ones_cannot_land(
    tmp_path: Path, http: aiohttp.ClientSession, upstream: RecordingUpstream
) -> None:
    config = write_config(tmp_path, upstream, route=", timeout: 1s, quarantine: 1s")
    async with running(config) as proxy:
        # Generation 1 is at the upstream, not yet applied, when the proxy dies.
        release = await killed_with_a_write_at_the_upstream(proxy, upstream, write(http, proxy, 1))
        await proxy.restart()
        status, body = await write(http, proxy, 2)
        assert status == 503
        assert str(body["type"]).endswith("job-quarantined")
        release()  # the old write lands late, as a slow upstream's would
        # Only the job that had a write in flight waits.
        assert (await write(http, proxy, 1, job="another-job"))[0] == 200
        async with asyncio.timeout(10):
            while (status := (await write(http, proxy, 2))[0]) == 503:
                await asyncio.sleep(0.1)
        assert status == 200
        assert [(r.job, r.generation) for r in upstream.received] == [
            ("invoice-42", 1),
            ("another-job", 1),
            ("invoice-42", 2),
        ]


async def test_sigterm_drains_writes_in_flight(
    spawn: Callable[..., ProxyProcess], http: aiohttp.ClientSession, upstream: RecordingUpstream
) -> None:
    proxy = await spawn().start()
    release = upstream.hold()
    in_flight = asyncio.ensure_future(write(http, proxy, 1, key="k"))
    await upstream.wait_for(1)
    proxy.signal(signal.SIGTERM)
    # New connections are refused while the write in flight is still held.
    refused = False
    for _ in range(500):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.close()
            await asyncio.sleep(0.01)
        except OSError:
            refused = True
            break
    assert refused
    assert not in_flight.done()
    release()
    assert (await in_flight)[0] == 200
    assert await proxy.wait() == 0

    # The answer was recorded before the exit: a retry is replayed.
    restarted = await spawn().start()
    status, _ = await write(http, restarted, 1, key="k")
    assert status == 200
    assert len(upstream.received) == 1


async def test_second_proxy_on_one_sqlite_file_is_refused(
    spawn: Callable[..., ProxyProcess], config_file: Path
) -> None:
    await spawn().start()
    assert "in use by another process" in await refused_start(config_file)


async def test_bad_config_exits_non_zero_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("routes:\n  - name: x\n    path: /x/\n    upstream: nowhere\n")
    message = await refused_start(bad)
    assert "exited 2" in message
    assert f"{bad}: routes[0].upstream" in message
    assert "Traceback" not in message


async def test_malformed_requests_are_logged_in_one_line_without_traceback(
    spawn: Callable[..., ProxyProcess],
) -> None:
    proxy = await spawn().start()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(b"POST /billing/x HTTP/1.1\r\nHost: a\r\nX-Bad: a\x01b\r\n\r\n")
    await writer.drain()
    assert (await reader.read()).startswith(b"HTTP/1.0 400")
    writer.close()
    proxy.signal(signal.SIGTERM)
    assert await proxy.wait() == 0
    log = proxy.output()
    assert "refused a malformed request (400 request-malformed)" in log
    assert "Traceback" not in log


async def test_a_write_cut_off_at_shutdown_keeps_its_job_quarantined_after_restart(
    tmp_path: Path, http: aiohttp.ClientSession, upstream: RecordingUpstream
) -> None:
    config = write_config(tmp_path, upstream, shutdown="300ms", route=", quarantine: 30s")
    proxy = await ProxyProcess(config, free_port()).start()
    release = upstream.hold()
    try:
        in_flight = asyncio.ensure_future(write(http, proxy, 1))
        await upstream.wait_for(1)
        proxy.signal(signal.SIGTERM)  # the drain time runs out before the upstream answers
        assert await proxy.wait() == 0
        with contextlib.suppress(aiohttp.ClientError):
            await in_flight
        await proxy.restart()
        status, body = await write(http, proxy, 2)
        assert status == 503
        assert str(body["type"]).endswith("job-quarantined")
        # Cut at shutdown, the write was settled before the store closed: its record
        # says its outcome is unknown, so the refusal is at once, not after waiting.
        assert "got no answer" in str(body["detail"])
    finally:
        release()
        await proxy.stop()


async def test_a_relative_store_is_the_config_files_whatever_the_working_directory(
    tmp_path: Path, upstream: RecordingUpstream, http: aiohttp.ClientSession
) -> None:
    config = tmp_path / "etc" / "fenceproxy.yaml"
    config.parent.mkdir()
    config.write_text(
        "store: sqlite:///state/fences.db\n"
        f"routes:\n  - {{name: billing, path: /billing/, upstream: '{upstream.url}'}}\n"
    )
    (config.parent / "state").mkdir()
    first_cwd, second_cwd = tmp_path / "a", tmp_path / "b"
    first_cwd.mkdir()
    second_cwd.mkdir()
    port = free_port()

    first = await ProxyProcess(config, port, cwd=first_cwd).start()
    assert (await write(http, first, 7))[0] == 200
    first.signal(signal.SIGTERM)
    assert await first.wait() == 0
    assert f"store: SQLite file {config.parent / 'state' / 'fences.db'}" in first.output()
    await first.stop()

    second = await ProxyProcess(config, port, cwd=second_cwd).start()
    try:
        status, body = await write(http, second, 6)
        assert (status, body["type"]) == (409, "urn:fenceproxy:problem:stale-generation")
    finally:
        await second.stop()
    assert [r.generation for r in upstream.received] == [7]
    # No store was made in either working directory.
    assert list(tmp_path.glob("[ab]/*")) == []  # noqa: ASYNC240


async def test_a_relative_store_on_the_command_line_is_the_working_directorys(
    tmp_path: Path, upstream: RecordingUpstream, http: aiohttp.ClientSession
) -> None:
    config = write_config(tmp_path, upstream)
    cwd = tmp_path / "run"
    cwd.mkdir()
    proxy = await ProxyProcess(config, free_port(), "--store", "sqlite:///cli.db", cwd=cwd).start()
    try:
        assert (await write(http, proxy, 1))[0] == 200
        assert (cwd / "cli.db").exists()
        assert f"store: SQLite file {cwd / 'cli.db'}" in proxy.output()
    finally:
        await proxy.stop()
