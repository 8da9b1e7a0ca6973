"""The AWS CLI's plugin (fenceproxy/awscli.py) as a user enables it: the CLI's own
``aws`` command, with ``[plugins] fenceproxy = fenceproxy.awscli`` in a config file of
its own, run by ``fenceproxy run`` (or given a stale holder's environment), writing
through a real proxy process to moto's S3 server, which checks every signature.

Every write of ``aws s3 cp`` (whole, and a 40 MiB multipart upload), ``aws s3 sync``
and ``aws s3api put-object`` arrives with the lease's fields, signed, and the proxy
recorded each; a stale holder's first write is refused, the command exits non-zero
at once with the proxy's reason, and nothing of it reaches S3."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from fenceproxy.awscli import fencing_fields
from fenceproxy.client import SyncLeaseClient
from fenceproxy.testing import ProxyProcess, free_port

from .conftest import run_under_lease, write_decisions
from .s3 import WRITES, Moto, route, tool_env

MiB = 1024 * 1024
BUCKET = "nightly"
PLUGIN = "[plugins]\nfenceproxy = fenceproxy.awscli\n"
CONFIG = "[default]\nregion = us-east-1\ns3 =\n    addressing_style = path\n" + PLUGIN


@dataclass
class Stack:
    proxy: ProxyProcess
    moto: Moto
    folder: Path

    def env(self, fencing: dict[str, str]) -> dict[str, str]:
        """The CLI's environment: its config file, moto's credentials, the proxy as
        the endpoint, ``fencing``, and this venv's ``aws`` first on the PATH."""
        env = tool_env()
        return {
            **env,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            "AWS_CONFIG_FILE": str(self.folder / "aws.cfg"),
            "AWS_SHARED_CREDENTIALS_FILE": str(self.folder / "no-credentials"),
            "AWS_ACCESS_KEY_ID": self.moto.credentials["aws_access_key_id"],
            "AWS_SECRET_ACCESS_KEY": self.moto.credentials["aws_secret_access_key"],
            "AWS_ENDPOINT_URL": self.proxy.url,
            **fencing,
        }

    def aws(self, *args: str, fencing: dict[str, str]) -> subprocess.CompletedProcess[str]:
        """``aws ARGS``, its fencing variables ``fencing`` (a stale holder's)."""
        return subprocess.run(
            ["aws", *args], env=self.env(fencing), capture_output=True, text=True, timeout=60
        )

    def run(self, job: str, script: str) -> subprocess.CompletedProcess[str]:
        """The shell ``script`` under ``fenceproxy run JOB``."""
        return run_under_lease(self.proxy, job, script, self.env({}))

    def writes(self, prefix: str) -> list[dict[str, Any]]:
        """The writes moto received under ``prefix`` of the bucket, as they arrived."""
        received = self.moto.received(f"/{BUCKET}/{prefix}")
        return [r for r in received if r["method"] in WRITES]


@pytest.fixture(scope="module")
def stack(moto: Moto, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One proxy in front of moto's bucket for the module; each test its own job and
    key prefix."""
    folder = tmp_path_factory.mktemp("awscli")
    (folder / "aws.cfg").write_text(CONFIG)
    moto.client().create_bucket(Bucket=BUCKET)
    config = folder / "proxy.yaml"
    store = f"sqlite:///{folder / 'fences.db'}"
    config.write_text(
        yaml.safe_dump({"store": store, "leases": {}, "routes": [route(BUCKET, moto.url)]})
    )
    moto.record()
    with asyncio.Runner() as runner:
        proxy = runner.run(ProxyProcess(config, free_port()).start())
        try:
            yield Stack(proxy, moto, folder)
        finally:
            runner.run(proxy.stop())


def signed(request: dict[str, Any]) -> list[str]:
    """The header names a request's SigV4 signature covers."""
    authorization = request["headers"]["Authorization"]
    return authorization.split("SignedHeaders=", 1)[1].split(",", 1)[0].split(";")


def assert_fenced(stack: Stack, job: str, prefix: str) -> list[dict[str, Any]]:
    """Every write moto received under ``prefix`` came with the job's fields, signed,
    and is a write the proxy forwarded after recording its fence; those writes."""
    writes = stack.writes(prefix)
    decisions = write_decisions(stack.proxy, job)
    assert [d["outcome"] for d in decisions] == ["forwarded"] * len(writes)
    (generation,) = {d["generation"] for d in decisions}
    for write in writes:
        headers = write["headers"]
        assert (headers["Fencing-Job"], headers["Fencing-Token"]) == (job, str(generation))
        assert {"fencing-job", "fencing-token", "idempotency-key"} <= set(signed(write))
    keys = sorted(w["headers"]["Idempotency-Key"] for w in writes)
    assert keys == sorted(d["key"] for d in decisions)
    assert len(set(keys)) == len(keys)  # one key per call
    return writes


@pytest.mark.slow
def test_aws_s3_cp_sync_and_put_object_under_fenceproxy_run_arrive_fenced(
    stack: Stack, tmp_path: Path
) -> None:
    """A shell job's ``aws`` commands need no flag of their own: the plugin sends
    the lease ``fenceproxy run`` holds with every write, signed with it."""
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "a.csv").write_text("a")
    (out / "sub" / "b.csv").write_text("b")
    small = tmp_path / "small.csv"
    small.write_text("small")
    done = stack.run("nightly-run", " && ".join([
        f"aws s3 cp {small} s3://{BUCKET}/run/small.csv",
        f"aws s3 sync {out} s3://{BUCKET}/run/out",
        f"aws s3api put-object --bucket {BUCKET} --key run/put.csv --body {small}",
    ]))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted(stack.moto.keys(BUCKET, "run/")) == [
        "run/out/a.csv", "run/out/sub/b.csv", "run/put.csv", "run/small.csv",
    ]  # fmt: skip
    assert len(assert_fenced(stack, "nightly-run", "run/")) == 4


@pytest.mark.slow
def test_a_40_mib_aws_s3_cp_arrives_fenced_in_parts(stack: Stack, tmp_path: Path) -> None:
    """The CLI's multipart upload: its create, every part and its completion."""
    data = os.urandom(40 * MiB)
    dump = tmp_path / "dump.bin"
    dump.write_bytes(data)
    done = stack.run("nightly-big", f"aws s3 cp {dump} s3://{BUCKET}/big/dump.bin")
    assert done.returncode == 0, done.stderr
    read = stack.moto.client().get_object(Bucket=BUCKET, Key="big/dump.bin")["Body"].read()
    assert hashlib.sha256(read).digest() == hashlib.sha256(data).digest()
    writes = assert_fenced(stack, "nightly-big", "big/")
    assert sorted(w["method"] for w in writes) == ["POST", "POST"] + ["PUT"] * 5  # 8 MiB parts


@pytest.mark.slow
def test_a_stale_aws_cli_write_fails_at_once_and_nothing_reaches_s3(
    stack: Stack, tmp_path: Path
) -> None:
    """A holder that was superseded: each command's first write is refused, never
    retried, the command exits non-zero with the proxy's reason, and S3 holds
    nothing of it: no object, no unfinished multipart upload."""
    with SyncLeaseClient(stack.proxy.url) as leases:
        old = leases.claim("nightly-stale", "worker-a")
        leases.release("nightly-stale", "worker-a", old.generation)
    small = tmp_path / "small.csv"
    small.write_text("late")
    newer = stack.run("nightly-stale", f"aws s3 cp {small} s3://{BUCKET}/stale/newer.csv")
    assert newer.returncode == 0, newer.stderr
    big = tmp_path / "big.bin"  # over the CLI's 8 MiB: a multipart upload
    big.write_bytes(b"x" * 9 * MiB)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("a.csv", "b.csv"):
        (out / name).write_text(name)

    stale = {"FENCING_JOB": "nightly-stale", "FENCING_TOKEN": old.token}
    reason = f"generation {old.generation} is older than generation {old.generation + 1}"
    for command in (
        ["s3", "cp", str(small), f"s3://{BUCKET}/stale/small.csv"],
        ["s3", "cp", str(big), f"s3://{BUCKET}/stale/big.bin"],
        ["s3", "sync", str(out), f"s3://{BUCKET}/stale/out"],
        ["s3api", "put-object", "--bucket", BUCKET, "--key", "stale/put.csv", "--body", str(small)],
    ):
        refused = stack.aws(*command, fencing=stale)
        assert refused.returncode != 0
        assert "An error occurred (stale-generation)" in refused.stderr
        assert reason in refused.stderr

    assert stack.moto.keys(BUCKET, "stale/") == ["stale/newer.csv"]
    assert stack.moto.client().list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []
    assert [w["method"] for w in stack.writes("stale/")] == ["PUT"]  # the newer holder's
    refusals = [
        d for d in write_decisions(stack.proxy, "nightly-stale") if d["outcome"] != "forwarded"
    ]
    assert {d["outcome"] for d in refusals} == {"stale-generation"}
    assert len({d["key"] for d in refusals}) == len(refusals) == 5  # each write once


@pytest.mark.slow
def test_without_a_lease_the_aws_cli_names_the_missing_fields(stack: Stack, tmp_path: Path) -> None:
    """Outside ``fenceproxy run`` the plugin adds nothing, and the CLI says what the
    proxy wants instead of botocore's bare ``409`` or ``428``."""
    body = tmp_path / "x.csv"
    body.write_text("x")
    put = ["s3api", "put-object", "--bucket", BUCKET, "--key", "none/x.csv", "--body", str(body)]
    refused = stack.aws(*put, fencing={})
    assert refused.returncode != 0
    assert "An error occurred (fencing-header-missing)" in refused.stderr
    assert "needs the header(s) Fencing-Job, Fencing-Token" in refused.stderr
    assert stack.writes("none/") == []


def test_the_fields_come_from_the_variables_fenceproxy_run_sets() -> None:
    """Both fields under the header names given, when a token is; none without."""
    run = {"FENCING_JOB": "nightly", "FENCING_TOKEN": "7", "FENCING_GENERATION": "7"}
    assert fencing_fields(run) == {"Fencing-Job": "nightly", "Fencing-Token": "7"}
    named = {**run, "FENCING_TOKEN_HEADER": "X-Lease-Token", "FENCING_JOB_HEADER": ""}
    assert fencing_fields(named) == {"Fencing-Job": "nightly", "X-Lease-Token": "7"}
    assert fencing_fields({"FENCING_TOKEN": "7"}) == {"Fencing-Token": "7"}  # a {job} route
    assert fencing_fields({"FENCING_JOB": "nightly"}) == {}
    assert fencing_fields({}) == {}


def test_the_plugin_loads_with_the_standard_library_alone() -> None:
    """AWS CLI v2 runs its own Python, where fenceproxy is installed without its
    dependencies (``pip install --no-deps --target``): the plugin needs none."""
    check = (
        "import sys, fenceproxy.awscli; "
        "top = {m.split('.')[0] for m in sys.modules}; "
        "print(sorted(top - {*sys.stdlib_module_names, '__main__'}))"
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(  # -S: no site-packages, none of the venv's packages
        [sys.executable, "-S", "-c", check], env=env, capture_output=True, text=True, timeout=30
    )
    assert (done.returncode, done.stdout.strip()) == (0, "['fenceproxy']"), done.stderr
