"""Soak: a long stream of lookups against one server; its memory must stay flat.

Each lookup runs the scheduler's cycle on a request id never used before (as vLLM's are):
`lookup` → (after the ack) `query_prefetch_status` → `end_session`, with `WINDOW` cycles in flight
on one DEALER socket. Half the prompts are stored (4-chunk L1 hits), half are misses; one cycle in
a hundred is abandoned after the lookup (never queried, never ended), so its leases stay held until
the server's reaper frees them at the job TTL.

Every per-request table is bounded by a TTL, so memory reaches a plateau once the run is older
than the longest TTL. The warm-up is therefore the later of 10% of the lookups and TTL + 15 s; after
it the server's RSS may grow by at most 5%, and at the end every lease and job must be gone.

Environment: `MPCACHE_SOAK_LOOKUPS` (default 1,000,000), `MPCACHE_SOAK_TTL` (job and tombstone
TTL in seconds, default 60 as in production; lower it for a shorter run). `make soak` runs it.
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

# The default per-test timeout (300 s) is far below a million lookups on a shared 2-core box.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * 3600)]

LOOKUPS = int(os.environ.get("MPCACHE_SOAK_LOOKUPS", "1000000"))
TTL_S = float(os.environ.get("MPCACHE_SOAK_TTL", "60"))
WINDOW = 32
CHUNK = 256
CHUNKS = 4
OBJ_BYTES = 4096
STORED_PROMPTS = 8
MISS_PROMPTS = 64
MAX_RSS_GROWTH = 0.05
ABANDON_EVERY = 100
RSS_SAMPLE_EVERY = 5_000


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
    ttl = f"{TTL_S:g}"
    sp = start_server("--job-ttl", ttl, "--tombstone-ttl", ttl, "--log-level", "WARNING",
                      transport="ipc")
    pid = sp.proc.pid
    stored = [_prompt(s) for s in range(STORED_PROMPTS)]
    misses = [_prompt(10_000 + s) for s in range(MISS_PROMPTS)]
    with MPCacheClient(sp.url, request_timeout=10.0) as c:
        layout = {"model_name": "soak", "world_size": 1, "object_bytes": OBJ_BYTES, "engine_driven": True}
        assert c.register_instance(1, layout).result(5) is None
        for i, toks in enumerate(stored):
            plan = c.prepare_store(_key(toks, f"store-{i}", worker_id=0), 1).result(5)
            assert plan["ok"]
            assert c.commit_store(plan["transfer_id"], True).result(5)["ok"]
            c.end_session(f"store-{i}").result(5)

    op_lookup, op_status, op_end, op_error = (
        msgpack.packb(o) for o in ("lookup", "query_prefetch_status", "end_session", "error"))
    tp = msgpack.packb(1)

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sp.url)
    pending: dict[int, tuple[int, str]] = {}  # uid -> (cycle, stage)
    uid = 0
    started = 0
    finished = 0
    abandoned = 0
    wrong: list[str] = []
    warmup_lookups = max(LOOKUPS // 10, 1000)
    warmup_until = time.monotonic() + TTL_S + 15
    rss_warm = 0
    warm_at = 0
    rss_peak_after_warm = 0
    t0 = time.monotonic()

    def rid_frame(cycle: int) -> bytes:
        return msgpack.packb(f"soak-{cycle}")

    def send(frames: list[bytes], cycle: int, stage: str) -> None:
        nonlocal uid
        uid += 1
        pending[uid] = (cycle, stage)
        sock.send_multipart([msgpack.packb(uid)] + frames)

    try:
        while finished < LOOKUPS:
            while started < LOOKUPS and len(pending) < WINDOW:
                cycle = started
                toks = stored[cycle // 2 % STORED_PROMPTS] if cycle % 2 == 0 else misses[cycle // 2 % MISS_PROMPTS]
                send([op_lookup, msgpack.packb(_key(toks, f"soak-{cycle}")), tp], cycle, "lookup")
                started += 1
            if not sock.poll(20_000):
                raise AssertionError(f"no reply for 20 s after {finished} lookups; {len(pending)} pending")
            while True:
                try:
                    reply = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                cycle, stage = pending.pop(msgpack.unpackb(reply[0]))
                if reply[1] == op_error:
                    wrong.append(f"{stage} of cycle {cycle}: {msgpack.unpackb(reply[2])!r}")
                    finished += 1
                elif stage == "lookup":
                    if cycle % ABANDON_EVERY == ABANDON_EVERY - 1:
                        abandoned += 1  # its leases stay held until the job TTL reaps them
                        finished += 1
                    else:
                        send([op_status, rid_frame(cycle)], cycle, "status")
                elif stage == "status":
                    status = msgpack.unpackb(reply[2]) if len(reply) > 2 else None
                    if status is None:
                        send([op_status, rid_frame(cycle)], cycle, "status")  # still loading
                    else:
                        expected = CHUNKS if cycle % 2 == 0 else 0
                        if status != expected:
                            wrong.append(f"cycle {cycle}: status {status}, expected {expected}")
                        send([op_end, rid_frame(cycle)], cycle, "end")
                else:
                    finished += 1
                if finished % RSS_SAMPLE_EVERY == 0:
                    if not rss_warm:
                        if finished >= warmup_lookups and time.monotonic() >= warmup_until:
                            rss_warm = _rss_bytes(pid)
                            warm_at = finished
                    else:
                        rss_peak_after_warm = max(rss_peak_after_warm, _rss_bytes(pid))
            if len(wrong) > 10:
                break
    finally:
        sock.close()
        ctx.term()
    elapsed = time.monotonic() - t0
    rss_end = _rss_bytes(pid)
    assert wrong == [], wrong[:10]
    assert rss_warm, (
        f"the run ({LOOKUPS} lookups, {elapsed:.0f} s) ended before the warm-up (TTL {TTL_S:g} s "
        f"+ 15 s); raise MPCACHE_SOAK_LOOKUPS or lower MPCACHE_SOAK_TTL")
    rss_peak_after_warm = max(rss_peak_after_warm, rss_end)

    # The last abandoned jobs are reaped at the job TTL; then every table must be empty.
    with MPCacheClient(sp.url, request_timeout=10.0) as c:
        end = time.monotonic() + TTL_S + 15
        while True:
            s = c.stats()
            if s["leases_held"] == 0 and s["jobs"] == 0 or time.monotonic() > end:
                break
            time.sleep(0.5)
    growth = rss_peak_after_warm / rss_warm - 1
    print(f"\nsoak: {LOOKUPS} lookups ({abandoned} abandoned), TTL {TTL_S:g} s, in {elapsed:.1f} s "
          f"({LOOKUPS / elapsed:,.0f}/s); RSS at warm-up end (lookup {warm_at}) "
          f"{rss_warm / 2**20:.1f} MiB, peak after {rss_peak_after_warm / 2**20:.1f} MiB, end "
          f"{rss_end / 2**20:.1f} MiB ({growth * 100:+.2f}%); after the reaper: "
          f"leases_held={s['leases_held']} jobs={s['jobs']} tombstones={s['tombstones']}")
    assert s["leases_held"] == 0, s
    assert s["jobs"] == 0, s
    assert growth <= MAX_RSS_GROWTH, f"RSS grew {growth * 100:.1f}% after warm-up"
