"""The decision table of a fenced write, end to end over loopback HTTP, asserting on
what the upstream actually received."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient
from multidict import CIMultiDict

from fenceproxy.errors import PROBLEM_BASE
from fenceproxy.fence.fencing import Admit, FencedWrite
from fenceproxy.http.answer import Answer
from fenceproxy.http.request import Request
from fenceproxy.http.server import DataPlane, Limits, Listener
from fenceproxy.server.app import FenceProxy
from fenceproxy.testing import FakeClock, RecordingUpstream, drop_connection, free_port, status

from .conftest import ProxyFactory, admit, fenced, raw_request, store_of

Client = TestClient[Any, Any]


async def problem(response: Any, status_code: int, slug: str) -> dict[str, Any]:
    assert response.status == status_code, await response.text()
    assert response.content_type == "application/problem+json"
    body: dict[str, Any] = await response.json()
    assert body["type"] == PROBLEM_BASE + slug
    assert body["status"] == status_code
    assert body["title"]
    assert body["detail"]
    return body


async def fencing_with(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, **fence: Any
) -> Client:
    """A proxy whose one route, ``/billing/`` to ``upstream``, fences as ``fence`` says
    (the route's ``fence:`` settings)."""
    route = {"name": "billing", "path": "/billing/", "upstream": upstream.url, "fence": fence}
    return await start_proxy([route])


async def test_worked_example_stale_generation_never_reaches_upstream(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    r7 = await fenced(proxy, "invoice-42", 7, body={"from": "A"})
    assert r7.status == 200
    r8 = await fenced(proxy, "invoice-42", 8, body={"from": "B"})
    assert r8.status == 200
    late = await fenced(proxy, "invoice-42", 7, body={"from": "A", "late": True})
    body = await problem(late, 409, "stale-generation")
    assert body["job"] == "invoice-42"
    assert body["generation"] == 7
    assert body["current_generation"] == 8
    assert upstream.bodies() == [{"from": "A"}, {"from": "B"}]
    assert await store_of(proxy).generation("invoice-42") == 8


async def test_equal_generation_is_accepted_many_times(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    for n in range(3):
        assert (await fenced(proxy, "j", 5, body={"n": n})).status == 200
    assert upstream.bodies() == [{"n": 0}, {"n": 1}, {"n": 2}]


async def test_jobs_are_fenced_independently(proxy: Client, upstream: RecordingUpstream) -> None:
    assert (await fenced(proxy, "a", 9)).status == 200
    assert (await fenced(proxy, "b", 1)).status == 200
    assert [r.job for r in upstream.received] == ["a", "b"]


async def test_missing_fencing_headers_are_428(proxy: Client, upstream: RecordingUpstream) -> None:
    no_token = await problem(await fenced(proxy, "j", None), 428, "fencing-header-missing")
    assert no_token["missing"] == ["Fencing-Token"]
    no_job = await problem(await fenced(proxy, None, 3), 428, "fencing-header-missing")
    assert no_job["missing"] == ["Fencing-Job"]
    await problem(await fenced(proxy, None, None), 428, "fencing-header-missing")
    assert upstream.received == []


async def test_malformed_tokens_are_400(proxy: Client, upstream: RecordingUpstream) -> None:
    for token in [
        "",
        "-1",
        "abc",
        "1.5",
        "9223372036854775808",
        "1_0",
        "7 8",
        "+7",
        "0x10",
        "\u0667",
    ]:
        response = await fenced(proxy, "j", token)
        await problem(response, 400, "fencing-header-malformed")
    assert upstream.received == []


async def test_largest_token_is_accepted(proxy: Client, upstream: RecordingUpstream) -> None:
    assert (await fenced(proxy, "j", 2**63 - 1)).status == 200
    assert (await fenced(proxy, "j", 0)).status == 409


async def test_malformed_job_ids_are_400(proxy: Client, upstream: RecordingUpstream) -> None:
    for job in ["", "x" * 257, "a\tb", "é" * 129]:
        await problem(await fenced(proxy, job, 1), 400, "fencing-header-malformed")
    assert (await fenced(proxy, "x" * 256, 1)).status == 200
    assert (await fenced(proxy, "é" * 128, 1)).status == 200
    assert len(upstream.received) == 2


async def test_unfenced_methods_pass_without_headers(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    response = await proxy.get("/billing/charges?page=2")
    assert response.status == 200
    assert upstream.received[0].method == "GET"
    assert upstream.received[0].path_qs == "/billing/charges?page=2"


async def test_every_default_write_method_is_fenced(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    for method in ["POST", "PUT", "PATCH", "DELETE"]:
        response = await proxy.request(method, "/billing/x")
        await problem(response, 428, "fencing-header-missing")
    assert upstream.received == []


async def test_unknown_path_is_404(proxy: Client, upstream: RecordingUpstream) -> None:
    await problem(await proxy.get("/elsewhere"), 404, "no-route")
    assert upstream.received == []


async def test_longest_prefix_wins(start_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    async with RecordingUpstream.serve() as other:
        proxy = await start_proxy(
            [
                {"name": "api", "path": "/api/", "upstream": upstream.url, "fence": False},
                {"name": "orders", "path": "/api/orders/", "upstream": other.url},
            ]
        )
        assert (await proxy.post("/api/misc")).status == 200
        await problem(await proxy.post("/api/orders/1"), 428, "fencing-header-missing")
        assert (await fenced(proxy, "o", 1, path="/api/orders/1")).status == 200
        assert [r.path_qs for r in upstream.received] == ["/api/misc"]
        assert [r.path_qs for r in other.received] == ["/api/orders/1"]


async def test_job_from_path(start_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await start_proxy([{"name": "o", "path": "/orders/{job}/", "upstream": upstream.url}])
    assert (await fenced(proxy, None, 4, path="/orders/inv%2D7/lines")).status == 200
    await problem(await fenced(proxy, None, 3, path="/orders/inv-7/lines"), 409, "stale-generation")
    assert (await fenced(proxy, None, 1, path="/orders/other/lines")).status == 200
    assert await store_of(proxy).generation("inv-7") == 4
    assert len(upstream.received) == 2


async def test_fence_overrides(start_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await fencing_with(
        start_proxy, upstream,
        methods=["POST"], job_header="X-Job", token_header="X-Gen", key_header="X-Key",
    )  # fmt: skip
    assert (await proxy.put("/billing/a")).status == 200  # PUT is not fenced here
    assert (await proxy.post("/billing/a", headers={"X-Job": "j", "X-Gen": "2"})).status == 200
    stale = await proxy.post("/billing/a", headers={"x-job": "j", "x-gen": "1"})
    await problem(stale, 409, "stale-generation")
    headers = {"X-Job": "j", "X-Gen": "2", "X-Key": "k1"}
    assert (await proxy.post("/billing/a", data=b"x", headers=headers)).status == 200
    replay = await proxy.post("/billing/a", data=b"x", headers=headers)
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert len(upstream.received) == 3


async def test_pass_through_route(start_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await start_proxy(
        [{"name": "p", "path": "/", "upstream": upstream.url, "fence": False}]
    )
    assert (await proxy.post("/anything", data=b"raw")).status == 200
    assert upstream.received[0].body == b"raw"


# -- idempotency keys -------------------------------------------------------------


async def test_completed_duplicate_is_replayed_not_forwarded(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    async def created(request: web.Request, received: Any) -> web.StreamResponse:
        return web.json_response(
            {"id": len(upstream.received)}, status=201, headers={"X-Upstream": "yes"}
        )

    upstream.respond = created
    first = await fenced(proxy, "j", 1, key="k-1", body={"amount": 5})
    assert first.status == 201
    assert "Idempotent-Replayed" not in first.headers
    again = await fenced(proxy, "j", 1, key="k-1", body={"amount": 5})
    assert again.status == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.headers["X-Upstream"] == "yes"
    assert again.headers["Content-Type"].startswith("application/json")
    assert await again.json() == await first.json() == {"id": 1}
    assert len(upstream.received) == 1


async def test_replay_survives_a_newer_generation(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    assert (await fenced(proxy, "j", 1, key="k", body={"a": 1})).status == 200
    assert (await fenced(proxy, "j", 2)).status == 200
    retry = await fenced(proxy, "j", 1, key="k", body={"a": 1})
    assert retry.status == 200
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert len(upstream.received) == 2


async def test_keys_are_scoped_to_the_job(proxy: Client, upstream: RecordingUpstream) -> None:
    assert (await fenced(proxy, "a", 1, key="k")).status == 200
    assert (await fenced(proxy, "b", 1, key="k")).status == 200
    assert len(upstream.received) == 2


async def test_on_duplicate_reject(start_proxy: ProxyFactory, upstream: RecordingUpstream) -> None:
    proxy = await fencing_with(start_proxy, upstream, on_duplicate="reject")
    assert (await fenced(proxy, "j", 1, key="k")).status == 200
    body = await problem(await fenced(proxy, "j", 1, key="k"), 409, "duplicate-rejected")
    assert body["original_status"] == 200
    assert len(upstream.received) == 1


async def test_same_key_other_body_is_422(proxy: Client, upstream: RecordingUpstream) -> None:
    assert (await fenced(proxy, "j", 1, key="k", body={"amount": 5})).status == 200
    reused = await fenced(proxy, "j", 1, key="k", body={"amount": 6})
    await problem(reused, 422, "idempotency-key-reused")
    other_path = await fenced(proxy, "j", 1, key="k", body={"amount": 5}, path="/billing/x")
    await problem(other_path, 422, "idempotency-key-reused")
    other_method = await fenced(proxy, "j", 1, key="k", body={"amount": 5}, method="PUT")
    await problem(other_method, 422, "idempotency-key-reused")
    assert len(upstream.received) == 1


async def test_same_key_in_flight_is_409(proxy: Client, upstream: RecordingUpstream) -> None:
    release = upstream.hold()
    first = asyncio.ensure_future(fenced(proxy, "j", 1, key="k", body={"a": 1}))
    await upstream.wait_for(1)
    await problem(await fenced(proxy, "j", 1, key="k", body={"a": 1}), 409, "duplicate-in-flight")
    await problem(
        await fenced(proxy, "j", 1, key="k", body={"a": 2}), 422, "idempotency-key-reused"
    )
    release()
    assert (await first).status == 200
    assert len(upstream.received) == 1


async def test_malformed_key_is_400(proxy: Client, upstream: RecordingUpstream) -> None:
    for key in ["", "x" * 256, "clé"]:
        await problem(await fenced(proxy, "j", 1, key=key), 400, "idempotency-key-malformed")
    # Control characters are refused by the HTTP parser itself; other bytes by the proxy.
    for raw in [b"k\x01k", b"k\x7fk", b"\xff\xfe"]:
        answer = await raw_request(proxy.port, _raw_post(b"Idempotency-Key: " + raw))
        assert answer.split(b" ", 2)[1] == b"400", answer
    answer = await raw_request(proxy.port, _raw_post(b"Idempotency-Key: \xc3\xa9"))
    assert PROBLEM_BASE.encode() + b"idempotency-key-malformed" in answer
    assert upstream.received == []


async def test_control_characters_in_fencing_headers_are_400(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    for job in [b"a\x01b", b"a\x7fb", b"\xff\xfe", b"a\x1bb", b"\xc2\x85"]:
        head = b"Fencing-Job: " + job + b"\r\nFencing-Token: 1"
        answer = await raw_request(proxy.port, _raw_post(head, job_and_token=False))
        assert answer.split(b" ", 2)[1] == b"400", answer
    # Invalid UTF-8 and C1 controls reach the proxy, which refuses without echoing them.
    for job in [b"\xff\xfe", b"\xc2\x85"]:
        head = b"Fencing-Job: " + job + b"\r\nFencing-Token: 1"
        answer = await raw_request(proxy.port, _raw_post(head, job_and_token=False))
        assert b"fencing-header-malformed" in answer
        assert job not in answer.partition(b"\r\n\r\n")[2]
    assert upstream.received == []


def _raw_post(extra: bytes, *, job_and_token: bool = True) -> bytes:
    fence = b"Fencing-Job: j\r\nFencing-Token: 1\r\n" if job_and_token else b""
    return (
        b"POST /billing/x HTTP/1.1\r\nHost: proxy\r\nContent-Length: 2\r\n"
        + fence
        + extra
        + b"\r\nConnection: close\r\n\r\n{}"
    )


async def test_upstream_5xx_is_replayed(proxy: Client, upstream: RecordingUpstream) -> None:
    upstream.respond = status(500, b"boom")
    first = await fenced(proxy, "j", 1, key="k")
    assert first.status == 500
    assert await first.read() == b"boom"
    again = await fenced(proxy, "j", 1, key="k")
    assert again.status == 500
    assert again.headers["Idempotent-Replayed"] == "true"
    assert await again.read() == b"boom"
    assert len(upstream.received) == 1


async def test_keys_expire_after_their_ttl(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, clock: FakeClock
) -> None:
    proxy = await start_proxy(idempotency={"ttl": "1h"})
    assert (await fenced(proxy, "j", 1, key="k")).status == 200
    clock.advance(3599)
    assert (await fenced(proxy, "j", 1, key="k")).headers.get("Idempotent-Replayed") == "true"
    clock.advance(2)
    fresh = await fenced(proxy, "j", 1, key="k")
    assert fresh.status == 200
    assert "Idempotent-Replayed" not in fresh.headers
    assert len(upstream.received) == 2


async def test_response_too_large_to_store(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    upstream.respond = status(200, b"x" * 2048)
    proxy = await start_proxy(idempotency={"max_response": 1024})
    first = await fenced(proxy, "j", 1, key="k")
    assert await first.read() == b"x" * 2048
    await problem(await fenced(proxy, "j", 1, key="k"), 409, "duplicate-not-stored")
    assert len(upstream.received) == 1


# -- upstream failures ------------------------------------------------------------


async def test_refused_connection_is_502_and_releases_the_key(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = await start_proxy(
        [
            {"name": "dead", "path": "/dead/", "upstream": dead},
            {"name": "billing", "path": "/billing/", "upstream": upstream.url},
        ]
    )
    body = await problem(
        await fenced(proxy, "j", 1, key="k", path="/dead/x"), 502, "upstream-unreachable"
    )
    assert "connect" in body["detail"]
    # The key was released: the same request is tried again, not refused as a duplicate.
    await problem(await fenced(proxy, "j", 1, key="k", path="/dead/x"), 502, "upstream-unreachable")


async def test_timeout_is_504_and_keeps_the_key_as_unknown(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(
        [{"name": "billing", "path": "/billing/", "upstream": upstream.url, "timeout": "200ms"}]
    )
    release = upstream.hold()
    try:
        await problem(await fenced(proxy, "j", 1, key="k"), 504, "upstream-timeout")
        retry = await fenced(proxy, "j", 1, key="k")
        await problem(retry, 409, "duplicate-outcome-unknown")
    finally:
        release()
    assert len(upstream.received) == 1


async def test_reset_after_send_is_502_and_keeps_the_key_as_unknown(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    upstream.respond = drop_connection
    await problem(await fenced(proxy, "j", 1, key="k", method="PUT"), 502, "upstream-failed")
    await problem(
        await fenced(proxy, "j", 1, key="k", method="PUT"), 409, "duplicate-outcome-unknown"
    )
    # Not re-sent by the HTTP client either, though PUT is idempotent by the book.
    assert len(upstream.received) == 1


async def test_store_failure_fails_closed(proxy: Client, upstream: RecordingUpstream) -> None:
    await store_of(proxy).close()
    await problem(await fenced(proxy, "j", 1), 503, "store-unavailable")
    assert upstream.received == []


# -- a real proxy -----------------------------------------------------------------


async def test_headers_forwarded_and_hop_by_hop_dropped(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    response = await fenced(
        proxy,
        "j",
        3,
        key="k",
        headers={
            "Connection": "keep-alive, X-Secret-Hop",
            "X-Secret-Hop": "1",
            "Keep-Alive": "timeout=5",
            "Proxy-Authorization": "Basic eA==",
            "X-Forwarded-For": "6.6.6.6",
            "Forwarded": "for=6.6.6.6;proto=https",
            "X-Real-IP": "6.6.6.6",
            "X-App": "kept",
        },
    )
    assert response.status == 200
    assert response.headers["Via"] == "1.1 fenceproxy"
    got = upstream.received[0].headers
    assert got["Fencing-Job"] == "j"
    assert got["Fencing-Token"] == "3"
    assert got["Idempotency-Key"] == "k"
    assert got["X-App"] == "kept"
    for hop in ["X-Secret-Hop", "Keep-Alive", "Proxy-Authorization", "Forwarded", "X-Real-IP"]:
        assert hop not in got
    assert got["X-Forwarded-For"] == "127.0.0.1"  # the untrusted client's value is replaced
    assert got["X-Forwarded-Proto"] == "http"
    assert got["X-Forwarded-Host"] == f"127.0.0.1:{proxy.port}"
    assert got["Via"] == "1.1 fenceproxy"
    assert got["Host"] == upstream.url.removeprefix("http://")


async def test_trusted_proxy_forwarded_for_is_appended(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(trusted_proxies=["127.0.0.0/8"])
    await proxy.get("/billing/", headers={"X-Forwarded-For": "203.0.113.9"})
    assert upstream.received[0].headers["X-Forwarded-For"] == "203.0.113.9, 127.0.0.1"


async def test_body_limit_by_content_length_is_413(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(
        [{"name": "billing", "path": "/billing/", "upstream": upstream.url, "max_body": "1KiB"}]
    )
    big = b"x" * 1025
    h = {"Fencing-Job": "j", "Fencing-Token": "1"}
    await problem(await proxy.post("/billing/x", data=big, headers=h), 413, "body-too-large")
    keyed = {**h, "Idempotency-Key": "k"}
    await problem(await proxy.post("/billing/x", data=big, headers=keyed), 413, "body-too-large")
    assert (await proxy.post("/billing/x", data=b"x" * 1024, headers=h)).status == 200
    assert [len(r.body) for r in upstream.received] == [1024]


async def test_chunked_body_over_limit_never_arrives_whole(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(
        [{"name": "billing", "path": "/billing/", "upstream": upstream.url, "max_body": "64KiB"}]
    )

    async def chunks() -> Any:
        for _ in range(4):
            yield b"y" * 32 * 1024

    h = {"Fencing-Job": "j", "Fencing-Token": "1"}
    response = await proxy.post("/billing/x", data=chunks(), headers=h)
    await problem(response, 413, "body-too-large")
    assert upstream.received == []


async def test_streamed_body_keeps_its_content_length(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    payload = bytes(range(256)) * 1000
    h = {"Fencing-Job": "j", "Fencing-Token": "1"}
    assert (await proxy.post("/billing/x", data=payload, headers=h)).status == 200
    got = upstream.received[0]
    assert got.body == payload
    assert got.headers["Content-Length"] == str(len(payload))
    assert "Transfer-Encoding" not in got.headers


async def test_large_response_is_streamed_back(proxy: Client, upstream: RecordingUpstream) -> None:
    blob = b"z" * (3 * 1024 * 1024)
    upstream.respond = status(200, blob)
    response = await fenced(proxy, "j", 1)
    assert await response.read() == blob


async def test_compressed_answers_pass_untouched(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    import gzip

    packed = gzip.compress(b"hello" * 100)

    async def gz(request: web.Request, received: Any) -> web.StreamResponse:
        return web.Response(body=packed, headers={"Content-Encoding": "gzip"})

    upstream.respond = gz
    response = await proxy.get("/billing/x", auto_decompress=False)
    assert response.headers["Content-Encoding"] == "gzip"
    assert await response.read() == packed


async def test_a_method_in_lower_case_never_passes_a_route_fencing_it(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """Many servers take `post` for POST; the parser refuses it before any route, so it
    cannot pass unfenced a route that fences POST (written `post` in the config)."""
    routes = [{"name": "billing", "path": "/billing/", "upstream": upstream.url,
               "fence": {"methods": ["post"]}}]  # fmt: skip
    proxy = await start_proxy(routes)
    port = proxy.server.port  # type: ignore[union-attr]
    head = b"post /billing/x HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n"
    answer = await raw_request(port, head)
    assert answer.split(b"\r\n")[0].split(b" ")[1] == b"400"
    assert b"request-malformed" in answer
    assert upstream.received == []


async def test_a_proxy_with_only_its_lease_api_serves_leases_and_nothing_else(
    start_proxy: ProxyFactory,
) -> None:
    proxy = await start_proxy([], leases={})
    assert (await proxy.post("/_leases/job/claim", json={"owner": "w"})).status == 200
    await problem(await proxy.post("/billing/x"), 404, "no-route")


# -- whose a key is ---------------------------------------------------------------------

SECRET = {"card": "4242-4242-4242-4242", "api_secret": "sk_live_abc123"}


def _secret_answer() -> Any:
    async def respond(request: web.Request, received: object) -> web.StreamResponse:
        return web.json_response(SECRET, status=201, headers={"X-Account": "acct_alice"})

    return respond


async def replayed_secret(answer: ClientResponse) -> None:
    """``answer`` is the secret answer, replayed from the store, not forwarded again."""
    assert answer.status == 201
    assert answer.headers["Idempotent-Replayed"] == "true"
    assert await answer.json() == SECRET


async def test_another_callers_key_is_422_and_tells_nothing_of_its_answer(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    upstream.respond = _secret_answer()
    alice = {"Authorization": "Bearer alice"}
    first = await fenced(proxy, "j", 1, key="k", body={"a": 1}, headers=alice)
    assert first.status == 201
    others: list[dict[str, str]] = [
        {"Authorization": "Bearer mallory"},
        {},  # no credential at all
        {"Authorization": ""},  # an empty one is not an absent one, nor alice's
        {"Cookie": "Bearer alice"},  # alice's value under another header
        {"Authorization": "Bearer alice", "Cookie": "session=other"},
    ]
    for headers in others:
        for generation in (1, 0):  # a stale token too
            answer = await fenced(proxy, "j", generation, key="k", body={"a": 1}, headers=headers)
            body = await problem(answer, 422, "idempotency-key-other-caller")
            assert set(body) <= {"type", "title", "status", "detail", "instance", "job"}
            assert body["job"] == "j"
            text = await answer.text()
            for secret in (*SECRET.values(), "acct_alice", "201", "flight"):
                assert secret not in text
            assert "X-Account" not in answer.headers
            assert "Idempotent-Replayed" not in answer.headers
    # Nor whether the request is the same: another body is refused alike.
    other_body = await fenced(proxy, "j", 1, key="k", body={"a": 2}, headers=others[0])
    await problem(other_body, 422, "idempotency-key-other-caller")
    assert len(upstream.received) == 1
    # Its own caller still gets its answer.
    again = await fenced(proxy, "j", 1, key="k", body={"a": 1}, headers=alice)
    await replayed_secret(again)
    assert len(upstream.received) == 1


async def test_a_caller_is_every_value_of_its_scope_headers_in_order(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    def sent(*pairs: tuple[str, str]) -> CIMultiDict[str]:
        headers: CIMultiDict[str] = CIMultiDict(pairs)
        headers.update({"Fencing-Job": "j", "Fencing-Token": "1", "Idempotency-Key": "k"})
        return headers

    caller = sent(("Cookie", "a=1"), ("Cookie", "b=2"))
    assert (await proxy.post("/billing/x", json={}, headers=caller)).status == 200
    for other in (
        sent(("Cookie", "b=2"), ("Cookie", "a=1")),
        sent(("Cookie", "a=1")),
        sent(("Cookie", "a=1"), ("Cookie", "b=2"), ("Cookie", "")),
    ):
        answer = await proxy.post("/billing/x", json={}, headers=other)
        await problem(answer, 422, "idempotency-key-other-caller")
    again = await proxy.post("/billing/x", json={}, headers=caller)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(upstream.received) == 1


async def test_a_route_without_scope_headers_replays_to_anyone(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await fencing_with(start_proxy, upstream, scope_headers=[])
    upstream.respond = _secret_answer()
    first = await fenced(proxy, "j", 1, key="k", headers={"Authorization": "Bearer alice"})
    assert first.status == 201
    for headers in ({"Authorization": "Bearer bob"}, {}):
        await replayed_secret(await fenced(proxy, "j", 1, key="k", headers=headers))
    assert len(upstream.received) == 1


async def test_keys_can_be_scoped_by_a_header_of_the_apis_own(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await fencing_with(start_proxy, upstream, scope_headers=["X-Api-Key"])
    first = await fenced(proxy, "j", 1, key="k", headers={"X-Api-Key": "alice"})
    assert first.status == 200
    # Only the configured header makes the caller: Authorization is not part of it.
    same = {"X-Api-Key": "alice", "Authorization": "Bearer anything"}
    assert (await fenced(proxy, "j", 1, key="k", headers=same)).headers[
        "Idempotent-Replayed"
    ] == "true"
    # The spelling CGI servers read as X-Api-Key is the same caller to the proxy.
    underscored = await fenced(proxy, "j", 1, key="k", headers={"X_Api_Key": "alice"})
    assert underscored.headers["Idempotent-Replayed"] == "true"
    for other in ({"X-Api-Key": "bob"}, {"Authorization": "Bearer alice"}):
        answer = await fenced(proxy, "j", 1, key="k", headers=other)
        await problem(answer, 422, "idempotency-key-other-caller")
    assert len(upstream.received) == 1


async def test_another_caller_while_the_key_is_in_flight_gets_422_not_409(
    proxy: Client, upstream: RecordingUpstream
) -> None:
    release = upstream.hold()
    alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
    first = asyncio.ensure_future(fenced(proxy, "j", 1, key="k", body={"a": 1}, headers=alice))
    await upstream.wait_for(1)
    answer = await fenced(proxy, "j", 1, key="k", body={"a": 1}, headers=bob)
    body = await problem(answer, 422, "idempotency-key-other-caller")
    assert "Retry-After" not in answer.headers
    assert "flight" not in body["detail"]
    duplicate = await fenced(proxy, "j", 1, key="k", body={"a": 1}, headers=alice)
    await problem(duplicate, 409, "duplicate-in-flight")
    release()
    assert (await first).status == 200
    assert len(upstream.received) == 1


async def test_a_write_that_waits_out_its_timeout_behind_another_of_its_job_is_503(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    """Behind another proxy's write of the job (its in-flight record in the store), or
    behind this proxy's own write held at the upstream: once the route's timeout is
    waited out, 503 `job-quarantined` with Retry-After, and nothing is forwarded. A
    client retries then; a 500 would tell it nothing."""
    proxy = await start_proxy(
        [{"name": "billing", "path": "/billing/", "upstream": upstream.url, "timeout": "300ms"},
         {"name": "slow", "path": "/slow/", "upstream": upstream.url, "timeout": "30s"}]
    )  # fmt: skip
    elsewhere = FencedWrite("billing", "a", 1, hold=30)
    assert isinstance(await admit(store_of(proxy), elsewhere), Admit)
    refused = await fenced(proxy, "a", 1)
    assert (await problem(refused, 503, "job-quarantined"))["job"] == "a"
    assert refused.headers["Retry-After"] == "30"  # when that record ends
    release = upstream.hold()
    try:
        first = asyncio.ensure_future(fenced(proxy, "b", 1, path="/slow/charges"))
        await upstream.wait_for(1)
        refused = await fenced(proxy, "b", 2)
    finally:
        release()
    assert (await first).status == 200
    assert (await problem(refused, 503, "job-quarantined"))["job"] == "b"
    assert refused.headers["Retry-After"] == "1"
    assert [(r.job, r.generation) for r in upstream.received] == [("b", 1)]


async def test_a_writes_record_holds_its_job_for_its_timeouts_quarantine_and_one_second(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, clock: FakeClock
) -> None:
    """As the configuration reference says: an admitted write's in-flight record holds
    its job `connect_timeout` + `timeout` + `quarantine` + 1 s on the store's clock."""
    proxy = await start_proxy(
        [{"name": "billing", "path": "/billing/", "upstream": upstream.url,
          "connect_timeout": "1s", "timeout": "3s", "quarantine": "7s"}]
    )  # fmt: skip
    release = upstream.hold()
    writing = asyncio.ensure_future(fenced(proxy, "j", 1))
    await upstream.wait_for(1)
    try:
        view = await store_of(proxy).inspect("j")
    finally:
        release()
    assert (await writing).status == 200
    assert view.in_flight is not None
    assert view.in_flight[2] == clock.now + 1 + 3 + 7 + 1
    assert (await store_of(proxy).inspect("j")).in_flight is None


@pytest.mark.parametrize(
    ("request_bytes", "says", "forwarded"),
    [
        (b"POST /billing/x HTTP/1.1\r\nHost: a\r\nFencing-Job: j\r\nFencing-Token: 1\r\n"
         b"Content-Length: 2\r\n\r\n{}", b"it may have reached the upstream", 1),
        (b"GET /open/x HTTP/1.1\r\nHost: a\r\n\r\n", b"it may have reached the upstream", 1),
        (b"POST /billing/x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}",
         b"nothing was forwarded", 0),
    ],
    ids=["fenced", "pass-through", "refused"],
)  # fmt: skip
async def test_a_handler_failing_after_the_proxy_forwarded_says_it_may_have(
    proxy_config: Any,
    upstream: RecordingUpstream,
    request_bytes: bytes,
    says: bytes,
    forwarded: int,
) -> None:
    """A bug after the proxy sent a request on (here, once the upstream answered) is a
    500 that says the request may have reached the upstream, so its client does not
    take it for one never sent; a bug before anything left says nothing was forwarded."""
    routes = [
        {"name": "billing", "path": "/billing/", "upstream": upstream.url},
        {"name": "open", "path": "/open/", "upstream": upstream.url, "fence": False},
    ]
    async with FenceProxy(proxy_config(routes)) as proxy:

        async def buggy(request: Request) -> Answer:
            await proxy.handle(request)
            raise RuntimeError("a bug once the answer is in")

        limits = Limits(header_timeout=10, keepalive_timeout=10, send_timeout=10,
                        max_connections=10, max_connections_per_client=None)  # fmt: skip
        listener = Listener(DataPlane(buggy, limits))
        await listener.listen("127.0.0.1", 0)
        try:
            async with asyncio.timeout(10):
                raw = await raw_request(listener.ports[0], request_bytes)
        finally:
            await listener.close()
    assert raw.startswith(b"HTTP/1.1 500 ")
    assert says in raw
    assert len(upstream.received) == forwarded
