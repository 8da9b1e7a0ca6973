"""Report-only rollout (``fence: {mode: report}``): the same traffic through a route
that enforces and one that reports. The reporting route forwards every write, and
marks exactly those the enforcing one refused or replayed, with the same kind;
metrics, logs and the operator's events say the same."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from fenceproxy.client import refusal_kind
from fenceproxy.store import open_store
from fenceproxy.testing import FakeClock, Received, RecordingUpstream

from .conftest import ProxyFactory
from .test_admin import samples

Client = TestClient[Any, Any]

# (job, token, key, body, extra headers): one of each decision a write can get.
TRAFFIC: list[tuple[str | None, str | None, str | None, bytes, dict[str, str]]] = [
    ("a", "1", None, b"1", {}),  # forwarded
    ("a", "3", None, b"2", {}),  # forwarded, the fence raised to 3
    ("a", "2", None, b"3", {}),  # stale-generation
    ("b", "1", "k-1", b"4", {}),  # forwarded, the key completed
    ("b", "1", "k-1", b"4", {}),  # replayed
    ("b", "1", "k-1", b"other", {}),  # idempotency-key-reused
    (None, "1", None, b"5", {}),  # fencing-header-missing
    ("c", "x", None, b"6", {}),  # fencing-header-malformed
    ("c", "1", None, b"7", {"X-HTTP-Method-Override": "GET, PUT"}),  # method-override-malformed
    ("c", "1", None, b"8", {}),  # forwarded
]


def route(upstream: RecordingUpstream, mode: str) -> dict[str, Any]:
    return {"name": "billing", "path": "/billing/", "upstream": upstream.url,
            "fence": {"mode": mode}}  # fmt: skip


async def send(proxy: Client) -> list[tuple[int, str | None, str | None, str | None]]:
    """Each write's status, its refusal kind, its Fencing-Decision and Idempotent-Replayed."""
    answers = []
    for job, token, key, body, extra in TRAFFIC:
        headers = dict(extra)
        for name, value in (("Fencing-Job", job), ("Fencing-Token", token),
                            ("Idempotency-Key", key)):  # fmt: skip
            if value is not None:
                headers[name] = value
        answer = await proxy.post("/billing/charges", data=body, headers=headers)
        content = await answer.read()
        kind = refusal_kind(answer.status, answer.headers, content)
        answers.append(
            (
                answer.status,
                kind,
                answer.headers.get("Fencing-Decision"),
                answer.headers.get("Idempotent-Replayed"),
            )
        )
    return answers


async def test_report_marks_exactly_what_enforce_refuses_and_forwards_everything(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, tmp_path: Path, clock: FakeClock
) -> None:
    enforcing = await send(await start_proxy([route(upstream, "enforce")]))
    applied = len(upstream.received)
    # The same traffic on a store of its own, as a fresh rollout would have.
    store = await open_store(f"sqlite:///{tmp_path / 'report.db'}", key_ttl=3600, clock=clock)
    try:
        reporting_proxy = await start_proxy([route(upstream, "report")], store=store)
        reporting = await send(reporting_proxy)
        metrics = reporting_proxy.server.proxy.metrics  # type: ignore[union-attr]
        counts = samples(metrics.render().decode())
    finally:
        await store.close()
    assert len(upstream.received) - applied == len(TRAFFIC)  # every write forwarded

    expected: list[str | None] = []
    for status, kind, _, replayed in enforcing:
        if replayed == "true":
            expected.append("would-replay")
        elif kind is not None:
            expected.append(f"would-refuse; kind={kind}")
        else:
            assert status == 200
            expected.append(None)
    assert [decision for _, _, decision, _ in reporting] == expected
    assert expected.count(None) == 4  # and six of each kind the traffic holds
    assert {e for e in expected if e} == {
        "would-refuse; kind=stale-generation",
        "would-replay",
        "would-refuse; kind=idempotency-key-reused",
        "would-refuse; kind=fencing-header-missing",
        "would-refuse; kind=fencing-header-malformed",
        "would-refuse; kind=method-override-malformed",
    }
    assert all(status == 200 for status, _, _, _ in reporting)  # the upstream's answers

    # Counted as would-be decisions, beside the forwarded ones.
    assert counts[("fenceproxy_decisions_total",
                   (("outcome", "would-stale-generation"), ("route", "billing")))] == 1  # fmt: skip
    assert counts[("fenceproxy_decisions_total",
                   (("outcome", "would-replay"), ("route", "billing")))] == 1  # fmt: skip
    assert counts[("fenceproxy_decisions_total",
                   (("outcome", "forwarded"), ("route", "billing")))] == 4  # fmt: skip


@pytest.mark.parametrize("mode", ["report", "enforce"])
def test_mode_is_enforce_or_report(mode: str) -> None:
    from fenceproxy.config import parse_config

    config = parse_config({"routes": [{"name": "b", "path": "/b/", "upstream": "http://h:1",
                                       "fence": {"mode": mode}}]}, "f")  # fmt: skip
    assert config.routes[0].fence is not None
    assert config.routes[0].fence.mode == mode


async def test_a_would_be_refusal_is_logged_and_shown_as_a_refusal_is(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await start_proxy([route(upstream, "report")])
    fence = {"Fencing-Job": "j"}
    assert (await proxy.post("/billing/x", headers={**fence, "Fencing-Token": "5"})).status == 200
    with caplog.at_level(logging.INFO, logger="fenceproxy.decisions"):
        stale = await proxy.post("/billing/x", headers={**fence, "Fencing-Token": "4"})
    assert stale.status == 200
    assert stale.headers["Fencing-Decision"] == "would-refuse; kind=stale-generation"
    (record,) = [r for r in caplog.records if r.name == "fenceproxy.decisions"]
    fields = record.fields  # type: ignore[attr-defined]
    assert (record.levelno, fields["decision"], fields["generation"]) == (
        logging.INFO, "would-stale-generation", 4,
    )  # fmt: skip
    recent = proxy.server.proxy.metrics.recent  # type: ignore[union-attr]
    assert recent.refusals() == {"would-stale-generation": [1, 1, 1]}


@pytest.mark.parametrize("mode", ["report", "enforce"])
async def test_an_upstreams_own_headers_never_pass_for_the_proxys_decision(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, mode: str
) -> None:
    """An API that does idempotency itself answers Idempotent-Replayed; one may even
    answer Fencing-Decision. Neither makes a write count as replayed or would-be
    refused, nor sends it twice."""

    async def own_headers(request: web.Request, received: Received) -> web.StreamResponse:
        headers = {"Idempotent-Replayed": "true", "Fencing-Decision": "would-refuse; kind=x"}
        return web.Response(text="ok", headers=headers)

    upstream.respond = own_headers
    proxy = await start_proxy([route(upstream, mode)])
    fence = {"Fencing-Job": "j", "Fencing-Token": "1", "Idempotency-Key": "k"}
    answer = await proxy.post("/billing/x", data=b"1", headers=fence)
    assert answer.status == 200
    assert "Fencing-Decision" not in answer.headers
    assert len(upstream.received) == 1
    metrics = proxy.server.proxy.metrics  # type: ignore[union-attr]
    counts = samples(metrics.render().decode())
    outcomes = {dict(labels)["outcome"] for (name, labels) in counts
                if name == "fenceproxy_decisions_total"}  # fmt: skip
    assert outcomes == {"forwarded"}
