"""TLS on every hop, with a certificate authority each test makes (trustme): the
proxy's listener to curl and the Python clients (TLS 1.2 and up, ALPN http/1.1, a
client certificate standing for a lease credential, a certificate renewed on SIGHUP
without dropping a connection), its upstreams (a private CA, a client certificate, a
server name, verification off; every refusal a 502 naming the route), and
PostgreSQL with ``ssl = on``. Then what is refused before anything is served:
credentials in clear beyond loopback, files that cannot be loaded; and the admin
listener's credentials."""

from __future__ import annotations

import asyncio
import datetime
import os
import re
import shutil
import signal
import ssl
import tempfile
import warnings
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from fenceproxy.client import LeaseClient
from fenceproxy.config import load_config, parse_config
from fenceproxy.errors import PROBLEM_BASE, ConfigError, LeaseRefused, LeaseServiceError
from fenceproxy.fence.tokens import generate_key
from fenceproxy.server.app import FenceProxy
from fenceproxy.store import PostgresStore
from fenceproxy.testing import ProxyProcess, Received, RecordingUpstream, eventually
from fenceproxy.tls import ServerTLS, server_context, subject

from .certs import Certificates
from .conftest import ProxyFactory, fenced, refused_start, running
from .postgres import PostgresServer, required_postgres_bin
from .test_proxy import problem

ADMIN = generate_key()
FENCED = {"Fencing-Job": "invoice-1", "Fencing-Token": "1", "Content-Type": "application/json"}


@pytest.fixture
def certs(tmp_path: Path) -> Certificates:
    return Certificates(tmp_path / "tls")


def trusting(ca: Path, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
    """A client's context that trusts ``ca``, presenting ``cert`` when given."""
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert[0]), str(cert[1]))
    return context


def write_config(tmp_path: Path, upstream: str, **top: Any) -> Path:
    path = tmp_path / "proxy.yaml"
    route = {"name": "billing", "path": "/billing/", "upstream": upstream}
    data = {"store": f"sqlite:///{tmp_path / 'fences.db'}", "routes": [route], **top}
    path.write_text(yaml.safe_dump(data))
    return path


LISTENER = {"cert": "tls/server.pem", "key": "tls/server-key.pem"}
"""The listener's pair, relative to the config file's folder."""


def https(proxy: ProxyProcess) -> str:
    return proxy.url.replace("http://", "https://")


async def run(*argv: str) -> tuple[int, str]:
    """A command's exit code and what it printed, both streams."""
    if shutil.which(argv[0]) is None:
        if os.environ.get("CI"):
            pytest.fail(f"{argv[0]} is not installed, and CI must run every test")
        pytest.skip(f"{argv[0]} is not installed")
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    async with asyncio.timeout(20):
        out, _ = await process.communicate()
    return await process.wait(), out.decode()


async def exchange(
    port: int, context: ssl.SSLContext, request: bytes = b""
) -> tuple[ssl.SSLObject, bytes]:
    """One TLS connection to the proxy as ``localhost``: its TLS state, and the head
    of the answer to ``request`` (none when empty)."""
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="localhost"
    )
    try:
        tls = writer.get_extra_info("ssl_object")
        if not request:
            return tls, b""
        writer.write(request)
        return tls, await answer_head(reader)
    finally:
        writer.close()


async def answer_head(reader: asyncio.StreamReader) -> bytes:
    """An answer's head, its body read past (framed by Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            await reader.readexactly(int(value))
    return head


def fenced_request(job: str, generation: int) -> bytes:
    return (
        f"POST /billing/charges HTTP/1.1\r\nHost: localhost\r\nFencing-Job: {job}\r\n"
        f"Fencing-Token: {generation}\r\nContent-Length: 2\r\n\r\n{{}}"
    ).encode()


# -- the listener -------------------------------------------------------------------


async def test_the_listener_speaks_tls_to_curl_and_the_python_clients(
    tmp_path: Path, certs: Certificates, upstream: RecordingUpstream
) -> None:
    certs.server()
    config = write_config(tmp_path, upstream.url, tls=LISTENER, leases={})
    async with running(config) as proxy:
        code, out = await run(
            "curl", "-sS", "--cacert", str(certs.ca_file), "-o", "/dev/null",
            "-w", "%{http_code} %{scheme}", "-d", "{}",
            *(f"-H{name}: {value}" for name, value in FENCED.items()),
            f"{https(proxy)}/billing/charges",
        )  # fmt: skip
        assert (code, out) == (0, "200 HTTPS")
        assert f"fenceproxy on https://127.0.0.1:{proxy.port}," in proxy.output()
        (arrived,) = await upstream.wait_for(1)
        assert arrived.headers["X-Forwarded-Proto"] == "https"

        async with (
            httpx.AsyncClient(verify=trusting(certs.ca_file)) as http,
            LeaseClient(https(proxy), http=http) as leases,
        ):
            grant = await leases.claim("invoice-2", "worker-a")
            answer = await http.post(
                f"{https(proxy)}/billing/charges",
                json={},
                headers={"Fencing-Job": "invoice-2", "Fencing-Token": str(grant.generation)},
            )
            assert answer.status_code == 200
        assert [r.job for r in upstream.received] == ["invoice-1", "invoice-2"]

        # What it offers: TLS 1.2 or 1.3, and HTTP/1.1 whatever else the client asks for.
        offering = trusting(certs.ca_file)
        offering.set_alpn_protocols(["h2", "http/1.1"])
        tls, _ = await exchange(proxy.port, offering)
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
        assert tls.selected_alpn_protocol() == "http/1.1"


async def test_plain_http_and_tls_before_1_2_are_refused_at_a_tls_listener(
    tmp_path: Path, certs: Certificates, upstream: RecordingUpstream
) -> None:
    certs.server()
    async with running(write_config(tmp_path, upstream.url, tls=LISTENER)) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(fenced_request("invoice-1", 1))
        async with asyncio.timeout(10):
            answer = await reader.read()  # until the proxy closes it
        writer.close()
        assert not answer.startswith(b"HTTP/")

        old = trusting(certs.ca_file)  # a client that would speak TLS 1.1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # as it should be
            old.minimum_version = ssl.TLSVersion.MINIMUM_SUPPORTED
            old.maximum_version = ssl.TLSVersion.TLSv1_1
        old.set_ciphers("DEFAULT:@SECLEVEL=0")
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await exchange(proxy.port, old)
        _, head = await exchange(proxy.port, trusting(certs.ca_file), fenced_request("j", 1))
        assert head.startswith(b"HTTP/1.1 200 ")
    assert [r.job for r in upstream.received] == ["j"]


@pytest.mark.parametrize(
    ("hosts", "not_after", "why"),
    [
        (("other.test",), None, "no alternative certificate subject name matches"),
        (("localhost", "127.0.0.1"), datetime.datetime(2020, 1, 1), "certificate has expired"),
    ],
    ids=["wrong-name", "expired"],
)
async def test_clients_refuse_a_listener_certificate_for_another_name_or_expired(
    tmp_path: Path,
    certs: Certificates,
    upstream: RecordingUpstream,
    hosts: tuple[str, ...],
    not_after: datetime.datetime | None,
    why: str,
) -> None:
    certs.server(hosts=hosts, not_after=not_after)
    tls = {**LISTENER, "allow_expired": not_after is not None}  # served, as for a test
    async with running(write_config(tmp_path, upstream.url, tls=tls)) as proxy:
        code, out = await run(
            "curl", "-sS", "--cacert", str(certs.ca_file), "-d", "{}",
            *(f"-H{name}: {value}" for name, value in FENCED.items()),
            f"{https(proxy)}/billing/charges",
        )  # fmt: skip
        assert code == 60, out  # the peer's certificate cannot be authenticated
        assert why in out
        with pytest.raises(ssl.SSLCertVerificationError):
            await exchange(proxy.port, trusting(certs.ca_file))
    assert upstream.received == []


async def test_a_client_certificate_stands_for_a_lease_credential(
    tmp_path: Path, certs: Certificates, upstream: RecordingUpstream
) -> None:
    certs.server()
    worker_a, worker_b = certs.client("worker-a"), certs.client("worker-b")
    stranger = Certificates(tmp_path / "elsewhere").client("worker-a")
    config = write_config(
        tmp_path,
        upstream.url,
        tls={**LISTENER, "client_ca": "tls/ca.pem"},
        leases={"clients": [{"name": "worker-a", "subject": "CN=worker-a"}]},
    )
    async with running(config) as proxy:
        url = https(proxy)

        async def claim(cert: tuple[Path, Path] | None, job: str) -> Any:
            async with (
                httpx.AsyncClient(verify=trusting(certs.ca_file, cert)) as http,
                LeaseClient(url, http=http) as leases,
            ):
                return await leases.claim(job, None)

        grant = await claim(worker_a, "invoice-1")
        assert (grant.owner, grant.generation) == ("worker-a", 1)
        for cert in (worker_b, None):  # verified but not a credential; no certificate
            with pytest.raises(LeaseRefused) as refused:
                await claim(cert, "invoice-2")
            assert refused.value.status == 401
        with pytest.raises(LeaseServiceError):  # signed by a CA the proxy does not trust
            await claim(stranger, "invoice-2")
        # Writes need no certificate when one is optional.
        async with httpx.AsyncClient(verify=trusting(certs.ca_file)) as http:
            answer = await http.post(f"{url}/billing/charges", json={}, headers=FENCED)
            assert answer.status_code == 200


async def test_a_required_client_certificate_refuses_the_handshake_without_one(
    tmp_path: Path, certs: Certificates, upstream: RecordingUpstream
) -> None:
    certs.server()
    worker = certs.client("worker-a")
    tls = {**LISTENER, "client_ca": "tls/ca.pem", "client_cert": "required"}
    async with running(write_config(tmp_path, upstream.url, tls=tls)) as proxy:
        request = fenced_request("invoice-1", 1)
        with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
            await exchange(proxy.port, trusting(certs.ca_file), request)
        _, head = await exchange(proxy.port, trusting(certs.ca_file, worker), request)
        assert head.startswith(b"HTTP/1.1 200 ")
    assert len(upstream.received) == 1


async def test_sighup_loads_a_renewed_certificate_and_keeps_open_connections(
    tmp_path: Path, certs: Certificates, upstream: RecordingUpstream
) -> None:
    certs.server()
    context = trusting(certs.ca_file)
    async with running(write_config(tmp_path, upstream.url, tls=LISTENER)) as proxy:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", proxy.port, ssl=context, server_hostname="localhost"
        )
        first = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)

        async def ask(generation: int) -> bytes:
            writer.write(fenced_request("invoice-1", generation))
            return await answer_head(reader)

        assert (await ask(1)).startswith(b"HTTP/1.1 200 ")
        certs.server()  # renewed where it was
        assert proxy.process is not None
        proxy.signal(signal.SIGHUP)
        served: list[bytes] = []

        async def renewed() -> bool:
            tls, _ = await exchange(proxy.port, context)
            served.append(tls.getpeercert(binary_form=True))
            return served[-1] != first

        await eventually_async(renewed)
        assert (await ask(2)).startswith(b"HTTP/1.1 200 ")  # the open connection lives on
        writer.close()

        # A pair that cannot be loaded is refused, naming its key; the last one stays.
        (tmp_path / "tls" / "server-key.pem").write_text("not a key\n")
        proxy.signal(signal.SIGHUP)
        await eventually(lambda: "tls: cannot load the certificate" in proxy.output())
        tls, head = await exchange(proxy.port, context, fenced_request("invoice-1", 3))
        assert tls.getpeercert(binary_form=True) == served[-1]
        assert head.startswith(b"HTTP/1.1 200 ")
    assert [r.generation for r in upstream.received] == [1, 2, 3]


async def eventually_async(check: Any, within: float = 10.0) -> None:
    async with asyncio.timeout(within):
        while not await check():
            await asyncio.sleep(0.05)


# -- certificates near or past their end ---------------------------------------------


def days_from_now(days: float) -> datetime.datetime:
    """A certificate's date ``days`` from now, to the second (as X.509 keeps it)."""
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    return now + datetime.timedelta(days=days)


def iso(at: datetime.datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def lines_with(output: str, text: str) -> list[str]:
    return [line for line in output.splitlines() if text in line]


LEDGER = {
    "name": "ledger",
    "path": "/ledger/",
    "upstream": "https://127.0.0.1:9",
    "tls": {"cert": "tls/client.pem", "key": "tls/client-key.pem"},
}
"""A route presenting a client certificate to its upstream (never asked here)."""


@pytest.mark.parametrize(("key", "name"), [("tls", "proxy"), ("admin_tls", "admin")])
async def test_an_expired_listener_certificate_stops_the_start_naming_its_file_and_key(
    tmp_path: Path, certs: Certificates, upstream: RecordingUpstream, key: str, name: str
) -> None:
    """Every client refuses a certificate past its end (curl exits 60): the proxy does
    not start with one, and says which file under which key; ``allow_expired: true``
    (a test's) serves it, warned of."""
    end = days_from_now(-1)
    certs.server(not_after=end)
    cert = tmp_path / "tls" / "server.pem"
    config = write_config(tmp_path, upstream.url, **{key: LISTENER})
    said = await refused_start(config)
    assert said.startswith("fenceproxy exited 2: fenceproxy: config error\n")
    assert f"{config}: {key}: the certificate {cert} (O=trustme" in said
    assert f"expired on {iso(end)}: every client refuses it" in said

    allowed = {**LISTENER, "allow_expired": True}
    async with running(write_config(tmp_path, upstream.url, **{key: allowed})) as served:
        (line,) = lines_with(served.output(), f"the {name} listener's certificate")
        assert f"WARNING fenceproxy.server the {name} listener's certificate ({key}.cert) " in line
        assert f"{cert} (O=trustme" in line
        assert line.endswith(f"expired on {iso(end)}: whoever verifies it refuses it")


async def test_an_expired_certificate_is_refused_on_reload_and_the_last_one_kept(
    tmp_path: Path, certs: Certificates, upstream: RecordingUpstream
) -> None:
    """A renewal that put an expired certificate in place is refused in one line, and
    the proxy goes on presenting the one it had, as for a pair that does not load."""
    certs.server()
    context = trusting(certs.ca_file)
    async with running(write_config(tmp_path, upstream.url, tls=LISTENER)) as proxy:
        tls, _ = await exchange(proxy.port, context)
        first = tls.getpeercert(binary_form=True)
        end = days_from_now(-2)
        certs.server(not_after=end)
        proxy.signal(signal.SIGHUP)
        await eventually(lambda: "reload refused" in proxy.output())
        (line,) = lines_with(proxy.output(), "reload refused")
        assert f"tls: the certificate {tmp_path / 'tls' / 'server.pem'} (O=trustme" in line
        assert f"expired on {iso(end)}" in line
        tls, head = await exchange(proxy.port, context, fenced_request("invoice-1", 1))
        assert tls.getpeercert(binary_form=True) == first
        assert head.startswith(b"HTTP/1.1 200 ")


async def test_a_certificate_near_its_end_or_not_yet_valid_is_warned_of_at_start_and_on_reload(
    tmp_path: Path, certs: Certificates, upstream: RecordingUpstream
) -> None:
    """Clients will refuse a certificate once it ends, or before it begins: one line
    names each that ends within 14 days (a listener's, a route's client certificate)
    or is not valid yet, with its file, subject and date, when the proxy starts and
    when a reload loads it, while there is time to renew it."""
    ending, client_ending = days_from_now(5), days_from_now(10)
    certs.server(not_after=ending)
    certs.server("client", not_after=client_ending)
    billing = {"name": "billing", "path": "/billing/", "upstream": upstream.url}
    config = write_config(tmp_path, upstream.url, tls=LISTENER, routes=[billing, LEDGER])
    listener = "WARNING fenceproxy.server the proxy listener's certificate (tls.cert) "
    route = "WARNING fenceproxy.server the client certificate of route 'ledger' "
    async with running(config) as proxy:
        (line,) = lines_with(proxy.output(), listener)
        assert f"{tmp_path / 'tls' / 'server.pem'} (O=trustme" in line
        assert line.endswith(f"ends on {iso(ending)} (5 days left): renew it")
        (line,) = lines_with(proxy.output(), route)
        assert f"(routes[1].tls.cert) {tmp_path / 'tls' / 'client.pem'} (O=trustme" in line
        assert line.endswith(f"ends on {iso(client_ending)} (10 days left): renew it")

        begins = days_from_now(2)
        certs.server(not_before=begins, not_after=days_from_now(400))
        proxy.signal(signal.SIGHUP)
        await eventually(lambda: len(lines_with(proxy.output(), route)) == 2)
        *_, line = lines_with(proxy.output(), listener)
        assert line.endswith(
            f"is not valid before {iso(begins)}: whoever verifies it refuses it until then"
        )


async def test_each_certificates_end_is_a_metric_and_on_the_operator_page(
    tmp_path: Path, certs: Certificates, upstream: RecordingUpstream
) -> None:
    """An operator's alert and the operator page see when each certificate the proxy
    presents ends (the listeners', a route's client certificate), as loaded at start
    and again on a reload; the page flags one ending within 14 days."""
    ends = {"proxy": days_from_now(5), "admin": days_from_now(200), "ledger": days_from_now(30)}
    certs.server(not_after=ends["proxy"])
    certs.server("admin", not_after=ends["admin"])
    certs.server("client", not_after=ends["ledger"])
    billing = {"name": "billing", "path": "/billing/", "upstream": upstream.url}
    admin_tls = {"cert": "tls/admin.pem", "key": "tls/admin-key.pem"}
    config = write_config(
        tmp_path, upstream.url, tls=LISTENER, admin_tls=admin_tls, routes=[billing, LEDGER]
    )
    async with (
        running(config) as proxy,
        httpx.AsyncClient(verify=trusting(certs.ca_file)) as http,
    ):
        admin = proxy.admin_url.replace("http://", "https://")

        async def shown() -> tuple[dict[tuple[str, str], float], dict[str, tuple[str, str, bool]]]:
            metrics = (await http.get(f"{admin}/metrics")).text
            samples = {
                next(iter(sample.labels.items())): sample.value
                for family in text_string_to_metric_families(metrics)
                if family.name == "fenceproxy_tls_certificate_expiry_timestamp_seconds"
                for sample in family.samples
            }
            page = (await http.get(f"{admin}/")).text
            table = page.split('<tbody id="certificates">', 1)[1].split("</tbody>", 1)[0]
            rows = re.findall(
                r'<tr( class="ending")?><td>([^<]*)</td>(?:<td>[^<]*</td>){2}'
                r"<td>([^<]*)</td><td>(-?\d+)</td>",
                table,
            )
            return samples, {of: (end, days, bool(flag)) for flag, of, end, days in rows}

        assert await shown() == (
            {
                ("listener", "proxy"): ends["proxy"].timestamp(),
                ("listener", "admin"): ends["admin"].timestamp(),
                ("route", "ledger"): ends["ledger"].timestamp(),
            },
            {
                "listener proxy": (iso(ends["proxy"]), "5", True),
                "listener admin": (iso(ends["admin"]), "200", False),
                "route ledger": (iso(ends["ledger"]), "30", False),
            },
        )
        ends["proxy"] = days_from_now(90)  # renewed where it was, and reloaded
        certs.server(not_after=ends["proxy"])
        proxy.signal(signal.SIGHUP)
        await eventually(lambda: "reloaded" in proxy.output())
        samples, rows = await shown()
        assert samples[("listener", "proxy")] == ends["proxy"].timestamp()
        assert rows["listener proxy"] == (iso(ends["proxy"]), "90", False)


# -- the upstreams -----------------------------------------------------------------


@asynccontextmanager
async def tls_upstream(
    certs: Certificates, name: str = "upstream", **server: Any
) -> AsyncIterator[tuple[RecordingUpstream, list[tuple[int, dict[str, str]]]]]:
    """An upstream over TLS whose certificate ``certs`` signs (``hosts``,
    ``not_after``; ``client_ca`` to ask for a client certificate), and what it saw of
    each request's connection: the proxy's port and its certificate's subject."""
    client_ca = server.pop("client_ca", None)
    cert, key = certs.server(name, **server)
    context = server_context(  # whatever its dates: the proxy is what is tested
        ServerTLS(str(cert), str(key), client_ca and str(client_ca), client_ca is not None, True)
    )
    seen: list[tuple[int, dict[str, str]]] = []

    async def respond(request: web.Request, received: Received) -> web.StreamResponse:
        transport = request.transport
        assert transport is not None
        seen.append(
            (transport.get_extra_info("peername")[1], subject(transport.get_extra_info("peercert")))
        )
        return web.json_response({"ok": True})

    async with RecordingUpstream.serve(tls=context) as upstream:
        upstream.respond = respond
        yield upstream, seen


def route(upstream: RecordingUpstream, **tls: Any) -> list[dict[str, Any]]:
    spec = {"name": "billing", "path": "/billing/", "upstream": upstream.url}
    return [{**spec, "tls": tls} if tls else spec]


async def test_an_upstream_signed_by_a_private_ca_is_verified_and_its_connection_reused(
    start_proxy: ProxyFactory, certs: Certificates
) -> None:
    async with tls_upstream(certs) as (upstream, seen):
        proxy = await start_proxy(route(upstream, ca=str(certs.ca_file)))
        for generation in (1, 2):
            assert (await fenced(proxy, "invoice-1", generation)).status == 200
        assert len(upstream.received) == 2
        assert seen[0][0] == seen[1][0]  # one connection, kept alive
        assert seen[0][1] == {}  # no client certificate asked for, none sent


async def test_an_upstream_certificate_the_proxy_cannot_verify_is_a_502_naming_the_route(
    start_proxy: ProxyFactory, certs: Certificates
) -> None:
    async with tls_upstream(certs) as (upstream, _):
        proxy = await start_proxy(route(upstream))  # the system's CAs only
        body = await problem(await fenced(proxy, "invoice-1", 1), 502, "upstream-unreachable")
        assert body["detail"].startswith("route 'billing': the upstream's TLS certificate")
        assert "unable to get local issuer certificate" in body["detail"]
    assert upstream.received == []


async def test_a_routes_ca_is_the_only_one_its_upstream_may_chain_to(
    start_proxy: ProxyFactory,
    certs: Certificates,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a CA of its own, a route does not trust the system's beside it: a
    certificate from a CA the system trusts cannot stand in for the private one."""
    monkeypatch.setenv("SSL_CERT_FILE", str(certs.ca_file))  # the system trusts it
    private = Certificates(tmp_path / "private")
    async with tls_upstream(certs) as (upstream, _):
        own = {"name": "ledger", "path": "/ledger/", "upstream": upstream.url}
        proxy = await start_proxy([*route(upstream), {**own, "tls": {"ca": str(private.ca_file)}}])
        assert (await fenced(proxy, "invoice-1", 1)).status == 200  # the system's CAs
        answer = await fenced(proxy, "invoice-2", 1, path="/ledger/charges")
        body = await problem(answer, 502, "upstream-unreachable")
        assert "unable to get local issuer certificate" in body["detail"]
    assert len(upstream.received) == 1


@pytest.mark.parametrize(
    ("server", "tls", "why"),
    [
        ({"hosts": ("api.internal",)}, {}, "IP address mismatch"),
        ({"hosts": ("api.internal",)}, {"server_name": "other.internal"}, "Hostname mismatch"),
        ({"not_after": datetime.datetime(2020, 1, 1)}, {}, "certificate has expired"),
    ],
    ids=["wrong-name", "wrong-server-name", "expired"],
)
async def test_an_upstream_certificate_for_another_name_or_expired_is_refused(
    start_proxy: ProxyFactory,
    certs: Certificates,
    server: dict[str, Any],
    tls: dict[str, str],
    why: str,
) -> None:
    async with tls_upstream(certs, **server) as (upstream, _):
        proxy = await start_proxy(route(upstream, ca=str(certs.ca_file), **tls))
        body = await problem(await fenced(proxy, "invoice-1", 1), 502, "upstream-unreachable")
        assert body["detail"].startswith("route 'billing': the upstream's TLS certificate")
        assert why in body["detail"]
    assert upstream.received == []


async def test_server_name_is_what_the_proxy_sends_and_verifies(
    start_proxy: ProxyFactory, certs: Certificates
) -> None:
    async with tls_upstream(certs, hosts=("api.internal",)) as (upstream, _):
        spec = route(upstream, ca=str(certs.ca_file), server_name="api.internal")
        proxy = await start_proxy(spec)
        assert (await fenced(proxy, "invoice-1", 1)).status == 200
    assert len(upstream.received) == 1


async def test_an_upstream_that_asks_for_a_client_certificate_gets_the_routes(
    start_proxy: ProxyFactory, certs: Certificates
) -> None:
    cert, key = certs.client("fenceproxy")
    async with tls_upstream(certs, client_ca=certs.ca_file) as (upstream, seen):
        # Under TLS 1.3 the upstream refuses a missing certificate after the handshake,
        # once the request is sent: a write the proxy cannot tell was not applied.
        bare = await start_proxy(route(upstream, ca=str(certs.ca_file)))
        await problem(await fenced(bare, "invoice-1", 1), 502, "upstream-failed")
        assert upstream.received == []
        await bare.close()  # its store, for the next
        mutual = await start_proxy(
            route(upstream, ca=str(certs.ca_file), cert=str(cert), key=str(key))
        )
        assert (await fenced(mutual, "invoice-2", 1)).status == 200
    assert [who["CN"] for _, who in seen] == ["fenceproxy"]


async def test_verify_false_speaks_to_any_certificate_and_warns_at_start(
    tmp_path: Path, certs: Certificates
) -> None:
    unknown = Certificates(tmp_path / "unknown")
    async with tls_upstream(unknown) as (upstream, _):
        config = write_config(tmp_path, upstream.url)
        data = yaml.safe_load(config.read_text())
        data["routes"][0]["tls"] = {"verify": False}
        config.write_text(yaml.safe_dump(data))
        async with running(config) as proxy, aiohttp.ClientSession() as http:
            assert "route 'billing' does not verify its upstream's TLS certificate" in (
                proxy.output()
            )
            answer = await http.post(f"{proxy.url}/billing/charges", json={}, headers=FENCED)
            assert answer.status == 200
    assert len(upstream.received) == 1


def test_route_tls_settings_are_checked_when_the_config_is_read(tmp_path: Path) -> None:
    def refused(tls: Any, upstream: str = "https://api.internal") -> str:
        routes = [{"name": "b", "path": "/b/", "upstream": upstream, "tls": tls}]
        path = tmp_path / "proxy.yaml"
        path.write_text(yaml.safe_dump({"routes": routes}))
        with pytest.raises(ConfigError) as error:
            load_config(path)
        return str(error.value)

    assert "routes[0]: tls is for an https:// upstream" in refused(
        {"verify": False}, "http://api.internal"
    )
    assert "routes[0].tls: give cert and key together" in refused({"cert": "c.pem"})
    message = refused({"ca": "missing.pem"})
    assert f"routes[0].tls: cannot load the CA certificates {tmp_path / 'missing.pem'}" in message


# -- PostgreSQL --------------------------------------------------------------------


@pytest.fixture(scope="module")
def postgres_tls() -> Iterator[tuple[PostgresServer, Certificates]]:
    """A PostgreSQL cluster with ``ssl = on`` that takes only TLS connections proving
    their user with a client certificate (``hostssl ... cert``), and its CA."""
    bin_dir = required_postgres_bin()
    directory = Path(tempfile.mkdtemp(prefix="fenceproxy-postgres-tls-"))
    server = PostgresServer(directory, bin_dir).init()
    certs = Certificates(directory / "certs")
    cert, key = certs.server("postgres")
    for path in (cert, key):  # PostgreSQL reads its key only when the key is its own
        shutil.copy(path, server.data / path.name)
        if os.geteuid() == 0:
            shutil.chown(server.data / path.name, "postgres")
    with open(server.data / "postgresql.conf", "a") as conf:
        conf.write(
            "ssl = on\nssl_cert_file = 'postgres.pem'\nssl_key_file = 'postgres-key.pem'\n"
            f"ssl_ca_file = '{certs.ca_file}'\n"
        )
    (server.data / "pg_hba.conf").write_text(
        "local all all trust\nhostssl all all 127.0.0.1/32 cert\n"
    )
    server.start()
    try:
        yield server, certs
    finally:
        server.stop("immediate")
        shutil.rmtree(directory, ignore_errors=True)


async def test_postgresql_over_tls_with_verify_full_and_a_client_certificate(
    tmp_path: Path,
    postgres_tls: tuple[PostgresServer, Certificates],
    upstream: RecordingUpstream,
) -> None:
    server, certs = postgres_tls
    folder = tmp_path / "pg"  # the config's own copies, named relative to it
    folder.mkdir()
    shutil.copy(certs.ca_file, folder / "ca.pem")
    for path in certs.client(server.user):
        shutil.copy(path, folder / path.name)
        (folder / path.name).chmod(0o600)
    query = (
        "sslmode=verify-full&sslrootcert=pg/ca.pem&sslcert=pg/fenceproxy.pem"
        "&sslkey=pg/fenceproxy-key.pem"
    )
    config = write_config(tmp_path, upstream.url, store=f"{server.url()}?{query}")
    await PostgresStore.migrate(load_config(config).store)
    async with running(config) as proxy, aiohttp.ClientSession() as http:
        newer = {**FENCED, "Fencing-Token": "2"}
        answer = await http.post(f"{proxy.url}/billing/charges", json={}, headers=newer)
        assert answer.status == 200
        stale = await http.post(f"{proxy.url}/billing/charges", json={}, headers=FENCED)
        assert stale.status == 409  # the fence, kept in PostgreSQL over TLS
    assert len(upstream.received) == 1


@pytest.mark.parametrize(
    ("query", "why"),
    [
        ("sslmode=verify-full&sslrootcert=pg/other-ca.pem", "certificate verify failed"),
        ("sslmode=disable", "no pg_hba.conf entry"),
        ("sslmode=sometimes", "sslmode"),
    ],
    ids=["another-ca", "in-clear", "unknown-mode"],
)
async def test_postgresql_that_cannot_be_verified_or_reached_in_clear_stops_the_start(
    tmp_path: Path,
    postgres_tls: tuple[PostgresServer, Certificates],
    upstream: RecordingUpstream,
    query: str,
    why: str,
) -> None:
    server, _ = postgres_tls
    (tmp_path / "pg").mkdir()
    shutil.copy(Certificates(tmp_path / "other").ca_file, tmp_path / "pg" / "other-ca.pem")
    config = write_config(tmp_path, upstream.url, store=f"{server.url()}?{query}")
    assert why in await refused_start(config)


# -- what is refused before anything is served ---------------------------------------


ROUTES = [{"name": "b", "path": "/b/", "upstream": "http://127.0.0.1:9"}]
SECRETS = {"clients": [{"name": "ops", "env": "FP_OPS"}]}
SIGNING = {"keys": [{"id": "k1", "env": "FP_KEY"}]}
COLLECTOR = {"endpoint": "http://127.0.0.1:4318", "headers": {"Authorization": {"env": "FP_OTLP"}}}


@pytest.mark.parametrize(
    ("top", "key"),
    [
        ({"listen": "0.0.0.0:8080", "leases": SECRETS}, "tls"),
        ({"listen": "10.0.0.5:8080", "signing": SIGNING}, "tls"),
        (
            {"admin": "0.0.0.0:9901", "admin_clients": [{"name": "ops", "env": "FP_OPS"}]},
            "admin_tls",
        ),
        ({"leases": {"clients": [{"name": "a", "subject": "CN=a"}]}}, "tls.client_ca"),
        ({"tracing": {**COLLECTOR, "endpoint": "http://10.0.0.7:4318"}}, "tracing.endpoint"),
    ],
    ids=["lease-secrets", "signed-tokens", "admin-secrets", "subject-without-ca", "collector"],
)
def test_credentials_in_clear_beyond_loopback_are_refused(top: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({"routes": ROUTES, **top}, "f.yaml")
    assert f"f.yaml: {key}: " in str(refused.value)
    if key != "tls.client_ca":  # a network the operator trusts, said in so many words
        parse_config({"routes": ROUTES, **top, "allow_plaintext": True}, "f.yaml")
        on_loopback = {k: v for k, v in top.items() if k not in ("listen", "admin")}
        if "tracing" in top:  # or over TLS
            on_loopback["tracing"] = COLLECTOR
            https = {**COLLECTOR, "endpoint": "https://10.0.0.7:4318"}
            parse_config({"routes": ROUTES, "tracing": https}, "f.yaml")
        parse_config({"routes": ROUTES, **on_loopback}, "f.yaml")


def test_listener_files_that_cannot_be_loaded_are_config_errors_naming_them(
    tmp_path: Path, certs: Certificates
) -> None:
    certs.server()
    certs.server("other")
    path = tmp_path / "proxy.yaml"
    cases = [
        ({"tls": {"cert": "tls/missing.pem", "key": "tls/server-key.pem"}}, "tls",
         f"cannot load the certificate {tmp_path / 'tls/missing.pem'}"),
        ({"tls": {"cert": "tls/server.pem", "key": "tls/other-key.pem"}}, "tls",
         "KEY_VALUES_MISMATCH"),
        ({"admin_tls": {**LISTENER, "client_ca": "tls/server-key.pem"}}, "admin_tls",
         "cannot load the CA certificates"),
        ({"tls": {**LISTENER, "client_cert": "required"}}, "tls",
         "client_cert: required needs client_ca"),
    ]  # fmt: skip
    for top, key, message in cases:
        path.write_text(yaml.safe_dump({"routes": ROUTES, **top}))
        with pytest.raises(ConfigError) as refused:
            load_config(path)
        assert f"{path}: {key}" in str(refused.value)
        assert message in str(refused.value)


@pytest.mark.parametrize(
    ("clients", "key", "message"),
    [
        ([{"name": "a", "subject": "CN=a, Role=admin"}], "leases.clients[0].subject",
         "Role is not one of C, CN, emailAddress, L, O, OU, serialNumber, ST"),
        ([{"name": "a", "subject": "CN=a"}, {"name": "b", "env": "FP_UNSET_SECRET"}],
         "leases.clients[1].env", "not set"),
    ],
    ids=["unknown-attribute", "bearer-after-subject"],
)  # fmt: skip
def test_lease_clients_by_subject_are_checked_and_named_at_their_place(
    tmp_path: Path,
    certs: Certificates,
    monkeypatch: pytest.MonkeyPatch,
    clients: list[dict[str, str]],
    key: str,
    message: str,
) -> None:
    certs.server()
    monkeypatch.delenv("FP_UNSET_SECRET", raising=False)
    tls = {**LISTENER, "client_ca": "tls/ca.pem"}
    path = write_config(tmp_path, "http://127.0.0.1:9", tls=tls, leases={"clients": clients})
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert f"{path}: {key}: " in str(refused.value)
    assert message in str(refused.value)


# -- the admin listener ------------------------------------------------------------


@pytest.mark.parametrize("probes", ["open", "closed"])
@pytest.mark.parametrize("workers", [1, 2])
async def test_the_admin_listener_takes_its_credentials_over_tls(
    tmp_path: Path,
    certs: Certificates,
    upstream: RecordingUpstream,
    monkeypatch: pytest.MonkeyPatch,
    database: str,
    probes: str,
    workers: int,
) -> None:
    certs.server()
    monkeypatch.setenv("FP_ADMIN", ADMIN)
    config = write_config(
        tmp_path,
        upstream.url,
        store=database,  # which workers share; the supervisor serves their admin listener
        admin_tls=LISTENER,
        admin_clients=[{"name": "ops", "env": "FP_ADMIN"}],
        admin_probes=probes,
        workers=workers,
    )
    async with running(config) as proxy:
        admin = proxy.admin_url.replace("http://", "https://")
        async with httpx.AsyncClient(verify=trusting(certs.ca_file)) as http:
            metrics = await http.get(f"{admin}/metrics")
            assert metrics.status_code == 401
            assert metrics.headers["Content-Type"].startswith("application/problem+json")
            assert metrics.headers["WWW-Authenticate"].startswith("Bearer")
            assert metrics.json()["type"] == PROBLEM_BASE + "admin-unauthenticated"
            wrong = await http.get(f"{admin}/metrics", headers={"Authorization": "Bearer x"})
            assert wrong.status_code == 401
            granted = {"Authorization": f"Bearer {ADMIN}"}
            assert (await http.get(f"{admin}/metrics", headers=granted)).status_code == 200
            probe = await http.get(f"{admin}/readyz")
            assert probe.status_code == (200 if probes == "open" else 401)
            assert (await http.get(f"{admin}/readyz", headers=granted)).status_code == 200


def test_the_listeners_serve_with_contexts_hardened_as_the_threat_model_says(
    tmp_path: Path, certs: Certificates
) -> None:
    """The contexts the proxy's listener and the admin listener serve with: TLS 1.2
    at least, renegotiation refused, no compression, the server's cipher order, and
    every option the standard library sets on a server's context kept."""
    certs.server()
    config = load_config(
        write_config(tmp_path, "http://127.0.0.1:9", tls=LISTENER, admin_tls=LISTENER)
    )
    tls = FenceProxy(config).tls
    hardened = ssl.OP_NO_RENEGOTIATION | ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
    expected = hardened | ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).options
    for context in (tls.listener, tls.admin):
        assert context is not None
        assert context.minimum_version == ssl.TLSVersion.TLSv1_2
        assert context.options & expected == expected
