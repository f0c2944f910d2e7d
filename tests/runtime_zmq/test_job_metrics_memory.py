"""The hit-token metric's per-lookup record lasts the job's life, not a fixed number of lookups:
an abandoned lookup leaves nothing in the metrics once its job is gone."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from mpcache.runtime_zmq import metrics


def _metrics(job_ttl: float = 8.0) -> metrics.ServerMetrics:
    m = metrics.ServerMetrics(lambda: {})
    m.attach(SimpleNamespace(config=SimpleNamespace(chunk_size=256, job_ttl=job_ttl)), {}, summary_interval=0)
    return m


def _lookup(m: metrics.ServerMetrics, rid: str, model: str = "m") -> None:
    # a fresh model string each time, as the wire decodes it per message
    req: Any = SimpleNamespace(op="lookup", args=[SimpleNamespace(key=SimpleNamespace(
        request_id=rid, end=1024, model_name="".join([model]), cache_salt=""))])
    rt = ("id", rid, "lookup")
    m.on_request(req, rt)
    m.on_reply(rt, "lookup", None)


def _status(m: metrics.ServerMetrics, rid: str, hits: int | None) -> None:
    req: Any = SimpleNamespace(op="query_prefetch_status", args=[rid])
    rt = ("id", rid, "status")
    m.on_request(req, rt)
    m.on_reply(rt, "query_prefetch_status", hits)


def test_an_answered_lookup_counts_its_hits_once() -> None:
    m = _metrics()
    m.tick(100.0)
    _lookup(m, "a")
    _status(m, "a", None)  # not known yet: still tracked
    _status(m, "a", 3)
    _status(m, "a", 3)  # the tombstone's repeat: not counted again
    assert m.tokens[("m", "")] == [1, 1024, 3 * 256]
    assert m._tracked_lookups == 0


def test_abandoned_lookups_are_forgotten_within_1_125_job_ttls() -> None:
    m = _metrics(job_ttl=8.0)
    m.tick(100.0)
    for i in range(1000):
        _lookup(m, f"abandoned-{i}")
    assert m._tracked_lookups == 1000
    t = 100.0
    while t < 100.0 + 8.0:  # within the job TTL the job may still be answered: kept
        t += 1.0
        m.tick(t)
    assert m._tracked_lookups == 1000
    _status(m, "abandoned-7", 2)
    assert m.tokens[("m", "")][2] == 2 * 256
    while t < 100.0 + 9.0:
        t += 1.0
        m.tick(t)
    assert m._tracked_lookups == 0
    assert sum(len(g) for g in m._label_of_request) == 0


def test_rows_not_labels_are_kept_per_lookup() -> None:
    m = _metrics()
    m.tick(1.0)
    for i in range(10):
        _lookup(m, f"r{i}")
    rows = {id(row) for generation in m._label_of_request for row in generation.values()}
    assert rows == {id(m.tokens[("m", "")])}


def test_tracked_lookups_stay_bounded() -> None:
    m = _metrics(job_ttl=1e6)
    m.tick(1.0)
    for i in range(metrics._MAX_TRACKED_LOOKUPS + 50):
        _lookup(m, f"r{i}")
    assert m._tracked_lookups == metrics._MAX_TRACKED_LOOKUPS
    assert sum(len(g) for g in m._label_of_request) == metrics._MAX_TRACKED_LOOKUPS
