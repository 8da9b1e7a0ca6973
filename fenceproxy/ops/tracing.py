"""Traces of the requests the proxy answers, in OpenTelemetry, exported to a collector
over OTLP/HTTP (protobuf): the config's ``tracing:``, off unless set, on the ``otel``
extra (``pip install 'fenceproxy[otel]'``). Nothing imports this module unless
``tracing:`` is set; without it the proxy never looks at the trace context, and a
request's ``traceparent`` and ``tracestate`` reach the upstream as they came.

With it, each request the handler answers has one SERVER span, the child of the
trace context the request carries (W3C ``traceparent``/``tracestate``) or the root of
a new trace; each exchange with an upstream has one CLIENT span beneath it, whose
context replaces ``traceparent`` (and ``tracestate``) on the forwarded request, so the
upstream's own spans are its children, in the worker's trace. A write that is refused
was never forwarded: its trace ends at the proxy. Requests refused at the door
(malformed HTTP, the limits on heads and connections) have no span.

The attributes are OpenTelemetry's HTTP conventions where they exist, and the fence's
own under ``fenceproxy.``: :data:`ATTRIBUTES`, each described in
docs/observability.md.

A span ended is put in the SDK's bounded queue (BatchSpanProcessor: 2048 spans; when
full, the oldest are dropped) and exported in batches from the SDK's thread, never on
a request's path; a collector that cannot be reached costs spans, never a write nor
a request's time. What OpenTelemetry logs of it (each export that fails, each retry)
is held back: one line a minute at most on ``fenceproxy.tracing`` (:class:`_Gate`),
with how many were held back since the last.

Sampling is parent-based: a request whose ``traceparent`` says sampled is recorded,
one that says not is not, whatever the ratio; a new trace is recorded at
``tracing.sample_ratio``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, Mapping
from typing import TypeVar

from multidict import CIMultiDict
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Span as RecordingSpan
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from .._version import __version__
from ..config import TracingSpec, parse_listen
from ..errors import Refusal
from ..http.answer import Answer
from ..http.http1 import UpstreamResponse, encode_fields
from ..http.request import Request
from ..http.routes import Route
from ..http.upstream import Answered, UpstreamPool
from ..log import tracing_log

__all__ = ["ATTRIBUTES", "Tracing"]

T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Answer]]

ATTRIBUTES = frozenset({
    # OpenTelemetry's HTTP semantic conventions.
    "http.request.method", "http.request.method_original", "url.path", "url.scheme",
    "url.full", "server.address", "server.port", "http.route", "http.response.status_code",
    "error.type",
    # The fence's.
    "fenceproxy.route", "fenceproxy.job", "fenceproxy.generation",
    "fenceproxy.current_generation", "fenceproxy.decision", "fenceproxy.refusal",
    "fenceproxy.idempotency", "fenceproxy.store.wait_ms", "fenceproxy.store.batch_operations",
    "fenceproxy.lease.action", "fenceproxy.lease.owner", "fenceproxy.lease.result",
})  # fmt: skip
"""Every attribute a span may carry (docs/observability.md says what each holds)."""

# RFC 9110's methods and PATCH; any other is `_OTHER`, as the conventions say, so a
# client cannot fill the backend with span names of its own.
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE",
                      "PATCH"})  # fmt: skip
_TRACE_FIELDS = (b"traceparent", b"tracestate")
# At close, what is left is exported for this long at most; a collector that does not
# answer by then loses it, and the proxy stops on time.
_FLUSH_AT_CLOSE = 3.0
# What OpenTelemetry logs, at most once in this many seconds.
_TOLD_EVERY = 60.0
# Its loggers that speak of a request's own trace context, one that does not parse
# (the request's trace is then the proxy's own): they quote the client's header.
_CLIENTS_OWN = ("opentelemetry.trace.span", "opentelemetry.trace.propagation")


class Tracing:
    """The proxy's traces: spans made by :meth:`handler`, :meth:`upstreams` and the
    notes the proxy and the lease API take (:meth:`decided`, ...), exported to
    ``spec.endpoint`` with ``headers`` until :meth:`close`; the server spans name the
    proxy's ``listen`` address."""

    def __init__(self, spec: TracingSpec, headers: Mapping[str, str], listen: str) -> None:
        self._exporter: SpanExporter = OTLPSpanExporter(endpoint=spec.endpoint, headers=headers)
        resource = Resource.create({"service.name": "fenceproxy", "service.version": __version__})
        self._provider = TracerProvider(
            resource=resource, sampler=ParentBased(TraceIdRatioBased(spec.sample_ratio))
        )
        self._provider.add_span_processor(BatchSpanProcessor(self._exporter))
        self._tracer = self._provider.get_tracer("fenceproxy", __version__)
        self._propagator = TraceContextTextMapPropagator()
        host, port = parse_listen(listen)
        self._listening: dict[str, str | int] = {"server.address": host, "server.port": port}
        self._batch = 0  # the operations of the store's last commit
        self._gate = _Gate.install(spec.endpoint)

    def handler(self, handle: Handler) -> Handler:
        """``handle`` inside a SERVER span, the child of the request's trace context."""

        async def traced(request: Request) -> Answer:
            span = self._tracer.start_span(
                _method(request.method),
                context=self._propagator.extract(_incoming(request.raw_headers)),
                kind=SpanKind.SERVER,
                attributes={
                    **_method_attributes(request.method),
                    "url.path": _text(request.path),
                    "url.scheme": request.scheme,
                    **self._listening,
                },
            )
            with trace.use_span(span, end_on_exit=True, record_exception=False,
                                set_status_on_exception=False):  # fmt: skip
                try:
                    answer = await handle(request)
                except BaseException as exc:  # a bug (answered 500), or the task cancelled
                    _failed(span, type(exc).__qualname__)
                    raise
                span.set_attribute("http.response.status_code", answer.status)
                if answer.status >= 500:  # a server's span errs on its own faults only
                    _failed(span, str(answer.status))
                _name_by_route(span)
                return answer

        return traced

    def upstreams(self, routes: Iterable[Route], answered: Answered | None) -> UpstreamPool:
        """An upstream pool whose every exchange is a CLIENT span (:class:`_TracedPool`)."""
        return _TracedPool(routes, answered, self)

    def exchange(self, route: Route, method: str, target: str) -> Span:
        """A CLIENT span for an exchange with ``route``'s upstream, the child of the
        request's; the route noted on the request's span (a pass-through's too)."""
        trace.get_current_span().set_attributes(_routed(route))
        upstream = route.upstream
        path = route.base_path + target.partition("?")[0]
        return self._tracer.start_span(
            _method(method),
            kind=SpanKind.CLIENT,
            attributes={
                **_method_attributes(method),
                "server.address": upstream.host or "",
                "server.port": upstream.port or 0,
                # Without the query, which may carry a credential (a signed URL's).
                "url.full": _text(str(upstream) + path),
                "fenceproxy.route": route.name,
            },
        )

    def carry(self, span: Span, fields: bytes | CIMultiDict[str]) -> bytes:
        """The field lines of ``fields`` with ``span``'s trace context in place of the
        client's."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        lines = fields if isinstance(fields, bytes) else encode_fields(fields)
        kept = [
            line
            for line in lines.split(b"\r\n")
            if line and line.partition(b":")[0].strip().lower() not in _TRACE_FIELDS
        ]
        kept += (f"{name}: {value}".encode("ascii") for name, value in carrier.items())
        return b"\r\n".join(kept) + b"\r\n"

    def decided(
        self,
        route: Route,
        job: str | None,
        generation: int | None,
        current: int | None,
        keyed: bool,
        outcome: str,
    ) -> None:
        """Note a fenced write's decision (``outcome``: forwarded, replayed, a refusal's
        slug, or what a report-only route would have done) on the request's span."""
        span = trace.get_current_span()
        if not span.is_recording():
            return
        decision, refusal = _decision(outcome)
        noted = _routed(route) | _fence(job=job, generation=generation, current_generation=current)
        noted["fenceproxy.decision"] = decision
        if refusal is not None:
            noted["fenceproxy.refusal"] = refusal
        if keyed:
            noted["fenceproxy.idempotency"] = _idempotency(outcome)
        span.set_attributes(noted)

    def watch_commits(self, then: Callable[[float, int], object]) -> Callable[[float, int], None]:
        """The store's ``on_commit``: keeps each commit's size for :meth:`admitting`,
        then tells ``then``."""

        def committed(seconds: float, operations: int) -> None:
            self._batch = operations
            then(seconds, operations)

        return committed

    async def admitting(self, admission: Awaitable[T]) -> T:
        """``admission`` (the store's), its time and its transaction's size noted on
        the request's span. A batch tells its commit, then resumes the writes in it,
        before the next batch can commit: the size read on resuming is its own (on
        PostgreSQL a lease call, which is not batched, may commit in between)."""
        span = trace.get_current_span()
        if not span.is_recording():
            return await admission
        started = time.monotonic()
        try:
            return await admission
        finally:
            span.set_attributes({
                "fenceproxy.store.wait_ms": (time.monotonic() - started) * 1000,
                "fenceproxy.store.batch_operations": self._batch,
            })  # fmt: skip

    def lease_call(
        self, prefix: str, action: str, job: str, owner: str, outcome: Refusal | int
    ) -> None:
        """Note a lease API call (``outcome``: the generation granted, or the refusal)."""
        span = trace.get_current_span()
        if not span.is_recording():
            return
        if isinstance(outcome, Refusal):
            result, generation = outcome.slug, outcome.extensions.get("generation")
        else:
            result, generation = "granted", outcome
        span.set_attributes({
            "http.route": f"{prefix}/{{job}}/{action}",
            "fenceproxy.lease.action": action,
            "fenceproxy.lease.owner": _text(owner),
            "fenceproxy.lease.result": result,
            **_fence(job=job, generation=generation),
        })  # fmt: skip

    def refused(self, refusal: Refusal) -> None:
        """Note the refusal a request is answered with."""
        trace.get_current_span().set_attribute("fenceproxy.refusal", refusal.slug)

    async def close(self) -> None:
        """Export the spans left, for :data:`_FLUSH_AT_CLOSE` at most, and stop: what
        a collector has not taken by then is lost, and the exporter is cut short
        (its retries end). Never blocks the event loop."""
        done = threading.Event()

        def shut() -> None:
            self._provider.shutdown()
            done.set()

        # A daemon thread: one stuck on a collector never holds up the process's exit.
        threading.Thread(target=shut, name="fenceproxy-traces-close", daemon=True).start()
        await asyncio.get_running_loop().run_in_executor(None, done.wait, _FLUSH_AT_CLOSE)
        if not done.is_set():
            self._exporter.shutdown()
        self._gate.uninstall()


class _TracedPool(UpstreamPool):
    """An :class:`UpstreamPool` whose every exchange is a CLIENT span, from sending the
    request until the answer's head is in, whose context the upstream receives. In a
    trace not recorded (not sampled) the upstream receives the request's, and is told
    so: a span nobody records is not made."""

    def __init__(
        self, routes: Iterable[Route], answered: Answered | None, tracing: Tracing
    ) -> None:
        self._tracing = tracing
        super().__init__(routes, answered)

    async def send(
        self,
        route: Route,
        method: str,
        target: str,
        headers: CIMultiDict[str] | bytes,
        body: bytes | AsyncIterable[bytes] | None,
        *,
        host: str | None = None,
        length: int | None = None,
    ) -> UpstreamResponse:
        tracing = self._tracing
        parent = trace.get_current_span()
        if not parent.is_recording():
            headers = tracing.carry(parent, headers)
            return await super().send(
                route, method, target, headers, body, host=host, length=length
            )
        span = tracing.exchange(route, method, target)
        try:
            response = await super().send(
                route, method, target, tracing.carry(span, headers), body,
                host=host, length=length,
            )  # fmt: skip
        except Refusal as exc:  # the upstream's failure, as fenceproxy's (UpstreamError)
            _failed(span, exc.slug)
            raise
        except BaseException as exc:  # cut short: the write's deadline, or a cancellation
            _failed(span, type(exc).__qualname__)
            raise
        else:
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 400:  # a client's span errs on any refusal it gets
                _failed(span, str(response.status))
            return response
        finally:
            span.end()


class _Gate(logging.Handler):
    """Everything OpenTelemetry logs, held back: one line a minute at most on
    ``fenceproxy.tracing``, the first that came in the minute, saying how many were
    held back since the last. Installed on the ``opentelemetry`` logger, whose lines no
    longer reach the root's handlers, while any :class:`Tracing` is open. What it says
    of a client's trace context is dropped: a client's header is never echoed into the
    log, nor can a client take the minute's line from a collector that fails."""

    _installed: _Gate | None = None
    _users = 0

    def __init__(self, endpoint: str) -> None:
        super().__init__()
        self._endpoint = endpoint
        self._told_at: float | None = None
        self._held = 0

    @classmethod
    def install(cls, endpoint: str) -> _Gate:
        if cls._installed is None:
            gate = cls._installed = cls(endpoint)
            otel = logging.getLogger("opentelemetry")
            otel.addHandler(gate)
            otel.propagate = False
        cls._users += 1
        return cls._installed

    def uninstall(self) -> None:
        cls = type(self)
        cls._users -= 1
        if cls._users == 0 and cls._installed is not None:
            otel = logging.getLogger("opentelemetry")
            otel.removeHandler(cls._installed)
            otel.propagate = True
            cls._installed = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(_CLIENTS_OWN):
            return
        now = time.monotonic()
        if self._told_at is not None and now - self._told_at < _TOLD_EVERY:
            self._held += 1
            return
        held, self._held, self._told_at = self._held, 0, now
        also = f"; {held} held back since the last" if held else ""
        tracing_log.log(
            record.levelno,
            "traces to %s: %s (OpenTelemetry's next line in a minute at the earliest%s)",
            self._endpoint,
            record.getMessage().rstrip("."),
            also,
        )


def _incoming(fields: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's trace context fields, each once (a field sent twice is joined, as
    a list is: two ``traceparent`` are none that parses)."""
    found: dict[str, str] = {}
    for name, value in fields:
        lower = name.lower()
        if lower in _TRACE_FIELDS:
            key = lower.decode()
            text = value.decode("latin-1")
            found[key] = f"{found[key]},{text}" if key in found else text
    return found


def _routed(route: Route) -> dict[str, AttributeValue]:
    """The attributes of the route a request matched."""
    return {"http.route": route.path, "fenceproxy.route": route.name}


def _name_by_route(span: Span) -> None:
    """A server span's name, ``{method} {http.route}`` once it has a route."""
    if isinstance(span, RecordingSpan) and span.attributes:
        route = span.attributes.get("http.route")
        if route is not None:
            span.update_name(f"{span.name} {route}")


def _method(method: str) -> str:
    return method if method in _METHODS else "HTTP"


def _method_attributes(method: str) -> dict[str, str]:
    if method in _METHODS:
        return {"http.request.method": method}
    return {"http.request.method": "_OTHER", "http.request.method_original": _text(method)}


def _failed(span: Span, kind: str) -> None:
    span.set_attribute("error.type", kind)
    span.set_status(StatusCode.ERROR)


def _decision(outcome: str) -> tuple[str, str | None]:
    """The decision and the refusal kind, of a fenced write's outcome."""
    if outcome in ("forwarded", "replayed", "would-replay"):
        return outcome, None
    if outcome.startswith("would-"):
        return "would-refuse", outcome.removeprefix("would-")
    return "refused", outcome


def _idempotency(outcome: str) -> str:
    """What the key of a keyed write came to, of its outcome."""
    if outcome == "forwarded":
        return "new"
    if outcome in ("replayed", "would-replay"):
        return outcome
    if outcome.removeprefix("would-").startswith(("duplicate-", "idempotency-key-")):
        return "duplicate"
    return "unused"


def _fence(**values: str | int | None) -> dict[str, AttributeValue]:
    """``fenceproxy.<name>`` for each value given."""
    return {
        f"fenceproxy.{name}": _text(value) if isinstance(value, str) else value
        for name, value in values.items()
        if value is not None
    }


def _text(value: str) -> str:
    """A request's text as an attribute can hold it: UTF-8, what came as bytes that are
    not UTF-8 (kept as surrogate escapes, which no encoder takes) replaced."""
    if value.isascii():
        return value
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
