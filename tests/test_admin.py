"""The admin listener over real HTTP, on both stores: liveness, readiness that follows
the store (a schema moved on under a running proxy, a closed store), and metrics in
the Prometheus text format that count what the proxy decided. Then the config's side
and a real process with its admin listener on an address of its own."""

from __future__ import annotations

import asyncio
import json
import socket
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from fenceproxy import cli
from fenceproxy.config import LimitsSpec, parse_config
from fenceproxy.errors import (
    PROBLEM_BASE,
    AdminUnauthenticated,
    ConfigError,
    Refusal,
    StoreNotReady,
)
from fenceproxy.fence.tokens import generate_key
from fenceproxy.http.answer import Answer, problem_answer
from fenceproxy.http.request import Request
from fenceproxy.http.server import DataPlane, Listener
from fenceproxy.ops.admin import page_url
from fenceproxy.testing import ProxyProcess, RecordingUpstream, free_port

from .conftest import ProxyFactory, fenced, raw_request
from .postgres import sql
from .test_proxy import problem

Client = TestClient[Any, Any]


@pytest.fixture
async def proxy(start_proxy: ProxyFactory) -> Client:
    return await start_proxy(leases={})


@pytest.fixture
async def admin(proxy: Client, aiohttp_client: Any) -> Client:
    client: Client = await aiohttp_client(proxy.server.proxy.admin())  # type: ignore[union-attr]
    return client


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page, by name and sorted labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def scrape(admin: Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await admin.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=")
    return samples(await response.text())


async def test_healthz_and_readyz_answer_while_the_store_is_ready(admin: Client) -> None:
    assert (await admin.get("/healthz")).status == 200
    ready = await admin.get("/readyz")
    assert ready.status == 200
    assert (await ready.json()) == {"status": "ready"}
    await problem(await admin.get("/nothing-here"), 404, "no-route")


@pytest.mark.both_stores
async def test_readyz_is_503_with_the_reason_when_the_store_is_not_ready(
    proxy: Client, admin: Client, store_url: str
) -> None:
    if store_url.startswith("postgresql"):
        # Another fenceproxy migrated the database past this one's schema.
        await sql(store_url, "INSERT INTO fenceproxy_schema (version) VALUES (999)")
        try:
            body = await problem(await admin.get("/readyz"), 503, "store-not-ready")
        finally:
            await sql(store_url, "DELETE FROM fenceproxy_schema WHERE version = 999")
        assert "schema version 999" in body["detail"]
    else:
        await proxy.server.proxy.store.close()  # type: ignore[union-attr]
        body = await problem(await admin.get("/readyz"), 503, "store-not-ready")
        assert "closed" in body["detail"]
    assert (await admin.get("/healthz")).status == 200  # alive all the same


async def test_metrics_count_what_the_proxy_decided(
    proxy: Client, admin: Client, upstream: RecordingUpstream
) -> None:
    claim = await proxy.post("/_leases/j/claim", json={"owner": "w1"})
    assert claim.status == 200
    assert (await fenced(proxy, "j", 1, key="k1")).status == 200  # forwarded
    assert (await fenced(proxy, "j", 1, key="k1")).status == 200  # replayed
    await problem(await fenced(proxy, "j", 0), 409, "stale-generation")
    await problem(await fenced(proxy, "j", None), 428, "fencing-header-missing")
    held = await proxy.post("/_leases/j/claim", json={"owner": "w2"})
    assert held.status == 409
    got = await scrape(admin)

    def decisions(outcome: str) -> float:
        key = ("fenceproxy_decisions_total", (("outcome", outcome), ("route", "billing")))
        return got.get(key, 0.0)

    assert decisions("forwarded") == 1
    assert decisions("replayed") == 1
    assert decisions("stale-generation") == 1
    assert decisions("fencing-header-missing") == 1
    assert got[("fenceproxy_lease_calls_total", (("action", "claim"), ("result", "granted")))] == 1
    lease_held = (("action", "claim"), ("result", "lease-held"))
    assert got[("fenceproxy_lease_calls_total", lease_held)] == 1
    answered = (("route", "billing"), ("status_class", "2xx"))
    assert got[("fenceproxy_upstream_seconds_count", answered)] == len(upstream.received) == 1
    assert got[("fenceproxy_writes_in_flight", ())] == 0
    assert got[("fenceproxy_request_bytes_held", ())] == 0
    assert got[("fenceproxy_client_connections", ())] >= 1
    assert ("fenceproxy_build_info", (("version", "0.1.0"),)) in got
    commits = got[("fenceproxy_store_commit_seconds_count", ())]
    assert commits >= 1
    assert got[("fenceproxy_store_batch_operations_count", ())] == commits
    assert got[("fenceproxy_store_batch_operations_sum", ())] >= commits


def test_the_admin_listener_is_loopback_by_default_and_apart_from_the_proxy() -> None:
    routes = [{"name": "b", "path": "/b/", "upstream": "http://127.0.0.1:9"}]
    assert parse_config({"routes": routes}, "f.yaml").admin == "127.0.0.1:9901"
    assert parse_config({"routes": routes, "admin": False}, "f.yaml").admin is None
    with pytest.raises(ConfigError, match=r"f\.yaml: admin must listen on another address"):
        parse_config({"routes": routes, "listen": "127.0.0.1:9901"}, "f.yaml")
    with pytest.raises(ConfigError, match="admin: expected HOST:PORT"):
        parse_config({"routes": routes, "admin": 9901}, "f.yaml")


def test_the_operator_pages_address_is_the_admin_listeners() -> None:
    """The start line names the page as a browser reaches it: over TLS when the
    listener has it, an IPv6 address in brackets, none without a listener."""
    routes = [{"name": "b", "path": "/b/", "upstream": "http://127.0.0.1:9"}]
    tls = {"cert": "admin.pem", "key": "admin-key.pem"}
    pages = [
        page_url(parse_config({"routes": routes, **top}, "f.yaml"))
        for top in ({}, {"admin": "[::1]:9902", "admin_tls": tls}, {"admin": False})
    ]
    assert pages == ["http://127.0.0.1:9901/", "https://[::1]:9902/", None]


async def test_a_running_proxy_serves_its_admin_listener_apart(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    config = tmp_path / "proxy.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "store": f"sqlite:///{tmp_path / 'fences.db'}",
                "routes": [{"name": "billing", "path": "/billing/", "upstream": upstream.url}],
            }
        )
    )
    proxy = await ProxyProcess(config, free_port()).start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{proxy.admin_url}/readyz") as ready:
                assert ready.status == 200
            async with session.get(f"{proxy.url}/healthz") as not_here:
                assert not_here.status == 404  # the proxy's port serves routes only
    finally:
        await proxy.stop()


def test_an_admin_address_in_use_stops_the_start_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = tmp_path / "proxy.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "listen": f"127.0.0.1:{free_port()}",
                    "admin": f"127.0.0.1:{port}",
                    "store": f"sqlite:///{tmp_path / 'fences.db'}",
                    "routes": [{"name": "b", "path": "/b/", "upstream": "http://127.0.0.1:9"}],
                }
            )
        )
        assert cli.main(["serve", "-c", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: address already in use" in err
    assert "Traceback" not in err


async def test_a_job_is_shown_with_its_fence_lease_in_flight_record_and_keys(
    proxy: Client, admin: Client, upstream: RecordingUpstream
) -> None:
    claim = await proxy.post("/_leases/invoice-7/claim", json={"owner": "w1", "ttl": 30})
    generation = (await claim.json())["generation"]
    assert (await fenced(proxy, "invoice-7", generation, key="k1")).status == 200
    release = upstream.hold()
    pending = asyncio.ensure_future(fenced(proxy, "invoice-7", generation, key="k2"))
    await upstream.wait_for(2)  # the second write is at the upstream now
    response = await admin.get("/jobs/invoice-7")
    assert response.status == 200
    shown = await response.json()
    release()
    assert (await pending).status == 200
    assert shown["job"] == "invoice-7"
    assert shown["generation"] == generation
    assert shown["generation_set_at"] <= shown["now"]
    assert shown["lease"]["owner"] == "w1"
    assert shown["lease"]["live"] is True
    assert 29 <= shown["lease"]["expires_in"] <= 30
    assert shown["in_flight"]["state"] == "in_flight"
    assert shown["in_flight"]["expires_at"] > shown["now"]
    keys = {k["key"]: k for k in shown["keys"]}
    assert keys["k1"]["state"] == "completed"
    assert keys["k1"]["status"] == 200
    assert keys["k2"]["state"] == "in_flight"
    assert all("body" not in k and "headers" not in k for k in shown["keys"])
    # Once answered, the record is gone and the key completed.
    after = await (await admin.get("/jobs/invoice-7")).json()
    assert after["in_flight"] is None
    assert {k["key"]: k["state"] for k in after["keys"]} == {"k1": "completed", "k2": "completed"}


async def test_jobs_are_listed_by_prefix_a_page_at_a_time(proxy: Client, admin: Client) -> None:
    for job in ("a-1", "a-2", "a-3", "b-1"):
        assert (await fenced(proxy, job, 1)).status == 200
    assert (await proxy.post("/_leases/a-4/claim", json={"owner": "w"})).status == 200
    first = await (await admin.get("/jobs", params={"prefix": "a-", "limit": "2"})).json()
    assert first == {"jobs": ["a-1", "a-2"], "next": "a-2"}
    rest = await (
        await admin.get("/jobs", params={"prefix": "a-", "limit": "2", "after": "a-2"})
    ).json()
    assert rest == {"jobs": ["a-3", "a-4"], "next": "a-4"}
    last = await (
        await admin.get("/jobs", params={"prefix": "a-", "limit": "2", "after": "a-4"})
    ).json()
    assert last == {"jobs": [], "next": None}
    await problem(await admin.get("/jobs", params={"limit": "0"}), 400, "request-malformed")


async def test_an_unknown_or_malformed_job_is_a_problem_not_a_500(admin: Client) -> None:
    await problem(await admin.get("/jobs/nobody"), 404, "no-route")
    await problem(await admin.get("/jobs/%01"), 400, "fencing-header-malformed")


async def test_a_job_id_with_slashes_is_shown(proxy: Client, admin: Client) -> None:
    assert (await fenced(proxy, "orders/42/ship", 3)).status == 200
    shown = await (await admin.get("/jobs/orders/42/ship")).json()
    assert (shown["job"], shown["generation"]) == ("orders/42/ship", 3)
    encoded = await (await admin.get("/jobs/orders%2F42%2Fship")).json()
    assert encoded["job"] == "orders/42/ship"


async def jobs_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``fenceproxy jobs ...`` as an operator runs it, in a thread (it runs a loop of
    its own) against the admin listener on loopback."""
    code = await asyncio.to_thread(cli.main, ["jobs", *argv])
    out, err = capsys.readouterr()
    return code, out, err


async def test_jobs_show_prints_a_job_for_a_person_or_as_json(
    proxy: Client, admin: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    claim = await proxy.post("/_leases/orders%2F7/claim", json={"owner": "w1", "ttl": 30})
    generation = (await claim.json())["generation"]
    assert (await fenced(proxy, "orders/7", generation, key="k-1")).status == 200
    url = str(admin.make_url("")).rstrip("/")

    code, out, _ = await jobs_cli(capsys, "show", "orders/7", "--admin", url)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["job", "orders/7"]
    assert lines[1].startswith(f"generation  {generation}, set ")
    assert lines[2].startswith(f"lease       w1, generation {generation}, held, live, ")
    assert lines[3] == "in flight   nothing"
    assert lines[4] == "keys        1"
    assert lines[5].split()[:8] == [
        "k-1", "completed", "route", "billing", "generation", str(generation), "status", "200",
    ]  # fmt: skip

    code, out, _ = await jobs_cli(capsys, "show", "orders/7", "--admin", url, "--json")
    assert code == 0
    printed = json.loads(out)
    assert (printed["job"], printed["generation"]) == ("orders/7", generation)
    assert [k["key"] for k in printed["keys"]] == ["k-1"]


async def test_jobs_list_pages_and_show_of_an_unknown_job_is_refused(
    proxy: Client, admin: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    for job in ("a-1", "a-2", "a-3", "b-1"):
        assert (await fenced(proxy, job, 1)).status == 200
    url = str(admin.make_url("")).rstrip("/")

    code, out, err = await jobs_cli(
        capsys, "list", "--prefix", "a-", "--limit", "2", "--admin", url
    )
    assert (code, out.split(), err.strip()) == (0, ["a-1", "a-2"], "(more: --after a-2)")
    code, out, _ = await jobs_cli(capsys, "list", "--prefix", "a-", "--after", "a-2", "--admin",
                                  url, "--json")  # fmt: skip
    assert (code, json.loads(out)) == (0, {"jobs": ["a-3"], "next": None})

    for odd in ("..", "."):  # path segments a URL would resolve away
        assert (await fenced(proxy, odd, 1)).status == 200
        code, out, _ = await jobs_cli(capsys, "show", odd, "--admin", url)
        assert (code, out.splitlines()[0].split()) == (0, ["job", odd])

    code, out, _ = await jobs_cli(capsys, "show", "nobody", "--admin", url)
    assert code == 1
    assert json.loads(out)["type"] == "urn:fenceproxy:problem:no-route"


async def test_jobs_cli_says_when_the_admin_listener_cannot_be_reached(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = await jobs_cli(capsys, "list", "--admin", url)
    assert (code, out) == (3, "")
    assert err.startswith(f"fenceproxy: cannot ask {url}: ")
    assert "Traceback" not in err
    # Something else listening there, such as the proxy's own port.
    async with RecordingUpstream.serve() as other:
        code, out, err = await jobs_cli(capsys, "show", "j", "--admin", other.url)
    assert (code, out) == (3, "")
    assert "not a fenceproxy admin listener's answer" in err
    with pytest.raises(SystemExit) as usage:
        cli.main(["jobs", "show", "x", "--admin", "127.0.0.1:9901"])
    assert usage.value.code == 2
    assert "give a URL" in capsys.readouterr().err


async def test_events_list_the_last_decisions_and_lease_calls(proxy: Client, admin: Client) -> None:
    claim = await proxy.post("/_leases/e-1/claim", json={"owner": "w1", "ttl": 30})
    generation = (await claim.json())["generation"]
    assert (await fenced(proxy, "e-1", generation, key="k1")).status == 200
    assert (await fenced(proxy, "e-1", generation - 1)).status == 409
    assert (await fenced(proxy, "e-2", 5)).status == 200
    shown = await (await admin.get("/events", params={"job": "e-1"})).json()
    assert [(e["action"], e["outcome"], e["generation"]) for e in shown["events"]] == [
        ("claim", "granted", generation),
        ("write", "forwarded", generation),
        ("write", "stale-generation", generation - 1),
    ]
    assert shown["events"][0]["owner"] == "w1"
    assert shown["events"][1]["key"] == "k1"
    assert shown["events"][2]["current_generation"] == generation
    assert shown["refusals"] == {"stale-generation": [1, 1, 1]}
    after = await (await admin.get("/events", params={"after": str(shown["last"] - 1)})).json()
    assert [e["job"] for e in after["events"]] == ["e-2"]
    for bad in ({"after": "-1"}, {"limit": "0"}, {"after": "x"}):
        await problem(await admin.get("/events", params=bad), 400, "request-malformed")


async def test_the_page_escapes_what_clients_sent_and_allows_only_its_own_script(
    proxy: Client, admin: Client
) -> None:
    hostile = '<img src=x onerror="alert(1)">'
    assert (await fenced(proxy, hostile, 1, key="<k>")).status == 200
    page = await admin.get("/", params={"job": hostile})
    assert page.status == 200
    assert page.headers["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    html = await page.text()
    assert "<img" not in html
    assert html.count("&lt;img src=x onerror=&quot;alert(1)&quot;&gt;") >= 3  # form, h3, rows
    assert "&lt;k&gt;" in html
    script = await admin.get("/static/page.js")
    assert script.status == 200
    assert script.headers["Content-Type"].startswith("text/javascript")
    not_a_job = await (await admin.get("/", params={"job": "\x01"})).text()
    assert "must be 1 to 256 bytes" in not_a_job


async def test_a_browser_sent_here_under_another_name_reads_nothing(admin: Client) -> None:
    """DNS rebinding: a page at evil.example re-points its name at this listener, and
    the browser sends its requests here with that name as the Host."""
    browser = {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"}
    for path in ("/", "/events", "/jobs", "/metrics"):
        refused = await admin.get(path, headers={**browser, "Host": "evil.example:9901"})
        await problem(refused, 421, "misdirected-request")
    for host in ("127.0.0.1:9901", "[::1]:9901", "localhost:9901", "10.1.2.3"):
        assert (await admin.get("/events", headers={**browser, "Host": host})).status == 200
    # Probes and scrapers are no browsers: they may use any name (a service's, say).
    assert (await admin.get("/metrics", headers={"Host": "fenceproxy-admin:9901"})).status == 200


_PROBLEM_FIELDS = (b"content-type", b"content-length", b"retry-after", b"www-authenticate")


async def raw_answer(port: int, request: bytes) -> tuple[bytes, list[bytes], bytes]:
    """An answer as it came off the socket: its status line, the fields a problem is
    read by (Content-Type, Content-Length, Retry-After, WWW-Authenticate) as sent,
    and its body."""
    head, body = (await raw_request(port, request)).split(b"\r\n\r\n", 1)
    status, *lines = head.split(b"\r\n")
    fields = [line for line in lines if line.split(b":", 1)[0].lower() in _PROBLEM_FIELDS]
    return status, sorted(fields), body


async def test_a_refusal_reads_the_same_from_the_proxys_port_and_the_admin_listener(
    start_proxy: ProxyFactory, aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client, a script or a probe reads a refusal one way, whichever listener gave
    it: the same status line, Content-Type, Retry-After, WWW-Authenticate and
    problem body, byte for byte."""
    secret = generate_key()
    monkeypatch.setenv("FP_OPS", secret)
    proxy = await start_proxy(leases={}, admin_clients=[{"name": "ops", "env": "FP_OPS"}])
    fence_proxy = proxy.server.proxy  # type: ignore[attr-defined]
    admin: Client = await aiohttp_client(fence_proxy.admin())
    granted = f"Authorization: Bearer {secret}\r\n".encode()

    # The same refusal for the same reason on both: a job id that is not one.
    claimed = await raw_answer(
        proxy.port,  # type: ignore[arg-type]
        b"POST /_leases/%01/claim HTTP/1.1\r\nHost: p\r\nContent-Length: 15\r\n"
        b'Connection: close\r\n\r\n{"owner": "w1"}',
    )
    shown = await raw_answer(
        admin.port,
        b"GET /jobs/%01 HTTP/1.1\r\nHost: a\r\n" + granted + b"Connection: close\r\n\r\n",
    )
    assert claimed == shown
    assert claimed[0] == b"HTTP/1.1 400 Bad Request"
    assert json.loads(claimed[2])["type"] == PROBLEM_BASE + "fencing-header-malformed"

    # The admin listener's own, with a challenge and a Retry-After: as the proxy's port
    # renders the same refusal.
    await fence_proxy.store.close()
    answers = {
        AdminUnauthenticated: await raw_answer(
            admin.port, b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
        ),
        StoreNotReady: await raw_answer(
            admin.port,
            b"GET /readyz HTTP/1.1\r\nHost: a\r\n" + granted + b"Connection: close\r\n\r\n",
        ),
    }
    for kind, (status, fields, body) in answers.items():
        problem = json.loads(body)
        assert problem["type"] == kind.type_uri()
        retry = [float(f.split(b": ")[1]) for f in fields if f.lower().startswith(b"retry-after")]
        refusal = kind(problem["detail"], retry_after=retry[0] if retry else None)
        plane = Listener(DataPlane(partial(answer_with, refusal), LimitsSpec()))
        await plane.listen("127.0.0.1", 0)
        try:
            rendered = await raw_answer(
                plane.ports[0], b"GET / HTTP/1.1\r\nHost: p\r\nConnection: close\r\n\r\n"
            )
        finally:
            await plane.close()
        assert rendered == (status, fields, body)
        assert any(f.lower().startswith(b"www-authenticate: bearer") for f in fields) == (
            kind is AdminUnauthenticated
        )
        assert bool(retry) == (kind is StoreNotReady)


async def answer_with(refusal: Refusal, request: Request) -> Answer:
    """The proxy's port's answer to a request it refuses with ``refusal``."""
    return problem_answer(refusal)
