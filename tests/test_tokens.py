"""Signed fencing tokens against a real proxy on both stores: the lease API hands out
tokens bound to their job; a route that requires signatures refuses a missing
signature, a tampered, unknown-key or other job's token with 403, forwards nothing
of it, and never lets it raise the job's generation; keys rotate with old and new
verifying at once; keys come from the environment or files, never from the config.
Then the token format on its own."""

from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient

from fenceproxy import cli
from fenceproxy.config import load_config, parse_config, signing_keys
from fenceproxy.errors import ConfigError, TokenRejected
from fenceproxy.fence.fencing import GENERATION_MAX
from fenceproxy.fence.tokens import SigningKeys, decode_key, generate_key, read_token
from fenceproxy.testing import RecordingUpstream

from .conftest import ProxyFactory, fenced, store_of
from .test_proxy import problem

Client = TestClient[Any, Any]

OLD, NEW = generate_key(), generate_key()


@pytest.fixture(autouse=True)
def keys_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FP_KEY_NEW", NEW)
    monkeypatch.setenv("FP_KEY_OLD", OLD)


SIGNING = {"keys": [{"id": "new", "env": "FP_KEY_NEW"}, {"id": "old", "env": "FP_KEY_OLD"}]}


def routes(upstream: RecordingUpstream) -> list[dict[str, Any]]:
    return [
        {"name": "signed", "path": "/billing/", "upstream": upstream.url,
         "fence": {"tokens": "signed"}},
        {"name": "any", "path": "/ledger/", "upstream": upstream.url},
    ]  # fmt: skip


@pytest.fixture
async def proxy(start_proxy: ProxyFactory, upstream: RecordingUpstream) -> Client:
    return await start_proxy(routes(upstream), leases={}, signing=SIGNING)


async def claim(client: Client, job: str, owner: str = "w1") -> dict[str, Any]:
    response = await client.post(f"/_leases/{job}/claim", json={"owner": owner, "ttl": 30})
    assert response.status == 200, await response.text()
    body: dict[str, Any] = await response.json()
    return body


async def test_a_claimed_token_is_signed_for_its_job_and_forwarded(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    lease = await claim(proxy, "invoice-1")
    assert lease["token"].startswith(f"v1.new.{lease['generation']}.")
    response = await fenced(proxy, "invoice-1", lease["token"])
    assert response.status == 200, await response.text()
    (received,) = upstream.received
    assert received.headers["Fencing-Token"] == lease["token"]  # passed on unchanged


async def test_a_signed_token_goes_to_its_holder_only(proxy: Client) -> None:
    """Claim and renew hand the token out; looking the job up does not, or anyone
    who can read a lease could write as its holder."""
    lease = await claim(proxy, "invoice-3")
    shown = await proxy.get("/_leases/invoice-3")
    assert shown.status == 200
    body = await shown.json()
    assert body["generation"] == lease["generation"]
    assert "token" not in body
    renewed = await proxy.post(
        "/_leases/invoice-3/renew", json={"owner": "w1", "generation": lease["generation"]}
    )
    assert (await renewed.json())["token"] == lease["token"]


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(lambda token, job: "999", id="plain-integer"),
        pytest.param(lambda token, job: token[:-2] + ("AA" if token[-2:] != "AA" else "BB"),
                     id="tampered-signature"),
        pytest.param(lambda token, job: token.replace(".1.", ".999.", 1), id="raised-generation"),
        pytest.param(lambda token, job: SigningKeys({"x": decode_key(generate_key())}, "x")
                     .sign(job, 999), id="unknown-key"),
        pytest.param(lambda token, job: SigningKeys({"new": decode_key(generate_key())}, "new")
                     .sign(job, 999), id="known-id-other-secret"),
        pytest.param(lambda token, job: SigningKeys({"new": decode_key(NEW)}, "new")
                     .sign("another-job", 999), id="other-job"),
        pytest.param(lambda token, job: "v1.new.999", id="malformed"),
    ],
)  # fmt: skip
async def test_a_forged_token_is_refused_never_forwarded_and_never_raises_the_fence(
    proxy: Client, upstream: RecordingUpstream, forge: Any
) -> None:
    lease = await claim(proxy, "invoice-2")
    assert lease["generation"] == 1
    forged = forge(lease["token"], "invoice-2")
    for path in ("/billing/charges", "/ledger/entries"):
        if path.startswith("/ledger") and not forged.startswith("v1."):
            continue  # a plain integer is a plain token on a route that takes any
        body = await problem(await fenced(proxy, "invoice-2", forged, path=path), 403,
                             "token-rejected")  # fmt: skip
        assert forged not in body["detail"]
    assert upstream.received == []
    assert await store_of(proxy).generation("invoice-2") == 1
    # The honest holder is not locked out, and the next claim is the next generation.
    assert (await fenced(proxy, "invoice-2", lease["token"])).status == 200
    await proxy.post("/_leases/invoice-2/release", json={"owner": "w1", "generation": 1})
    assert (await claim(proxy, "invoice-2", owner="w2"))["generation"] == 2


async def test_a_route_that_takes_any_token_still_takes_plain_integers(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    assert (await fenced(proxy, "job-a", 5, path="/ledger/entries")).status == 200
    signed = SigningKeys({"old": decode_key(OLD)}, "old").sign("job-a", 6)
    assert (await fenced(proxy, "job-a", signed, path="/ledger/entries")).status == 200
    assert [r.generation for r in upstream.received] == [5, None]  # the token is opaque
    assert await store_of(proxy).generation("job-a") == 6


async def test_rotation_old_and_new_keys_verify_at_once(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    # Before: tokens signed with "old". After: "new" signs, "old" still verifies.
    signing = {**SIGNING, "sign_with": "new"}
    client = await start_proxy(routes(upstream), leases={}, signing=signing)
    by_old = SigningKeys({"old": decode_key(OLD)}, "old").sign("job-r", 3)
    assert (await fenced(client, "job-r", by_old)).status == 200
    lease = await claim(client, "job-r-2")
    assert lease["token"].startswith("v1.new.")
    assert (await fenced(client, "job-r-2", lease["token"])).status == 200
    assert len(upstream.received) == 2


async def test_a_signed_token_on_a_proxy_without_keys_is_refused(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    client = await start_proxy()
    token = SigningKeys({"new": decode_key(NEW)}, "new").sign("job-s", 4)
    await problem(await fenced(client, "job-s", token), 403, "token-rejected")
    assert upstream.received == []
    assert await store_of(client).generation("job-s") is None


# -- config ----------------------------------------------------------------------


def config_with(signing: Any, tokens: str = "signed") -> dict[str, Any]:
    return {
        "routes": [
            {"name": "r", "path": "/r/", "upstream": "http://127.0.0.1:9",
             "fence": {"tokens": tokens}}
        ],
        "signing": signing,
    }  # fmt: skip


def test_keys_come_from_files_relative_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "k1.key").write_text(NEW + "\n")
    (tmp_path / "fp.yaml").write_text(
        "routes: [{name: r, path: /r/, upstream: 'http://127.0.0.1:9', fence: {tokens: signed}}]\n"
        "signing: {keys: [{id: k1, file: keys/k1.key}]}\n"
    )
    config = load_config(tmp_path / "fp.yaml")
    keys = signing_keys(config.signing, "fp.yaml")
    assert keys is not None
    assert keys.verify(keys.sign("j", 7), "j", "Fencing-Token") == 7
    assert NEW not in repr(keys)
    assert NEW not in repr(config)


@pytest.mark.parametrize(
    ("signing", "key", "says"),
    [
        ({"keys": [{"id": "a", "env": "FP_UNSET_VARIABLE"}]}, "signing.keys[0].env",
         "FP_UNSET_VARIABLE is not set"),
        ({"keys": [{"id": "a", "file": "/nonexistent/a.key"}]}, "signing.keys[0].file",
         "cannot read"),
        ({"keys": [{"id": "a", "env": "FP_SHORT"}]}, "signing.keys[0].env", "32 bytes"),
        ({"keys": [{"id": "a", "env": "FP_NOT_BASE64"}]}, "signing.keys[0].env", "base64url"),
    ],
)  # fmt: skip
def test_a_missing_or_bad_key_is_a_config_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signing: Any, key: str, says: str
) -> None:
    monkeypatch.delenv("FP_UNSET_VARIABLE", raising=False)
    monkeypatch.setenv("FP_SHORT", base64.urlsafe_b64encode(b"x" * 16).decode().rstrip("="))
    monkeypatch.setenv("FP_NOT_BASE64", "not a key!")
    path = tmp_path / "fp.yaml"
    path.write_text(yaml.safe_dump(config_with(signing)))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(path) in str(caught.value)
    assert key in str(caught.value), str(caught.value)
    assert says in str(caught.value), str(caught.value)


@pytest.mark.parametrize(
    ("signing", "says"),
    [
        (None, "routes[0].fence.tokens is signed, and no signing keys"),
        ({"keys": [{"id": "a", "env": "X", "file": "f"}]}, "exactly one of env"),
        ({"keys": [{"id": "a"}]}, "exactly one of env"),
        ({"keys": [{"id": "a", "env": "X"}], "sign_with": "b"}, "not among the keys"),
        ({"keys": [{"id": "a", "env": "X"}, {"id": "a", "env": "Y"}]}, "same id"),
        ({"keys": [{"id": "a b", "env": "X"}]}, "signing.keys[0].id"),
        ({"keys": [{"id": "a;b", "env": "X"}]}, "signing.keys[0].id"),
        ({"keys": [{"id": "a\\b", "env": "X"}]}, "signing.keys[0].id"),
        ({"keys": [{"id": "k" * 33, "env": "X"}]}, "signing.keys[0].id"),
        ({"keys": [{"id": "a", "secret": NEW}]}, "signing.keys[0].secret"),  # not in YAML
    ],
)
def test_signing_config_is_checked(signing: Any, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(config_with(signing), "fp.yaml")
    assert says in str(caught.value), str(caught.value)
    assert NEW not in str(caught.value)


def test_keys_generate_prints_a_usable_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["keys", "generate"]) == 0
    text = capsys.readouterr().out.strip()
    assert len(decode_key(text)) == 32
    assert text != generate_key()


# -- the format ------------------------------------------------------------------


def test_the_token_format_is_stable() -> None:
    """Pinned bytes, so that a change of format is a decision, not an accident."""
    keys = SigningKeys({"k1": bytes(range(32))}, "k1")
    token = keys.sign("invoice-42", 8)
    assert token == "v1.k1.8." + token.split(".")[3]
    assert len(token.split(".")[3]) == 43
    mac = hmac.new(bytes(range(32)), b"fenceproxy-token-v1\0k1\0invoice-42\08", hashlib.sha256)
    assert token.split(".")[3] == base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")
    assert keys.verify(token, "invoice-42", "T") == 8
    top = keys.sign("j", GENERATION_MAX)
    assert keys.verify(top, "j", "T") == GENERATION_MAX


@pytest.mark.parametrize("inserted", [" ", "\\"], ids=["space", "backslash"])
@pytest.mark.parametrize("where", ["before", "after"])
def test_a_generation_field_holding_anything_but_digits_is_rejected(
    inserted: str, where: str
) -> None:
    """Rejected as a token (403), never read as the number around it nor failing as
    a bare ValueError (a 500)."""
    keys = SigningKeys({"k1": bytes(range(32))}, "k1")
    prefix, generation, signature = keys.sign("j", 7).rsplit(".", 2)
    field = inserted + generation if where == "before" else generation + inserted
    with pytest.raises(TokenRejected):
        keys.verify(f"{prefix}.{field}.{signature}", "j", "T")
    with pytest.raises(TokenRejected):
        read_token(f"{prefix}.{field}.{signature}", "T", "j", keys, signed_only=False)


def test_a_key_longer_than_the_least_is_taken_whole() -> None:
    material = bytes(range(37))
    text = base64.urlsafe_b64encode(material).decode().rstrip("=")
    assert decode_key(text) == material
    keys = SigningKeys({"k1": decode_key(text)}, "k1")
    assert keys.verify(keys.sign("j", 3), "j", "T") == 3


KEY_33 = base64.urlsafe_b64encode(bytes(range(33))).decode()  # 44 characters, no padding


@pytest.mark.parametrize(
    "text",
    [KEY_33[:20] + " " + KEY_33[20:], KEY_33[:20] + "%" + KEY_33[20:], "%" + KEY_33, "A" * 45],
    ids=["space-inside", "percent-inside", "percent-first", "45-characters"],
)
def test_key_text_that_is_not_base64url_is_refused(text: str) -> None:
    """Not skipped over: base64 decoders drop characters outside the alphabet, which
    would take a mistyped key as the key without them."""
    assert len(decode_key(KEY_33)) == 33
    with pytest.raises(ValueError, match="base64url"):
        decode_key(text)
