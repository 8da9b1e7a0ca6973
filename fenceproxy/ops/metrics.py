"""Every metric of one proxy, in a Prometheus registry of its own (so two proxies in
one process, as in the tests, never mix). The proxy, the upstream pool and the lease
API record into it; the admin listener serves it at ``/metrics``."""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections.abc import Callable, Iterator
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from .._version import __version__
from ..config import Presented
from ..errors import StoreError
from ..store.base import Store, StoreGauges, StoreServer
from .recent import Recent
from .series import Series

__all__ = ["Metrics"]

# How long a scrape waits for the store's gauges before it says the store is down.
_STORE_READ_WAIT = 2.0
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """Every metric of one proxy, in a registry of its own."""

    def __init__(self) -> None:
        self.recent = Recent()
        """The last decisions and lease calls themselves, for the operator page."""
        self.series = Series()
        """The last hour in buckets, for the operator page's charts."""
        self.registry = CollectorRegistry()
        r = self.registry
        # Counted on every request: plain numbers, turned into samples when scraped.
        self._decisions: dict[tuple[str, str], int] = {}
        self._upstream = _Latencies()
        r.register(_PerRequest(self._decisions, self._upstream))
        self._commits = Histogram(
            "fenceproxy_store_commit_seconds",
            "How long a store transaction took, to its commit",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._batches = Histogram(
            "fenceproxy_store_batch_operations",
            "Operations per committed transaction (SQLite batches them; PostgreSQL: 1)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=r,
        )
        self.in_flight = Gauge(
            "fenceproxy_writes_in_flight",
            "Fenced writes sent upstream whose answer has not come yet",
            registry=r,
        )
        self._leases = Counter(
            "fenceproxy_lease_calls",
            "Lease API calls by action (claim, renew, complete, release) and result "
            "(granted, or the problem kind of the refusal)",
            ["action", "result"],
            registry=r,
        )
        self.claims_waiting = Gauge(
            "fenceproxy_lease_claims_waiting",
            "Claims held waiting for their job (the claim's wait)",
            registry=r,
        )
        self.bodies_held = Gauge(
            "fenceproxy_request_bytes_held",
            "Request bodies held in memory (limits.max_buffered caps it)",
            registry=r,
        )
        self.connections = Gauge(
            "fenceproxy_client_connections", "Open client connections", registry=r
        )
        Info("fenceproxy_build", "The running fenceproxy", registry=r).info(
            {"version": __version__}
        )
        self.store = _StoreMetrics()
        r.register(self.store)
        self.certificates: tuple[Presented, ...] = ()
        """The certificates the proxy presents, as loaded at start and on each reload:
        their ends, for the gauge and the operator page."""
        r.register(_CertificateEnds(lambda: self.certificates))

    def decided(self, route: str, outcome: str, seconds: float) -> None:
        key = (route, outcome)
        self._decisions[key] = self._decisions.get(key, 0) + 1
        self.series.decision(outcome, seconds)

    def upstream_answered(self, route: str, seconds: float, status: int | None) -> None:
        self._upstream.observe(route, -1 if status is None else status // 100, seconds)

    def committed(self, seconds: float, operations: int) -> None:
        self._commits.observe(seconds)
        self._batches.observe(operations)
        self.series.batch(operations)

    def lease_call(self, action: str, result: str) -> None:
        self._leases.labels(action, result).inc()

    def watch(self, bodies_held: Callable[[], float], connections: Callable[[], float]) -> None:
        """Read these gauges from the proxy when scraped."""
        self.bodies_held.set_function(bodies_held)
        self.connections.set_function(connections)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Latencies:
    """``fenceproxy_upstream_seconds``'s buckets, sum and count per route and status
    class, as plain numbers: the event loop is the only writer, so no lock."""

    __slots__ = ("series",)

    def __init__(self) -> None:
        self.series: dict[tuple[str, int], list[float]] = {}
        """(route, status // 100 or -1) -> a count per bucket, then +Inf's, sum, count."""

    def observe(self, route: str, status_class: int, seconds: float) -> None:
        key = (route, status_class)
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = [0.0] * (len(_LATENCY_BUCKETS) + 3)
        series[bisect_left(_LATENCY_BUCKETS, seconds)] += 1
        series[-2] += seconds
        series[-1] += 1


class _PerRequest:
    """The metrics counted on every request, read when scraped."""

    def __init__(self, decisions: dict[tuple[str, str], int], upstream: _Latencies) -> None:
        self._decisions = decisions
        self._upstream = upstream

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily(
            "fenceproxy_decisions",
            "Fenced writes by route and outcome: forwarded, replayed, or the problem kind "
            "of the refusal (stale-generation, duplicate-in-flight, job-quarantined, ...)",
            labels=["route", "outcome"],
        )
        for (route, outcome), count in sorted(self._decisions.items()):
            decisions.add_metric([route, outcome], count)
        yield decisions
        upstream = HistogramMetricFamily(
            "fenceproxy_upstream_seconds",
            "From sending a request upstream to the head of its answer, by route and "
            "status class (2xx ... 5xx, or error when none came)",
            labels=["route", "status_class"],
        )
        for (route, status), series in sorted(self._upstream.series.items()):
            bounds = [*(str(float(b)) for b in _LATENCY_BUCKETS), "+Inf"]
            cumulative = list(accumulate(series[: len(bounds)]))
            upstream.add_metric(
                [route, "error" if status < 0 else f"{status}xx"],
                list(zip(bounds, cumulative, strict=True)),
                series[-2],
            )
        yield upstream


class _StoreMetrics:
    """The store, as :meth:`read` found it for the scrape, and the database server it
    reaches."""

    def __init__(self) -> None:
        self.server: StoreServer | None = None
        """The open store's :attr:`~fenceproxy.store.base.Store.server`."""
        self._scraped = False
        self._gauges: StoreGauges | None = None
        self._reading: asyncio.Task[StoreGauges] | None = None

    async def read(self, store: Store) -> None:
        """Read the store's gauges for the scrape about to be rendered. A store that
        fails, or takes longer than ``_STORE_READ_WAIT``, is down for this scrape,
        which waits no longer. Scrapes that come while a read is under way wait for
        that one: however many come at once, the store serves one read at a time (one
        connection of PostgreSQL's pool, one operation in SQLite's queue), and the
        writes keep the rest."""
        self._scraped = True
        reading = self._reading
        if reading is None:
            reading = self._reading = asyncio.create_task(_gauges(store))
            reading.add_done_callback(self._read_done)
        try:
            async with asyncio.timeout(_STORE_READ_WAIT):
                self._gauges = await asyncio.shield(reading)
        except (StoreError, TimeoutError):
            self._gauges = None

    def _read_done(self, reading: asyncio.Task[StoreGauges]) -> None:
        self._reading = None
        if not reading.cancelled():
            reading.exception()  # told to the scrapes that waited, if any still did

    def describe(self) -> list[Metric]:
        return []  # collected only when scraped, once the store is open

    def collect(self) -> Iterator[Metric]:
        if self._scraped:
            yield from self._read_gauges(self._gauges)
        server = self.server
        if server is None or server.address is None:
            return  # an embedded store reaches no server
        yield CounterMetricFamily(
            "fenceproxy_store_connections",
            "Connections opened to the database: reconnects after a restart or failover add",
            value=server.connections,
        )
        yield CounterMetricFamily(
            "fenceproxy_store_failovers",
            "Times a new connection reached another server than the last: a new primary",
            value=server.changes,
        )
        primary = GaugeMetricFamily(
            "fenceproxy_store_primary",
            "The server (host:port) the store's decisions go to, as last connected: 1",
            labels=["server"],
        )
        primary.add_metric([server.address], 1)
        yield primary

    @staticmethod
    def _read_gauges(gauges: StoreGauges | None) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "fenceproxy_store_up",
            "Whether the store answered this scrape's read: 1, or 0 when it failed or "
            f"took over {_STORE_READ_WAIT:g} s",
            value=0 if gauges is None else 1,
        )
        if gauges is None:
            return
        held = GaugeMetricFamily(
            "fenceproxy_store_jobs_held",
            "Jobs held by a live in-flight record, by its state: in_flight (a write at "
            "the upstream), unknown (its outcome unknown: the job quarantined)",
            labels=["state"],
        )
        for state in ("in_flight", "unknown"):
            held.add_metric([state], gauges.held.get(state, 0))
        yield held
        if gauges.synchronous is not None:
            yield GaugeMetricFamily(
                "fenceproxy_store_synchronous_standby",
                "PostgreSQL with ?require_sync=true: 1 when every commit waits for a "
                "synchronous standby (as that option checks), else 0",
                value=int(gauges.synchronous),
            )


async def _gauges(store: Store) -> StoreGauges:
    """The store's gauges, the read cut after ``_STORE_READ_WAIT``. What cutting it
    takes (on PostgreSQL a cancel request, and the connection's clean-up: seconds when
    the server hangs) is spent here, outside any scrape's wait."""
    async with asyncio.timeout(_STORE_READ_WAIT):
        return await store.gauges()


class _CertificateEnds:
    """``fenceproxy_tls_certificate_expiry_timestamp_seconds``: each certificate the
    proxy presents, labelled ``listener`` (proxy, admin) or ``route`` (its name)."""

    def __init__(self, certificates: Callable[[], tuple[Presented, ...]]) -> None:
        self._certificates = certificates

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        ends = GaugeMetricFamily(
            "fenceproxy_tls_certificate_expiry_timestamp_seconds",
            "When a certificate the proxy presents expires (its notAfter, a Unix time), "
            "by listener (proxy, admin) or by route (its client certificate)",
        )
        for presented in self._certificates():
            ends.add_sample(
                ends.name, {presented.label: presented.name}, presented.certificate.not_after
            )
        yield ends
