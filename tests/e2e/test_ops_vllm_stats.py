"""MPCacheConnector's stats into vLLM's metrics (runtime_zmq/vllm_stats.py), without starting vLLM:
the worker recorder, aggregation across workers, the Prometheus series vLLM's /metrics would serve,
and the warning for LMCache's config keys. Needs the vLLM venv (`make e2e`)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.e2e
pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest  # noqa: E402

from mpcache.runtime_zmq import vllm_stats  # noqa: E402


class Op:
    def __init__(self, request_id: str, start: int, end: int, skip: int = 0) -> None:
        self.request_id, self.start, self.end, self.skip_first_n_tokens = request_id, start, end, skip


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_recorder_counts_loads_and_stores_per_interval() -> None:
    clock = Clock()
    rec = vllm_stats.TransferRecorder(clock)
    rec.bytes_per_token = 10
    assert rec.take() is None
    rec.retrieves_submitted([Op("a", 0, 512, skip=16), Op("b", 256, 512)])
    rec.stores_submitted([Op("c", 0, 256)])
    clock.now += 0.25
    rec.finished(sending={"c"}, recving={"a", "unknown"})
    rec.finished((), (), load_failed_blocks=3)
    data = rec.take()
    assert data is not None
    assert (data["loads"], data["load_tokens"], data["load_bytes"], data["load_failed_blocks"]) == (1, 496, 4960, 3)
    assert (data["stores"], data["store_tokens"], data["store_bytes"]) == (1, 256, 2560)
    assert data["load_seconds"] == [0.25] and data["store_seconds"] == [0.25]
    assert rec.take() is None  # a new interval
    rec.finished((), {"b"})
    assert rec.take()["load_tokens"] == 256  # type: ignore[index]


def test_stats_aggregate_across_workers_and_reduce() -> None:
    a = vllm_stats.MPCacheConnectorStats(data={"loads": 2, "load_tokens": 512, "load_seconds": [0.1, 0.3]})
    b = vllm_stats.MPCacheConnectorStats(data={"loads": 1, "load_tokens": 256, "load_seconds": [0.2], "stores": 4})
    merged = a.aggregate(b)
    assert not merged.is_empty()
    reduced = merged.reduce()
    assert reduced["loads"] == 3 and reduced["load_tokens"] == 768 and reduced["stores"] == 4
    assert reduced["load_avg_ms"] == pytest.approx(200.0)
    big = vllm_stats.MPCacheConnectorStats(data={"loads": 1, "load_seconds": [0.1] * vllm_stats.MAX_SAMPLES})
    big.aggregate(b)
    assert len(big.data["load_seconds"]) == vllm_stats.MAX_SAMPLES  # bounded
    merged.reset()
    assert merged.is_empty()


def test_prometheus_series_in_the_engines_registry() -> None:
    registry = CollectorRegistry()

    def bound(cls: Any) -> Any:
        return lambda **kw: cls(registry=registry, **kw)

    class Config:
        kv_transfer_config = None

    prom = vllm_stats.MPCachePromMetrics(Config(), {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)},
                                         ["model_name", "engine"], {0: ["tiny", "0"]})
    prom.observe({"loads": 2, "load_tokens": 512, "load_bytes": 4096, "load_seconds": [0.01, 0.2], "load_failed_blocks": 1}, 0)
    text = generate_latest(registry).decode()
    assert 'vllm:mpcache_load_tokens_total{engine="0",model_name="tiny"} 512.0' in text
    assert 'vllm:mpcache_load_failed_blocks_total{engine="0",model_name="tiny"} 1.0' in text
    assert 'vllm:mpcache_load_seconds_count{engine="0",model_name="tiny"} 2.0' in text


def test_lmcache_keys_get_a_warning_naming_the_mpcache_key() -> None:
    seen: list[str] = []
    out = vllm_stats.check_extra_config(
        {"lmcache.mp.host": "10.0.0.1", "lmcache.mp.port": 6000, "mpcache.server_urls": "tcp://x:1", "lmcache.chunk_size": 256},
        warn=lambda fmt, text: seen.append(text))
    assert out == seen and len(out) == 3
    assert any("'lmcache.mp.host'" in w and "use mpcache.server_urls" in w for w in out)
    assert any("'lmcache.chunk_size'" in w and "mpcache.* keys" in w for w in out)
