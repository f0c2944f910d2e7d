"""Two mpcache servers sharing one Redis: what one node stores, the other finds.

Server A stores a prompt's chunks (engine-driven store into its L1); its write-behind copies them
to Redis. Server B, which never saw them, answers a lookup of the same prompt by prefetching them
from Redis into its own L1: the status query reports every chunk, and B's L1 then holds the very
bytes A stored."""
from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install '.[redis]')")

from mpcache.runtime_zmq.client import MPCacheClient  # noqa: E402
from mpcache.runtime_zmq.l1_pool import MappedSegment  # noqa: E402
from mpcache.runtime_zmq.l2_seal import HEADER_BYTES  # noqa: E402

try:
    from .redis_server import redis_server, redis_url  # noqa: F401
except ImportError:
    from redis_server import redis_server, redis_url  # type: ignore[no-redef]  # noqa: F401

CHUNK = 256
CHUNKS = 4
OBJ_BYTES = 8192
MODEL = "shared/model"


def _key(tokens: list[int], rid: str, worker_id: int | None = None) -> dict[str, Any]:
    return {
        "model_name": MODEL, "world_size": 1, "worker_id": worker_id, "token_ids": tokens,
        "start": 0, "end": len(tokens), "request_id": rid, "cache_salt": "",
        "request_configs": None, "num_kv_readers": 1,
    }


def _content(chunk: int) -> bytes:
    return bytes((chunk * 37 + i * 11) % 256 for i in range(OBJ_BYTES))


def _register(c: MPCacheClient) -> None:
    layout = {"model_name": MODEL, "world_size": 1, "object_bytes": OBJ_BYTES, "engine_driven": True}
    assert isinstance(c.register_instance(1, layout).result(5), int)


def _wait(pred: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _poll_status(c: MPCacheClient, rid: str, timeout: float = 10.0) -> tuple[int, int]:
    """(final status, how many polls answered None first)."""
    in_progress = 0
    end = time.monotonic() + timeout
    while True:
        status = c.query_prefetch_status(rid).result(5)
        if status is not None:
            return int(status), in_progress
        in_progress += 1
        if time.monotonic() > end:
            raise AssertionError(f"status of {rid} still in progress after {timeout} s")
        time.sleep(0.01)


def test_store_on_a_is_found_through_b(
    start_server: Callable[..., Any], redis_url: str  # noqa: F811
) -> None:
    # Two nodes: separate processes, separate L1 segments, over tcp, one Redis between them.
    secret = tempfile.mkdtemp(prefix="mpcache-secret-") + "/l2.secret"  # shared by the fleet
    a = start_server("--l2", redis_url, "--l2-secret-file", secret, transport="tcp")
    b = start_server("--l2", redis_url, "--l2-secret-file", secret, transport="tcp")
    raw = redis.Redis.from_url(redis_url)
    tokens = [(i * 7 + 3) % 30000 for i in range(CHUNKS * CHUNK)]
    with MPCacheClient(a.url, request_timeout=5.0) as ca, MPCacheClient(b.url, request_timeout=5.0) as cb:
        _register(ca)
        _register(cb)

        # B has nothing yet: a lookup misses (its L2 read finds nothing in Redis either).
        assert cb.lookup(_key(tokens, "before")).result(5) is None
        assert _poll_status(cb, "before")[0] == 0
        cb.end_session("before").result(5)

        # Store through A: prepare, fill the slots in A's shared-memory L1, commit.
        plan = ca.prepare_store(_key(tokens, "store", worker_id=0), 1).result(5)
        assert plan["ok"] and len(plan["placements"]) == CHUNKS
        seg = MappedSegment(plan["segment"], plan["slot_bytes"], 1 << 30)
        try:
            for chunk, slot, _offset in plan["placements"]:
                seg.view(slot, OBJ_BYTES)[:] = _content(chunk)
        finally:
            seg.close()
        assert ca.commit_store(plan["transfer_id"], True).result(5)["ok"]
        ca.end_session("store").result(5)

        # A's write-behind puts the objects in Redis under the mpcache: prefix.
        _wait(lambda: len(raw.keys(b"mpcache:*")) == CHUNKS, 10, "A's write-behind to Redis")
        # each value: the sealed envelope (layout header with size and keyed checksum) + the object
        assert sorted(len(raw.get(k) or b"") for k in raw.keys(b"mpcache:*")) == [HEADER_BYTES + OBJ_BYTES] * CHUNKS

        # B: the lookup misses L1, hits L2, prefetches, and the status reports every chunk.
        assert cb.lookup(_key(tokens, "after")).result(5) is None
        hits, _polls_in_progress = _poll_status(cb, "after")
        assert hits == CHUNKS
        stats = cb.stats()
        assert stats["l2_read_hits"] >= CHUNKS
        # Idempotent repeat of the status (tombstone), as core_sm promises.
        assert cb.query_prefetch_status("after").result(5) == CHUNKS

        # B's L1 now holds A's bytes: retrieve them through B.
        rplan = cb.prepare_retrieve(_key(tokens, "after", worker_id=0), 1, 0).result(5)
        assert rplan["ok"] and [p[0] for p in rplan["placements"]] == list(range(CHUNKS))
        seg = MappedSegment(rplan["segment"], rplan["slot_bytes"], 1 << 30)
        try:
            for chunk, slot, _offset in rplan["placements"]:
                assert bytes(seg.view(slot, OBJ_BYTES)) == _content(chunk), f"chunk {chunk}"
        finally:
            seg.close()
        assert cb.commit_retrieve(rplan["transfer_id"], True).result(5)["ok"]
        cb.end_session("after").result(5)

        # A second lookup through B is now an L1 hit (no new L2 read needed).
        reads_before = cb.stats()["l2_reads"]
        assert cb.lookup(_key(tokens, "again")).result(5) is None
        assert _poll_status(cb, "again")[0] == CHUNKS
        assert cb.stats()["l2_reads"] == reads_before
        cb.end_session("again").result(5)
    raw.close()
