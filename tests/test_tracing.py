"""Traces (``tracing:``, fenceproxy.ops.tracing): what an operator sees in a trace
backend and what the upstream receives, with a real OTLP/HTTP collector on loopback
(a recording server, each export decoded with opentelemetry-proto's classes, as a
collector decodes it) and a real proxy. A worker's trace goes through the proxy to
the upstream; a refused write's ends at the proxy, saying why; with tracing off the
trace context passes through untouched; a collector that cannot be reached costs no
write, and one log line."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

from fenceproxy.config import load_config
from fenceproxy.errors import ConfigError
from fenceproxy.ops.tracing import ATTRIBUTES
from fenceproxy.testing import (
    ProxyProcess,
    RawUpstream,
    RecordingUpstream,
    eventually,
    free_port,
)

from .conftest import ProxyFactory, fenced, raw_request, running

SERVER, CLIENT = ProtoSpan.SpanKind.SPAN_KIND_SERVER, ProtoSpan.SpanKind.SPAN_KIND_CLIENT
WORKER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
WORKER_SPAN = "00f067aa0ba902b7"
SAMPLED = f"00-{WORKER_TRACE}-{WORKER_SPAN}-01"


@dataclass(frozen=True)
class Span:
    """One span as the collector received it."""

    trace_id: str
    span_id: str
    parent: str
    name: str
    kind: int
    attributes: dict[str, Any]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def spans(collector: RecordingUpstream) -> list[Span]:
    """Every span the collector received, in the order they came."""
    found = []
    for export in collector.received:
        request = ExportTraceServiceRequest.FromString(export.body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                found += [
                    Span(
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                        span.name,
                        span.kind,
                        {kv.key: _value(kv.value) for kv in span.attributes},
                    )
                    for span in scope.spans
                ]
    return found


async def trace_of(collector: RecordingUpstream, trace_id: str, count: int) -> list[Span]:
    """The ``count`` spans of ``trace_id``, once they came. A client span ends before
    its server span, so it is exported first: once the server span is in, the trace
    is whole."""
    await eventually(lambda: len([s for s in spans(collector) if s.trace_id == trace_id]) >= count)
    return [s for s in spans(collector) if s.trace_id == trace_id]


@pytest.fixture
async def collector(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[RecordingUpstream]:
    """A collector taking OTLP/HTTP exports; the proxies started beside it export
    every 20 ms (the SDK's OTEL_BSP_SCHEDULE_DELAY), not every 5 s."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    async with RecordingUpstream.serve() as up:
        yield up


def tracing(collector: RecordingUpstream, **settings: Any) -> dict[str, Any]:
    return {"endpoint": f"{collector.url}/v1/traces", **settings}


async def test_a_stale_write_s_trace_ends_at_the_proxy_saying_why(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, collector: RecordingUpstream
) -> None:
    """An operator asking why a worker's write was refused finds the refusal on the
    proxy's span in the worker's own trace, and no exchange with the upstream after it:
    nothing was forwarded."""
    proxy = await start_proxy(tracing=tracing(collector))
    assert (await fenced(proxy, "job-1", 2)).status == 200
    stale = await fenced(proxy, "job-1", 1, headers={"traceparent": SAMPLED})
    assert stale.status == 409

    (span,) = await trace_of(collector, WORKER_TRACE, 1)
    assert (span.kind, span.parent, span.name) == (SERVER, WORKER_SPAN, "POST /billing/")
    assert span.attributes == {
        "http.request.method": "POST",
        "url.path": "/billing/charges",
        "url.scheme": "http",
        "server.address": "127.0.0.1",
        "server.port": 8080,  # the config's listen address
        "http.route": "/billing/",
        "http.response.status_code": 409,
        "fenceproxy.route": "billing",
        "fenceproxy.job": "job-1",
        "fenceproxy.generation": 1,
        "fenceproxy.current_generation": 2,
        "fenceproxy.decision": "refused",
        "fenceproxy.refusal": "stale-generation",
        "fenceproxy.store.wait_ms": span.attributes["fenceproxy.store.wait_ms"],
        "fenceproxy.store.batch_operations": 1,
    }
    assert span.attributes["fenceproxy.store.wait_ms"] > 0
    assert len(upstream.received) == 1  # the first write only


async def test_a_forwarded_write_reaches_the_upstream_in_the_worker_s_trace(
    start_proxy: ProxyFactory,
    upstream: RecordingUpstream,
    collector: RecordingUpstream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The upstream gets the worker's trace id with the proxy's client span as its
    parent (and the worker's tracestate), so its own spans sit under the proxy's, which
    sit under the worker's; the collector gets the credential the config names."""
    monkeypatch.setenv("FENCEPROXY_TEST_COLLECTOR_KEY", "s3cret-key")
    secret = {"X-Collector-Key": {"env": "FENCEPROXY_TEST_COLLECTOR_KEY"}}
    proxy = await start_proxy(tracing=tracing(collector, headers=secret))
    sent = {"traceparent": SAMPLED, "tracestate": "vendor=x"}
    assert (await fenced(proxy, "job-1", 1, key="k-1", headers=sent)).status == 200

    (received,) = upstream.received
    version, trace_id, parent, flags = received.headers["traceparent"].split("-")
    assert (version, trace_id, flags) == ("00", WORKER_TRACE, "01")
    assert received.headers.getall("tracestate") == ["vendor=x"]
    client, server = await trace_of(collector, WORKER_TRACE, 2)
    assert (client.kind, server.kind) == (CLIENT, SERVER)
    assert parent == client.span_id
    assert client.parent == server.span_id
    assert server.parent == WORKER_SPAN
    assert server.attributes["fenceproxy.decision"] == "forwarded"
    assert server.attributes["fenceproxy.idempotency"] == "new"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["fenceproxy.store.batch_operations"] >= 1
    upstream_port = int(upstream.url.rsplit(":", 1)[1])
    assert client.name == "POST"
    assert client.attributes == {
        "http.request.method": "POST",
        "server.address": "127.0.0.1",
        "server.port": upstream_port,
        "url.full": f"{upstream.url}/billing/charges",
        "fenceproxy.route": "billing",
        "http.response.status_code": 200,
    }
    assert {r.headers.get("X-Collector-Key") for r in collector.received} == {"s3cret-key"}
    assert set(client.attributes) | set(server.attributes) <= ATTRIBUTES  # each documented


async def test_tracing_off_passes_the_trace_context_through_byte_identical(
    start_proxy: ProxyFactory,
) -> None:
    """Without ``tracing:`` the proxy is no hop of the trace: the upstream gets the
    client's ``traceparent`` and ``tracestate`` fields exactly as sent, even ones
    that do not parse, each in its place."""
    async with RawUpstream.serve() as raw:
        proxy = await start_proxy([{"name": "billing", "path": "/billing/", "upstream": raw.url}])
        fields = [
            b"traceparent: 00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",
            b"tracestate: rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
            b"TraceState: x@y=1",
        ]
        head = b"POST /billing/a HTTP/1.1\r\nHost: a\r\nFencing-Job: j\r\nFencing-Token: 1\r\n"
        end = b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        request = head + b"\r\n".join(fields) + end
        assert b" 200 " in await raw_request(proxy.port, request)
        (received,) = raw.received
        lines = received.head.split(b"\r\n")
        assert [line for line in lines if line.lower().startswith(b"trace")] == fields


async def test_a_lease_call_is_a_span_with_its_outcome(
    start_proxy: ProxyFactory, collector: RecordingUpstream
) -> None:
    """Each claim, renew, complete and release is a server span saying what was asked
    and what came of it: the generation granted, or the refusal."""
    proxy = await start_proxy(leases={}, tracing=tracing(collector))
    other_trace = "0af7651916cd43dd8448eb211c80319c"
    granted = await proxy.post(
        "/_leases/job-9/claim", json={"owner": "a"}, headers={"traceparent": SAMPLED}
    )
    assert granted.status == 200
    held = await proxy.post(
        "/_leases/job-9/claim",
        json={"owner": "b"},
        headers={"traceparent": f"00-{other_trace}-{WORKER_SPAN}-01"},
    )
    assert held.status == 409

    (claim,) = await trace_of(collector, WORKER_TRACE, 1)
    assert claim.name == "POST /_leases/{job}/claim"
    assert claim.attributes["http.route"] == "/_leases/{job}/claim"
    assert claim.attributes["http.response.status_code"] == 200
    lease = {k: v for k, v in claim.attributes.items() if k.startswith("fenceproxy.")}
    assert lease == {
        "fenceproxy.lease.action": "claim",
        "fenceproxy.lease.owner": "a",
        "fenceproxy.lease.result": "granted",
        "fenceproxy.job": "job-9",
        "fenceproxy.generation": 1,
    }
    (refused,) = await trace_of(collector, other_trace, 1)
    assert refused.attributes["fenceproxy.lease.result"] == "lease-held"
    assert refused.attributes["fenceproxy.refusal"] == "lease-held"
    assert refused.attributes["http.response.status_code"] == 409


async def test_a_request_s_own_traceparent_decides_whether_it_is_recorded(
    start_proxy: ProxyFactory, upstream: RecordingUpstream, collector: RecordingUpstream
) -> None:
    """With ``sample_ratio: 0`` the proxy starts no recorded trace of its own, and
    tells the upstream so; a worker whose trace is sampled is still traced through."""
    proxy = await start_proxy(tracing=tracing(collector, sample_ratio=0))
    assert (await fenced(proxy, "job-1", 1)).status == 200
    assert (await fenced(proxy, "job-1", 2, headers={"traceparent": SAMPLED})).status == 200

    await trace_of(collector, WORKER_TRACE, 2)
    # Exported in the order they ended: the first write's would have come first.
    assert {span.trace_id for span in spans(collector)} == {WORKER_TRACE}
    first, second = (r.headers["traceparent"].split("-") for r in upstream.received)
    assert int(first[3], 16) & 1 == 0  # not sampled: the upstream need not record it
    assert (second[1], second[3]) == (WORKER_TRACE, "01")


# An export every 20 ms, each given up after 0.1 s: dozens fail in a second.
FAILING_FAST = {"OTEL_BSP_SCHEDULE_DELAY": "20", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "0.1"}


def traced_to_nobody(tmp_path: Path, upstream: RecordingUpstream) -> tuple[Path, str]:
    """A proxy's config whose traces go where nothing listens, and that endpoint."""
    config = tmp_path / "proxy.yaml"
    nobody = f"http://127.0.0.1:{free_port()}/v1/traces"
    config.write_text(
        yaml.safe_dump({
            "store": f"sqlite:///{tmp_path / 'fences.db'}",
            "tracing": {"endpoint": nobody},
            "routes": [{"name": "billing", "path": "/billing/", "upstream": upstream.url}],
        })
    )  # fmt: skip
    return config, nobody


def told_of_traces(proxy: ProxyProcess) -> list[str]:
    """The proxy's log lines about its traces, its own and OpenTelemetry's."""
    lines = proxy.output().splitlines()
    return [line for line in lines if "fenceproxy.tracing" in line or " opentelemetry" in line]


async def test_a_collector_that_cannot_be_reached_costs_no_write_and_one_log_line(
    tmp_path: Path, upstream: RecordingUpstream, http: aiohttp.ClientSession
) -> None:
    """Every write still goes through while each export fails, and the proxy's log
    says so once, however many exports failed (at most once a minute)."""
    config, nobody = traced_to_nobody(tmp_path, upstream)
    async with running(config, env=FAILING_FAST) as proxy:
        ends = time.monotonic() + 1.5
        generation = 0
        while time.monotonic() < ends:
            generation += 1
            headers = {"Fencing-Job": "j", "Fencing-Token": str(generation)}
            async with http.post(f"{proxy.url}/billing/a", headers=headers) as answer:
                assert answer.status == 200
            await asyncio.sleep(0.01)
        assert len(upstream.received) == generation
        await eventually(lambda: "fenceproxy.tracing" in proxy.output())
        told = told_of_traces(proxy)
    assert len(told) == 1, told
    assert f"traces to {nobody}: " in told[0]


async def test_a_client_s_malformed_trace_context_is_never_logged(
    tmp_path: Path, upstream: RecordingUpstream, http: aiohttp.ClientSession
) -> None:
    """A trace context that does not parse starts a trace of the proxy's own, and its
    text never reaches the log (a client's header is never echoed there), nor takes
    the log's one line a minute about the traces: a collector that cannot be reached
    is still told."""
    config, nobody = traced_to_nobody(tmp_path, upstream)
    async with running(config, env=FAILING_FAST) as proxy:
        for generation, traceparent in enumerate((SAMPLED, "00-forged-by-a-client-01"), 1):
            headers = {
                "Fencing-Job": "j",
                "Fencing-Token": str(generation),
                "traceparent": traceparent,
                "tracestate": "Forged-By-A-Client=1",
            }
            async with http.post(f"{proxy.url}/billing/a", headers=headers) as answer:
                assert answer.status == 200
        await eventually(lambda: "fenceproxy.tracing" in proxy.output())
        told = told_of_traces(proxy)
        output = proxy.output()
    assert len(told) == 1, told
    assert f"traces to {nobody}: " in told[0]
    assert "export" in told[0].lower(), told
    assert "forged" not in output.lower()


async def test_a_reload_keeps_where_traces_go_and_says_so_without_its_secrets(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    """Where traces go changes with a restart only: a reload that changes it says the
    running one stays, naming the endpoint and never the headers' values."""
    config = tmp_path / "proxy.yaml"
    route = {"name": "billing", "path": "/billing/", "upstream": upstream.url}
    store = f"sqlite:///{tmp_path / 'fences.db'}"

    def write(endpoint: str) -> None:
        headers = {"X-Key": "plain-secret", "X-Other": {"env": "FENCEPROXY_TEST_OTLP"}}
        section = {"endpoint": endpoint, "headers": headers}
        config.write_text(yaml.safe_dump({"store": store, "tracing": section, "routes": [route]}))

    write("http://127.0.0.1:1/v1/traces")
    env = {"FENCEPROXY_TEST_OTLP": "env-secret"}
    async with running(config, env=env) as proxy:
        write("http://127.0.0.1:2/v1/traces")
        proxy.signal(signal.SIGHUP)
        await eventually(lambda: "reloaded" in proxy.output())
        output = proxy.output()
    (line,) = [line for line in output.splitlines() if "reloaded" in line]
    assert line.endswith(
        "not changed until a restart: tracing (still to http://127.0.0.1:1/v1/traces)"
    )
    assert "plain-secret" not in output
    assert "env-secret" not in output


def test_tracing_without_the_extra_is_a_config_error_naming_the_extra(tmp_path: Path) -> None:
    """Where OpenTelemetry is not installed, ``tracing:`` is refused at start with the
    command that installs it, never a traceback at the first request."""
    config = tmp_path / "proxy.yaml"
    config.write_text(
        "tracing: {}\nroutes: [{name: a, path: /a/, upstream: 'http://127.0.0.1:9'}]\n"
    )
    # A Python without the otel extra: the package cannot be imported.
    without = (
        "import sys; sys.modules['opentelemetry'] = None; "
        "from fenceproxy.cli import main; sys.exit(main())"
    )
    done = subprocess.run(
        [sys.executable, "-c", without, "check-config", "-c", str(config)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{config}: tracing: traces need OpenTelemetry, which is not installed: " in done.stderr
    assert "pip install 'fenceproxy[otel]'" in done.stderr
    assert "Traceback" not in done.stderr


def refused_headers(config: Path, headers: dict[str, Any]) -> list[str]:
    """The lines of the ConfigError that loading ``config``, written with ``headers``
    for the collector, raises."""
    config.write_text(
        yaml.safe_dump({
            "tracing": {"headers": headers},
            "routes": [{"name": "a", "path": "/a/", "upstream": "http://127.0.0.1:9"}],
        })
    )  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    return refused.value.lines


def test_a_header_secret_that_cannot_be_read_is_a_config_error_naming_its_key(
    tmp_path: Path,
) -> None:
    """A collector's credential read from the environment or a file must be there when
    the file is loaded: the error names the header's key, as every secret's does."""
    config = tmp_path / "proxy.yaml"
    headers = {"Authorization": {"env": "FENCEPROXY_TEST_UNSET"}, "X-Key": {"file": "missing.txt"}}
    assert refused_headers(config, headers) == [
        f"{config}: tracing.headers.Authorization.env: the environment variable "
        "FENCEPROXY_TEST_UNSET is not set",
        f"{config}: tracing.headers.X-Key.file: cannot read {tmp_path / 'missing.txt'}: "
        f"[Errno 2] No such file or directory: '{tmp_path / 'missing.txt'}'",
    ]


@pytest.mark.parametrize("value", [" Bearer s3cret", "Bearer s3cret "])
def test_a_header_value_the_export_could_not_send_is_a_config_error(
    tmp_path: Path, value: str
) -> None:
    """A collector's header written with a space at either end is refused when the
    file is loaded, naming the header and never its value. HTTP strips such spaces;
    sent with a leading one, every export would fail at run time, the failure quoting
    the credential in the log."""
    config = tmp_path / "proxy.yaml"
    assert refused_headers(config, {"Authorization": value}) == [
        f"{config}: tracing.headers: Authorization: a header value is printable ASCII "
        "on one line, without spaces at either end"
    ]
