"""L2 through real servers: write-behind to disk survives a restart; two servers on one Redis
share hits (the multi-node tier). Bytes are checked end to end through the L1 segment."""

from __future__ import annotations

import tempfile
from collections.abc import Callable

from live_server import ServerProcess, wait_for
from mpcache.runtime_zmq.client import MPCacheClient
from mpcache.runtime_zmq.l1_pool import MappedSegment
from test_server_ops import OBJ_BYTES, key, pattern, register, store_chunks, tokens

try:
    from redis_server import RedisServer, redis_server, redis_url  # noqa: F401
except ImportError:  # pragma: no cover
    pass


def _written_behind(c: MPCacheClient, n: int) -> bool:
    s = c.stats()
    return bool(s["l2_writes"] >= n and s["l2_writes_in_flight"] == 0)


def _retrieve_and_check(c: MPCacheClient, toks: list[int], rid: str, iid: int, seed: int) -> None:
    c.lookup(key(toks, rid)).result(5)
    n = len(toks) // 256
    assert c.wait_prefetch_status(rid, 10.0).result(15) == n
    plan = c.prepare_retrieve(key(toks, rid, worker_id=0), iid).result(5)
    assert plan["ok"] and len(plan["placements"]) == n
    seg = MappedSegment(plan["segment"], plan["slot_bytes"], 1 << 30)
    try:
        for chunk, slot, _off in plan["placements"]:
            assert bytes(seg.view(slot, OBJ_BYTES)) == pattern(chunk, seed)
    finally:
        seg.close()
    assert c.commit_retrieve(plan["transfer_id"], True).result(5) == {"ok": True, "chunks": n}
    assert c.end_session(rid).result(5) is None


def test_disk_l2_survives_restart(start_server: Callable[..., ServerProcess]) -> None:
    path = tempfile.mkdtemp(prefix="mpcache-l2-") + "/tier"
    toks = tokens(3, seed=21)
    a = start_server("--l2", f"disk:{path}")
    c = MPCacheClient(a.url, request_timeout=5.0)
    try:
        register(c, 1)
        assert store_chunks(c, toks, "w", iid=1, seed=7)["stored"] == 3
        assert wait_for(lambda: _written_behind(c, 3), timeout=10.0)
    finally:
        c.close()
    assert a.terminate() == 0
    b = start_server("--l2", f"disk:{path}")
    c = MPCacheClient(b.url, request_timeout=5.0)
    try:
        register(c, 1)
        assert c.stats()["objects"] == 0  # a fresh L1: the hits come from the disk tier
        _retrieve_and_check(c, toks, "r", 1, seed=7)
        assert c.stats()["l2_read_hits"] >= 3
    finally:
        c.close()


def test_two_servers_share_redis(start_server: Callable[..., ServerProcess], redis_url: str) -> None:
    a = start_server("--l2", redis_url)
    b = start_server("--l2", redis_url)
    ca = MPCacheClient(a.url, request_timeout=5.0)
    cb = MPCacheClient(b.url, request_timeout=5.0)
    try:
        toks = tokens(4, seed=33)
        register(ca, 1)
        register(cb, 2)
        assert store_chunks(ca, toks, "w", iid=1, seed=3)["stored"] == 4
        assert wait_for(lambda: _written_behind(ca, 4), timeout=10.0)
        # server B never saw these chunks: they come from Redis
        _retrieve_and_check(cb, toks, "r", 2, seed=3)
        # and a miss on both stays a miss
        cb.lookup(key(tokens(2, seed=99), "miss")).result(5)
        assert cb.wait_prefetch_status("miss", 10.0).result(15) == 0
    finally:
        ca.close()
        cb.close()
