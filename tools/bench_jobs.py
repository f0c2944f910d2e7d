"""`mpcache-bench jobs`: what an abandoned lookup job costs the server, and that it is given back.

An abandoned lookup is one whose client never queries it or ends its session (the engine died,
the request was dropped): the server keeps its job until the job TTL, then reaps it. For each
prompt length (`--lengths`, default 1,024 and 8,192 tokens):

* **server process**: a real `mpcache-server` (L1 only, `--job-ttl`), warmed with a round of
  lookups that are ended; then `--jobs` lookups (all misses, so no leases: the job alone) under
  fresh request ids that are never ended. RSS (`/proc/PID/status` VmRSS) before, once every
  lookup is acknowledged, and after the reaper ran (`stats` says no job is left);
* **core_sm alone**: the same lookups fed to `core_sm`'s `LookupServer` in this process,
  measured with `tracemalloc` (bytes per job, exact), then reaped by advancing its clock.

Target: an abandoned job costs <= 200 B beyond its leases, and the memory comes back after the
reaper.
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
from array import array
import time
import tracemalloc
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq

from mpcache.tools.bench_rpc import BenchError, _call, _dealer, _start, _env_with_repo, _url, lookup_key

TARGET_BYTES_PER_JOB = 200


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise BenchError("no VmRSS")


def _tokens(n: int, seed: int) -> list[int]:
    return [(i * 2654435761 + seed * 7919) % 128_000 for i in range(n)]


def _flood(sock: zmq.Socket[Any], n: int, num_tokens: int, tag: str, end: bool, window: int = 64) -> None:
    """``n`` lookups of distinct prompts under fresh ids, ``window`` in flight; ended if ``end``."""
    lookup_op, end_op, one = msgpack.packb("lookup"), msgpack.packb("end_session"), msgpack.packb(1)
    sent = done = ends = 0
    inflight = 0
    while done < n or ends < (n if end else 0):
        while inflight < window and sent < n:
            rid = f"{tag}-{sent}"
            key = msgpack.packb(lookup_key(_tokens(num_tokens, sent), rid, packed=True), use_bin_type=True)
            sock.send_multipart([msgpack.packb(sent), lookup_op, key, one])
            if end:
                sock.send_multipart([msgpack.packb(-1), end_op, msgpack.packb(rid)])
            sent += 1
            inflight += 1
        if not sock.poll(10_000):
            raise BenchError("no reply within 10 s")
        reply = sock.recv_multipart()
        if reply[1] == end_op:
            ends += 1
            continue
        if reply[1] != lookup_op:
            raise BenchError(f"lookup failed: {reply!r}")
        inflight -= 1
        done += 1


def server_row(num_tokens: int, jobs: int, job_ttl: float) -> tuple[int, int, int, int]:
    """(rss before, rss with the jobs live, rss after the reaper, jobs left)."""
    workdir = tempfile.mkdtemp(prefix="mpcache-bench-jobs-")
    url = _url("tcp", workdir, "jobs")
    port = url.rsplit(":", 1)[1]
    argv = [sys.executable, "-m", "mpcache.runtime_zmq.cli", "--l1-size-gb", "0.25", "--slot-mb", "1",
            "--log-level", "WARNING", "--no-metrics", "--host", "127.0.0.1", "--port", port,
            "--job-ttl", str(job_ttl), "--tombstone-ttl", "1"]
    server = _start("mpcache", "tcp", argv, url, workdir, env=_env_with_repo())
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = _dealer(ctx, url)
    try:
        # warm-up: the allocator's pools, the numba scanner thread, every code path once
        _flood(sock, jobs, num_tokens, "warm", end=True)
        time.sleep(1.5)
        _call(sock, 1, "noop")
        before = _rss_bytes(server.proc.pid)
        _flood(sock, jobs, num_tokens, "abandoned", end=False)
        live = _rss_bytes(server.proc.pid)
        held = int(_call(sock, 2, "stats")["jobs"])
        if held < jobs:
            raise BenchError(f"only {held} of {jobs} jobs still live when measured: raise --job-ttl")
        deadline = time.monotonic() + job_ttl + 30
        left = -1
        while time.monotonic() < deadline:
            time.sleep(0.5)
            stats = _call(sock, 3, "stats")
            left = int(stats["jobs"])
            if left == 0:
                break
        time.sleep(1.0)
        after = _rss_bytes(server.proc.pid)
        return before, live, after, left
    finally:
        sock.close()
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def core_sm_row(num_tokens: int, jobs: int) -> tuple[float, float]:
    """(bytes per abandoned job while live, bytes per job left after the reaper) in core_sm."""
    from mpcache.core_sm import messages as m
    from mpcache.core_sm.server import LookupServer, ServerConfig

    sm = LookupServer(ServerConfig(chunk_size=256, num_slots=64, slot_bytes=1 << 20))
    now = 0.0
    # The events are built while tracing and dropped once handled: what is still allocated then
    # is what the server kept (the request id strings included; the tokens are not kept).
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(jobs):
        packed = array("I", _tokens(num_tokens, i)).tobytes()
        key = m.CacheKey("bench/model", 1, None, packed, 0, num_tokens, f"abandoned-{i:08d}")
        sm.handle(m.Lookup(key, 1, reply_to=("bench", i)), now)
    del key, packed
    gc.collect()
    live = tracemalloc.get_traced_memory()[0]
    sm.handle(m.TimerFired(), now + 10_000.0)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (live - base) / jobs, (after - base) / jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpcache-bench jobs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,8192", help="prompt lengths in tokens")
    parser.add_argument("--jobs", type=int, default=10_000, help="abandoned lookups per length")
    parser.add_argument("--job-ttl", type=float, default=40.0, help="the server's --job-ttl, s")
    parser.add_argument("--no-server", action="store_true", help="core_sm rows only")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    load = os.getloadavg()
    print(f"# mpcache-bench jobs: {args.jobs} abandoned lookups (misses: no leases) per length; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| tokens | core_sm B/job live | core_sm B/job after reap | server RSS before MiB | "
          "with jobs MiB | growth per 10k MiB | B/job | after reaper MiB | jobs left |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rc = 0
    for n in lengths:
        live_b, after_b = core_sm_row(n, args.jobs)
        cells = [f"{n:,}", f"{live_b:,.0f}", f"{after_b:,.0f}"]
        if live_b > TARGET_BYTES_PER_JOB:
            rc = 1
        if not args.no_server:
            before, live, after, left = server_row(n, args.jobs, args.job_ttl)
            growth = live - before
            cells += [f"{before / 2**20:.1f}", f"{live / 2**20:.1f}", f"{growth / 2**20 * 10_000 / args.jobs:.2f}",
                      f"{growth / args.jobs:,.0f}", f"{after / 2**20:.1f}", str(left)]
        else:
            cells += ["-"] * 6
        print("| " + " | ".join(cells) + " |", flush=True)
    print(f"target: <= {TARGET_BYTES_PER_JOB} B per abandoned job beyond its leases (core_sm column) -> "
          f"{'met' if rc == 0 else 'MISSED'}")
    return rc
