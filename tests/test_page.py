"""The operator page in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which ``make test`` installs) driven by Selenium, against a real
proxy process. A stale write sent through the proxy appears on the open page, the
refusals are counted by kind, and a job's timeline shows its generations, holders and
writes with their decisions."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from fenceproxy.testing import ProxyProcess, RecordingUpstream, free_port

from .test_workers import write_config

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver") or (
    "/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None
)


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed (make servers)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
async def proxy(tmp_path: Path, upstream: RecordingUpstream) -> AsyncIterator[ProxyProcess]:
    path = tmp_path / "proxy.yaml"
    config = {
        "store": f"sqlite:///{tmp_path / 'fences.db'}",
        "leases": {},
        "routes": [{"name": "billing", "path": "/billing/", "upstream": upstream.url}],
    }
    path.write_text(yaml.safe_dump(config))
    proxy = await ProxyProcess(path, free_port()).start()
    try:
        yield proxy
    finally:
        await proxy.stop()


class Worker:
    """A worker of another language's kind: plain HTTP to the lease API and the proxy."""

    def __init__(self, session: aiohttp.ClientSession, proxy: ProxyProcess, name: str) -> None:
        self.session, self.url, self.name = session, proxy.url, name

    async def lease(self, action: str, job: str, generation: int | None = None) -> int:
        body: dict[str, Any] = {"owner": self.name}
        if generation is not None:
            body["generation"] = generation
        quoted = job.replace("/", "%2F")
        async with self.session.post(f"{self.url}/_leases/{quoted}/{action}", json=body) as r:
            assert r.status == 200, await r.text()
            return int((await r.json())["generation"])

    async def write(self, job: str, generation: int, key: str) -> int:
        headers = {"Fencing-Job": job, "Fencing-Token": str(generation), "Idempotency-Key": key}
        async with self.session.post(f"{self.url}/billing/charges", headers=headers) as r:
            return r.status


async def until(
    browser: WebDriver, condition: Callable[[WebDriver], Any], within: float = 15
) -> Any:
    """Wait, polling the page, until ``condition`` holds in the browser."""

    def wait() -> Any:
        try:
            return WebDriverWait(browser, within, poll_frequency=0.1).until(condition)
        except TimeoutException:
            raise AssertionError(f"the page never showed it:\n{browser.page_source}") from None

    return await asyncio.to_thread(wait)


_ROWS = """return Array.from(document.querySelectorAll(arguments[0]),
    row => Array.from(row.querySelectorAll("td"), cell => cell.innerText.trim()));"""


def rows(browser: WebDriver, tbody: str) -> list[list[str]]:
    """The text of each cell of each row of the table body ``#tbody``, read in one
    step: the page's script may replace the rows between two reads."""
    found: list[list[str]] = browser.execute_script(_ROWS, f"#{tbody} tr")
    return found


async def test_a_stale_write_appears_live_and_a_job_shows_its_timeline(
    browser: WebDriver, proxy: ProxyProcess, upstream: RecordingUpstream
) -> None:
    job = "invoice/7"
    async with aiohttp.ClientSession() as session:
        old, new = Worker(session, proxy, "w-old"), Worker(session, proxy, "w-new")
        first = await old.lease("claim", job)
        assert await old.write(job, first, "k-1") == 200
        await old.lease("release", job, first)
        second = await new.lease("claim", job)
        assert second == first + 1

        await asyncio.to_thread(browser.get, f"{proxy.admin_url}/")
        assert browser.title == f"fenceproxy on 127.0.0.1:{proxy.port}"
        routes = rows(browser, "routes")
        assert routes[0][:3] == ["billing", "/billing/", upstream.url]
        # The page is open; the paused worker wakes up and writes under its old lease.
        written_in = int(time.time() // 60)
        assert await old.write(job, first, "k-2") == 409
        stale = await until(
            browser,
            lambda b: [r for r in rows(b, "events") if r[1:3] == ["write", job] and
                       r[7] == "stale-generation"],
        )  # fmt: skip
        assert stale[0][2:] == [job, "billing", str(first), str(second), "k-2",
                                "stale-generation", "409"]  # fmt: skip
        # Counted per minute of the clock, the minute under way included: the write's
        # minute may have ended by the time the page shows it.
        [counted] = rows(browser, "refusals")
        minute_ended = int(time.time() // 60) != written_in
        assert counted[0] == "stale-generation"
        assert counted[1] in (("0", "1") if minute_ended else ("1",))
        assert counted[2:] == ["1", "1"]
        assert "live" in browser.find_element(By.ID, "feed-status").text

        # A job's timeline, asked for by its id.
        field = browser.find_element(By.ID, "job-input")
        field.clear()
        field.send_keys(job)
        await asyncio.to_thread(field.submit)
        await until(browser, lambda b: b.find_element(By.CSS_SELECTOR, "#job h3").text == job)
        now = browser.find_element(By.ID, "job-now").text
        assert f"generation {second}, set " in now
        assert f"lease w-new, generation {second}, held, live" in now
        assert [r[1:] for r in rows(browser, "timeline")] == [
            ["claim", "-", str(first), "-", "w-old", "granted", "200"],
            ["write", "billing", str(first), "-", "k-1", "forwarded", "200"],
            ["release", "-", str(first), "-", "w-old", "granted", "200"],
            ["claim", "-", str(second), "-", "w-new", "granted", "200"],
            ["write", "billing", str(first), str(second), "k-2", "stale-generation", "409"],
        ]
        # The shown timeline goes on live: the new holder's write is added to it.
        assert await new.write(job, second, "k-3") == 200
        await until(browser, lambda b: len(rows(b, "timeline")) == 6)
        assert rows(browser, "timeline")[-1][1:] == [
            "write", "billing", str(second), "-", "k-3", "forwarded", "200",
        ]  # fmt: skip
        # A job this proxy has seen nothing of: its timeline appears with its first write.
        await asyncio.to_thread(browser.get, f"{proxy.admin_url}/?job=fresh")
        assert browser.find_element(By.ID, "timeline-empty").is_displayed()
        assert await new.write("fresh", 1, "k-4") == 200
        await until(browser, lambda b: b.find_element(By.ID, "timeline").is_displayed())
        assert [r[1:] for r in rows(browser, "timeline")] == [
            ["write", "billing", "1", "-", "k-4", "forwarded", "200"]
        ]
        assert browser.find_elements(By.ID, "timeline-empty") == []
    # Nothing the page did was refused by its own Content-Security-Policy, and its
    # script raised nothing.
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []


async def on_worker(proxy: ProxyProcess, worker: int, admin: aiohttp.ClientSession) -> Worker:
    """A worker of another language's kind whose one connection the proxy's worker
    ``worker`` serves: the kernel hands each new connection to one worker or another,
    so connections are opened until one lands there (as its ``/events`` tells)."""
    async with asyncio.timeout(30):
        for n in itertools.count():
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            found = Worker(session, proxy, f"probe-{n}")
            await found.lease("claim", f"probe-{n}")
            query = {"worker": str(worker), "job": f"probe-{n}"}
            async with admin.get(f"{proxy.admin_url}/events", params=query) as events:
                if (await events.json())["events"]:
                    return found
            await session.close()
    raise AssertionError("unreachable")


async def test_a_page_opened_for_one_worker_follows_that_worker(
    browser: WebDriver, tmp_path: Path, database: str, upstream: RecordingUpstream
) -> None:
    """Under ``workers:``, an operator who opens the page for a worker (``?worker=1``)
    sees that worker's decisions as they happen, and a job asked for there is read
    from it too, never the first worker's mixed in."""
    config = tmp_path / "fenceproxy.yaml"
    write_config(config, database, upstream, "/billing", workers=2)
    proxy = await ProxyProcess(config, free_port()).start()
    browser.get_log("browser")  # what pages opened before said
    try:
        async with aiohttp.ClientSession() as admin:
            second = await on_worker(proxy, 1, admin)
        async with second.session:
            await asyncio.to_thread(browser.get, f"{proxy.admin_url}/?worker=1")
            generation = await second.lease("claim", "invoice/9")
            assert await second.write("invoice/9", generation, "k-9") == 200
            await until(
                browser,
                lambda b: (
                    [r[1:3] for r in rows(b, "events")][:2]
                    == [["write", "invoice/9"], ["claim", "invoice/9"]]
                ),
            )
            field = browser.find_element(By.ID, "job-input")
            field.clear()
            field.send_keys("invoice/9")
            await asyncio.to_thread(field.submit)
            await until(browser, lambda b: b.find_element(By.CSS_SELECTOR, "#job h3").text)
            assert "worker=1" in browser.current_url
            assert [r[1] for r in rows(browser, "timeline")] == ["claim", "write"]
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
    finally:
        await asyncio.to_thread(browser.get, "about:blank")  # its polling ends here
        print(proxy.output())  # shown when the test fails
        await proxy.stop()
