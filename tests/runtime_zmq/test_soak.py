"""Soak: a long stream of lookups against one server; its memory must stay flat.

Each lookup runs the scheduler's cycle on its own request id: `lookup` → (after the ack)
`query_prefetch_status` → `end_session`, with `WINDOW` cycles in flight on one DEALER socket.
Half the prompts are stored (4-chunk L1 hits), half are misses; one cycle in a
hundred is abandoned after the lookup (never queried, never ended), so the server's reaper must
free its leases. After a warm-up of 10% of the lookups, the server's RSS may grow by at most 5%.

`MPCACHE_SOAK_LOOKUPS` sets the count (default 1,000,000); `make soak` runs it.
"""
from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import zmq

from runtime_zmq.client import MPCacheClient

pytestmark = pytest.mark.slow

LOOKUPS = int(os.environ.get("MPCACHE_SOAK_LOOKUPS", "1000000"))
WINDOW = 32
CHUNK = 256
CHUNKS = 4
OBJ_BYTES = 4096
STORED_PROMPTS = 8
MAX_RSS_GROWTH = 0.05
ABANDON_EVERY = 100


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _key(tokens: list[int], rid: str, worker_id: int | None = None) -> dict[str, Any]:
    return {
        "model_name": "soak", "world_size": 1, "worker_id": worker_id, "token_ids": tokens,
        "start": 0, "end": len(tokens), "request_id": rid, "cache_salt": "",
        "request_configs": None, "num_kv_readers": 1,
    }


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 100_000) for _ in range(CHUNKS * CHUNK)]


def test_soak_lookups_rss_flat(start_server: Callable[..., Any]) -> None:
    # Short TTLs so abandoned jobs and tombstones are reaped many times during the run.
    sp = start_server("--job-ttl", "2", "--tombstone-ttl", "2", "--lease-ttl", "5",
                      "--log-level", "WARNING", transport="ipc")
    pid = sp.proc.pid
    stored = [_prompt(s) for s in range(STORED_PROMPTS)]
    with MPCacheClient(sp.url, request_timeout=10.0) as c:
        layout = {"model_name": "soak", "world_size": 1, "object_bytes": OBJ_BYTES, "engine_driven": True}
        assert c.register_instance(1, layout).result(5) is None
        for i, toks in enumerate(stored):
            plan = c.prepare_store(_key(toks, f"store-{i}", worker_id=0), 1).result(5)
            assert plan["ok"]
            assert c.commit_store(plan["transfer_id"], True).result(5)["ok"]
            c.end_session(f"store-{i}").result(5)

    # Pre-encoded lookup frames: stored prompts (hits) and fresh ones (misses), request ids cycled.
    ids = 4096
    lookup_frames: list[bytes] = []
    rid_frames: list[bytes] = []
    expect_hits: list[int] = []
    for n in range(ids):
        rid = f"soak-{n}"
        hit = n % 2 == 0
        toks = stored[n % STORED_PROMPTS] if hit else _prompt(10_000 + n)
        lookup_frames.append(msgpack.packb(_key(toks, rid)))
        rid_frames.append(msgpack.packb(rid))
        expect_hits.append(CHUNKS if hit else 0)
    op_lookup, op_status, op_end = (msgpack.packb(o) for o in ("lookup", "query_prefetch_status", "end_session"))
    tp = msgpack.packb(1)

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sp.url)
    # uid -> (cycle number, stage)
    pending: dict[int, tuple[int, str]] = {}
    uid = 0
    started = 0
    finished = 0
    abandoned = 0
    wrong: list[str] = []
    warmup = max(LOOKUPS // 10, 1000)
    rss_warm = 0
    rss_peak_after_warm = 0
    t0 = time.monotonic()

    def send(frames: list[bytes], cycle: int, stage: str) -> None:
        nonlocal uid
        uid += 1
        pending[uid] = (cycle, stage)
        sock.send_multipart([msgpack.packb(uid)] + frames)

    def start_cycle() -> None:
        nonlocal started
        i = started % ids
        send([op_lookup, lookup_frames[i], tp], started, "lookup")
        started += 1

    try:
        while finished < LOOKUPS:
            while started < LOOKUPS and len(pending) < WINDOW:
                start_cycle()
            if not sock.poll(20_000):
                raise AssertionError(f"no reply for 20 s after {finished} lookups; {len(pending)} pending")
            while True:
                try:
                    reply = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                cycle, stage = pending.pop(msgpack.unpackb(reply[0]))
                i = cycle % ids
                if reply[1] == b"\xa5error":
                    wrong.append(f"{stage} of cycle {cycle}: {msgpack.unpackb(reply[2])!r}")
                    finished += 1
                elif stage == "lookup":
                    if cycle % ABANDON_EVERY == ABANDON_EVERY - 1:
                        # Abandoned: the id's next use (ids later) replaces it, or the reaper frees it.
                        abandoned += 1
                        finished += 1
                    else:
                        send([op_status, rid_frames[i]], cycle, "status")
                elif stage == "status":
                    status = msgpack.unpackb(reply[2]) if len(reply) > 2 else None
                    if status is None:
                        send([op_status, rid_frames[i]], cycle, "status")  # still loading
                    else:
                        if status != expect_hits[i]:
                            wrong.append(f"cycle {cycle}: status {status}, expected {expect_hits[i]}")
                        send([op_end, rid_frames[i]], cycle, "end")
                else:
                    finished += 1
                if finished == warmup and rss_warm == 0:
                    rss_warm = _rss_bytes(pid)
                elif rss_warm and finished % 10_000 == 0:
                    rss_peak_after_warm = max(rss_peak_after_warm, _rss_bytes(pid))
            if len(wrong) > 10:
                break
    finally:
        sock.close()
        ctx.term()
    elapsed = time.monotonic() - t0
    rss_end = _rss_bytes(pid)
    rss_peak_after_warm = max(rss_peak_after_warm, rss_end)
    assert wrong == [], wrong[:10]

    # Let the reaper take the abandoned jobs' leases (job TTL 2 s), then check the tables drained.
    with MPCacheClient(sp.url, request_timeout=10.0) as c:
        end = time.monotonic() + 15
        while True:
            s = c.stats()
            if s["leases_held"] == 0 and s["jobs"] == 0 or time.monotonic() > end:
                break
            time.sleep(0.2)
    growth = rss_peak_after_warm / rss_warm - 1
    print(f"\nsoak: {LOOKUPS} lookups ({abandoned} abandoned) in {elapsed:.1f} s "
          f"({LOOKUPS / elapsed:,.0f}/s); RSS after warm-up {rss_warm / 2**20:.1f} MiB, "
          f"peak after {rss_peak_after_warm / 2**20:.1f} MiB, end {rss_end / 2**20:.1f} MiB "
          f"({growth * 100:+.2f}%); final stats: leases_held={s['leases_held']} jobs={s['jobs']} "
          f"tombstones={s['tombstones']}")
    assert s["leases_held"] == 0, s
    assert s["jobs"] == 0, s
    assert growth <= MAX_RSS_GROWTH, f"RSS grew {growth * 100:.1f}% after warm-up"
