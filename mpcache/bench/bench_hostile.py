"""`mpcache-bench hostile`: what each hostile input costs a live server.

For each bomb (the issue's findings), a fresh ``mpcache-server`` is started, an honest client
stores and looks up 4 chunks, a raw client sends the bomb while the honest client keeps sending
``noop``; the table shows the typed reply, the time to it, the server loop's longest single
message (wall and its thread's CPU time, from ``stats``), the server's RSS growth and peak (VmHWM)
growth, the honest client's worst ``noop`` round trip, and whether its hits are unchanged.
"""

from __future__ import annotations

import argparse
import struct
import sys
import time
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq

from mpcache.runtime_zmq.client import MPCacheClient
from mpcache.runtime_zmq.l1_pool import MappedSegment
from mpcache.bench.server_process import ServerProcess

P = msgpack.packb
MiB = 1 << 20
CHUNK = 256
OBJ = 4096


def _key(toks: Any, rid: str, **over: Any) -> dict[str, Any]:
    k = {"model_name": "m", "world_size": 1, "worker_id": None, "token_ids": toks, "start": 0, "end": 1024,
         "request_id": rid, "cache_salt": "", "request_configs": None, "num_kv_readers": 0}
    k.update(over)
    return k


def _bombs() -> list[tuple[str, list[bytes]]]:
    maps = 8 * MiB
    many_maps = b"\xdd" + struct.pack(">I", maps) + b"\x80" * maps
    big_name = _key(list(range(256)), "r", model_name="m" * (16 * MiB - 64))
    ghost = _key(list(range(256)), "ghost", worker_id=0, end=256)
    packed = struct.pack(f"<{1 << 20}I", *range(1 << 20))
    return [
        ("free_lookup_locks world_size=2**40", [P(1), P("free_lookup_locks"), P(_key(list(range(256)), "b", world_size=2**40)), P(1)]),
        ("lookup 1M packed tokens x 4096 ranks", [P(1), P("lookup"), P(_key(packed, "b", world_size=4096, end=1 << 20)), P(1)]),
        ("lookup 1M tokens as a list", [P(1), P("lookup"), P(_key(list(range(1 << 20)), "b", end=1 << 20)), P(1)]),
        ("8 MiB frame of empty maps", [P(1), P("lookup"), many_maps, P(1)]),
        ("80 frames x 4 MiB (320 MiB)", [P(1), P("noop"), *([b"\x00" * (4 * MiB)] * 80)]),
        ("16 MiB model name", [P(1), P("lookup"), P(big_name), P(1)]),
        ("store 200k block ids, not_after 1e15", [P(1), P("store"), P(ghost), P(77), P(list(range(200_000))), P(b"\x01" * 64), P(1e15)]),
        ("lookup 1M packed tokens (legitimate)", [P(1), P("lookup"), P(_key(packed, "big", end=1 << 20)), P(1)]),
        ("lookup 128k tokens as a list (legitimate)", [P(1), P("lookup"), P(_key(list(range(1 << 17)), "mid", end=1 << 17)), P(1)]),
    ]


def _mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    raise KeyError(field)


def _hits(c: MPCacheClient, rid: str) -> int:
    c.lookup(_key(list(range(1024)), rid)).result(10)
    n = int(c.query_prefetch_status(rid).result(10))
    c.end_session(rid).result(10)
    return n


def _prepare(c: MPCacheClient) -> None:
    c.register_instance(1, {"model_name": "m", "world_size": 1, "object_bytes": OBJ, "engine_driven": True}).result(10)
    plan = c.prepare_store(_key(list(range(1024)), "seed", worker_id=0), 1).result(10)
    seg = MappedSegment(plan["segment"], plan["slot_bytes"], 1 << 30)
    for _chunk, slot, _off in plan["placements"]:
        seg.view(slot, OBJ)[:] = b"\x07" * OBJ
    seg.close()
    c.commit_store(plan["transfer_id"], True).result(10)


def run_one(name: str, frames: list[bytes], server_args: list[str]) -> dict[str, Any]:
    server = ServerProcess(["--port", "0", "--no-metrics", *server_args])
    proc, url = server.proc, server.url
    try:
        c = MPCacheClient(url, request_timeout=30.0)
        _prepare(c)
        end = time.monotonic() + 60
        while not c.stats()["token_scanner_ready"] and time.monotonic() < end:
            time.sleep(0.05)  # numba's import is ~100 MiB of RSS: measure from after it
        hits0 = _hits(c, "before")
        rss0, hwm0 = _mib(proc.pid, "VmRSS"), _mib(proc.pid, "VmHWM")
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(url)
        t0 = time.perf_counter()
        raw.send_multipart(frames)
        worst = 0.0
        reply: list[bytes] | None = None
        while reply is None and time.perf_counter() - t0 < 60:
            s = time.perf_counter()
            c.noop()
            worst = max(worst, time.perf_counter() - s)
            if raw.poll(0):
                reply = raw.recv_multipart()
        took = time.perf_counter() - t0
        kind = "none"
        if reply is not None:
            body = msgpack.unpackb(reply[-1], raw=False) if len(reply) > 2 else None
            kind = body["kind"] if reply[1] == P("error") and isinstance(body, dict) else "ok"
        raw.close(0)
        ctx.term()
        st = c.stats()
        out = {
            "bomb": name, "reply": kind, "reply_ms": took * 1000, "loop_cpu_ms": st["loop_max_message_cpu_ms"],
            "loop_wall_ms": st["loop_max_message_ms"], "rss_mib": _mib(proc.pid, "VmRSS") - rss0,
            "hwm_mib": _mib(proc.pid, "VmHWM") - hwm0, "noop_worst_ms": worst * 1000,
            "hits_same": _hits(c, "after") == hits0,
        }
        c.close()
        return out
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mpcache-bench hostile", description=__doc__)
    ap.add_argument("--l1-size-gb", default="0.0625")
    args = ap.parse_args(argv)
    server_args = ["--l1-size-gb", args.l1_size_gb, "--slot-mb", "1"]
    rows = [run_one(name, frames, server_args) for name, frames in _bombs()]
    head = f"{'input':40} {'reply':>11} {'reply ms':>9} {'loop cpu ms':>12} {'loop wall ms':>13} {'RSS +MiB':>9} {'peak +MiB':>10} {'honest noop ms':>15} {'hits same':>10}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['bomb']:40} {r['reply']:>11} {r['reply_ms']:9.1f} {r['loop_cpu_ms']:12.2f} {r['loop_wall_ms']:13.2f} "
              f"{r['rss_mib']:9.1f} {r['hwm_mib']:10.1f} {r['noop_worst_ms']:15.1f} {str(r['hits_same']):>10}")
    return 0 if all(r["hits_same"] and r["reply"] != "none" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
