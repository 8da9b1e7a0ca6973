"""The S3 recipe (examples/fenced_boto3.py) as a user runs it: boto3 writing through
a real proxy process to moto's S3 server, over loopback. A stale holder's writes
(PutObject, UploadPart, CompleteMultipartUpload) are refused and never reach S3; a
write whose answer was lost is retried by botocore with its key and answered from the
first; the transfer manager's multipart upload arrives whole; reads pass unfenced."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import re
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from boto3.s3.transfer import TransferConfig
from botocore.exceptions import ClientError

from fenceproxy.client import Grant, LeaseLost, SyncLeaseClient
from fenceproxy.testing import ProxyProcess, free_port

from .s3 import Moto, route

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from fenced_boto3 import FenceRefused, fence_writes

pytestmark = pytest.mark.slow  # moto's server and a proxy, each a process

MiB = 1024 * 1024
FENCE_HEADERS = ("fencing-job", "fencing-token", "idempotency-key")


@dataclass
class Setup:
    proxy: ProxyProcess
    moto: Moto
    bucket: str
    s3: Any
    """Straight to moto: what S3 holds."""
    leases: SyncLeaseClient

    def fenced(
        self, headers: Callable[[], Mapping[str, str]], via: str | None = None
    ) -> tuple[Any, list[Any]]:
        """A client through the proxy (or what stands at ``via`` in front of it), fenced
        with ``headers``, and the list of every attempt it sends (each as signed, on the
        wire)."""
        client = fence_writes(self.moto.client(via or self.proxy.url), headers)
        sent: list[Any] = []
        client.meta.events.register("before-send.s3", lambda request, **_: sent.append(request))
        return client, sent

    def take_over(self, old: Grant, key: str) -> Grant:
        """The job passes from worker-a, who gives ``old`` back, to worker-b, who puts
        ``key`` (b's): from then on worker-a's headers are stale. Worker-b's grant."""
        self.leases.release(old.job_id, "worker-a", old.generation)
        new = self.leases.claim(old.job_id, "worker-b")
        fresh, _ = self.fenced(held(new))
        fresh.put_object(Bucket=self.bucket, Key=key, Body=b"b's")
        return new


@pytest.fixture
async def setup(tmp_path: Path, moto: Moto) -> AsyncIterator[Setup]:
    bucket = f"reports-{tmp_path.name.lower().replace('_', '-')[-40:]}"
    s3 = moto.client()
    s3.create_bucket(Bucket=bucket)
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    config = tmp_path / "proxy.yaml"
    store = f"sqlite:///{tmp_path / 'fences.db'}"
    routes = [route(bucket, moto.url)]
    config.write_text(yaml.safe_dump({"store": store, "leases": {}, "routes": routes}))
    proxy = await ProxyProcess(config, free_port()).start()
    try:
        with SyncLeaseClient(proxy.url) as leases:
            yield Setup(proxy, moto, bucket, s3, leases)
    finally:
        await proxy.stop()


def held(grant: Grant) -> Callable[[], dict[str, str]]:
    """The fencing headers of a grant, as a holder that does not know it was
    superseded sends them (paused between its last check and its write)."""
    return lambda: {"Fencing-Job": grant.job_id, "Fencing-Token": grant.token}


def body(s3: Any, bucket: str, key: str) -> bytes:
    return bytes(s3.get_object(Bucket=bucket, Key=key)["Body"].read())


def header(request: Any, name: str) -> str:
    """A header of a request as sent (botocore holds some values as bytes)."""
    value = request.headers[name]
    return value.decode() if isinstance(value, bytes) else str(value)


def signed_headers(request: Any) -> list[str]:
    found = re.search(r"SignedHeaders=([^,]+)", header(request, "Authorization"))
    assert found is not None
    return found.group(1).split(";")


async def test_a_stale_put_object_is_refused_and_never_reaches_s3(setup: Setup) -> None:
    old = setup.leases.claim("report-1", "worker-a")
    stale, stale_sent = setup.fenced(held(old))
    stale.put_object(Bucket=setup.bucket, Key="daily.csv", Body=b"a's first")
    new = setup.take_over(old, "daily.csv")

    stale_sent.clear()
    with pytest.raises(FenceRefused) as refused:
        stale.put_object(Bucket=setup.bucket, Key="daily.csv", Body=b"a's late")
    assert refused.value.kind == "stale-generation"
    assert refused.value.response["Error"]["Code"] == "stale-generation"  # a ClientError too
    assert refused.value.problem["current_generation"] == new.generation
    assert len(stale_sent) == 1  # never retried
    # The fencing headers are signed with the write, so no one on the way can move them.
    assert set(FENCE_HEADERS) <= set(signed_headers(stale_sent[0]))
    assert body(setup.s3, setup.bucket, "daily.csv") == b"b's"
    versions = setup.s3.list_object_versions(Bucket=setup.bucket, Prefix="daily.csv")
    assert len(versions["Versions"]) == 2  # a's first, b's: the late one never arrived


async def test_a_stale_upload_part_and_complete_are_refused(setup: Setup) -> None:
    old = setup.leases.claim("report-2", "worker-a")
    stale, stale_sent = setup.fenced(held(old))
    upload = stale.create_multipart_upload(Bucket=setup.bucket, Key="big.bin")["UploadId"]
    part = {"Bucket": setup.bucket, "Key": "big.bin", "UploadId": upload}
    first = stale.upload_part(**part, PartNumber=1, Body=b"1" * 5 * MiB)
    setup.take_over(old, "big.bin")

    stale_sent.clear()
    with pytest.raises(FenceRefused) as refused:
        stale.upload_part(**part, PartNumber=2, Body=b"2" * MiB)
    assert refused.value.kind == "stale-generation"
    parts = [{"PartNumber": 1, "ETag": first["ETag"]}]
    with pytest.raises(FenceRefused) as refused:
        stale.complete_multipart_upload(**part, MultipartUpload={"Parts": parts})
    assert refused.value.kind == "stale-generation"
    assert len(stale_sent) == 2  # one attempt each

    listed = setup.s3.list_parts(**part)["Parts"]
    assert [p["PartNumber"] for p in listed] == [1]  # part 2 never reached S3
    assert body(setup.s3, setup.bucket, "big.bin") == b"b's"


class LosesOneAnswer:
    """A TCP relay in front of the proxy that, once armed, cuts the client's
    connection when the next answer comes back: a write applied, its answer lost."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.armed = False
        self.url = ""

    async def __aenter__(self) -> LosesOneAnswer:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        proxy_r, proxy_w = await asyncio.open_connection("127.0.0.1", self.port)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, answers: bool) -> None:
            while data := await r.read(65536):
                # A final answer's status line (not an interim 100 Continue).
                if answers and self.armed and re.search(rb"HTTP/1\.1 [2-5]\d\d ", data):
                    self.armed = False
                    client_w.transport.abort()
                    break
                w.write(data)
                await w.drain()
            w.close()

        try:
            await asyncio.gather(pipe(client_r, proxy_w, False), pipe(proxy_r, client_w, True))
        except ConnectionError:
            pass
        finally:
            proxy_w.close()
            client_w.close()


async def test_a_write_whose_answer_was_lost_is_retried_with_its_key_and_applied_once(
    setup: Setup,
) -> None:
    grant = setup.leases.claim("report-3", "worker-a")
    async with LosesOneAnswer(setup.proxy.port) as relay:
        client, sent = setup.fenced(held(grant), via=relay.url)
        relay.armed = True
        answer = await asyncio.to_thread(
            client.put_object, Bucket=setup.bucket, Key="once.csv", Body=b"applied once"
        )
    assert not relay.armed  # the first answer was lost
    assert answer["ResponseMetadata"]["RetryAttempts"] == 1
    assert answer["ResponseMetadata"]["HTTPHeaders"]["idempotent-replayed"] == "true"
    keys = {header(request, "Idempotency-Key") for request in sent}
    assert len(sent) == 2
    assert len(keys) == 1  # botocore's retry kept the call's key
    versions = setup.s3.list_object_versions(Bucket=setup.bucket, Prefix="once.csv")
    assert len(versions["Versions"]) == 1
    assert answer["VersionId"] == versions["Versions"][0]["VersionId"]
    # Another call is another write, with a key of its own.
    await asyncio.to_thread(
        client.put_object, Bucket=setup.bucket, Key="once.csv", Body=b"applied once"
    )
    assert len({header(request, "Idempotency-Key") for request in sent}) == 2


async def test_a_50_mib_multipart_upload_arrives_whole(setup: Setup) -> None:
    grant = setup.leases.claim("report-4", "worker-a")
    client, sent = setup.fenced(held(grant))
    data = os.urandom(50 * MiB)
    transfer = TransferConfig(multipart_threshold=8 * MiB, multipart_chunksize=8 * MiB,
                              max_concurrency=4)  # fmt: skip
    await asyncio.to_thread(
        client.upload_fileobj, io.BytesIO(data), setup.bucket, "dump.bin", Config=transfer
    )
    read = body(setup.s3, setup.bucket, "dump.bin")
    assert hashlib.sha256(read).digest() == hashlib.sha256(data).digest()
    methods = sorted(request.method for request in sent)
    assert methods == ["POST", "POST"] + ["PUT"] * 7  # create, complete, 7 parts
    assert all(header(request, "Fencing-Token") == grant.token for request in sent)
    assert len({header(request, "Idempotency-Key") for request in sent}) == 9


async def test_reads_pass_unfenced_and_a_lost_lease_stops_writes(setup: Setup) -> None:
    setup.s3.put_object(Bucket=setup.bucket, Key="seen.csv", Body=b"there")

    def lost() -> dict[str, str]:
        raise LeaseLost("no renewal was confirmed before the local deadline")

    client, sent = setup.fenced(lost)
    assert body(client, setup.bucket, "seen.csv") == b"there"
    assert client.head_object(Bucket=setup.bucket, Key="seen.csv")["ContentLength"] == 5
    listed = client.list_objects_v2(Bucket=setup.bucket)["Contents"]
    assert [o["Key"] for o in listed] == ["seen.csv"]
    assert [r.method for r in sent] == ["GET", "HEAD", "GET"]
    assert not any(name in r.headers for r in sent for name in FENCE_HEADERS)

    with pytest.raises(LeaseLost):
        client.put_object(Bucket=setup.bucket, Key="seen.csv", Body=b"not sent")
    assert len(sent) == 3
    assert body(setup.s3, setup.bucket, "seen.csv") == b"there"


async def test_s3_verifies_the_signature_of_the_fenced_write(setup: Setup) -> None:
    grant = setup.leases.claim("report-5", "worker-a")
    client, _ = setup.fenced(held(grant))
    client.put_object(Bucket=setup.bucket, Key="signed.csv", Body=b"signed")

    def alter(request: Any, **_: Any) -> None:
        request.headers["Idempotency-Key"] = "altered-after-signing"

    client.meta.events.register_first("before-send.s3", alter)
    with pytest.raises(ClientError) as refused:
        client.put_object(Bucket=setup.bucket, Key="signed.csv", Body=b"altered")
    assert refused.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    assert body(setup.s3, setup.bucket, "signed.csv") == b"signed"


async def test_an_opaque_key_is_stored_as_sent(setup: Setup) -> None:
    grant = setup.leases.claim("report-6", "worker-a")
    client, _ = setup.fenced(held(grant))
    key = "logs//2026/./12/../x.csv"
    client.put_object(Bucket=setup.bucket, Key=key, Body=b"opaque")
    assert body(setup.s3, setup.bucket, key) == b"opaque"
    listed = setup.s3.list_objects_v2(Bucket=setup.bucket)["Contents"]
    assert [o["Key"] for o in listed] == [key]
