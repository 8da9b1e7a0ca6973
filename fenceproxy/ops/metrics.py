"""Every metric of one proxy, in a Prometheus registry of its own (so two proxies in
one process, as in the tests, never mix). The proxy, the upstream pool and the lease
API record into it; the admin listener serves it at ``/metrics``."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .._version import __version__
from ..store.base import StoreServer
from .recent import Recent

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """Every metric of one proxy, in a registry of its own."""

    def __init__(self) -> None:
        self.recent = Recent()
        """The last decisions and lease calls themselves, for the operator page."""
        self.registry = CollectorRegistry()
        r = self.registry
        self._decisions = Counter(
            "fenceproxy_decisions",
            "Fenced writes by route and outcome: forwarded, replayed, or the problem kind "
            "of the refusal (stale-generation, duplicate-in-flight, job-quarantined, ...)",
            ["route", "outcome"],
            registry=r,
        )
        self._upstream = Histogram(
            "fenceproxy_upstream_seconds",
            "From sending a request upstream to the head of its answer, by route and "
            "status class (2xx ... 5xx, or error when none came)",
            ["route", "status_class"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
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
        self._decided: dict[tuple[str, str], Counter] = {}
        self._answered: dict[tuple[str, int], Histogram] = {}

    def decided(self, route: str, outcome: str) -> None:
        key = (route, outcome)
        counter = self._decided.get(key)
        if counter is None:
            counter = self._decided[key] = self._decisions.labels(route, outcome)
        counter.inc()

    def upstream_answered(self, route: str, seconds: float, status: int | None) -> None:
        # One labelled child per route and status class, looked up once: prometheus'
        # labels() costs more than the observation.
        key = (route, -1 if status is None else status // 100)
        histogram = self._answered.get(key)
        if histogram is None:
            status_class = "error" if status is None else f"{status // 100}xx"
            histogram = self._answered[key] = self._upstream.labels(route, status_class)
        histogram.observe(seconds)

    def committed(self, seconds: float, operations: int) -> None:
        self._commits.observe(seconds)
        self._batches.observe(operations)

    def lease_call(self, action: str, result: str) -> None:
        self._leases.labels(action, result).inc()

    def watch(self, bodies_held: Callable[[], float], connections: Callable[[], float]) -> None:
        """Read these gauges from the proxy when scraped."""
        self.bodies_held.set_function(bodies_held)
        self.connections.set_function(connections)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StoreMetrics:
    """The database server the store reaches, read from the store when scraped."""

    def __init__(self) -> None:
        self.server: StoreServer | None = None
        """The open store's :attr:`~fenceproxy.store.base.Store.server`."""

    def describe(self) -> list[Metric]:
        return []  # collected only when scraped, once the store is open

    def collect(self) -> Iterator[Metric]:
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
