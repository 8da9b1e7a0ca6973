"""The lease service end to end over loopback HTTP on a real SQLite file, with the
store's clock moved by hand: one winner among concurrent claimers, generations that
only go up (across expiries, releases, restarts and a clock moved backwards), a
distinct refusal for each way a holder can be wrong, retried completions, the fence
a claim raises in the proxy, request validation and the ``leases:`` config. Then the
pure decisions of :mod:`fenceproxy.leases.model` on their own."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient
from yarl import URL

from fenceproxy.errors import (
    ConfigError,
    JobCompleted,
    LeaseExpired,
    LeaseHeld,
    LeaseMismatch,
    LeaseNotFound,
    LeaseReleased,
    LeaseSuperseded,
    Refusal,
)
from fenceproxy.fence.fencing import GENERATION_MAX
from fenceproxy.leases import model as leasing
from fenceproxy.leases.model import Lease, LeaseState
from fenceproxy.testing import FakeClock, RecordingUpstream, eventually

from .conftest import ProxyFactory, fenced, proxy_of, store_of
from .test_proxy import problem

pytestmark = pytest.mark.both_stores

Client = TestClient[Any, Any]

PREFIX = "/_leases"


@pytest.fixture
async def leases(start_proxy: ProxyFactory) -> Client:
    """A proxy with the lease API on, at its defaults (``leases:`` with nothing under it)."""
    return await start_proxy(leases=None)


async def call(
    client: Client, job: str, action: str, body: Any = None, *, prefix: str = PREFIX
) -> ClientResponse:
    return await client.post(f"{prefix}/{job}/{action}", json=body)


async def claim(
    client: Client, job: str, owner: str, ttl: float | None = None, *, prefix: str = PREFIX
) -> ClientResponse:
    body: dict[str, Any] = {"owner": owner}
    if ttl is not None:
        body["ttl"] = ttl
    return await call(client, job, "claim", body, prefix=prefix)


async def claimed(
    client: Client, job: str, owner: str, ttl: float | None = None, *, prefix: str = PREFIX
) -> dict[str, Any]:
    """Claim and expect success; the lease record answered."""
    response = await claim(client, job, owner, ttl, prefix=prefix)
    assert response.status == 200, await response.text()
    assert response.content_type == "application/json"
    body: dict[str, Any] = await response.json()
    return body


async def renew(
    client: Client, job: str, owner: str, generation: int, ttl: float | None = None
) -> ClientResponse:
    body: dict[str, Any] = {"owner": owner, "generation": generation}
    if ttl is not None:
        body["ttl"] = ttl
    return await call(client, job, "renew", body)


async def complete(client: Client, job: str, owner: str, generation: int) -> ClientResponse:
    return await call(client, job, "complete", {"owner": owner, "generation": generation})


async def release(client: Client, job: str, owner: str, generation: int) -> ClientResponse:
    return await call(client, job, "release", {"owner": owner, "generation": generation})


async def ok(response: ClientResponse) -> dict[str, Any]:
    assert response.status == 200, await response.text()
    body: dict[str, Any] = await response.json()
    return body


async def show(client: Client, job: str, *, prefix: str = PREFIX) -> dict[str, Any]:
    return await ok(await client.get(f"{prefix}/{job}"))


async def invalid(response: ClientResponse, field: str) -> dict[str, Any]:
    """A 422 whose detail and errors name ``field``."""
    body = await problem(response, 422, "lease-request-invalid")
    assert field in body["detail"]
    assert field in [e["field"] for e in body["errors"]], body["errors"]
    return body


# -- one winner -------------------------------------------------------------------


async def test_concurrent_claims_of_a_free_job_have_one_winner(leases: Client) -> None:
    owners = [f"worker-{n}" for n in range(50)]
    responses = await asyncio.gather(*(claim(leases, "job-1", o, ttl=30) for o in owners))
    winners = [r for r in responses if r.status == 200]
    assert len(winners) == 1
    won = await winners[0].json()
    assert won["generation"] == 1
    assert won["owner"] in owners
    for response in responses:
        if response is winners[0]:
            continue
        body = await problem(response, 409, "lease-held")
        assert body["owner"] == won["owner"]
        assert body["generation"] == 1
        assert int(response.headers["Retry-After"]) >= 1
    record = await show(leases, "job-1")
    assert (record["owner"], record["generation"], record["state"]) == (won["owner"], 1, "held")


async def test_concurrent_claims_of_different_jobs_all_win(leases: Client) -> None:
    responses = await asyncio.gather(*(claim(leases, f"job-{n}", "w") for n in range(20)))
    assert [r.status for r in responses] == [200] * 20
    assert {(await r.json())["generation"] for r in responses} == {1}


# -- generations only go up --------------------------------------------------------


async def test_generations_increase_over_expiry_release_and_reclaim(
    leases: Client, clock: FakeClock
) -> None:
    seen = [(await claimed(leases, "j", "a", ttl=5))["generation"]]
    clock.advance(5)  # the lease ends at exactly lease_until
    seen.append((await claimed(leases, "j", "b", ttl=5))["generation"])
    await ok(await release(leases, "j", "b", seen[-1]))
    seen.append((await claimed(leases, "j", "b", ttl=5))["generation"])
    await ok(await release(leases, "j", "b", seen[-1]))
    seen.append((await claimed(leases, "j", "a", ttl=5))["generation"])
    clock.advance(60)
    seen.append((await claimed(leases, "j", "a", ttl=5))["generation"])
    assert seen == [1, 2, 3, 4, 5]


async def test_generations_continue_after_a_restart_on_the_same_file(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, clock: FakeClock
) -> None:
    first = await start_proxy(leases=None)
    g1 = (await claimed(first, "j", "a", ttl=5))["generation"]
    clock.advance(6)
    g2 = (await claimed(first, "j", "b", ttl=5))["generation"]
    await ok(await release(first, "j", "b", g2))
    g3 = (await claimed(first, "j", "c", ttl=5))["generation"]
    await first.close()  # closes the app and its store

    second = await start_proxy(leases=None)
    record = await show(second, "j")
    assert (record["owner"], record["generation"], record["state"]) == ("c", g3, "held")
    await problem(await claim(second, "j", "d"), 409, "lease-held")
    await problem(await renew(second, "j", "a", g1), 409, "lease-superseded")
    clock.advance(6)
    g4 = (await claimed(second, "j", "d", ttl=5))["generation"]
    assert [g1, g2, g3, g4] == [1, 2, 3, 4]
    # The fence the claims raised survived the restart as well.
    assert await store_of(second).generation("j") == g4
    await problem(await fenced(second, "j", g3), 409, "stale-generation")
    assert upstream.received == []


async def test_generation_never_goes_down_when_the_clock_goes_back(
    leases: Client, clock: FakeClock
) -> None:
    g1 = (await claimed(leases, "j", "a", ttl=10))["generation"]
    clock.advance(11)
    g2 = (await claimed(leases, "j", "b", ttl=10))["generation"]
    clock.advance(-3600)
    # B's lease now looks live for an hour more: nobody takes it over...
    held = await claim(leases, "j", "c", ttl=10)
    body = await problem(held, 409, "lease-held")
    assert body["owner"] == "b"
    assert int(held.headers["Retry-After"]) >= 3600
    # ... and A, superseded, stays superseded.
    await problem(await renew(leases, "j", "a", g1), 409, "lease-superseded")
    await ok(await release(leases, "j", "b", g2))
    g3 = (await claimed(leases, "j", "c", ttl=10))["generation"]
    clock.advance(-3600)
    await ok(await release(leases, "j", "c", g3))
    g4 = (await claimed(leases, "j", "a", ttl=10))["generation"]
    assert [g1, g2, g3, g4] == [1, 2, 3, 4]
    assert (await show(leases, "j"))["generation"] == 4


# -- refusals ----------------------------------------------------------------------


async def test_stale_holder_is_superseded_and_the_new_lease_untouched(
    leases: Client, clock: FakeClock
) -> None:
    a = await claimed(leases, "j", "A", ttl=5)
    clock.advance(6)
    b = await claimed(leases, "j", "B", ttl=30)
    assert b["generation"] == a["generation"] + 1
    for response in [
        await renew(leases, "j", "A", a["generation"]),
        await renew(leases, "j", "A", a["generation"], ttl=60),
        await complete(leases, "j", "A", a["generation"]),
        await release(leases, "j", "A", a["generation"]),
    ]:
        body = await problem(response, 409, "lease-superseded")
        assert body["generation"] == a["generation"]
        assert body["current_generation"] == b["generation"]
    assert await show(leases, "j") == b
    # B still holds it: B's own renewal goes through.
    assert (await ok(await renew(leases, "j", "B", b["generation"])))["owner"] == "B"


async def test_worked_example_completion_by_an_older_generation_is_refused(
    leases: Client, clock: FakeClock
) -> None:
    for generation in range(1, 8):  # A ends up holding generation 7
        await claimed(leases, "job", "A", ttl=1)
        clock.advance(2)
        assert (await show(leases, "job"))["generation"] == generation
    b = await claimed(leases, "job", "B", ttl=30)
    assert b["generation"] == 8
    await problem(await complete(leases, "job", "A", 7), 409, "lease-superseded")
    assert (await show(leases, "job"))["state"] == "held"
    assert (await ok(await complete(leases, "job", "B", 8)))["state"] == "completed"


async def test_renew_by_another_owner_at_the_same_generation_is_a_mismatch(
    leases: Client,
) -> None:
    a = await claimed(leases, "j", "A")
    body = await problem(await renew(leases, "j", "B", a["generation"]), 409, "lease-mismatch")
    assert body["current_generation"] == a["generation"]
    await problem(await complete(leases, "j", "B", a["generation"]), 409, "lease-mismatch")
    await problem(await release(leases, "j", "B", a["generation"]), 409, "lease-mismatch")
    # A generation the job never gave out is not the holder's either.
    await problem(await renew(leases, "j", "A", a["generation"] + 1), 409, "lease-mismatch")
    assert await show(leases, "j") == a


async def test_renew_after_expiry_without_successor_is_expired(
    leases: Client, clock: FakeClock
) -> None:
    a = await claimed(leases, "j", "A", ttl=5)
    clock.advance(5.5)
    body = await problem(await renew(leases, "j", "A", a["generation"]), 409, "lease-expired")
    assert body["generation"] == a["generation"]
    await problem(await complete(leases, "j", "A", a["generation"]), 409, "lease-expired")
    await problem(await release(leases, "j", "A", a["generation"]), 409, "lease-expired")
    # Refusals change nothing; the record reads as expired, and the job is free to claim.
    assert await show(leases, "j") == {**a, "expires_in": 0.0, "state": "expired"}
    assert (await claimed(leases, "j", "B"))["generation"] == 2


async def test_renew_after_release_is_released(leases: Client) -> None:
    a = await claimed(leases, "j", "A")
    await ok(await release(leases, "j", "A", a["generation"]))
    await problem(await renew(leases, "j", "A", a["generation"]), 409, "lease-released")
    await problem(await complete(leases, "j", "A", a["generation"]), 409, "lease-released")


async def test_claim_of_a_completed_job_is_refused(leases: Client, clock: FakeClock) -> None:
    a = await claimed(leases, "j", "A", ttl=5)
    await ok(await complete(leases, "j", "A", a["generation"]))
    for owner in ["A", "B"]:
        body = await problem(await claim(leases, "j", owner), 409, "job-completed")
        assert body["generation"] == a["generation"]
    clock.advance(3600)
    await problem(await claim(leases, "j", "B"), 409, "job-completed")
    await problem(await renew(leases, "j", "A", a["generation"]), 409, "job-completed")
    await problem(await release(leases, "j", "A", a["generation"]), 409, "job-completed")
    assert (await show(leases, "j"))["generation"] == a["generation"]


async def test_claim_of_a_live_lease_by_its_own_owner_is_held(
    leases: Client, clock: FakeClock
) -> None:
    a = await claimed(leases, "j", "A", ttl=10)
    clock.advance(4)
    response = await claim(leases, "j", "A", ttl=10)
    body = await problem(response, 409, "lease-held")
    assert (body["owner"], body["generation"]) == ("A", a["generation"])
    assert body["expires_in"] == pytest.approx(6.0)
    assert response.headers["Retry-After"] == "6"
    assert await show(leases, "j") == {**a, "expires_in": pytest.approx(6.0)}


async def test_unknown_job_is_404(leases: Client) -> None:
    for response in [
        await leases.get(f"{PREFIX}/nobody"),
        await renew(leases, "nobody", "A", 1),
        await complete(leases, "nobody", "A", 1),
        await release(leases, "nobody", "A", 0),
    ]:
        body = await problem(response, 404, "lease-not-found")
        assert body["job_id"] == "nobody"


# -- retried completions -----------------------------------------------------------


async def test_completion_retried_after_success_answers_the_same(
    leases: Client, clock: FakeClock
) -> None:
    a = await claimed(leases, "j", "A", ttl=10)
    clock.advance(3)
    done = await ok(await complete(leases, "j", "A", a["generation"]))
    assert (done["state"], done["generation"], done["expires_in"]) == ("completed", 1, 0.0)
    clock.advance(30)  # the reply was lost; the retry comes after the lease would have ended
    assert await ok(await complete(leases, "j", "A", a["generation"])) == done
    assert await ok(await complete(leases, "j", "A", a["generation"])) == done
    assert await show(leases, "j") == done
    assert await store_of(leases).generation("j") == 1
    # Not anyone's retry: another owner is still refused.
    await problem(await complete(leases, "j", "B", a["generation"]), 409, "lease-mismatch")


async def test_release_retried_after_success_answers_the_same(
    leases: Client, clock: FakeClock
) -> None:
    a = await claimed(leases, "j", "A", ttl=10)
    clock.advance(3)
    released = await ok(await release(leases, "j", "A", a["generation"]))
    assert (released["state"], released["expires_in"]) == ("released", 0.0)
    clock.advance(30)
    assert await ok(await release(leases, "j", "A", a["generation"])) == released
    assert await show(leases, "j") == released
    # Once the next holder has claimed, the late retry cannot hurt it.
    b = await claimed(leases, "j", "B")
    await problem(await release(leases, "j", "A", a["generation"]), 409, "lease-superseded")
    await problem(await complete(leases, "j", "A", a["generation"]), 409, "lease-superseded")
    assert await show(leases, "j") == b


# -- the fence a claim raises ------------------------------------------------------


async def test_claim_raises_the_fence_before_the_new_holder_writes(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, clock: FakeClock
) -> None:
    proxy = await start_proxy(leases=None)
    a = await claimed(proxy, "invoice-42", "A", ttl=5)
    assert a["token"] == "1"
    assert (await fenced(proxy, "invoice-42", a["token"], body={"from": "A"})).status == 200
    clock.advance(6)
    b = await claimed(proxy, "invoice-42", "B", ttl=5)
    assert b["token"] == "2"
    assert await store_of(proxy).generation("invoice-42") == 2
    late = await fenced(proxy, "invoice-42", a["token"], body={"from": "A", "late": True})
    body = await problem(late, 409, "stale-generation")
    assert (body["generation"], body["current_generation"]) == (1, 2)
    assert upstream.bodies() == [{"from": "A"}]
    assert (await fenced(proxy, "invoice-42", b["token"], body={"from": "B"})).status == 200
    assert upstream.bodies() == [{"from": "A"}, {"from": "B"}]


async def test_claim_after_a_forged_high_fence_gets_a_token_above_it(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(leases=None)
    assert (await fenced(proxy, "j", 1000, body={"forged": True})).status == 200
    a = await claimed(proxy, "j", "A")
    assert (a["generation"], a["token"]) == (1001, "1001")
    assert (await fenced(proxy, "j", a["token"], body={"from": "A"})).status == 200
    assert upstream.bodies() == [{"forged": True}, {"from": "A"}]


# -- bad requests ------------------------------------------------------------------


async def test_body_that_is_not_json_is_400(leases: Client) -> None:
    for data in [b"", b"owner=a", b"{", b'{"owner": "a",}', b"\xff\xfe{}"]:
        for action in ["claim", "renew", "complete", "release"]:
            response = await leases.post(
                f"{PREFIX}/j/{action}", data=data, headers={"Content-Type": "application/json"}
            )
            await problem(response, 400, "lease-request-malformed")
    await problem(await leases.get(f"{PREFIX}/j"), 404, "lease-not-found")


async def test_json_that_is_not_an_object_is_422(leases: Client) -> None:
    for body in [[], ["owner", "a"], "a", 1]:
        await invalid(await call(leases, "j", "claim", body), "(body)")
    await invalid(await leases.post(f"{PREFIX}/j/claim", data=b"null"), "(body)")


async def test_missing_and_invalid_owner_is_422(leases: Client) -> None:
    await invalid(await call(leases, "j", "claim", {}), "owner")
    await invalid(await call(leases, "j", "claim", {"ttl": 10}), "owner")
    await invalid(await call(leases, "j", "renew", {"generation": 1}), "owner")
    for owner in ["", "x" * 257, 7, None, ["a"], "a\x01b", "a\nb", "a\u200bb", "\x7f"]:
        await invalid(await call(leases, "j", "claim", {"owner": owner}), "owner")
    assert (await claimed(leases, "j", "x" * 256))["owner"] == "x" * 256
    assert (await claimed(leases, "k", "wörker 7"))["owner"] == "wörker 7"


async def test_invalid_ttl_is_422(leases: Client) -> None:
    for ttl in [0, 0.05, -1, 86400.5, 10**9, "abc", "", [], {}]:
        await invalid(await call(leases, "j", "claim", {"owner": "a", "ttl": ttl}), "ttl")
    a = await claimed(leases, "j", "a")
    for ttl in [0.01, 86401, "abc"]:
        body = {"owner": "a", "generation": a["generation"], "ttl": ttl}
        await invalid(await call(leases, "j", "renew", body), "ttl")
    assert await show(leases, "j") == a


async def test_bounds_of_ttl_are_accepted(leases: Client) -> None:
    assert (await claimed(leases, "short", "a", ttl=0.1))["ttl"] == 0.1
    assert (await claimed(leases, "long", "a", ttl=86400))["ttl"] == 86400.0


async def test_ttl_that_is_not_finite_is_422(leases: Client) -> None:
    for literal in [b"NaN", b"Infinity", b"-Infinity"]:
        response = await leases.post(
            f"{PREFIX}/j/claim",
            data=b'{"owner": "a", "ttl": ' + literal + b"}",
            headers={"Content-Type": "application/json"},
        )
        assert response.status in (400, 422), await response.text()
        assert response.content_type == "application/problem+json"


async def test_ttl_as_a_numeric_string_is_422(leases: Client) -> None:
    await invalid(await call(leases, "j", "claim", {"owner": "a", "ttl": "30"}), "ttl")


async def test_ttl_as_a_boolean_is_422(leases: Client) -> None:
    await invalid(await call(leases, "j", "claim", {"owner": "a", "ttl": True}), "ttl")


async def test_invalid_generation_is_422(leases: Client) -> None:
    a = await claimed(leases, "j", "a")
    for action in ["renew", "complete", "release"]:
        await invalid(await call(leases, "j", action, {"owner": "a"}), "generation")
        for generation in [-1, 1.5, "1", True, False, None, 2**63, [1]]:
            body = {"owner": "a", "generation": generation}
            await invalid(await call(leases, "j", action, body), "generation")
    assert await show(leases, "j") == a
    # JSON has one kind of number: 1.0 is the integer 1, as JSON Schema (and the
    # OpenAPI file) and JavaScript have it.
    renewed = await call(leases, "j", "renew", {"owner": "a", "generation": 1.0})
    assert renewed.status == 200


async def test_unknown_field_is_422(leases: Client) -> None:
    await invalid(await call(leases, "j", "claim", {"owner": "a", "until": 5}), "until")
    await invalid(
        await call(leases, "j", "renew", {"owner": "a", "generation": 1, "extra": 1}), "extra"
    )
    # The holder fields take no ttl.
    await invalid(
        await call(leases, "j", "complete", {"owner": "a", "generation": 1, "ttl": 5}), "ttl"
    )
    await invalid(await call(leases, "j", "release", {"owner": "a", "generation": 1, "x": 1}), "x")
    await problem(await leases.get(f"{PREFIX}/j"), 404, "lease-not-found")


async def test_every_invalid_field_is_named(leases: Client) -> None:
    body = await problem(
        await call(leases, "j", "renew", {"owner": "", "generation": -1, "ttl": "x"}),
        422,
        "lease-request-invalid",
    )
    assert {e["field"] for e in body["errors"]} == {"owner", "generation", "ttl"}


async def test_job_with_a_control_character_in_the_path_is_400(leases: Client) -> None:
    for job in ["a%01b", "%00", "a%7Fb", "a%E2%80%8Bb"]:
        for action in ["claim", "renew", "complete", "release"]:
            url = URL(f"{PREFIX}/{job}/{action}", encoded=True)
            response = await leases.post(url, json={"owner": "a", "generation": 1})
            body = await problem(response, 400, "fencing-header-malformed")
            assert body["header"] == "path"
        url = URL(f"{PREFIX}/{job}", encoded=True)
        await problem(await leases.get(url), 400, "fencing-header-malformed")


async def test_job_longer_than_256_bytes_is_400(leases: Client) -> None:
    await problem(await claim(leases, "x" * 257, "a"), 400, "fencing-header-malformed")
    assert (await claimed(leases, "x" * 256, "a"))["job_id"] == "x" * 256


async def test_body_larger_than_64_kib_is_413(leases: Client) -> None:
    body = {"owner": "a", "pad": "x" * (70 * 1024)}
    await problem(await call(leases, "j", "claim", body), 413, "body-too-large")
    await problem(await leases.get(f"{PREFIX}/j"), 404, "lease-not-found")


async def test_deeply_nested_body_is_400_not_500(leases: Client) -> None:
    response = await leases.post(
        f"{PREFIX}/j/claim", data=b"[" * 60_000, headers={"Content-Type": "application/json"}
    )
    await problem(response, 400, "lease-request-malformed")


async def test_body_arriving_in_pieces_is_read_whole(leases: Client) -> None:
    async def pieces() -> AsyncIterator[bytes]:
        yield b'{"owner": '
        await asyncio.sleep(0.1)
        yield b'"slow"}'

    response = await leases.post(f"{PREFIX}/j/claim", data=pieces())
    assert (await ok(response))["owner"] == "slow"


async def test_bad_requests_are_never_500(leases: Client) -> None:
    statuses = []
    for action in ["claim", "renew", "complete", "release"]:
        for data in [b"", b"null", b"[]", b'"x"', b"{}", b'{"owner": {}}', b"\x00", b"1e999"]:
            response = await leases.post(f"{PREFIX}/j/{action}", data=data)
            assert response.content_type == "application/problem+json"
            statuses.append(response.status)
    assert set(statuses) <= {400, 422}, statuses


# -- the config --------------------------------------------------------------------


async def test_empty_leases_section_turns_the_api_on_with_defaults(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    proxy = await start_proxy(leases=None)
    a = await claimed(proxy, "j", "a")
    assert a["ttl"] == 30.0
    assert upstream.received == []


async def test_leases_true_turns_the_api_on(start_proxy: ProxyFactory) -> None:
    proxy = await start_proxy(leases=True)
    assert (await claimed(proxy, "j", "a"))["generation"] == 1


@pytest.mark.parametrize("setting", ["absent", "false"])
async def test_without_leases_the_prefix_is_proxied_like_any_path(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, setting: str
) -> None:
    top = {} if setting == "absent" else {"leases": False}
    no_match = await start_proxy(**top)
    await problem(await claim(no_match, "j", "a"), 404, "no-route")
    await problem(await no_match.get(f"{PREFIX}/j"), 404, "no-route")
    await no_match.close()
    catch_all = await start_proxy(
        [{"name": "all", "path": "/", "upstream": upstream.url, "fence": False}], **top
    )
    response = await claim(catch_all, "j", "a")
    assert response.status == 200
    assert await response.json() == {"applied": True, "path": f"{PREFIX}/j/claim"}
    assert [r.path_qs for r in upstream.received] == [f"{PREFIX}/j/claim"]


@pytest.mark.parametrize("path", ["/_leases/", "/_leases/x/", "/_leases/{job}/"])
def test_route_under_the_prefix_is_a_config_error(
    proxy_config: Callable[..., Any], upstream: RecordingUpstream, path: str
) -> None:
    routes = [{"name": "sneaky", "path": path, "upstream": upstream.url}]
    with pytest.raises(ConfigError) as info:
        proxy_config(routes, leases=None)
    assert "sneaky" in str(info.value)
    assert "/_leases" in str(info.value)
    # The same route is fine when the lease API is off or elsewhere.
    proxy_config(routes)
    proxy_config(routes, leases={"prefix": "/ops/leases"})
    with pytest.raises(ConfigError):
        proxy_config(
            [{"name": "sneaky", "path": "/ops/leases/x/", "upstream": upstream.url}],
            leases={"prefix": "/ops/leases"},
        )


@pytest.mark.parametrize(
    "leases",
    [
        {"prefix": "/_leases/"},
        {"prefix": "_leases"},
        {"prefix": "/"},
        {"prefix": "/a b"},
        {"default_ttl": "2d"},
        {"default_ttl": "50ms"},
        {"min_ttl": 0},
        {"max_ttl": -1},
        {"ttl": 5},
        "yes",
    ],
)
def test_invalid_leases_section_is_a_config_error(
    proxy_config: Callable[..., Any], leases: Any
) -> None:
    with pytest.raises(ConfigError) as info:
        proxy_config(leases=leases)
    assert "leases" in str(info.value)


async def test_custom_prefix_and_ttls(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, clock: FakeClock
) -> None:
    proxy = await start_proxy(
        leases={"prefix": "/ops/leases", "default_ttl": "5s", "min_ttl": "1s", "max_ttl": "1m"}
    )
    a = await claimed(proxy, "j", "a", prefix="/ops/leases")
    assert (a["ttl"], a["expires_in"]) == (5.0, 5.0)
    assert await show(proxy, "j", prefix="/ops/leases") == a
    for ttl in [0.5, 61]:
        await invalid(await claim(proxy, "k", "a", ttl, prefix="/ops/leases"), "ttl")
    await problem(await claim(proxy, "j", "b"), 404, "no-route")  # the default prefix is not it
    assert upstream.received == []


async def test_other_methods_and_endpoints_under_the_prefix_never_reach_the_upstream(
    start_proxy: ProxyFactory, upstream: RecordingUpstream
) -> None:
    for fence in [False, True]:
        proxy = await start_proxy(
            [{"name": "all", "path": "/", "upstream": upstream.url, "fence": fence}], leases=None
        )
        job = f"j-{fence}"
        await claimed(proxy, job, "a")
        for method, path in [
            ("PUT", "/{job}/claim"),
            ("DELETE", "/{job}"),
            ("PATCH", "/{job}"),
            ("POST", "/{job}"),
            ("PUT", "/{job}"),
            ("GET", "/{job}/claim"),
            ("POST", "/{job}/steal"),
            ("POST", "/{job}/claim/extra"),
            ("GET", "/"),
            ("POST", "/"),
            ("OPTIONS", "/{job}/claim"),
        ]:
            response = await proxy.request(
                method,
                PREFIX + path.format(job=job),
                json={"owner": "a"},
                headers={"Fencing-Job": job, "Fencing-Token": "9"},
            )
            await problem(response, 404, "no-route")
        assert upstream.received == []
        assert await store_of(proxy).generation(job) == 1
        await proxy.close()


# -- the response fields ---------------------------------------------------------


async def test_claim_response_fields(leases: Client, clock: FakeClock) -> None:
    response = await claim(leases, "job-7", "worker-a", ttl=12.5)
    assert response.status == 200
    assert response.content_type == "application/json"
    body = await response.json()
    assert body == {
        "job_id": "job-7",
        "owner": "worker-a",
        "generation": 1,
        "token": "1",
        "state": "held",
        "ttl": 12.5,
        "lease_until": clock.now + 12.5,
        "expires_in": 12.5,
    }


async def test_default_ttl_applies_when_omitted(leases: Client, clock: FakeClock) -> None:
    a = await claimed(leases, "j", "a")
    assert (a["ttl"], a["lease_until"], a["expires_in"]) == (30.0, clock.now + 30, 30.0)


async def test_token_is_the_generation_as_text(leases: Client, clock: FakeClock) -> None:
    for n in range(1, 6):
        lease = await claimed(leases, "j", f"w{n}", ttl=1)
        assert (lease["generation"], lease["token"]) == (n, str(n))
        clock.advance(1)


async def test_renew_extends_from_now_by_the_given_or_the_leases_own_ttl(
    leases: Client, clock: FakeClock
) -> None:
    a = await claimed(leases, "j", "a", ttl=10)
    clock.advance(4)
    same = await ok(await renew(leases, "j", "a", a["generation"]))
    assert (same["ttl"], same["lease_until"], same["expires_in"]) == (10.0, clock.now + 10, 10.0)
    assert same["generation"] == a["generation"]
    assert same["token"] == a["token"]
    clock.advance(9)
    longer = await ok(await renew(leases, "j", "a", a["generation"], ttl=60))
    assert (longer["ttl"], longer["lease_until"]) == (60.0, clock.now + 60)
    clock.advance(59)
    again = await ok(await renew(leases, "j", "a", a["generation"]))
    assert again["ttl"] == 60.0  # the lease's own ttl is now the last one asked for
    assert await show(leases, "j") == again


async def test_expires_in_counts_down_on_the_stores_clock(leases: Client, clock: FakeClock) -> None:
    a = await claimed(leases, "j", "a", ttl=10)
    clock.advance(2.5)
    record = await show(leases, "j")
    assert record["expires_in"] == pytest.approx(7.5)
    assert record["lease_until"] == a["lease_until"]
    clock.advance(100)
    assert (await show(leases, "j"))["expires_in"] == 0.0


async def test_state_follows_the_lease(leases: Client, clock: FakeClock) -> None:
    a = await claimed(leases, "j", "a", ttl=10)
    assert (await show(leases, "j"))["state"] == "held"
    released = await ok(await release(leases, "j", "a", a["generation"]))
    assert released["state"] == "released"
    assert released["lease_until"] == clock.now
    assert (await show(leases, "j"))["state"] == "released"
    b = await claimed(leases, "j", "b", ttl=10)
    assert (b["state"], b["generation"]) == ("held", 2)
    clock.advance(1)
    done = await ok(await complete(leases, "j", "b", b["generation"]))
    assert (done["state"], done["lease_until"], done["expires_in"]) == ("completed", clock.now, 0)
    assert await show(leases, "j") == done


# -- claims that wait ----------------------------------------------------------------
# The store's clock is a FakeClock here, so a held lease never runs out by itself: a
# waiting claim gets in only by being woken. Each wait below is bounded well inside
# the proxy's own re-ask (5 s), which would otherwise hide a wake that never came.


async def waiting_claim(client: Client, job: str, owner: str, wait: float) -> asyncio.Task[Any]:
    """A claim with ``wait``, sent; returned once the proxy holds it waiting."""
    claim = asyncio.create_task(call(client, job, "claim", {"owner": owner, "wait": wait}))
    await eventually(lambda: store_of(client).wakes.watched(job) or claim.done())
    return claim


async def test_a_waiting_claim_is_granted_when_the_holder_releases(leases: Client) -> None:
    a = await claimed(leases, "j", "a", ttl=30)
    claim = await waiting_claim(leases, "j", "b", 30)
    assert not claim.done()
    await ok(await release(leases, "j", "a", a["generation"]))
    async with asyncio.timeout(4):
        granted = await ok(await claim)
    assert (granted["owner"], granted["generation"]) == ("b", 2)
    assert granted["waited"] > 0


async def test_a_waiting_claim_is_told_at_once_when_the_holder_completes(leases: Client) -> None:
    a = await claimed(leases, "j", "a", ttl=30)
    claim = await waiting_claim(leases, "j", "b", 30)
    await ok(await complete(leases, "j", "a", a["generation"]))
    async with asyncio.timeout(4):
        refused = await claim
    assert refused.status == 409
    assert (await refused.json())["type"] == "urn:fenceproxy:problem:job-completed"


async def test_a_wait_that_runs_out_is_answered_with_the_refusal(
    leases: Client, clock: FakeClock
) -> None:
    """Counted once, as one claim, however often it was asked again meanwhile."""
    await claimed(leases, "j", "a", ttl=30)
    started = asyncio.get_running_loop().time()
    refused = await call(leases, "j", "claim", {"owner": "b", "wait": 0.3})
    assert asyncio.get_running_loop().time() - started >= 0.3
    assert refused.status == 409
    assert (await refused.json())["type"] == "urn:fenceproxy:problem:lease-held"
    assert int(refused.headers["Retry-After"]) > 0
    metrics = proxy_of(leases).metrics.registry
    held = {"action": "claim", "result": "lease-held"}
    assert metrics.get_sample_value("fenceproxy_lease_calls_total", held) == 1


async def test_a_wait_is_at_most_the_configured_longest(start_proxy: ProxyFactory) -> None:
    client = await start_proxy(leases={"max_wait": "200ms"})
    await claimed(client, "j", "a", ttl=30)
    async with asyncio.timeout(4):  # far less than the 60 s asked for
        refused = await call(client, "j", "claim", {"owner": "b", "wait": 60})
    assert refused.status == 409


async def sent_and_reset(client: Client, job: str, body: dict[str, Any]) -> None:
    """A claim sent whole, its client then gone (its connection reset, unread)."""
    data = json.dumps(body).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", client.port)
    writer.write(
        b"POST %s/%s/claim HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (PREFIX.encode(), job.encode(), len(data), data)
    )
    await writer.drain()
    await eventually(lambda: store_of(client).wakes.watched(job) or not body.get("wait"))
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def test_a_waiting_claim_whose_client_left_is_never_granted(leases: Client) -> None:
    """B stops waiting with its client: when A releases, the job is C's, not held for
    the rest of a ttl by a claim nobody is told of."""
    a = await claimed(leases, "j", "a", ttl=30)
    await sent_and_reset(leases, "j", {"owner": "b", "ttl": 30, "wait": 30})
    await eventually(lambda: not store_of(leases).wakes.watched("j"))
    await ok(await release(leases, "j", "a", a["generation"]))
    c = await claimed(leases, "j", "c", ttl=30)
    assert c["generation"] == a["generation"] + 1


async def test_a_claim_granted_after_its_client_left_is_given_back(leases: Client) -> None:
    """Nobody can be told the job is theirs: the grant is released at once."""
    await sent_and_reset(leases, "j", {"owner": "b", "ttl": 30})
    recent = proxy_of(leases).metrics.recent
    await eventually(lambda: [e.action for e in recent.after(0, "j")] == ["claim", "release"])
    c = await claimed(leases, "j", "c", ttl=30)
    assert c["generation"] == 2


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
async def test_a_claim_waiting_behind_a_write_asks_again_only_when_it_is_answered(
    leases: Client, upstream: RecordingUpstream, clock: FakeClock
) -> None:
    """On a store no other proxy shares, every record is cleared by this proxy, which
    wakes the claim: it does not poll meanwhile."""
    a = await claimed(leases, "j", "a", ttl=30)
    answer = upstream.hold()
    write = asyncio.create_task(fenced(leases, "j", a["generation"], path="/billing/x"))
    await upstream.wait_for(1)
    clock.advance(31)  # the lease ran out; its write is at the upstream
    store, asked = store_of(leases), []
    change_lease = store.change_lease

    async def counted(job: str, change: Any) -> Any:
        asked.append(job)
        return await change_lease(job, change)

    store.change_lease = counted  # type: ignore[method-assign]
    claim = await waiting_claim(leases, "j", "b", 30)
    await asyncio.sleep(0.5)  # a poll would have asked again many times by now
    assert asked == ["j"]
    answer()
    assert (await write).status == 200
    async with asyncio.timeout(4):
        granted = await ok(await claim)
    assert granted["generation"] == a["generation"] + 2  # past the fence the wait raised
    assert asked == ["j", "j"]


@pytest.mark.parametrize("wait", [-1, "10", True])
async def test_a_wait_that_is_not_seconds_is_422(leases: Client, wait: Any) -> None:
    refused = await call(leases, "j", "claim", {"owner": "b", "wait": wait})
    assert refused.status == 422
    assert [e["field"] for e in (await refused.json())["errors"]] == ["wait"]


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("listener_lost", [False, True], ids=["listening", "listener-lost"])
async def test_a_release_through_one_proxy_wakes_a_claim_waiting_on_another(
    start_proxy: ProxyFactory, store_url: str, listener_lost: bool
) -> None:
    """Each proxy listens on the database for the others' releases (LISTEN/NOTIFY). Its
    listening connection is opened again as soon as the server closes it, and every
    waiting claim asks again then: a release told to nobody meanwhile is not missed."""
    one, other = await start_proxy(leases=None), await start_proxy(leases=None)
    a = await claimed(one, "j", "a", ttl=30)
    claim = await waiting_claim(other, "j", "b", 30)
    if listener_lost:
        conn = await asyncpg.connect(store_url)
        try:
            ended = 0
            while not ended:  # the listener, once it listens
                ended = await conn.fetchval(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                    " WHERE query LIKE 'LISTEN %fenceproxy_jobs%'"
                )
        finally:
            await conn.close()
    await ok(await release(one, "j", "a", a["generation"]))
    async with asyncio.timeout(3):  # well before the claim would ask again by itself
        granted = await ok(await claim)
    assert granted["generation"] == 2


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
async def test_a_proxy_listens_for_other_proxies_releases_once_a_claim_waits(
    start_proxy: ProxyFactory, store_url: str
) -> None:
    """Until then it holds its pool and nothing more; then one connection listens."""

    async def listening() -> int:
        conn = await asyncpg.connect(store_url)
        try:
            found = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN fenceproxy_jobs'"
                " OR query LIKE 'LISTEN \"fenceproxy_jobs\"%'"
            )
            return int(found)
        finally:
            await conn.close()

    leases = await start_proxy(leases=None)
    a = await claimed(leases, "j", "a", ttl=30)
    await ok(await release(leases, "j", "a", a["generation"]))
    assert await listening() == 0
    await claimed(leases, "j", "b", ttl=30)
    claim = await waiting_claim(leases, "j", "c", 0.5)
    async with asyncio.timeout(10):
        while await listening() == 0:
            await asyncio.sleep(0.01)
    assert (await claim).status == 409


# -- the pure decisions ------------------------------------------------------------

NOW = 1000.0


def lease(
    generation: int = 3,
    owner: str = "a",
    *,
    until: float = NOW + 10,
    ttl: float = 10.0,
    state: LeaseState = LeaseState.HELD,
) -> Lease:
    return Lease("j", owner, generation, until, ttl, state)


def test_model_claim_of_a_new_job_is_generation_one() -> None:
    assert leasing.claim(None, None, "j", "a", 5.0, NOW) == Lease(
        "j", "a", 1, NOW + 5, 5.0, LeaseState.HELD
    )


@pytest.mark.parametrize(
    ("current", "fence", "expected"),
    [
        (None, 0, 1),
        (None, 41, 42),
        (lease(3, until=NOW), None, 4),
        (lease(3, until=NOW - 1), 3, 4),
        (lease(3, until=NOW - 1), 2, 4),
        (lease(3, until=NOW - 1), 500, 501),
        (lease(3, state=LeaseState.RELEASED), 3, 4),
        (lease(3, state=LeaseState.RELEASED), 9, 10),
    ],
)
def test_model_claim_generation_is_above_lease_and_fence(
    current: Lease | None, fence: int | None, expected: int
) -> None:
    new = leasing.claim(current, fence, "j", "b", 5.0, NOW)
    assert isinstance(new, Lease)
    assert (new.owner, new.generation, new.token, new.state) == (
        "b",
        expected,
        str(expected),
        "held",
    )


def test_model_forged_high_fence_cannot_make_the_new_token_stale() -> None:
    new = leasing.claim(lease(3, until=NOW - 1), GENERATION_MAX - 1, "j", "b", 5.0, NOW)
    assert isinstance(new, Lease)
    assert new.generation == GENERATION_MAX


def test_model_claim_with_no_generation_left_is_refused() -> None:
    refused = leasing.claim(None, GENERATION_MAX, "j", "b", 5.0, NOW)
    assert isinstance(refused, Refusal)
    assert refused.status == 409


def test_model_claim_of_a_live_lease_is_held() -> None:
    for owner in ["a", "b"]:
        refused = leasing.claim(lease(3, until=NOW + 2.5), 3, "j", owner, 5.0, NOW)
        assert isinstance(refused, LeaseHeld)
        assert refused.retry_after == 2.5
        assert refused.extensions["owner"] == "a"
        assert refused.extensions["generation"] == 3


def test_model_claim_of_a_completed_job_is_refused_even_after_expiry() -> None:
    done = lease(3, until=NOW - 100, state=LeaseState.COMPLETED)
    assert isinstance(leasing.claim(done, 3, "j", "b", 5.0, NOW), JobCompleted)


@pytest.mark.parametrize(
    ("current", "owner", "generation", "refusal"),
    [
        (None, "a", 1, LeaseNotFound),
        (lease(3), "a", 2, LeaseSuperseded),
        (lease(3, until=NOW - 1), "a", 2, LeaseSuperseded),
        (lease(3, state=LeaseState.COMPLETED), "b", 0, LeaseSuperseded),
        (lease(3), "b", 3, LeaseMismatch),
        (lease(3), "a", 4, LeaseMismatch),
        (lease(3, until=NOW), "a", 3, LeaseExpired),
        (lease(3, state=LeaseState.RELEASED), "a", 3, LeaseReleased),
        (lease(3, state=LeaseState.COMPLETED), "a", 3, JobCompleted),
    ],
)
def test_model_renew_refusals(
    current: Lease | None, owner: str, generation: int, refusal: type[Refusal]
) -> None:
    assert type(leasing.renew(current, "j", owner, generation, 5.0, NOW)) is refusal


@pytest.mark.parametrize("decide", [leasing.complete, leasing.release])
@pytest.mark.parametrize(
    ("current", "owner", "generation", "refusal"),
    [
        (None, "a", 1, LeaseNotFound),
        (lease(3), "a", 2, LeaseSuperseded),
        (lease(3), "b", 3, LeaseMismatch),
        (lease(3, until=NOW - 0.001), "a", 3, LeaseExpired),
    ],
)
def test_model_end_refusals(
    decide: Callable[..., Any],
    current: Lease | None,
    owner: str,
    generation: int,
    refusal: type[Refusal],
) -> None:
    assert type(decide(current, "j", owner, generation, NOW)) is refusal


def test_model_renew_extends_from_now() -> None:
    held = lease(3, until=NOW + 1, ttl=10.0)
    assert leasing.renew(held, "j", "a", 3, None, NOW) == lease(3, until=NOW + 10, ttl=10.0)
    assert leasing.renew(held, "j", "a", 3, 30.0, NOW) == lease(3, until=NOW + 30, ttl=30.0)


def test_model_complete_and_release_end_the_lease_now_and_are_idempotent() -> None:
    held = lease(3, until=NOW + 5)
    done = leasing.complete(held, "j", "a", 3, NOW)
    assert done == lease(3, until=NOW, state=LeaseState.COMPLETED)
    assert isinstance(done, Lease)
    assert leasing.complete(done, "j", "a", 3, NOW + 100) == done
    assert isinstance(leasing.release(done, "j", "a", 3, NOW), JobCompleted)
    gone = leasing.release(held, "j", "a", 3, NOW)
    assert gone == lease(3, until=NOW, state=LeaseState.RELEASED)
    assert isinstance(gone, Lease)
    assert leasing.release(gone, "j", "a", 3, NOW + 100) == gone
    assert isinstance(leasing.complete(gone, "j", "a", 3, NOW), LeaseReleased)
    # A retry by someone else, or by an older generation, is still refused.
    assert isinstance(leasing.complete(done, "j", "b", 3, NOW), LeaseMismatch)
    assert isinstance(leasing.release(gone, "j", "a", 2, NOW), LeaseSuperseded)


def test_model_lease_is_live_until_lease_until() -> None:
    held = lease(3, until=NOW)
    assert held.live(NOW - 0.001)
    assert not held.live(NOW)
    assert not lease(3, state=LeaseState.RELEASED).live(NOW)
    assert not lease(3, state=LeaseState.COMPLETED).live(NOW)
