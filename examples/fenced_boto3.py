"""Fence boto3's S3 writes through fenceproxy: copy this module into your worker.

    import boto3
    from botocore.config import Config

    from fenceproxy.client import SyncLeaseClient
    from fenced_boto3 import FenceRefused, fence_writes

    leases = SyncLeaseClient("http://127.0.0.1:8080")
    s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:8080",  # through the proxy
                      config=Config(s3={"addressing_style": "path"}))
    with leases.hold("nightly-report", owner="worker-a", ttl=30) as lease:
        fence_writes(s3, lease.headers)
        s3.upload_file("report.csv", "reports", "2026/12/report.csv")
        lease.complete()

Every write the client sends (every method but the safe ones, GET, HEAD ...: PutObject,
UploadPart, CreateMultipartUpload, CompleteMultipartUpload, CopyObject,
DeleteObject, ...) carries the lease's ``Fencing-Job`` and ``Fencing-Token`` and an
``Idempotency-Key``, all added before botocore signs it, so SigV4 covers them. Reads
pass as they were. The key is made once per call, so botocore's own retries of a
call (it signs each attempt anew) send the same key, and the proxy answers a retry
of a write that was applied from that write's stored answer instead of applying it
again. A refusal of the proxy raises :class:`FenceRefused` (a ``ClientError``
whose code is the problem's kind, ``stale-generation`` say) at once, never retried;
only the refusals that say nothing was sent (``job-quarantined``, ``proxy-busy``,
``store-unavailable``, ``upstream-unreachable``, ``duplicate-in-flight``) are left
to botocore's own retry rules, which retry the 502 and 503 ones. A lease that is
lost raises ``LeaseLost`` before the write is sent.

The proxy's route, one per bucket, in path-style addressing (``/{bucket}/{key}``),
the job in a header, in front of an S3 server that answers to the name the clients
use for the proxy (MinIO, Ceph's RGW, ...), since the signature covers that name:

    routes:
      - name: reports
        path: /reports                # the bucket: /reports and /reports/{key}
        upstream: http://minio.internal:9000
        host: preserve                # SigV4 signs the Host the client sent
        paths: exact                  # S3 keys are opaque: a//b and a/../b are keys
        max_body: 64MiB               # at least the transfer manager's part size
        timeout: 5m                   # a part takes its time to arrive
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from botocore.exceptions import ClientError

from fenceproxy.client import SAFE_TO_RETRY, refusal_kind
from fenceproxy.errors import PROBLEM_BASE

__all__ = ["FenceRefused", "fence_writes"]

READS = frozenset({"GET", "HEAD", "OPTIONS", "PROPFIND", "REPORT", "SEARCH"})
"""The methods the proxy passes unfenced by default (a route's ``fence.methods``)."""


class FenceRefused(ClientError):
    """The proxy refused the write and did not forward it. ``kind`` is the problem's
    kind (``stale-generation``, ``lease-not-live``, ...: see "What a fenced write
    gets", docs/fenced-writes.md), ``problem`` the RFC 9457 body, with
    ``current_generation`` when a newer holder took the job. After
    ``duplicate-outcome-unknown`` an earlier attempt of the same call may have been
    applied: read S3 to know."""

    def __init__(self, operation: str, status: int, problem: dict[str, Any]) -> None:
        self.kind = str(problem["type"]).removeprefix(PROBLEM_BASE)
        self.problem = problem
        error = {"Code": self.kind, "Message": str(problem.get("detail", problem.get("title")))}
        super().__init__(
            {"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}}, operation
        )


def fence_writes(client: Any, headers: Callable[[], Mapping[str, str]]) -> Any:
    """Send every write of the S3 ``client`` fenced with ``headers()`` (a held
    lease's ``headers``, asked again for each attempt); returns the client."""

    def keyed(model: Any, context: dict[str, Any], **_: Any) -> None:
        if model.http["method"] not in READS:  # one key per call, kept by its retries
            context["idempotency_key"] = uuid.uuid4().hex

    def fenced(request: Any, **_: Any) -> None:
        key = request.context.get("idempotency_key")
        if key is not None:
            for name, value in {**headers(), "Idempotency-Key": key}.items():
                request.headers[name] = value  # replaces: one value per field

    def not_retried(response: Any, operation: Any, **_: Any) -> None:
        refusal = _refusal(operation.name, response[0] if response else None)
        if refusal is not None and refusal.kind not in SAFE_TO_RETRY:
            raise refusal

    def refused(http_response: Any, model: Any, **_: Any) -> None:
        refusal = _refusal(model.name, http_response)  # botocore's retries did not help
        if refusal is not None:
            raise refusal

    events = client.meta.events
    events.register("before-call.s3", keyed)
    events.register("before-sign.s3", fenced)
    events.register_first("needs-retry.s3", not_retried)  # before botocore's retry rules
    events.register("after-call.s3", refused)
    return client


def _refusal(operation: str, http: Any) -> FenceRefused | None:
    """The proxy's refusal in an answer, or None: a success (whose body, a GetObject's
    stream, is left unread), an error of S3's, or no answer at all."""
    if http is None or http.status_code < 400:
        return None
    if refusal_kind(http.status_code, http.headers, http.content) is None:
        return None
    return FenceRefused(operation, http.status_code, json.loads(http.content))
