"""Every operation, over tcp and ipc, against a real server process."""

from __future__ import annotations

import os
import stat
from typing import Any

import pytest

from mpcache.runtime_zmq.client import MPCacheClient, RemoteError
from mpcache.runtime_zmq.l1_pool import MappedSegment

CHUNK = 256
OBJ_BYTES = 4096


def key(tokens: list[int], rid: str, *, start: int = 0, end: int | None = None, worker_id: int | None = None, salt: str = "", world_size: int = 1) -> dict[str, Any]:
    if end is None:
        end = len(tokens) // CHUNK * CHUNK
    return {
        "model_name": "m", "world_size": world_size, "worker_id": worker_id, "token_ids": tokens,
        "start": start, "end": end, "request_id": rid, "cache_salt": salt,
        "request_configs": None, "num_kv_readers": 0,
    }


def tokens(n_chunks: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i) % 50000 for i in range(n_chunks * CHUNK)]


def pattern(chunk: int, seed: int = 0) -> bytes:
    return bytes(((chunk * 31 + seed + i) % 251) for i in range(OBJ_BYTES))


def register(c: MPCacheClient, iid: int = 1) -> None:
    assert isinstance(c.register_instance(iid, {"model_name": "m", "world_size": 1, "object_bytes": OBJ_BYTES, "engine_driven": True}).result(5), int)


def store_chunks(c: MPCacheClient, toks: list[int], rid: str, iid: int = 1, seed: int = 0) -> dict[str, Any]:
    plan = c.prepare_store(key(toks, rid, worker_id=0), iid).result(5)
    assert plan["ok"] and plan["kind"] == "store"
    seg = MappedSegment(plan["segment"], plan["slot_bytes"], 1 << 30)
    try:
        for chunk, slot, offset in plan["placements"]:
            assert offset == slot * plan["slot_bytes"]
            seg.view(slot, OBJ_BYTES)[:] = pattern(chunk, seed)
    finally:
        seg.close()
    return dict(c.commit_store(plan["transfer_id"], True).result(5))


def test_control_plane_ops(client: MPCacheClient) -> None:
    assert client.noop() == "OK"
    assert client.ping() is True
    assert client.call("ping", None) is True
    with pytest.raises(RemoteError, match="not_registered"):  # a named ping is that instance's heartbeat
        client.call("ping", 7)
    assert client.get_chunk_size() == CHUNK
    # legacy integer op ids reach the same handlers
    assert client.call(24) == "OK"
    assert client.call(21) == CHUNK
    assert client.query_prefetch_status("never-seen").result(5) == 0
    assert client.call(9, "never-seen") == 0
    assert client.wait_prefetch_status("never-seen", 0.1).result(5) == 0
    assert client.end_session("never-seen").result(5) is None
    # clear is an admin operation; with the token: test_hostile.py
    with pytest.raises(RemoteError, match="forbidden"):
        client.clear(True).result(5)
    assert client.call("report_block_allocation", 1, "m", [{"req_id": "r", "new_block_ids": [1], "new_token_ids": [2]}]) is None
    assert client.call("report_block_allocation", [{"req_id": "r", "new_block_ids": [1], "new_token_ids": [2]}]) is None
    h = client.health()
    assert h["status"] == "ok" and h["chunk_size"] == CHUNK
    s = client.stats()
    assert s["block_allocation_records"] == 2


def test_lookup_miss_then_hit_and_free(client: MPCacheClient) -> None:
    toks = tokens(4)
    assert client.lookup(key(toks, "miss")).result(5) is None
    assert client.query_prefetch_status("miss").result(5) == 0
    # idempotent repeat (tombstone)
    assert client.query_prefetch_status("miss").result(5) == 0
    register(client)
    res = store_chunks(client, toks, "writer")
    assert res == {"ok": True, "stored": 4, "skipped": 0}
    assert client.lookup(key(toks, "hit")).result(5) is None
    assert client.query_prefetch_status("hit").result(5) == 4
    assert client.query_prefetch_status("hit").result(5) == 4
    assert client.stats()["leases_held"] > 0
    assert client.free_lookup_locks(key(toks, "hit", start=0, end=4 * CHUNK)).result(5) is None
    assert client.stats()["leases_held"] == 0
    assert client.end_session("hit").result(5) is None
    # wait on a finished job answers at once
    assert client.lookup(key(toks, "hit2")).result(5) is None
    assert client.wait_prefetch_status("hit2", 1.0).result(5) == 4
    assert client.end_session("hit2").result(5) is None
    assert client.stats()["leases_held"] == 0


def test_engine_driven_round_trip(client: MPCacheClient) -> None:
    register(client, 3)
    toks = tokens(3, seed=5)
    assert store_chunks(client, toks, "w", iid=3, seed=9)["ok"]
    # a second store of the same chunks skips them
    assert store_chunks(client, toks, "w2", iid=3, seed=9)["skipped"] == 3
    assert client.lookup(key(toks, "r")).result(5) is None
    assert client.query_prefetch_status("r").result(5) == 3
    plan = client.prepare_retrieve(key(toks, "r", worker_id=0, start=CHUNK), 3, 0).result(5)
    assert plan["ok"] and plan["kind"] == "retrieve"
    assert [p[0] for p in plan["placements"]] == [1, 2]
    seg = MappedSegment(plan["segment"], plan["slot_bytes"], 1 << 30)
    try:
        for chunk, slot, _off in plan["placements"]:
            assert bytes(seg.view(slot, OBJ_BYTES)) == pattern(chunk, 9)
    finally:
        seg.close()
    assert client.commit_retrieve(plan["transfer_id"], True).result(5) == {"ok": True, "chunks": 2}
    # unknown transfer id: typed error
    with pytest.raises(RemoteError) as e:
        client.commit_store(999_999, True).result(5)
    assert e.value.kind == "unknown_transfer"
    assert client.unregister_instance(3).result(5) is None


def test_l1_segment_is_private(client: MPCacheClient) -> None:
    info = client.l1_info()
    st = os.stat(info["segment"])
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert info["slot_bytes"] > 0 and info["num_slots"] > 0


def test_server_driven_without_gpu_is_refused_cleanly(client: MPCacheClient) -> None:
    with pytest.raises(RemoteError) as e:
        client.register_instance(9, {"model_name": "m", "world_size": 1, "object_bytes": OBJ_BYTES, "engine_driven": False}).result(5)
    assert e.value.kind == "validation"
    with pytest.raises(RemoteError) as e2:
        client.store(key(tokens(1), "s", worker_id=0), 9, list(range(16)), b"\0" * 64).result(5)
    assert e2.value.kind == "not_registered"
