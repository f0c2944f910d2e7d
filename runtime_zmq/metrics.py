"""Prometheus metrics of one server (prometheus-client, own registry so tests can run several
servers' code in one process). Request counters and latencies are recorded on the loop thread;
gauges are refreshed from ``LookupServer.stats()`` at most once a second (off the hot path)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3, 0.25, 1.0, 5.0, 30.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("mpcache_requests", "Requests answered, by op and outcome", ["op", "outcome"], registry=r)
        self.latency = Histogram("mpcache_request_latency_seconds", "Receive-to-reply latency by op", ["op"], buckets=_LATENCY_BUCKETS, registry=r)
        self.malformed = Counter("mpcache_malformed_messages", "Messages with no readable uid (not answered)", registry=r)
        self.dropped_replies = Counter("mpcache_dropped_replies", "Replies whose peer was gone or full", registry=r)
        self.errors = Counter("mpcache_errors", "Error replies by kind", ["kind"], registry=r)
        self.block_allocation_reports = Counter("mpcache_block_allocation_reports", "report_block_allocation records", registry=r)
        self.l2_reads = Counter("mpcache_l2_objects_read", "Objects read from L2 (attempts)", registry=r)
        self.l2_read_hits = Counter("mpcache_l2_hits", "Objects loaded from L2 into L1", registry=r)
        self.l2_writes = Counter("mpcache_l2_objects_written", "Objects written behind to L2", registry=r)
        self.gauges: dict[str, Gauge] = {}
        self._seen: dict[str, float] = {}

    def update_stats(self, stats: dict[str, Any]) -> None:
        """Export ``stats`` (numbers only) as gauges ``mpcache_state_<name>``."""
        for name, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            g = self.gauges.get(name)
            if g is None:
                safe = "".join(ch if ch.isalnum() else "_" for ch in name)
                g = self.gauges[name] = Gauge(f"mpcache_state_{safe}", f"server stat {name}", registry=self.registry)
            g.set(value)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
