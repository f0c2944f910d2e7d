"""Prometheus metrics of one server, and the loop's observation hooks.

The loop thread records into plain dicts and lists (a counter bump is a dict update, a latency
observation a bisect): prometheus-client's own metric objects cost tens of microseconds per
request in locking and label lookups, more than serving a status query. A custom collector turns
the numbers into metric families only when Prometheus scrapes (on the HTTP thread; the values
are read without a lock, a scrape may be one request stale).

Names follow Prometheus conventions: counters end in ``_total``, sizes in ``_bytes``, latencies
are ``_seconds`` histograms. ``METRICS`` below is the list of every family this module exposes;
docs/metrics.md is generated from it (``python -m mpcache.runtime_zmq.metrics``) and a test checks that
a live exposition contains exactly these names (plus prometheus-client's standard ``process_*`` and
``python_*`` collectors). Labels are bounded: ``model_name`` / ``cache_salt_hash``
take their first ``LABEL_BUDGET`` distinct pairs, later ones are counted under ``other``.

**No tenant secret in a label.** vLLM's ``cache_salt`` is a tenant's isolation secret, and
``/metrics`` is unauthenticated: a salt is shown as ``cache_salt_hash``, a keyed BLAKE2b of it
(16 hex digits; the key is derived from the server's chunk-chain key, so servers sharing one label
a tenant alike and nobody without the key can test a guessed salt against a label). No salt: ``""``.

Hooks the server loop calls (all on the loop thread, each a few dict operations):
``on_request`` / ``on_reply`` / ``on_error`` per request, ``started`` per L2 or transfer effect,
``on_completion`` per completion event (it also runs ``LoopCall``s posted by the HTTP thread),
``tick`` once a second (gauges, the periodic summary line, folded log repeats).
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("mpcache.server")

LATENCY_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 50e-3, 0.25, 1.0, 5.0, 30.0)
LABEL_BUDGET = 32
_LABEL_CHARS = 64
_MAX_TRACKED_LOOKUPS = 1 << 16
# lookups waiting for their hit count are kept in this many generations, each spanning an
# eighth of the job TTL: a job is answered or reaped within its TTL, so its entry goes between
# one and 1.125 TTLs after its lookup (no per-lookup record outlives its job by long)
_LABEL_GENERATIONS = 8
OTHER = ("other", "other")
# Requests an idle engine keeps sending (heartbeats, polls): they do not make the server busy.
_HEARTBEAT_OPS = frozenset({"ping", "noop", "health", "stats", "l1_info", "get_chunk_size"})

# (name, type, labels, help): every family exposed; docs/metrics.md is generated from this list.
METRICS: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    ("mpcache_build_info", "gauge", ("version", "python"), "Always 1; the labels say which build is running"),
    ("mpcache_up", "gauge", (), "1 while the server loop is serving, 0 while starting or stopping"),
    ("mpcache_requests_total", "counter", ("op", "outcome"), "Requests answered, by wire op and outcome (ok, error)"),
    ("mpcache_errors_total", "counter", ("kind",), "Error replies, by error kind (validation, not_registered, internal, ...)"),
    ("mpcache_request_latency_seconds", "histogram", ("op",), "Receive-to-reply time of a request, by op"),
    ("mpcache_lookups_total", "counter", ("model_name", "cache_salt_hash"), "Lookups acknowledged"),
    ("mpcache_lookup_requested_tokens_total", "counter", ("model_name", "cache_salt_hash"), "Tokens asked for by lookups (chunk-aligned prefix)"),
    ("mpcache_lookup_hit_tokens_total", "counter", ("model_name", "cache_salt_hash"), "Tokens found by lookups (L1 or L2), counted once per lookup when its status is first delivered"),
    ("mpcache_stores_total", "counter", ("outcome",), "STORE / COMMIT_STORE requests answered, by outcome"),
    ("mpcache_l1_capacity_bytes", "gauge", (), "L1 size: slots times slot size"),
    ("mpcache_l1_used_bytes", "gauge", (), "L1 bytes in slots that hold an object or are being written"),
    ("mpcache_l1_slot_bytes", "gauge", (), "Size of one L1 slot (the largest object)"),
    ("mpcache_l1_objects", "gauge", (), "Objects (one chunk of one KV rank) in L1"),
    ("mpcache_l1_evictions_total", "counter", (), "Objects evicted from L1 to make room (LRU)"),
    ("mpcache_l1_leases_held", "gauge", (), "Read/write leases currently held on L1 objects"),
    ("mpcache_l2_up", "gauge", ("tier",), "1 if the last operation on the L2 tier succeeded, 0 after a failure"),
    ("mpcache_l2_bytes", "gauge", ("tier",), "Bytes an L2 tier holds, where the tier reports it"),
    ("mpcache_l2_objects", "gauge", ("tier",), "Objects an L2 tier holds, where the tier reports it"),
    ("mpcache_l2_operations_total", "counter", ("op", "outcome"), "L2 batches finished (read, write, probe) by outcome"),
    ("mpcache_l2_objects_read_total", "counter", ("outcome",), "Objects asked from L2 by reads: hit or miss"),
    ("mpcache_l2_latency_seconds", "histogram", ("op",), "Time from an L2 batch's start to its completion, by op"),
    ("mpcache_copy_latency_seconds", "histogram", ("direction",), "Server-driven KV copy time (GPU store / retrieve), effect to completion"),
    ("mpcache_transfers_total", "counter", ("direction", "outcome"), "Server-driven KV copies finished"),
    ("mpcache_registered_instances", "gauge", (), "Engine instances (workers) registered"),
    ("mpcache_malformed_messages_total", "counter", (), "Messages that could not be attributed to a request (not answered)"),
    ("mpcache_dropped_replies_total", "counter", (), "Replies the peer was gone for, or not reading"),
    ("mpcache_block_allocation_reports_total", "counter", (), "Block allocation records reported by engines"),
    ("mpcache_sm", "counter", ("counter",), "Every other core_sm and runtime counter, by name (mpcache_sm_total{counter=...}); none that a family above already shows"),
    ("mpcache_state", "gauge", ("name",), "Live sizes of core_sm and runtime tables (jobs, tombstones, in-flight work); none that a family above already shows"),
)
# prometheus-client's standard collectors, registered beside ours (docs/metrics.md lists them)
STANDARD_FAMILIES = ("process_", "python_")

# stats that a first-class family above already exposes: left out of mpcache_sm / mpcache_state
_FIRST_CLASS_STATS = frozenset({
    "objects", "evictions", "leases_held", "instances", "l1_num_slots", "l1_slot_bytes", "free_slots",
    "malformed", "dropped_replies", "block_allocation_records", "l2_reads", "l2_read_hits",
})
_NAMES = {name for name, *_ in METRICS}

# What MPCacheConnector adds to vLLM's own /metrics (runtime_zmq/vllm_stats.py builds them; kept
# here so docs/metrics.md lists them without importing vLLM). name -> (type, help)
VLLM_METRICS: dict[str, tuple[str, str]] = {
    "loads": ("counter", "Requests whose KV mpcache loaded"),
    "load_tokens": ("counter", "Tokens loaded from mpcache"),
    "load_bytes": ("counter", "KV bytes loaded from mpcache"),
    "load_failed_blocks": ("counter", "KV blocks whose load from mpcache failed (vLLM recomputed them)"),
    "stores": ("counter", "Requests whose KV was stored to mpcache"),
    "store_tokens": ("counter", "Tokens stored to mpcache"),
    "store_bytes": ("counter", "KV bytes stored to mpcache"),
    "load_seconds": ("histogram", "Time from submitting a request's load to mpcache until vLLM was told it finished"),
    "store_seconds": ("histogram", "Time from submitting a request's stores to mpcache until they finished"),
}

# core_sm / runtime stats that are live sizes (gauges); every other stat is a monotonic count.
_STATE_GAUGES = frozenset({
    "jobs", "jobs_pending", "tombstones", "waiters", "transfers", "instances", "store_waits",
    "pinned_effects", "timers", "reap_queue", "objects", "bytes", "free_slots", "leases_held", "lease_owners",
    "writing", "quarantined_slots", "pinned_slots", "outstanding_requests", "l1_num_slots",
    "l1_slot_bytes", "l1_segment_created", "l2_queued", "l2_tiers_open", "tenants",
})


def _is_gauge(stat: str) -> bool:
    return stat in _STATE_GAUGES or stat.endswith("_in_flight")


class _Histogram:
    __slots__ = ("counts", "total", "n")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds
        self.n += 1


class LoopCall:
    """Work the HTTP thread posts to the loop (through the completion channel): ``fn(server)`` runs
    on the loop thread, its result or exception is handed back. ``wait`` is bounded."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        import threading

        self.fn = fn
        self._done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self, server: Any) -> None:
        try:
            self.result = self.fn(server)
        except BaseException as e:  # handed to the waiter, never raised in the loop
            self.error = e
        self._done.set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)


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
        # keys the salt labels: random until attach() derives it from the server's chunk key
        self._salt_key = os.urandom(32)
        # per (model, cache_salt_hash): [lookups, requested tokens, hit tokens]
        self.tokens: dict[tuple[str, str], list[int]] = {}
        self.stores: dict[str, int] = {}
        self.l2_ops: dict[tuple[str, str], int] = {}
        self.l2_latency: dict[str, _Histogram] = {}
        self.copy_latency: dict[str, _Histogram] = {}
        self.transfers: dict[tuple[str, str], int] = {}
        self._lookups_pending: dict[Any, tuple[str, tuple[str, str], int]] = {}  # reply_to -> (rid, label, tokens)
        # request_id -> its label's row of ``tokens``, until its hits count: newest generation last
        self._label_of_request: list[dict[str, list[int]]] = [{}]
        self._tracked_lookups = 0
        self._generation_s = 7.5  # an eighth of the job TTL (attach)
        self._generation_at = 0.0
        self._status_pending: dict[Any, str] = {}  # reply_to -> request_id
        self._started: dict[tuple[str, Any], tuple[float, str]] = {}  # (kind, id) -> (t0, label)
        self._server: Any = None
        self.chunk_size = 0
        self.config: dict[str, Any] = {}
        self.summary_interval = 0.0
        self.require_l2 = False
        self.repeats: Any = None
        self.serving = False
        self._summary_at = 0.0
        self._summary_base: dict[str, int] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        # what every Prometheus exporter has (process_resident_memory_bytes, python_gc_*, ...), so
        # dashboards built for other exporters join on them
        from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR

        for standard in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(standard)

    def attach(self, server: Any, config: dict[str, Any], repeats: Any = None,
               summary_interval: float = 30.0, require_l2: bool = False) -> None:
        """Give the hooks the server (for gauges, /status and the summary line)."""
        self._server = server
        self.chunk_size = server.config.chunk_size
        chain_key = getattr(getattr(getattr(server, "machine", None), "config", None), "chain_key", None)
        if isinstance(chain_key, bytes) and chain_key and not self.tokens:
            self._salt_key = hashlib.blake2b(b"mpcache-metrics-cache-salt-label", key=chain_key[:64]).digest()
        job_ttl = getattr(server.config, "job_ttl", 60.0)
        self._generation_s = max(0.1, float(job_ttl) / _LABEL_GENERATIONS)
        self.config = config
        self.repeats = repeats
        self.summary_interval = summary_interval
        self.require_l2 = require_l2

    # hot path -----------------------------------------------------------------------------
    def request(self, op: str, outcome: str, seconds: float) -> None:
        k = (op, outcome)
        self.requests[k] = self.requests.get(k, 0) + 1
        h = self.latency.get(op)
        if h is None:
            h = self.latency[op] = _Histogram()
        h.observe(seconds)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def salt_label(self, salt: Any) -> str:
        """What stands for ``salt`` in labels and ``/status``: ``""`` for none, else its keyed hash."""
        if not salt:
            return ""
        return hashlib.blake2b(str(salt).encode("utf-8", "surrogatepass"), key=self._salt_key, digest_size=8).hexdigest()

    def _label(self, model: Any, salt: Any) -> tuple[str, str]:
        label = (str(model)[:_LABEL_CHARS], self.salt_label(salt))
        if label in self.tokens or len(self.tokens) < LABEL_BUDGET:
            return label
        return OTHER

    def _track(self, rid: str, row: list[int]) -> None:
        """Remember which row counts ``rid``'s hits (bounded; see ``_LABEL_GENERATIONS``)."""
        generations = self._label_of_request
        if self._tracked_lookups >= _MAX_TRACKED_LOOKUPS:
            for oldest in generations:
                if oldest:
                    del oldest[next(iter(oldest))]
                    self._tracked_lookups -= 1
                    break
        newest = generations[-1]
        if rid not in newest:
            self._tracked_lookups += 1
        newest[rid] = row

    def _untrack(self, rid: str) -> list[int] | None:
        for generation in reversed(self._label_of_request):
            row = generation.pop(rid, None)
            if row is not None:
                self._tracked_lookups -= 1
                return row
        return None

    def _age_tracked(self, now: float) -> None:
        if now - self._generation_at < self._generation_s:
            return
        self._generation_at = now
        generations = self._label_of_request
        generations.append({})
        if len(generations) > _LABEL_GENERATIONS + 1:
            self._tracked_lookups -= len(generations.pop(0))

    def on_request(self, req: Any, reply_to: Any) -> None:
        op = req.op
        if op == "lookup":
            key: Any = req.args[0].key if req.args else None  # wire.KeyPayload: the CacheKey
            rid = getattr(key, "request_id", None)
            if isinstance(rid, str):
                end = getattr(key, "end", 0)
                self._lookups_pending[reply_to] = (rid, self._label(key.model_name, key.cache_salt), end if isinstance(end, int) else 0)
        elif op == "query_prefetch_status" or op == "wait_prefetch_status":
            if req.args and isinstance(req.args[0], str):
                self._status_pending[reply_to] = req.args[0]
        elif op == "register_instance" or op == "unregister_instance":
            self._lookups_pending[reply_to] = (op, ("", ""), req.args[0] if req.args and isinstance(req.args[0], int) else -1)

    def on_reply(self, rt: Any, op: str, result: Any) -> None:
        if op == "lookup":
            pending = self._lookups_pending.pop(rt, None)
            if pending is not None:
                rid, label, tokens = pending
                row = self.tokens.get(label)
                if row is None:
                    row = self.tokens[label] = [0, 0, 0]
                row[0] += 1
                row[1] += tokens
                self._track(rid, row)
        elif op == "query_prefetch_status" or op == "wait_prefetch_status":
            status_of = self._status_pending.pop(rt, "")
            if status_of and type(result) is int:
                hit_row = self._untrack(status_of)
                if hit_row is not None:
                    hit_row[2] += result * self.chunk_size
        elif op == "store" or op == "commit_store":
            self.stores["ok"] = self.stores.get("ok", 0) + 1
        elif op == "register_instance" or op == "unregister_instance":
            self._registration(rt, op, None)

    def on_error(self, rt: Any, op: str, kind: str, message: str) -> None:
        if op == "store" or op == "commit_store":
            self.stores["error"] = self.stores.get("error", 0) + 1
        elif op == "register_instance" or op == "unregister_instance":
            self._registration(rt, op, f"{kind}: {message}")
        elif kind == "internal":
            log.error("%s answered internal error: %s", op, message)
        if self._lookups_pending or self._status_pending:
            self._lookups_pending.pop(rt, None)
            self._status_pending.pop(rt, None)

    def _registration(self, rt: Any, op: str, refused: str | None) -> None:
        pending = self._lookups_pending.pop(rt, None)
        instance = pending[2] if pending is not None else "?"
        peer = rt[0].hex()[:16] if isinstance(rt, tuple) and rt and isinstance(rt[0], bytes) else "?"
        what = "registration" if op == "register_instance" else "unregistration"
        if refused is None:
            detail = ""
            server = self._server
            if op == "register_instance" and server is not None:
                nbytes = getattr(server, "instance_bytes", {}).get(instance)
                if nbytes:
                    detail = f", {nbytes} bytes per object"
            log.info("instance %s %s accepted (peer %s%s)", instance, what, peer, detail, extra={"instance": instance, "no_fold": True})
        else:
            log.warning("instance %s %s refused (peer %s): %s", instance, what, peer, refused, extra={"instance": instance, "no_fold": True})

    def started(self, effect: Any, now: float) -> None:
        name = type(effect).__name__
        if name == "ReadL2":
            self._started[("l2", effect.read_id)] = (now, "read")
        elif name == "WriteL2":
            self._started[("l2", effect.write_id)] = (now, "write")
        elif name == "ProbeL2":
            self._started[("l2", effect.probe_id)] = (now, "probe")
        elif name == "StartTransfer":
            kind = getattr(effect.kind, "name", str(effect.kind)).lower()
            self._started[("copy", effect.transfer_id)] = (now, kind)

    def on_completion(self, ev: Any, now: float) -> bool:
        """Observe a completion; True when it was a LoopCall (handled here, not by core_sm)."""
        if type(ev) is LoopCall:
            ev.run(self._server)
            return True
        name = type(ev).__name__
        if name == "TransferFinished":
            began = self._started.pop(("copy", ev.transfer_id), None)
            direction = began[1] if began is not None else "unknown"
            k = (direction, "ok" if ev.ok else "failed")
            self.transfers[k] = self.transfers.get(k, 0) + 1
            if began is not None:
                self._observe(self.copy_latency, direction, now - began[0])
        elif name in ("L2ReadFinished", "L2WriteFinished", "L2ProbeFinished"):
            ident = getattr(ev, "read_id", None) if name == "L2ReadFinished" else (
                getattr(ev, "write_id", None) if name == "L2WriteFinished" else getattr(ev, "probe_id", None))
            began = self._started.pop(("l2", ident), None)
            op = name[2:-8].lower()
            ok = getattr(ev, "ok", True)
            k = (op, "ok" if ok else "failed")
            self.l2_ops[k] = self.l2_ops.get(k, 0) + 1
            if began is not None:
                self._observe(self.l2_latency, op, now - began[0])
        return False

    @staticmethod
    def _observe(table: dict[str, _Histogram], label: str, seconds: float) -> None:
        h = table.get(label)
        if h is None:
            h = table[label] = _Histogram()
        h.observe(seconds)

    def tick(self, now: float) -> None:
        """Once a second on the loop: the summary line when due, folded log repeats."""
        self.serving = True
        self._age_tracked(now)
        if self.repeats is not None:
            self.repeats.flush()
        if self.summary_interval > 0 and now - self._summary_at >= self.summary_interval:
            if self._summary_at:
                self._summary(now - self._summary_at)
            self._summary_at = now

    def _summary(self, elapsed: float) -> None:
        from mpcache.runtime_zmq import logs

        totals = {
            "requests": sum(n for (op, _outcome), n in self.requests.items() if op not in _HEARTBEAT_OPS),
            "lookups": sum(r[0] for r in self.tokens.values()),
            "requested": sum(r[1] for r in self.tokens.values()),
            "hits": sum(r[2] for r in self.tokens.values()),
            "stores": sum(self.stores.values()),
            "errors": sum(self.errors.values()),
        }
        delta = {k: v - self._summary_base.get(k, 0) for k, v in totals.items()}
        self._summary_base = totals
        if delta["requests"] == 0:
            return  # idle (an engine's heartbeats do not count): nothing to say
        log.info("%s", logs.summary_line(elapsed, delta, self.l1_usage(), self.l2_state(),
                                         {k: n for k, n in self.errors.items()}),
                 extra={"summary": delta, "no_fold": True})

    # state for gauges, /status and the summary ----------------------------------------------
    def _snapshot(self) -> dict[str, Any]:
        if self._stats is None:
            return {}
        try:
            return dict(self._stats())
        except Exception:
            return {}

    def l1_usage(self, stats: dict[str, Any] | None = None) -> dict[str, int]:
        s = self._snapshot() if stats is None else stats
        slots = int(s.get("l1_num_slots", 0) or 0)
        slot = int(s.get("l1_slot_bytes", 0) or 0)
        free = int(s.get("free_slots", slots) or 0)
        return {
            "capacity_bytes": slots * slot, "used_bytes": max(0, slots - free) * slot,
            "slot_bytes": slot, "objects": int(s.get("objects", 0) or 0),
            "object_bytes": int(s.get("bytes", 0) or 0),
        }

    def l2_state(self) -> list[dict[str, Any]]:
        """Per tier: ``tier`` (its name, no password), ``up`` (its circuit breaker is closed),
        ``state``, and ``bytes`` / ``objects`` where the tier reports them (``stats()``)."""
        server = self._server
        if server is None:
            return []
        worker = server.l2
        states = worker.tier_states() if hasattr(worker, "tier_states") else [
            {"tier": repr(t), "state": "closed"} for t in worker.tiers]
        out = []
        for tier, state in zip(list(worker.tiers), states):
            row: dict[str, Any] = {"tier": str(getattr(tier, "name", state["tier"])), "state": state["state"],
                                   "up": state["state"] == "closed"}
            stats = getattr(tier, "stats", None)
            if callable(stats):
                try:
                    st = stats()
                    for k in ("bytes", "objects"):
                        if isinstance(st.get(k), int):
                            row[k] = st[k]
                except Exception:
                    pass
            out.append(row)
        return out

    # scrape -------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        from mpcache.runtime_zmq.config import version

        info = GaugeMetricFamily("mpcache_build_info", _help("mpcache_build_info"), labels=["version", "python"])
        import platform

        info.add_metric([version(), platform.python_version()], 1)
        yield info
        yield GaugeMetricFamily("mpcache_up", _help("mpcache_up"), value=1 if self.serving and not getattr(self._server, "stopping", False) else 0)
        req = CounterMetricFamily("mpcache_requests", _help("mpcache_requests_total"), labels=["op", "outcome"])
        for (op, outcome), n in list(self.requests.items()):
            req.add_metric([op, outcome], n)
        yield req
        err = CounterMetricFamily("mpcache_errors", _help("mpcache_errors_total"), labels=["kind"])
        for kind, n in list(self.errors.items()):
            err.add_metric([kind], n)
        yield err
        yield _histogram("mpcache_request_latency_seconds", "op", self.latency)
        lookups = CounterMetricFamily("mpcache_lookups", _help("mpcache_lookups_total"), labels=["model_name", "cache_salt_hash"])
        requested = CounterMetricFamily("mpcache_lookup_requested_tokens", _help("mpcache_lookup_requested_tokens_total"), labels=["model_name", "cache_salt_hash"])
        hit = CounterMetricFamily("mpcache_lookup_hit_tokens", _help("mpcache_lookup_hit_tokens_total"), labels=["model_name", "cache_salt_hash"])
        for label, row in list(self.tokens.items()):
            lookups.add_metric(list(label), row[0])
            requested.add_metric(list(label), row[1])
            hit.add_metric(list(label), row[2])
        yield lookups
        yield requested
        yield hit
        stores = CounterMetricFamily("mpcache_stores", _help("mpcache_stores_total"), labels=["outcome"])
        for outcome, n in list(self.stores.items()):
            stores.add_metric([outcome], n)
        yield stores
        stats = self._snapshot()
        l1 = self.l1_usage(stats)
        yield GaugeMetricFamily("mpcache_l1_capacity_bytes", _help("mpcache_l1_capacity_bytes"), value=l1["capacity_bytes"])
        yield GaugeMetricFamily("mpcache_l1_used_bytes", _help("mpcache_l1_used_bytes"), value=l1["used_bytes"])
        yield GaugeMetricFamily("mpcache_l1_slot_bytes", _help("mpcache_l1_slot_bytes"), value=l1["slot_bytes"])
        yield GaugeMetricFamily("mpcache_l1_objects", _help("mpcache_l1_objects"), value=l1["objects"])
        yield CounterMetricFamily("mpcache_l1_evictions", _help("mpcache_l1_evictions_total"), value=int(stats.get("evictions", 0) or 0))
        yield GaugeMetricFamily("mpcache_l1_leases_held", _help("mpcache_l1_leases_held"), value=int(stats.get("leases_held", 0) or 0))
        up = GaugeMetricFamily("mpcache_l2_up", _help("mpcache_l2_up"), labels=["tier"])
        nbytes = GaugeMetricFamily("mpcache_l2_bytes", _help("mpcache_l2_bytes"), labels=["tier"])
        nobj = GaugeMetricFamily("mpcache_l2_objects", _help("mpcache_l2_objects"), labels=["tier"])
        for tier in self.l2_state():
            up.add_metric([tier["tier"]], 1 if tier["up"] else 0)
            if "bytes" in tier:
                nbytes.add_metric([tier["tier"]], tier["bytes"])
            if "objects" in tier:
                nobj.add_metric([tier["tier"]], tier["objects"])
        yield up
        yield nbytes
        yield nobj
        l2ops = CounterMetricFamily("mpcache_l2_operations", _help("mpcache_l2_operations_total"), labels=["op", "outcome"])
        for (op, outcome), n in list(self.l2_ops.items()):
            l2ops.add_metric([op, outcome], n)
        yield l2ops
        objs = CounterMetricFamily("mpcache_l2_objects_read", _help("mpcache_l2_objects_read_total"), labels=["outcome"])
        hits, asked = self.counters.get("l2_hits", 0), self.counters.get("l2_objects_read", 0)
        objs.add_metric(["hit"], hits)
        objs.add_metric(["miss"], max(0, asked - hits))
        yield objs
        yield _histogram("mpcache_l2_latency_seconds", "op", self.l2_latency)
        yield _histogram("mpcache_copy_latency_seconds", "direction", self.copy_latency)
        tr = CounterMetricFamily("mpcache_transfers", _help("mpcache_transfers_total"), labels=["direction", "outcome"])
        for (direction, outcome), n in list(self.transfers.items()):
            tr.add_metric([direction, outcome], n)
        yield tr
        yield GaugeMetricFamily("mpcache_registered_instances", _help("mpcache_registered_instances"), value=int(stats.get("instances", 0) or 0))
        for name in ("malformed_messages", "dropped_replies", "block_allocation_reports"):
            yield CounterMetricFamily(f"mpcache_{name}", _help(f"mpcache_{name}_total"), value=self.counters.get(name, 0))
        sm = CounterMetricFamily("mpcache_sm", _help("mpcache_sm"), labels=["counter"])
        state = GaugeMetricFamily("mpcache_state", _help("mpcache_state"), labels=["name"])
        for name, value in sorted(stats.items()):
            if isinstance(value, bool):
                value = int(value)
            if not isinstance(value, (int, float)) or name in _FIRST_CLASS_STATS:
                continue
            (state if _is_gauge(name) else sm).add_metric([name], value)
        yield sm
        yield state


def _help(name: str) -> str:
    for n, _t, _l, text in METRICS:
        if n == name:
            return text
    raise KeyError(f"metric {name} is not in METRICS (add it there: docs/metrics.md is generated from it)")


def _histogram(name: str, label: str, table: dict[str, _Histogram]) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, _help(name), labels=[label])
    for value, h in list(table.items()):
        cum, buckets = 0, []
        for bound, c in zip([*map(str, LATENCY_BUCKETS), "+Inf"], h.counts):
            cum += c
            buckets.append((bound, cum))
        fam.add_metric([value], buckets, h.total)
    return fam


def render_markdown() -> str:
    """docs/metrics.md."""
    lines = [
        "# Metrics reference",
        "",
        "<!-- generated by `python -m mpcache.runtime_zmq.metrics > docs/metrics.md` from",
        "     runtime_zmq/metrics.py METRICS; tests/runtime_zmq/test_ops_metrics.py keeps it in sync. -->",
        "",
        "`mpcache-server` serves these on `http://<--metrics-host>:<--metrics-port>/metrics` (default",
        "`127.0.0.1:9555`; `--metrics-host 0.0.0.0` for a pod Prometheus scrapes). Counters end in",
        "`_total`, sizes are `_bytes`, latencies `_seconds` histograms. `model_name` (vLLM's and",
        f"LMCache's name for it) / `cache_salt_hash` labels take the first {LABEL_BUDGET} distinct pairs (64",
        "characters each); later pairs are counted under `model_name=\"other\", cache_salt_hash=\"other\"`,",
        "so a client cannot grow the series without bound. Labelled series appear after their first",
        "event.",
        "",
        "A request's `cache_salt` is its tenant's isolation secret in vLLM, and `/metrics` needs no",
        "credentials: it never appears. `cache_salt_hash` is a keyed hash of it (16 hex digits, `\"\"` for",
        "no salt), keyed from the server's chunk key: servers that share a chunk key (`--chunk-key-file`,",
        "or one L2 secret) label a tenant alike, and a label does not let anyone test a guessed salt.",
        "",
        "Hit rate: `rate(mpcache_lookup_hit_tokens_total[5m]) / rate(mpcache_lookup_requested_tokens_total[5m])`.",
        "",
        "| name | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    for name, typ, labels, text in METRICS:
        shown = name + ("_total" if typ == "counter" and not name.endswith("_total") else "")
        lines.append(f"| `{shown}` | {typ} | {', '.join(f'`{x}`' for x in labels) or '—'} | {text} |")
    lines += [
        "",
        "Beside these, prometheus-client's standard collectors: `process_*` (CPU seconds, resident and",
        "virtual memory, open file descriptors, start time) and `python_*` (`python_info`, garbage",
        "collector counts), as every Python exporter serves them.",
    ]
    lines += [
        "",
        "## In vLLM's /metrics",
        "",
        "`MPCacheConnector` reports through vLLM's connector-stats hooks, so these appear on the",
        "engine's own `/metrics` (labelled like vLLM's other series, e.g. `model_name`, `engine`),",
        "and vLLM's periodic `KV Transfer metrics:` log line. Hit tokens are vLLM's own",
        "`vllm:external_prefix_cache_queries_total` / `vllm:external_prefix_cache_hits_total`.",
        "",
        "| name | type | meaning |",
        "|---|---|---|",
    ]
    for name, (typ, text) in VLLM_METRICS.items():
        lines.append(f"| `vllm:mpcache_{name}{'_total' if typ == 'counter' else ''}` | {typ} | {text} |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    from mpcache.runtime_zmq import metrics as _metrics

    sys.stdout.write(_metrics.render_markdown())
