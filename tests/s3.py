"""moto's S3 server in a process of its own, checking signatures, for the tests that
drive S3 clients through a real proxy (boto3, the AWS CLI, rclone): the ``moto``
fixture of tests/conftest.py."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
from botocore.config import Config

from fenceproxy.testing import free_port

WRITES = frozenset({"PUT", "POST", "DELETE"})
"""The methods with which S3 clients write."""


def tool_env() -> dict[str, str]:
    """This process's environment for a tool under test: none of the user's AWS
    settings, and no lease but the one a test gives it."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FENCING_"))}


@dataclass
class Moto:
    url: str
    credentials: dict[str, str]
    recording: Path

    def client(self, url: str | None = None) -> Any:
        """An S3 client, path-style, straight to moto or (``url``) through the proxy."""
        config = Config(s3={"addressing_style": "path"}, retries={"mode": "standard"})
        return boto3.client("s3", endpoint_url=url or self.url, region_name="us-east-1",
                            config=config, **self.credentials)  # fmt: skip

    def keys(self, bucket: str, prefix: str) -> list[str]:
        """The keys S3 holds under ``prefix``, in order."""
        listed = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for o in listed.get("Contents", []))

    def record(self) -> None:
        """Keep every request moto receives from now on (see :meth:`received`)."""
        for action in ("reset-recording", "start-recording"):
            httpx.post(f"{self.url}/moto-api/recorder/{action}").raise_for_status()

    def received(self, prefix: str) -> list[dict[str, Any]]:
        """The requests moto received since :meth:`record` whose path starts with
        ``prefix``: each its ``method``, ``url`` and ``headers``, as they arrived."""
        with contextlib.suppress(FileNotFoundError):
            lines = self.recording.read_text().splitlines()
            entries = [json.loads(line) for line in lines]
            return [e for e in entries if httpx.URL(e["url"]).path.startswith(prefix)]
        return []


@contextlib.contextmanager
def serve_moto(folder: Path) -> Iterator[Moto]:
    """moto's S3 server, checking every request's SigV4 signature (after the three
    calls that create its IAM user), recording into ``folder`` when asked."""
    port = free_port()
    recording = folder / "requests.jsonl"
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3",
           "MOTO_RECORDER_FILEPATH": str(recording)}  # fmt: skip
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            assert server.poll() is None, "moto's server exited"
            try:
                httpx.get(f"{url}/moto-api/", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "moto's server did not start"
                time.sleep(0.05)
        credentials = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
        # The three calls taken without credentials: a real IAM user and its key.
        iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1", **credentials)
        iam.create_user(UserName="worker")
        iam.put_user_policy(UserName="worker", PolicyName="s3", PolicyDocument=(
            '{"Version": "2012-10-17", "Statement": '
            '[{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}'
        ))  # fmt: skip
        key = iam.create_access_key(UserName="worker")["AccessKey"]
        credentials = {"aws_access_key_id": key["AccessKeyId"],
                       "aws_secret_access_key": key["SecretAccessKey"]}  # fmt: skip
        yield Moto(url, credentials, recording)
    finally:
        server.kill()
        server.wait()


def route(bucket: str, upstream: str) -> dict[str, Any]:
    """The route docs/boto3.md describes, for one bucket."""
    return {"name": bucket, "path": f"/{bucket}", "upstream": upstream, "max_body": "16MiB",
            "host": "preserve", "paths": "exact"}  # fmt: skip
