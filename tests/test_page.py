"""The operator page in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, which ``make test`` installs) driven by Selenium, against a real
proxy process. A stale write sent through the proxy appears on the open page, the
refusals are counted by kind, and a job's timeline shows its generations, holders and
writes with their decisions; the charts draw the last hour (every worker's under
``workers:``), on one clock, UTC and 24-hour, with every size and duration in its
unit; and with JavaScript off the tables are there all the same."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import re
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
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

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = ROOT / "build" / "artifacts" / "operator-page.png"
DURATION = r"[0-9.]+ (µs|ms|s)"
STATIC = ROOT / "fenceproxy" / "ops" / "static"
VENDORED = re.compile(
    r"`uplot` (?P<version>[\d.]+).*?`package/dist/uPlot\.iife\.min\.js`, sha256\s+"
    r"`(?P<js>[0-9a-f]{64})`.*?`package/dist/uPlot\.min\.css`, sha256\s+`(?P<css>[0-9a-f]{64})`",
    re.S,
)
TWELVE_HOUR = re.compile(r"\b[0-9]{1,2}:[0-9]{2}(:[0-9]{2})?\s*[AaPp]\.?[Mm]\b")
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
        assert stale[0][2:-1] == [job, "billing", str(first), str(second), "k-2",
                                  "stale-generation", "409"]  # fmt: skip
        assert re.fullmatch(DURATION, stale[0][-1]), stale[0][-1]  # the time it took
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
        assert [r[1:-1] for r in rows(browser, "timeline")] == [
            ["claim", "-", str(first), "-", "w-old", "granted", "200"],
            ["write", "billing", str(first), "-", "k-1", "forwarded", "200"],
            ["release", "-", str(first), "-", "w-old", "granted", "200"],
            ["claim", "-", str(second), "-", "w-new", "granted", "200"],
            ["write", "billing", str(first), str(second), "k-2", "stale-generation", "409"],
        ]
        # The shown timeline goes on live: the new holder's write is added to it.
        assert await new.write(job, second, "k-3") == 200
        await until(browser, lambda b: len(rows(b, "timeline")) == 6)
        assert rows(browser, "timeline")[-1][1:-1] == [
            "write", "billing", str(second), "-", "k-3", "forwarded", "200",
        ]  # fmt: skip
        # A job this proxy has seen nothing of: its timeline appears with its first write.
        await asyncio.to_thread(browser.get, f"{proxy.admin_url}/?job=fresh")
        assert browser.find_element(By.ID, "timeline-empty").is_displayed()
        assert await new.write("fresh", 1, "k-4") == 200
        await until(browser, lambda b: b.find_element(By.ID, "timeline").is_displayed())
        assert [r[1:-1] for r in rows(browser, "timeline")] == [
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
            probe = f"probe-{worker}-{n}"  # a job of its own, whichever worker is asked for
            found = Worker(session, proxy, probe)
            await found.lease("claim", probe)
            query = {"worker": str(worker), "job": probe}
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


# -- the charts -----------------------------------------------------------------

_RECORD_TEXT = """window.drawnText = [];
const fillText = CanvasRenderingContext2D.prototype.fillText;
CanvasRenderingContext2D.prototype.fillText = function (text, ...rest) {
  window.drawnText.push(String(text));
  return fillText.call(this, text, ...rest);
};"""


@contextmanager
def canvas_text(browser: WebDriver) -> Iterator[Callable[[], list[str]]]:
    """What the pages opened meanwhile write on their canvases (the charts' axes: their
    labels and ticks, which no element holds), read by the function yielded."""
    added = browser.execute_cdp_cmd(
        "Page.addScriptToEvaluateOnNewDocument", {"source": _RECORD_TEXT}
    )

    def read() -> list[str]:
        found: list[str] = browser.execute_script("return window.drawnText || []")
        return found

    try:
        yield read
    finally:
        browser.execute_cdp_cmd(
            "Page.removeScriptToEvaluateOnNewDocument", {"identifier": added["identifier"]}
        )


_HIGHEST = """const [selector, colours] = arguments;
const canvas = document.querySelector(selector);
if (!canvas || !canvas.width) { return null; }
const { data, width, height } =
  canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height);
return colours.map((hex) => {
  const [r, g, b] = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
  for (let i = 0; i < data.length; i += 4) {
    const off = Math.abs(data[i] - r) + Math.abs(data[i + 1] - g) + Math.abs(data[i + 2] - b);
    if (data[i + 3] > 200 && off < 30) { return Math.floor(i / 4 / width) / height; }
  }
  return 1;
});"""

CHARTS = {
    "chart-decisions": {"forwarded": "#1b5e20", "replayed": "#1565c0", "refused": "#b00020"},
    "chart-refusals": {"stale-generation": "#b00020"},
    "chart-seconds": {
        "through the proxy": "#0d47a1",
        "in the store": "#6a1b9a",
        "at the upstream": "#e65100",
    },
    "chart-batches": {"mean": "#00838f", "largest": "#5d4037"},
}
"""Each chart's lines and their colours, as the page's script draws them."""


def highest(browser: WebDriver, chart: str) -> dict[str, float]:
    """How high each line of ``chart`` reaches on its canvas: the first row of pixels
    in its colour, as a fraction of the height from the top; 1 where it is not drawn."""
    colours = CHARTS[chart]
    found = browser.execute_script(_HIGHEST, f"#{chart} canvas", list(colours.values()))
    return dict(zip(colours, found or [1] * len(colours), strict=True))


async def every_kind_of_write(proxy: ProxyProcess) -> None:
    """Fenced writes of each kind through ``proxy``: 12 forwarded, 4 of them again
    (replayed from their keys), then 3 under a lease that was taken over (stale)."""
    async with aiohttp.ClientSession() as session:
        old, new = Worker(session, proxy, "w-old"), Worker(session, proxy, "w-new")
        first = await old.lease("claim", "chart/1")
        for n in [*range(12), *range(4)]:
            assert await old.write("chart/1", first, f"k-{n}") == 200
        await old.lease("release", "chart/1", first)
        await new.lease("claim", "chart/1")
        for n in range(3):
            assert await old.write("chart/1", first, f"s-{n}") == 409


async def test_the_charts_draw_the_last_hour_with_labelled_axes(
    browser: WebDriver, proxy: ProxyProcess
) -> None:
    """After writes forwarded, replayed and refused, every chart draws (a line of
    each decision, the forwarded ones, the most, at the top of theirs; the time of
    each part, which may draw over one another, as a mean and a largest batch may),
    with its axes labelled and their ticks in units, under the page's own
    Content-Security-Policy; a screenshot is kept at build/artifacts/operator-page.png."""
    await every_kind_of_write(proxy)
    browser.get_log("browser")  # what pages opened before said
    size = browser.get_window_size()
    browser.set_window_size(1400, 1800)
    try:
        with canvas_text(browser) as drawn:
            await asyncio.to_thread(browser.get, f"{proxy.admin_url}/")
            for chart in CHARTS:
                await until(browser, lambda b, c=chart: min(highest(b, c).values()) < 1)
            texts = drawn()
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            assert browser.save_screenshot(str(SCREENSHOT))
            print(f"the operator page, drawn: {SCREENSHOT}")
            tops = {chart: highest(browser, chart) for chart in CHARTS}
            errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        await asyncio.to_thread(browser.get, "about:blank")  # its polling ends here
        browser.set_window_size(size["width"], size["height"])
    decisions = tops["chart-decisions"]
    assert decisions["forwarded"] < 0.3, tops  # the most: near the top
    assert max(decisions.values()) < 1, tops  # each drawn
    assert tops["chart-refusals"]["stale-generation"] < 0.3, tops  # the only kind
    labels = {"time (UTC)", "writes per second", "refusals per second", "time, log scale",
              "operations per commit"}  # fmt: skip
    assert labels <= set(texts)
    assert [t for t in texts if re.fullmatch("[0-2][0-9]:[0-5][0-9]", t)]  # the time axis
    assert [t for t in texts if re.fullmatch(DURATION, t)]  # the time taken, in units
    assert errors == []


async def test_the_page_has_one_utc_clock_and_units_with_or_without_javascript(
    browser: WebDriver, proxy: ProxyProcess
) -> None:
    """Every time on the page is UTC on a 24-hour clock, said so, and every size and
    duration has its unit (``10 MiB``, ``30 s``, ``2.5 ms``), on the tables the
    server renders and on what the script draws; with JavaScript off the tables are
    there, and the charts say they need it."""
    await every_kind_of_write(proxy)
    with canvas_text(browser) as drawn:
        await asyncio.to_thread(browser.get, f"{proxy.admin_url}/?job=chart/1")
        await until(browser, lambda b: "UTC" in b.find_element(By.ID, "feed-status").text)
        await until(browser, lambda b: "time (UTC)" in drawn())
        text = browser.find_element(By.TAG_NAME, "body").text
        status = browser.find_element(By.ID, "feed-status").text
        texts = drawn()
        routes, events = rows(browser, "routes"), rows(browser, "events")
        timeline = rows(browser, "timeline")
    assert re.fullmatch("live, updated [0-2][0-9]:[0-5][0-9]:[0-5][0-9] UTC", status)
    assert [t for t in [text, *texts] if TWELVE_HOUR.search(t)] == []
    assert routes[0][-2:] == ["30 s", "10 MiB"]
    assert str(10 * 1024 * 1024) not in text
    assert len(timeline) == 22  # the job's claims, release and writes
    assert [r[-1] for r in events if r[1] == "write"]
    assert [r[-1] for r in events if r[1] == "write" and not re.fullmatch(DURATION, r[-1])] == []
    browser.execute_cdp_cmd("Emulation.setScriptExecutionDisabled", {"value": True})
    try:
        await asyncio.to_thread(browser.get, f"{proxy.admin_url}/?job=chart/1")
        shown = browser.find_element(By.TAG_NAME, "body").text
        assert "The charts are drawn by the page's script" in shown
        assert not browser.find_element(By.ID, "charts").is_displayed()
        assert len(browser.find_elements(By.CSS_SELECTOR, "#events tr")) == len(events)
        assert len(browser.find_elements(By.CSS_SELECTOR, "#timeline tr")) == len(timeline)
        assert "30 s" in shown
        assert "10 MiB" in shown
    finally:
        browser.execute_cdp_cmd("Emulation.setScriptExecutionDisabled", {"value": False})
        await asyncio.to_thread(browser.get, "about:blank")


async def test_under_workers_the_charts_add_up_every_workers_writes(
    tmp_path: Path, database: str, upstream: RecordingUpstream
) -> None:
    """Under ``workers: 2`` the charts are the whole proxy's: writes served by each
    worker are counted once each, added up by the supervisor."""
    config = tmp_path / "fenceproxy.yaml"
    write_config(config, database, upstream, "/billing", workers=2)
    proxy = await ProxyProcess(config, free_port()).start()
    try:
        async with aiohttp.ClientSession() as admin:
            first, second = await on_worker(proxy, 0, admin), await on_worker(proxy, 1, admin)
            async with first.session, second.session:
                for n in range(3):
                    assert await first.write("sum/0", 1, f"k-{n}") == 200
                assert await second.write("sum/1", 2, "k-1") == 200
                assert await second.write("sum/1", 1, "k-2") == 409
            async with admin.get(f"{proxy.admin_url}/page/series") as answer:
                assert answer.status == 200
                drawn = await answer.json()

        def count(rates: list[float | None]) -> int:
            return round(sum(r * s for r, s in zip(rates, drawn["seen"], strict=True) if r))

        assert count(drawn["decisions"]["forwarded"]) == 4
        assert count(drawn["decisions"]["refused"]) == 1
        assert count(drawn["refusals"]["stale-generation"]) == 1
        assert [v for v in drawn["seconds"]["upstream"]["p50"] if v is not None]
    finally:
        print(proxy.output())  # shown when the test fails
        await proxy.stop()


def test_the_vendored_uplot_is_the_release_the_docs_record() -> None:
    """The uPlot the page loads is the release docs/observability.md names, byte for
    byte (each file's SHA-256), at that version, with its licence: a file changed or
    replaced without its record fails, so what operators' browsers run was reviewed."""
    record = VENDORED.search((ROOT / "docs" / "observability.md").read_text())
    assert record is not None, "docs/observability.md records the vendored uPlot"
    script = (STATIC / "uPlot.iife.min.js").read_bytes()
    assert hashlib.sha256(script).hexdigest() == record["js"]
    assert f"(v{record['version']})".encode() in script.split(b"\n", 1)[0]
    assert hashlib.sha256((STATIC / "uPlot.min.css").read_bytes()).hexdigest() == record["css"]
    assert (STATIC / "uPlot.LICENSE").read_text().startswith("The MIT License")
