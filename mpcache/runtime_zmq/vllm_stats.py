"""What MPCacheConnector reports into vLLM's own metrics, and its start-up config checks.

vLLM (0.32) collects connector statistics in three steps: each worker's
``get_kv_connector_stats()`` returns a ``KVConnectorStats`` (plain data, pickled to the engine
core), ``build_kv_connector_stats(data)`` rebuilds and ``aggregate``s them across workers, and
``build_prom_metrics(...)`` creates the Prometheus series that vLLM's ``/metrics`` serves and
``observe``s each aggregated payload into them; ``reduce()`` is the periodic
"KV Transfer metrics: ..." log line. Hit tokens need nothing from us: vLLM counts a connector's
hits itself (``vllm:external_prefix_cache_queries`` / ``vllm:external_prefix_cache_hits``).

The worker side (``TransferRecorder``) counts, per interval: loads and stores (requests),
their tokens and bytes, loads that failed (recomputed by vLLM), and submit-to-finished times
(bounded to ``MAX_SAMPLES`` per interval, so a stats payload never grows with traffic).

``check_extra_config`` warns about LMCache keys a migrating user may carry over
(``lmcache.mp.host`` / ``lmcache.mp.port`` / ...), naming the mpcache key to use instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from mpcache.runtime_zmq.metrics import VLLM_METRICS

logger = logging.getLogger("mpcache.vllm")

MAX_SAMPLES = 1024
_COUNTS = tuple(name for name, (kind, _help) in VLLM_METRICS.items() if kind == "counter")
_SAMPLES = tuple(name for name, (kind, _help) in VLLM_METRICS.items() if kind == "histogram")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# LMCache MP keys (kv_connector_extra_config) -> what to write for mpcache
LMCACHE_KEYS: dict[str, str] = {
    "lmcache.mp.host": "mpcache.server_urls (e.g. \"tcp://HOST:5555\")",
    "lmcache.mp.port": "mpcache.server_urls (e.g. \"tcp://127.0.0.1:PORT\")",
    "lmcache.mp.server_urls": "mpcache.server_urls",
    "lmcache.mp.hash_algorithm": "nothing: mpcache's chunk hash is fixed (the server and all engines agree by construction)",
}


def check_extra_config(extra: Mapping[str, Any] | None, warn: Callable[..., None] | None = None) -> list[str]:
    """Warn once per ``lmcache.*`` key in ``kv_connector_extra_config``; returns the warnings."""
    warn = warn if warn is not None else logger.warning
    out = []
    for key in sorted(extra or {}):
        if not isinstance(key, str) or not key.startswith("lmcache."):
            continue
        instead = LMCACHE_KEYS.get(key)
        if instead is None:
            text = f"kv_connector_extra_config key {key!r} is LMCache's and is ignored by MPCacheConnector; its settings are mpcache.* keys (docs/vllm.md)"
        else:
            text = f"kv_connector_extra_config key {key!r} is LMCache's and is ignored by MPCacheConnector; use {instead}"
        warn("%s", text)
        out.append(text)
    return out


class TransferRecorder:
    """Worker-side counts for one stats interval. ``take()`` returns them and starts the next.

    Calls come from vLLM's model-runner thread; the lock keeps ``take`` (same thread in vLLM
    0.32, but not promised) consistent."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.bytes_per_token = 0
        self._lock = threading.Lock()
        self._loads: dict[str, tuple[float, int]] = {}  # request_id -> (submitted at, tokens)
        self._stores: dict[str, tuple[float, int]] = {}
        self._data = _empty()

    def retrieves_submitted(self, ops: Iterable[Any]) -> None:
        now = self.clock()
        with self._lock:
            for op in ops:
                tokens = max(0, int(op.end) - int(op.start) - int(getattr(op, "skip_first_n_tokens", 0)))
                began, before = self._loads.get(op.request_id, (now, 0))
                self._loads[op.request_id] = (began, before + tokens)
                self._bound(self._loads)

    def stores_submitted(self, ops: Iterable[Any]) -> None:
        now = self.clock()
        with self._lock:
            for op in ops:
                tokens = max(0, int(op.end) - int(op.start))
                began, before = self._stores.get(op.request_id, (now, 0))
                self._stores[op.request_id] = (began, before + tokens)
                self._bound(self._stores)

    def finished(self, sending: Iterable[str] | None, recving: Iterable[str] | None, load_failed_blocks: int = 0) -> None:
        now = self.clock()
        with self._lock:
            self._count_finished(self._loads, recving, "load", "loads", now)
            self._count_finished(self._stores, sending, "store", "stores", now)
            self._data["load_failed_blocks"] += load_failed_blocks

    def _count_finished(self, table: dict[str, tuple[float, int]], request_ids: Iterable[str] | None,
                        prefix: str, ops: str, now: float) -> None:
        d = self._data
        for rid in request_ids or ():
            entry = table.pop(rid, None)
            if entry is not None:
                d[ops] += 1
                d[f"{prefix}_tokens"] += entry[1]
                d[f"{prefix}_bytes"] += entry[1] * self.bytes_per_token
                _sample(d[f"{prefix}_seconds"], now - entry[0])

    def take(self) -> dict[str, Any] | None:
        with self._lock:
            data, self._data = self._data, _empty()
        return None if _is_empty(data) else data

    @staticmethod
    def _bound(table: dict[str, tuple[float, int]]) -> None:
        # requests vLLM never reports finished (aborted before the load): forget the oldest
        while len(table) > 65536:
            del table[next(iter(table))]


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = dict.fromkeys(_COUNTS, 0)
    for name in _SAMPLES:
        data[name] = []
    return data


def _is_empty(data: Mapping[str, Any]) -> bool:
    return not any(data.get(k) for k in _COUNTS)


def _sample(samples: list[float], value: float) -> None:
    if len(samples) < MAX_SAMPLES:
        samples.append(value)


@dataclass
class MPCacheConnectorStats(KVConnectorStats):
    """The aggregated worker counts (``data`` as ``TransferRecorder.take`` builds it)."""

    data: dict[str, Any] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        base = _empty()
        base.update(self.data or {})
        self.data = base

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in _COUNTS:
            self.data[k] += int(other.data.get(k, 0))
        for k in _SAMPLES:
            room = MAX_SAMPLES - len(self.data[k])
            self.data[k].extend(list(other.data.get(k, ()))[: max(0, room)])
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: int(d[k]) for k in _COUNTS}
        for k in _SAMPLES:
            samples = d[k]
            out[k.replace("_seconds", "_avg_ms")] = round(1e3 * sum(samples) / len(samples), 3) if samples else 0.0
        return out

    def is_empty(self) -> bool:
        return _is_empty(self.data)


class MPCachePromMetrics(KVConnectorPromMetrics):
    """vLLM-side series: ``vllm:mpcache_{load,store}_{tokens,bytes}_total``,
    ``vllm:mpcache_load_failed_blocks_total``, ``vllm:mpcache_{load,store}_seconds`` histograms."""

    _COUNTERS = {name: text for name, (kind, text) in VLLM_METRICS.items() if kind == "counter"}
    _HISTOGRAMS = {name: text for name, (kind, text) in VLLM_METRICS.items() if kind == "histogram"}

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series: dict[str, dict[int, Any]] = {}
        for name, doc in self._COUNTERS.items():
            metric = self._counter_cls(name=f"vllm:mpcache_{name}", documentation=doc, labelnames=labelnames)
            self._series[name] = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}
        for name, doc in self._HISTOGRAMS.items():
            metric = self._histogram_cls(name=f"vllm:mpcache_{name}", documentation=doc, labelnames=labelnames,
                                         buckets=list(LATENCY_BUCKETS))
            self._series[name] = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in self._COUNTERS:
            n = transfer_stats_data.get(name, 0)
            if n:
                self._series[name][engine_idx].inc(n)
        for name in self._HISTOGRAMS:
            series = self._series[name][engine_idx]
            for seconds in transfer_stats_data.get(name, ()):
                series.observe(seconds)


def bytes_per_token(kv_caches: Mapping[str, Any], num_blocks: int, block_size: int) -> int:
    """KV bytes one token takes on this worker (all layers), from the registered tensors."""
    tokens = num_blocks * block_size
    if tokens <= 0:
        return 0
    total = sum(int(t.numel()) * int(t.element_size()) for t in kv_caches.values())
    return total // tokens
