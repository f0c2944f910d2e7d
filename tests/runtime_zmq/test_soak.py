"""Soak: a long stream of lookups against one server; its memory must stay flat.

Each lookup runs the scheduler's cycle on a request id never used before (as vLLM's are):
`lookup` → (after the ack) `query_prefetch_status` → `end_session`, on one DEALER socket. Lookups
are started at a steady `MPCACHE_SOAK_RATE` per second (a token bucket, at most `MAX_IN_FLIGHT`
cycles in flight), not as fast as the server answers: live protocol state is rate × TTL, so an
unpaced run measures the box's spare CPU (which changes with its other load), not whether memory
follows live state. Half the prompts are stored (4-chunk L1 hits), half are misses; one cycle in
a hundred is abandoned after the lookup (never queried, never ended), so its leases stay held until
the server's reaper frees them at the job TTL.

Every per-request table is bounded by a TTL, so memory reaches a plateau once the run is older
than the longest TTL and the rate is constant. The warm-up is therefore the later of 10% of the lookups and TTL + 15 s; after
it the server's RSS may grow by at most 5%, and at the end every lease and job must be gone. If the rate cannot be held (fewer than 95% of the
scheduled starts over any 10 s), the test fails and says so instead of measuring something else.

Environment: `MPCACHE_SOAK_LOOKUPS` (default 1,000,000), `MPCACHE_SOAK_TTL` (job and tombstone
TTL in seconds, default 60 as in production; lower it for a shorter run), `MPCACHE_SOAK_RATE`
(lookups started per second, default 2000, below what a shared 2-core box sustains). `make soak` runs it.
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

from mpcache.runtime_zmq.client import MPCacheClient

# The default per-test timeout (300 s) is far below a million lookups on a shared 2-core box.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * 3600)]

LOOKUPS = int(os.environ.get("MPCACHE_SOAK_LOOKUPS", "1000000"))
TTL_S = float(os.environ.get("MPCACHE_SOAK_TTL", "60"))
RATE = float(os.environ.get("MPCACHE_SOAK_RATE", "2000"))
MAX_IN_FLIGHT = 32  # cycles (the old window): a stall cannot pile up live jobs beyond it
BURST = max(RATE * 0.02, 1.0)  # token-bucket depth: a late start is not made up in a burst
MIN_RATE_FRACTION = 0.95
RATE_WINDOW_S = 10.0
TRACE_EVERY_S = 10.0
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
        assert isinstance(c.register_instance(1, layout).result(5), int)
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
    warm_t = 0.0
    # (seconds since start, RSS MiB, live jobs, leases held, tombstones), every TRACE_EVERY_S
    trace: list[tuple[float, float, int, int, int]] = []
    stats_client = MPCacheClient(sp.url, request_timeout=10.0)
    t0 = time.monotonic()
    tokens = 1.0
    last_refill = t0
    last_reply = t0
    next_trace = t0
    starts_log: list[tuple[float, int]] = [(t0, 0)]  # (time, started) about once a second

    def rid_frame(cycle: int) -> bytes:
        return msgpack.packb(f"soak-{cycle}")

    def send(frames: list[bytes], cycle: int, stage: str) -> None:
        nonlocal uid
        uid += 1
        pending[uid] = (cycle, stage)
        sock.send_multipart([msgpack.packb(uid)] + frames)

    try:
        while finished < LOOKUPS:
            now = time.monotonic()
            tokens = min(tokens + (now - last_refill) * RATE, BURST)
            last_refill = now
            while started < LOOKUPS and tokens >= 1.0 and len(pending) < MAX_IN_FLIGHT:
                cycle = started
                toks = stored[cycle // 2 % STORED_PROMPTS] if cycle % 2 == 0 else misses[cycle // 2 % MISS_PROMPTS]
                send([op_lookup, msgpack.packb(_key(toks, f"soak-{cycle}")), tp], cycle, "lookup")
                started += 1
                tokens -= 1.0
            if now - starts_log[-1][0] >= 1.0:
                starts_log.append((now, started))
                # the pace over the last RATE_WINDOW_S: fewer than 95% of the scheduled starts fails
                old = [e for e in starts_log if now - e[0] >= RATE_WINDOW_S]
                if old and started < LOOKUPS:
                    t_old, n_old = old[-1]
                    achieved = (started - n_old) / (now - t_old)
                    if achieved < MIN_RATE_FRACTION * RATE:
                        raise AssertionError(
                            f"the server did not keep the pace: {achieved:,.0f} lookups/s started over "
                            f"the last {now - t_old:.0f} s against {RATE:,.0f}/s (after {started} "
                            f"lookups, {len(pending)} in flight); lower MPCACHE_SOAK_RATE")
                    del starts_log[:len(old) - 1]
            if now >= next_trace:
                st = stats_client.stats()
                trace.append((now - t0, _rss_bytes(pid) / 2**20, st["jobs"], st["leases_held"],
                              st["tombstones"]))
                next_trace += TRACE_EVERY_S
            wait_s = 0.0 if tokens >= 1.0 and started < LOOKUPS else (
                (1.0 - tokens) / RATE if started < LOOKUPS else 1.0)
            if not sock.poll(max(1, int(wait_s * 1000))):
                if pending and time.monotonic() - last_reply > 20:
                    raise AssertionError(f"no reply for 20 s after {finished} lookups; {len(pending)} pending")
                continue
            last_reply = time.monotonic()
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
                            warm_t = time.monotonic()
                    else:
                        rss_peak_after_warm = max(rss_peak_after_warm, _rss_bytes(pid))
            if len(wrong) > 10:
                break
    finally:
        sock.close()
        ctx.term()
        stats_client.close()
    t_end = time.monotonic()
    elapsed = t_end - t0
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
    rate_after_warm = (LOOKUPS - warm_at) / (t_end - warm_t) if t_end > warm_t else 0.0
    trace_s = " ".join(f"{t:.0f}s:{m:.1f}MiB/j{j}/l{lh}/t{tb}" for t, m, j, lh, tb in trace)
    print(f"\nsoak: {LOOKUPS} lookups ({abandoned} abandoned), TTL {TTL_S:g} s, paced at {RATE:,.0f}/s, "
          f"in {elapsed:.1f} s ({LOOKUPS / elapsed:,.0f}/s achieved, {rate_after_warm:,.0f}/s after "
          f"warm-up); RSS at warm-up end (lookup {warm_at}) "
          f"{rss_warm / 2**20:.1f} MiB, peak after {rss_peak_after_warm / 2**20:.1f} MiB, end "
          f"{rss_end / 2**20:.1f} MiB ({growth * 100:+.2f}%); after the reaper: "
          f"leases_held={s['leases_held']} jobs={s['jobs']} tombstones={s['tombstones']}\n"
          f"soak trace (time: RSS/jobs/leases/tombstones): {trace_s}")
    assert s["leases_held"] == 0, s
    assert s["jobs"] == 0, s
    assert growth <= MAX_RSS_GROWTH, f"RSS grew {growth * 100:.1f}% after warm-up"
