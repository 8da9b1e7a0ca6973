"""The authenticated lease API against a real proxy on both stores: without a known
bearer credential every call is 401 and changes nothing; a credential limited to a
job-id prefix gets 403 outside it; the credential's name is the lease's owner, so a
client cannot renew, complete or release a lease taken under another credential;
the Python client and the CLI carry the credential. Then the config's side: secrets
come from the environment or files, and a proxy whose open lease API listens beyond
loopback says so at start."""

from __future__ import annotations

import asyncio
import hmac
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient

from fenceproxy import cli
from fenceproxy.client import LeaseClient
from fenceproxy.config import lease_credentials, load_config
from fenceproxy.errors import ConfigError, LeaseRefused, LeaseUnauthenticated
from fenceproxy.fence.tokens import generate_key
from fenceproxy.leases.auth import LeaseCredentials
from fenceproxy.testing import ProxyProcess, RecordingUpstream, free_port

from .conftest import ProxyFactory, fenced, store_of
from .test_proxy import problem

Client = TestClient[Any, Any]

BILLING, OPS = generate_key(), generate_key()


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """Two credentials: billing (jobs starting with ``invoice-``) from the environment,
    ops (every job) from a file."""
    monkeypatch.setenv("FP_LEASES_BILLING", BILLING)
    (tmp_path / "ops.secret").write_text(OPS + "\n")
    return {
        "clients": [
            {"name": "billing", "env": "FP_LEASES_BILLING", "job_prefix": "invoice-"},
            {"name": "ops", "file": str(tmp_path / "ops.secret")},
        ]
    }


@pytest.fixture
async def proxy(start_proxy: ProxyFactory, secrets: dict[str, Any]) -> Client:
    return await start_proxy(leases=secrets)


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def call(
    client: Client, job: str, action: str | None, secret: str | None, **body: Any
) -> Any:
    headers = {} if secret is None else bearer(secret)
    if action is None:
        return await client.get(f"/_leases/{job}", headers=headers)
    return await client.post(f"/_leases/{job}/{action}", json=body, headers=headers)


async def granted(client: Client, job: str, secret: str, **body: Any) -> dict[str, Any]:
    response = await call(client, job, "claim", secret, **body)
    assert response.status == 200, await response.text()
    answer: dict[str, Any] = await response.json()
    return answer


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param({}, id="none"),
        pytest.param(bearer(generate_key()), id="unknown-secret"),
        pytest.param(bearer(BILLING[:-1]), id="truncated"),
        pytest.param({"Authorization": f"Basic {BILLING}"}, id="not-bearer"),
        pytest.param({"Authorization": "Bearer"}, id="empty"),
        pytest.param({"Authorization": f"Bearer {BILLING}, Bearer {OPS}"}, id="two"),
    ],
)
async def test_a_call_without_a_known_credential_is_401_and_changes_nothing(
    proxy: Client, headers: dict[str, str]
) -> None:
    lease = await granted(proxy, "invoice-1", BILLING, owner="w1")
    attempts = [
        ("post", "/_leases/invoice-9/claim", {"owner": "w1"}),
        ("post", "/_leases/invoice-1/renew", {"owner": "w1", "generation": 1}),
        ("post", "/_leases/invoice-1/release", {"owner": "w1", "generation": 1}),
        ("post", "/_leases/invoice-1/complete", {"owner": "w1", "generation": 1}),
        ("get", "/_leases/invoice-1", None),
        ("get", "/_leases/invoice-1/no-such-endpoint", None),
    ]
    for method, path, body in attempts:
        response = await proxy.request(method, path, json=body, headers=headers)
        await problem(response, 401, "lease-unauthenticated")
        assert response.headers["WWW-Authenticate"].startswith("Bearer ")
    store = store_of(proxy)
    assert (await store.lease("invoice-9"))[0] is None
    after, _ = await store.lease("invoice-1")
    assert after is not None
    assert (after.owner, after.generation, after.state.value) == (lease["owner"], 1, "held")


async def test_a_credential_limited_to_a_prefix_is_403_outside_it(proxy: Client) -> None:
    for action in ("claim", None):
        await problem(await call(proxy, "payroll-1", action, BILLING), 403, "lease-out-of-scope")
    assert (await store_of(proxy).lease("payroll-1"))[0] is None
    assert (await granted(proxy, "payroll-1", OPS))["owner"] == "ops"  # ops covers every job


async def test_the_credential_is_the_owner_and_no_other_can_act_on_its_lease(
    proxy: Client,
) -> None:
    lease = await granted(proxy, "invoice-2", OPS, owner="w1")
    assert lease["owner"] == "ops/w1"
    generation = lease["generation"]
    # Billing covers the job, but did not take this lease: under no owner name can it
    # renew, complete or release it.
    for owner in ("w1", "ops/w1", None):
        holder = {"generation": generation} | ({} if owner is None else {"owner": owner})
        for action in ("renew", "complete", "release"):
            await problem(
                await call(proxy, "invoice-2", action, BILLING, **holder), 409, "lease-mismatch"
            )
    await problem(await call(proxy, "invoice-2", "claim", BILLING), 409, "lease-held")
    still, _ = await store_of(proxy).lease("invoice-2")
    assert still is not None
    assert (still.owner, still.state.value) == ("ops/w1", "held")
    # Its holder, under its own credential, can.
    done = await call(proxy, "invoice-2", "complete", OPS, owner="w1", generation=generation)
    assert done.status == 200, await done.text()
    assert (await done.json())["state"] == "completed"


async def test_without_an_owner_the_credential_alone_owns_the_lease(proxy: Client) -> None:
    lease = await granted(proxy, "invoice-3", BILLING)
    assert lease["owner"] == "billing"
    renewed = await call(proxy, "invoice-3", "renew", BILLING, generation=lease["generation"])
    assert renewed.status == 200, await renewed.text()


async def test_an_open_lease_api_still_needs_an_owner(start_proxy: ProxyFactory) -> None:
    proxy = await start_proxy(leases={})
    body = await problem(await call(proxy, "j", "claim", None), 422, "lease-request-invalid")
    assert body["errors"] == [{"field": "owner", "message": "Field required"}]


async def test_the_python_client_carries_its_credential(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    url = str(proxy.make_url(""))
    async with (
        LeaseClient(url, token=BILLING) as leases,
        leases.hold("invoice-4", owner="worker-a", ttl=30) as lease,
    ):
        assert (await fenced(proxy, "invoice-4", lease.token)).status == 200
        await lease.complete()
    shown, _ = await store_of(proxy).lease("invoice-4")
    assert shown is not None
    assert (shown.owner, shown.state.value) == ("billing/worker-a", "completed")
    async with LeaseClient(url) as anonymous:
        with pytest.raises(LeaseRefused) as refused:
            await anonymous.claim("invoice-5", "worker-a")
    assert refused.value.status == 401
    assert len(upstream.received) == 1


async def test_the_cli_reads_its_credential_from_the_environment_or_a_file(
    proxy: Client,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = str(proxy.make_url("")).rstrip("/")
    monkeypatch.delenv("FENCEPROXY_LEASE_TOKEN", raising=False)
    argv = ["lease", "claim", "invoice-6", "--url", url]
    assert await asyncio.to_thread(cli.main, [*argv, "--owner", "w1"]) == 1
    assert "lease-unauthenticated" in capsys.readouterr().out
    monkeypatch.setenv("FENCEPROXY_LEASE_TOKEN", BILLING)
    assert await asyncio.to_thread(cli.main, argv) == 0
    assert '"owner": "billing"' in capsys.readouterr().out
    monkeypatch.delenv("FENCEPROXY_LEASE_TOKEN")
    (tmp_path / "token").write_text(OPS)
    show = ["lease", "show", "invoice-6", "--url", url, "--token-file", str(tmp_path / "token")]
    assert await asyncio.to_thread(cli.main, show) == 0
    assert '"generation": 1' in capsys.readouterr().out


def write_config(tmp_path: Path, leases: dict[str, Any], **top: Any) -> Path:
    path = tmp_path / "proxy.yaml"
    route = {"name": "b", "path": "/b/", "upstream": "http://127.0.0.1:9"}
    path.write_text(yaml.safe_dump({"routes": [route], "leases": leases, **top}))
    return path


@pytest.mark.parametrize(
    ("client", "env", "key", "message"),
    [
        ({"name": "a", "env": "FP_UNSET_SECRET"}, {}, "leases.clients[0].env", "not set"),
        ({"name": "a", "env": "FP_S"}, {"FP_S": "short"}, "leases.clients[0].env", "32 to 1024"),
        ({"name": "a", "file": "missing.secret"}, {}, "leases.clients[0].file", "cannot read"),
        ({"name": "a", "env": "FP_S", "file": "x"}, {}, "leases.clients[0]", "exactly one"),
        ({"name": "a b", "env": "FP_S"}, {}, "leases.clients[0].name", "pattern"),
        ({"name": "a", "secret": BILLING}, {}, "leases.clients[0].secret", "unknown key"),
    ],
)
def test_a_credential_that_cannot_be_read_is_a_config_error_naming_its_key(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    client: dict[str, str],
    env: dict[str, str],
    key: str,
    message: str,
) -> None:
    monkeypatch.delenv("FP_UNSET_SECRET", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    path = write_config(tmp_path, {"clients": [client]})
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert f"{path}: {key}: " in str(caught.value)
    assert message in str(caught.value)
    assert BILLING not in str(caught.value)


@pytest.mark.parametrize(
    "secret",
    [
        pytest.param("s" * 31, id="31-characters"),
        pytest.param("s" * 1025, id="1025-characters"),
        pytest.param(BILLING[:20] + " " + BILLING[20:], id="space"),
        pytest.param(BILLING[:20] + "%" + BILLING[20:], id="percent"),
        pytest.param(BILLING[:20] + ";" + BILLING[20:], id="semicolon"),
        pytest.param(BILLING[:20] + "\\" + BILLING[20:], id="backslash"),
    ],
)
def test_a_secret_outside_its_length_or_alphabet_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, secret: str
) -> None:
    monkeypatch.setenv("FP_S", secret)
    path = write_config(tmp_path, {"clients": [{"name": "a", "env": "FP_S"}]})
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert f"{path}: leases.clients[0].env: " in str(caught.value)
    assert "32 to 1024" in str(caught.value)
    assert secret not in str(caught.value)


@pytest.mark.parametrize("length", [32, 1024])
def test_a_secret_of_32_to_1024_characters_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, length: int
) -> None:
    secret = ("Ab0._~+/-" * 114)[:length]
    monkeypatch.setenv("FP_S", secret)
    path = write_config(tmp_path, {"clients": [{"name": "a", "env": "FP_S"}]})
    credentials = lease_credentials(load_config(path).leases, str(path))
    assert credentials is not None
    assert credentials.authenticate(f"Bearer {secret}").name == "a"


def test_a_bearer_followed_by_spaces_is_its_caller() -> None:
    credentials = LeaseCredentials([("a", BILLING, None)])
    assert credentials.authenticate(f"Bearer {BILLING} ").name == "a"
    assert credentials.authenticate(f"Bearer {BILLING}   ").name == "a"


def test_a_bearer_beyond_ascii_is_unauthenticated() -> None:
    """The Kelvin sign folds to k under Unicode case rules: it must not pass as a
    secret's letter and then fail to encode (a 500)."""
    credentials = LeaseCredentials([("a", BILLING, None)])
    for presented in ("\u212a" * 40, BILLING[:-1] + "\u212a", BILLING + "\u00e9"):
        with pytest.raises(LeaseUnauthenticated):
            credentials.authenticate(f"Bearer {presented}")


async def test_a_bearer_beyond_ascii_is_401_from_the_lease_api(proxy: Client) -> None:
    for presented in ("\u212a" * 40, BILLING[:-1] + "\u212a"):
        headers = {"Authorization": f"Bearer {presented}"}
        response = await proxy.post("/_leases/invoice-1/claim", json={}, headers=headers)
        await problem(response, 401, "lease-unauthenticated")
    assert (await store_of(proxy).lease("invoice-1"))[0] is None


def test_two_credentials_with_one_secret_or_one_name_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FP_S", BILLING)
    same_secret = [{"name": "a", "env": "FP_S"}, {"name": "b", "env": "FP_S"}]
    with pytest.raises(ConfigError, match="same secret"):
        load_config(write_config(tmp_path, {"clients": same_secret}))
    same_name = [{"name": "a", "env": "FP_S"}, {"name": "a", "file": "x"}]
    with pytest.raises(ConfigError, match="same name"):
        load_config(write_config(tmp_path, {"clients": same_name}))


def test_every_secret_is_compared_in_constant_time_whichever_matches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first credential matching does not end the search early, and each is
    compared with ``hmac.compare_digest``: the time taken does not tell which
    credential, if any, a secret is close to."""
    credentials = LeaseCredentials([("a", BILLING, None), ("b", OPS, "x-")])
    compared: list[bytes] = []
    original = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append(a)
        return original(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    assert credentials.authenticate(f"Bearer {BILLING}").name == "a"
    assert credentials.authenticate(f"bearer  {OPS}").job_prefix == "x-"
    assert len(compared) == 4


@pytest.mark.parametrize(
    ("listen", "clients", "warned"),
    [("0.0.0.0", False, True), ("127.0.0.1", False, False), ("0.0.0.0", True, False)],
)
async def test_an_open_lease_api_beyond_loopback_is_warned_of_at_start(
    tmp_path: Path, listen: str, clients: bool, warned: bool
) -> None:
    leases: dict[str, Any] = {}
    env = {}
    top = {}
    if clients:
        leases["clients"] = [{"name": "a", "env": "FP_S"}]
        env["FP_S"] = BILLING
        top["allow_plaintext"] = True  # else refused: tests/test_tls.py
    config = write_config(tmp_path, leases, **top)
    port = free_port()
    proxy = ProxyProcess(config, port, "--listen", f"{listen}:{port}", env=env)
    try:
        await proxy.start()
        output = proxy.output()
    finally:
        await proxy.stop()
    assert ("takes no credentials" in output) is warned, output
