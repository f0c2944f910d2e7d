"""Prometheus metrics of one server.

The loop thread records into plain dicts and lists (a counter bump is a dict update, a latency
observation a bisect): prometheus-client's own metric objects cost tens of microseconds per
request in locking and label lookups, more than serving a status query. A custom collector turns
the numbers into metric families only when Prometheus scrapes (on the HTTP thread; the values
are read without a lock, a scrape may be one request stale). Gauges mirror the ``stats`` op.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3, 0.25, 1.0, 5.0, 30.0)


class _Histogram:
    __slots__ = ("counts", "total", "n")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0
        self.n = 0


class ServerMetrics(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]] | None = None) -> None:
        self.requests: dict[tuple[str, str], int] = {}  # (op, outcome) -> count
        self.errors: dict[str, int] = {}  # kind -> count
        self.latency: dict[str, _Histogram] = {}
        self.counters: dict[str, int] = {
            "malformed_messages": 0,
            "dropped_replies": 0,
            "block_allocation_reports": 0,
            "l2_objects_read": 0,
            "l2_hits": 0,
        }
        self._stats = stats
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # hot path -----------------------------------------------------------------------------
    def request(self, op: str, outcome: str, seconds: float) -> None:
        k = (op, outcome)
        self.requests[k] = self.requests.get(k, 0) + 1
        h = self.latency.get(op)
        if h is None:
            h = self.latency[op] = _Histogram()
        h.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        h.total += seconds
        h.n += 1

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    # scrape -------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        req = CounterMetricFamily("mpcache_requests", "Requests answered, by op and outcome", labels=["op", "outcome"])
        for (op, outcome), n in list(self.requests.items()):
            req.add_metric([op, outcome], n)
        yield req
        err = CounterMetricFamily("mpcache_errors", "Error replies by kind", labels=["kind"])
        for kind, n in list(self.errors.items()):
            err.add_metric([kind], n)
        yield err
        lat = HistogramMetricFamily("mpcache_request_latency_seconds", "Receive-to-reply latency by op", labels=["op"])
        for op, h in list(self.latency.items()):
            cum, buckets = 0, []
            for bound, c in zip([*map(str, LATENCY_BUCKETS), "+Inf"], h.counts):
                cum += c
                buckets.append((bound, cum))
            lat.add_metric([op], buckets, h.total)
        yield lat
        for name, n in list(self.counters.items()):
            yield CounterMetricFamily(f"mpcache_{name}", name.replace("_", " "), value=n)
        if self._stats is not None:
            for name, value in self._stats().items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                safe = "".join(ch if ch.isalnum() else "_" for ch in name)
                yield GaugeMetricFamily(f"mpcache_state_{safe}", f"server stat {name}", value=value)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
