"""Framing and size attacks on a raw socket: refused, and nothing reaches the upstream."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from fenceproxy.testing import RecordingUpstream

from .conftest import raw_request

FENCE = b"Fencing-Job: j\r\nFencing-Token: 1\r\n"
CASES = {
    "content-length and transfer-encoding": b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
    + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "two content-lengths": b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
    + b"Content-Length: 2\r\nContent-Length: 2\r\n\r\n{}",
    "two hosts": b"POST /billing/x HTTP/1.1\r\nHost: a\r\nHost: b\r\n" + FENCE
    + b"Content-Length: 2\r\n\r\n{}",
    "a transfer coding other than chunked": b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
    + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "more than 100 headers": b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
    + b"".join(b"X-H%d: v\r\n" % i for i in range(101)) + b"Content-Length: 2\r\n\r\n{}",
    "a header over 8190 bytes": b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
    + b"X-Big: " + b"a" * 9000 + b"\r\nContent-Length: 2\r\n\r\n{}",
    "a bare LF in a header": b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
    + b"X-A: 1\nX-B: 2\r\nContent-Length: 2\r\n\r\n{}",
}  # fmt: skip


@pytest.mark.parametrize("attack", CASES.values(), ids=CASES.keys())
async def test_framing_attack_is_refused_before_the_upstream(
    proxy: TestClient[Any, Any], upstream: RecordingUpstream, attack: bytes
) -> None:
    head, _, body = attack.partition(b"\r\n\r\n")
    answer = await raw_request(proxy.port, head + b"\r\nConnection: close\r\n\r\n" + body)
    status = answer.split(b" ", 2)[1] if answer else b"closed"
    assert status in (b"400", b"431", b"501", b"closed"), answer
    if answer:
        assert b"\r\nContent-Type: application/problem+json" in answer, answer
    # A well-formed write on a fresh connection still goes through: nothing queued.
    ok = await raw_request(
        proxy.port,
        b"POST /billing/x HTTP/1.1\r\nHost: a\r\n" + FENCE
        + b"Content-Length: 2\r\nConnection: close\r\n\r\n{}",
    )  # fmt: skip
    assert ok.startswith(b"HTTP/1.1 200 ")
    assert [r.body for r in upstream.received] == [b"{}"]
