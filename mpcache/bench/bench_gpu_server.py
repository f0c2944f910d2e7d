"""`mpcache-bench gpu-server [--engines 1,2,4] [--rounds N] [--out DIR]`: GPU store / retrieve
through a real ``mpcache-server --gpu on`` (a separate process: ZMQ over ipc, core_sm, the GPU
transfer engine with its interprocess-event waits and completion waiters).

Engine processes (1-4) each hold a Llama-3-8B-like paged KV cache on the GPU (32 layers, 8 KV
heads, head 128, bf16, block 16, vLLM NHD layout; chunk 256 tokens = one 32 MiB L1 slot),
register it by CUDA IPC handles and issue concurrent STOREs of fresh prompts, then RETRIEVEs of
them into other blocks (random block order), recording one interprocess event before each
request as vLLM's worker does. Every first and last round is checked bitwise on the engine
(retrieved blocks equal the stored ones).

Per shape (requests in flight x chunks per request, split over the engines) it reports:

* GB/s of the round (bytes / first send to last reply) against this run's pinned-memcpy ceiling
  in the same direction;
* p50 / p99 request latency (send to reply, on the engine);
* server CPU per request (all its threads, /proc schedstat), less what the server spends idle
  over the same wall time (measured for 0.5 s before the shapes: its threads' timed polls), and
  the GPU engine's host time per transfer (``gpu_start_ns`` / ``gpu_started`` from the server's stats);
* where a request's latency goes: the server's receipt-to-reply time, the GPU copy from enqueued to
  seen done, the client's submit call; for the first round too;
* the first round after the server started, separately (a fresh server per single-engine shape);
* lone transfers (``--lone-starts``): per fresh server, one loaded round of 16 x 8, then 40 single
  8-chunk requests one at a time (a store, then its retrieve), p50 / p90 / p99 per start, and for
  the slow ones (over 1.5 x that start's p50) where the time went: the server's receipt to reply,
  the GPU copy from enqueued to seen done, and the rest (client, socket, engine wake-up).

``--server-repo DIR`` runs the server from another checkout (e.g. an older commit) with this
checkout's engines, for before/after tables. Prints a table; writes gpu_server.json under --out.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from mpcache.bench.server_process import ServerProcess

MiB = 1 << 20
GEO = {"num_layers": 32, "block_size": 16, "num_heads": 8, "head_size": 128}
CHUNK = 256
BPC = CHUNK // GEO["block_size"]
SLOT = 2 * GEO["num_layers"] * CHUNK * GEO["num_heads"] * GEO["head_size"] * 2  # 32 MiB
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _engine(conn: Any, url: str, iid: int, num_blocks: int, seed: int, announce_event: bool = True) -> None:
    """One engine process: owns its KV cache, registers it, runs the phases the parent asks for."""
    import numpy as np
    import torch

    from mpcache.runtime_zmq.client import MPCacheClient
    from mpcache.runtime_zmq.gpu_ipc import device_uuid, export_event, export_kv_tensors

    torch.cuda.init()
    shape = (2, num_blocks, GEO["block_size"], GEO["num_heads"], GEO["head_size"])
    gen = torch.Generator(device="cuda").manual_seed(seed)
    layers = []
    for _ in range(GEO["num_layers"]):
        t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        t.view(torch.int16).random_(-32768, 32767, generator=gen)
        layers.append(t)
    torch.cuda.synchronize()
    layout = {
        "model_name": "bench/llama-3-8b", "world_size": 1, "object_bytes": SLOT, "engine_driven": False,
        "kv_layout": "nhd", "num_blocks": num_blocks, **{k: GEO[k] for k in ("block_size", "num_heads", "head_size")},
        "itemsize": 2, "device_uuid": device_uuid(torch.cuda.current_device()), "tensors": export_kv_tensors(layers),
    }
    event = torch.cuda.Event(interprocess=True)
    event.record()
    handle = export_event(event)
    if announce_event:  # opened by the server at registration, not on the first request
        layout["event_handles"] = [handle]
    client = MPCacheClient(url, request_timeout=120.0)
    rng = np.random.default_rng(seed)
    try:
        t0 = time.perf_counter()
        client.register_instance(iid, layout).result(300)
        conn.send({"registered_s": time.perf_counter() - t0})
        while True:
            msg = conn.recv()
            if msg["op"] == "bye":
                break
            if msg["op"] == "ceiling":
                conn.send(_ceiling(torch))
                continue
            conn.send(_phase(client, iid, handle, event, layers, rng, num_blocks, msg))
    except Exception as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
    finally:
        client.close()


def _phase(client: Any, iid: int, handle: bytes, event: Any, layers: list[Any], rng: Any, num_blocks: int,
           msg: dict[str, Any]) -> dict[str, Any]:
    import torch

    n_req, n_chunks, tag = msg["requests"], msg["chunks"], msg["tag"]
    need = n_req * n_chunks * BPC
    perm = [int(b) for b in rng.permutation(num_blocks)]
    src = [perm[i * n_chunks * BPC : (i + 1) * n_chunks * BPC] for i in range(n_req)]
    dst = [perm[need + i * n_chunks * BPC : need + (i + 1) * n_chunks * BPC] for i in range(n_req)] if 2 * need <= num_blocks else src
    keys = []
    for i in range(n_req):
        base = 1_000 + (hash((tag, iid, i)) % 40_000_000)
        tokens = list(range(base, base + n_chunks * CHUNK))
        keys.append({"model_name": "bench/llama-3-8b", "world_size": 1, "worker_id": 0, "token_ids": tokens, "start": 0,
                     "end": len(tokens), "request_id": f"{tag}-{iid}-{i}", "cache_salt": "", "request_configs": None,
                     "num_kv_readers": 1})
    before = None
    if msg["check"]:
        # compared as int16: random bit patterns include bf16 NaNs, which never compare equal
        before = [torch.stack([t.view(torch.int16)[:, s] for t in layers]).clone() for s in src]
    out: dict[str, Any] = {}
    for kind in ("store", "retrieve"):
        done_at = [0.0] * n_req
        sent_at = [0.0] * n_req
        submitted = [0.0] * n_req
        futures = []
        start_wall = time.monotonic()
        for i in range(n_req):
            event.record()  # what the engine's forward pass would be ordered by
            sent_at[i] = time.perf_counter()
            if kind == "store":
                f = client.store(keys[i], iid, src[i], handle)
            else:
                f = client.retrieve(keys[i], iid, dst[i], handle, 0)
            submitted[i] = time.perf_counter()

            def stamp(_f: Any, i: int = i) -> None:
                done_at[i] = time.perf_counter()
            f.add_done_callback(stamp)
            futures.append(f)
        oks = []
        for f in futures:
            r = f.result(120)
            oks.append(bool(r[-1]) if isinstance(r, (list, tuple)) else bool(r))
        end_wall = time.monotonic()
        lat = [(d - s) * 1e3 for s, d in zip(sent_at, done_at)]
        out[kind] = {"start": start_wall, "end": end_wall, "lat_ms": lat, "ok": all(oks), "oks": sum(oks),
                     "submit_ms": [(b - a) * 1e3 for a, b in zip(sent_at, submitted)]}
    if before is not None:
        torch.cuda.synchronize()
        good = all(torch.equal(torch.stack([t.view(torch.int16)[:, d] for t in layers]), b) for d, b in zip(dst, before))
        out["check"] = good
    return out


def _ceiling(torch: Any) -> dict[str, float]:
    n = 1 << 30
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.random_(0, 255)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, fn in (("d2h", lambda: host.copy_(dev, non_blocking=True)), ("h2d", lambda: dev.copy_(host, non_blocking=True))):
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        out[name] = n / statistics.median(times) / 1e9
    return out


def _server_cpu_ns(pid: int) -> int:
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:
            pass
    return total


def _server_cpu_by_task(pid: int) -> dict[int, int]:
    """CPU ns per thread (task id) of the server so far."""
    out: dict[int, int] = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                out[int(task)] = int(f.read().split()[0])
        except (OSError, ValueError):
            pass
    return out


def _thread_name(pid: int, tid: int, python_names: dict[str, str]) -> str:
    """The server's Python name for a thread (its ``stats`` answer's ``threads``), else the
    kernel's (zmq's I/O threads name themselves), with a trailing number dropped so that
    per-instance threads add up."""
    name = python_names.get(str(tid))
    if name is None:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            name = "gone"
    return "MainThread (loop)" if tid == pid else name.rstrip("0123456789").rstrip("-/")


class Server(ServerProcess):
    """``mpcache-server --gpu on`` for this benchmark (ipc socket, its chunk and slot size)."""

    def __init__(self, repo: str, l1_gb: float, workdir: str, extra: Sequence[str] = (), cpus: str = "") -> None:
        sock = os.path.join(workdir, f"s{time.monotonic_ns()}", "mpcache.sock")
        super().__init__(["--gpu", "on", "--ipc", sock, "--chunk-size", str(CHUNK), "--slot-mb", str(SLOT / MiB),
                          "--l1-size-gb", str(l1_gb), "--no-metrics", "--log-level", "WARNING", *extra], repo=repo)
        if cpus:
            # every thread the server has now; those it starts later (one waiter per engine) inherit it
            cores = {int(c) for c in cpus.split(",")}
            for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
                os.sched_setaffinity(int(tid), cores)

    def stats(self) -> dict[str, Any]:
        from mpcache.runtime_zmq.client import MPCacheClient

        with MPCacheClient(self.url, request_timeout=10.0) as c:
            return dict(c.stats())

    def stop(self, timeout: float = 60.0) -> int | None:
        code = super().stop(timeout)
        if code != 0:
            print(f"server exit code {code}; its last lines:\n" + "\n".join(self.log[-20:]), file=sys.stderr)
        return code


def _run_config(args: Any, n_engines: int, shapes: list[tuple[int, int]], workdir: str) -> list[dict[str, Any]]:
    """One server, ``n_engines`` engines, the shapes in order; rounds of each shape."""
    server = Server(args.server_repo, args.l1_gb, workdir, args.server_args.split(), args.server_cpus)
    ctx = mp.get_context("spawn")
    max_need = max(r * c for r, c in shapes)
    per_engine_need = -(-max_need // n_engines) * BPC
    num_blocks = 2 * per_engine_need + 64
    pipes: list[Any] = []
    procs: list[Any] = []
    rows: list[dict[str, Any]] = []
    try:
        for e in range(n_engines):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_engine, args=(child, server.url, e + 1, num_blocks, 100 + e, not args.no_announce_event),
                            daemon=True)
            p.start()
            pipes.append(parent)
            procs.append(p)
        reg = [p.recv() for p in pipes]
        for r in reg:
            if "error" in r:
                raise RuntimeError(r["error"])
        if args.ceiling is None:
            pipes[0].send({"op": "ceiling"})
            args.ceiling = pipes[0].recv()
        # the server's CPU while idle (its threads' timed polls), subtracted from each round's so
        # that "cpu us/req" is what the requests cost, not the time the engines spent preparing
        ca, ta = _server_cpu_ns(server.proc.pid), time.perf_counter()
        time.sleep(0.5)
        idle_ns_per_s = (_server_cpu_ns(server.proc.pid) - ca) / (time.perf_counter() - ta)
        for n_req, n_chunks in shapes:
            per = [n_req // n_engines + (1 if e < n_req % n_engines else 0) for e in range(n_engines)]
            rounds = []
            for rnd in range(args.rounds):
                check = rnd in (0, args.rounds - 1)
                s0 = server.stats()
                c0, w0 = _server_cpu_ns(server.proc.pid), time.perf_counter()
                t0 = _server_cpu_by_task(server.proc.pid)
                for e, conn in enumerate(pipes):
                    conn.send({"op": "phase", "requests": per[e], "chunks": n_chunks, "tag": f"{n_engines}-{n_req}x{n_chunks}-{rnd}-{time.monotonic_ns()}",
                            "check": check})
                res = [conn.recv() for conn in pipes]
                c1, w1 = _server_cpu_ns(server.proc.pid), time.perf_counter()
                t1 = _server_cpu_by_task(server.proc.pid)
                s1 = server.stats()
                threads: dict[str, int] = {}
                for tid, ns in t1.items():
                    name = _thread_name(server.proc.pid, tid, s1.get("threads", {}))
                    threads[name] = threads.get(name, 0) + ns - t0.get(tid, 0)
                for r in res:
                    if "error" in r:
                        raise RuntimeError(r["error"])
                rounds.append({"res": res, "cpu_ns": c1 - c0, "idle_ns": idle_ns_per_s * (w1 - w0), "s0": s0, "s1": s1,
                               "threads": threads})
            rows.append(_summarise(n_engines, n_req, n_chunks, rounds, args.ceiling))
    finally:
        for conn in pipes:
            try:
                conn.send({"op": "bye"})
            except OSError:
                pass
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        server.stop()
    for row in rows:
        row["server_ready_s"] = server.ready_s
        row["registered_s"] = max(r.get("registered_s", 0.0) for r in reg)
        row["server_exit"] = server.exit_code
        row["server_stop_s"] = server.stop_s
    return rows


def _run_lone(args: Any, workdir: str, start: int) -> dict[str, Any]:
    """One fresh server and engine: a loaded round of 16 x 8, then ``args.lone_count`` lone
    1 x 8 requests (store then retrieve), the server's counters read between them."""
    server = Server(args.server_repo, args.l1_gb, workdir, args.server_args.split(), args.server_cpus)
    ctx = mp.get_context("spawn")
    num_blocks = 2 * 16 * 8 * BPC + 64
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine, args=(child, server.url, 1, num_blocks, 300 + start, not args.no_announce_event),
                       daemon=True)
    proc.start()
    out: dict[str, Any] = {"start": start, "store": [], "retrieve": [], "checked": True}
    try:
        reg = parent.recv()
        if "error" in reg:
            raise RuntimeError(reg["error"])
        parent.send({"op": "phase", "requests": 16, "chunks": 8, "tag": f"lone-load-{start}-{time.monotonic_ns()}", "check": True})
        loaded = parent.recv()
        if "error" in loaded:
            raise RuntimeError(loaded["error"])
        out["checked"] &= bool(loaded.get("check", True))
        for k in range(args.lone_count):
            s0 = server.stats()
            parent.send({"op": "phase", "requests": 1, "chunks": 8, "tag": f"lone-{start}-{k}-{time.monotonic_ns()}",
                         "check": k in (0, args.lone_count - 1)})
            r = parent.recv()
            s1 = server.stats()
            if "error" in r:
                raise RuntimeError(r["error"])
            out["checked"] &= bool(r.get("check", True)) and r["store"]["ok"] and r["retrieve"]["ok"]
            flight = (s1.get("gpu_flight_ns", 0) - s0.get("gpu_flight_ns", 0)) / 2e6  # two transfers: mean ms
            for kind in ("store", "retrieve"):
                served = (s1.get(f"served_ns_{kind}", 0) - s0.get(f"served_ns_{kind}", 0)) / 1e6
                out[kind].append({"ms": r[kind]["lat_ms"][0], "served_ms": served, "flight_ms": flight})
    finally:
        try:
            parent.send({"op": "bye"})
        except OSError:
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        server.stop()
    return out


def _print_lone(lone: list[dict[str, Any]]) -> None:
    print(f"lone 1 x 8 transfers, one at a time after a loaded 16 x 8 round; slow = over 1.5 x the start's p50, "
          f"split into server receipt-to-reply / GPU enqueued-to-done (mean of the pair) / the rest")
    print(f"{'start':>5} {'dir':>8} {'n':>3} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} {'p99/p50':>7} {'slow':>4} | "
          f"{'slow: served':>12} {'gpu':>6} {'rest':>6} | {'fast: served':>12} {'gpu':>6} {'rest':>6} {'check':>5}")
    for run in lone:
        for kind in ("store", "retrieve"):
            xs = run[kind]
            if not xs:
                continue
            lat = [x["ms"] for x in xs]
            p50 = _pct(lat, 0.5)
            slow = [x for x in xs if x["ms"] > 1.5 * p50]
            fast = [x for x in xs if x["ms"] <= 1.5 * p50]

            def split(group: list[dict[str, Any]]) -> str:
                if not group:
                    return f"{'-':>12} {'-':>6} {'-':>6}"
                served = statistics.mean(x["served_ms"] for x in group)
                gpu = statistics.mean(x["flight_ms"] for x in group)
                rest = statistics.mean(x["ms"] - x["served_ms"] for x in group)
                return f"{served:>12.2f} {gpu:>6.2f} {rest:>6.2f}"
            print(f"{run['start']:>5} {kind:>8} {len(xs):>3} {p50:>7.2f} {_pct(lat, 0.9):>7.2f} {_pct(lat, 0.99):>7.2f} "
                  f"{_pct(lat, 0.99) / p50:>7.2f} {len(slow):>4} | {split(slow)} | {split(fast)} {'ok' if run['checked'] else 'FAIL':>5}")


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def _summarise(n_engines: int, n_req: int, n_chunks: int, rounds: list[dict[str, Any]], ceiling: dict[str, float]) -> dict[str, Any]:
    row: dict[str, Any] = {"engines": n_engines, "requests": n_req, "chunks": n_chunks}
    nbytes = n_req * n_chunks * SLOT
    for kind, direction in (("store", "d2h"), ("retrieve", "h2d")):
        def stats_of(rs: list[dict[str, Any]]) -> dict[str, Any]:
            gbps, lat, ok = [], [], True
            for r in rs:
                parts = [x[kind] for x in r["res"]]
                wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
                gbps.append(nbytes / wall / 1e9)
                for p in parts:
                    lat += p["lat_ms"]
                    ok &= p["ok"]
            sub = [x for r in rs for part in r["res"] for x in part[kind].get("submit_ms", [])]
            return {"gbps": statistics.median(gbps), "pct": statistics.median(gbps) / ceiling[direction] * 100,
                    "p50": _pct(lat, 0.5), "p99": _pct(lat, 0.99), "ok": ok,
                    "submit_p50": _pct(sub, 0.5) if sub else float("nan")}
        row[kind] = stats_of(rounds[1:] if len(rounds) > 1 else rounds)
        row[kind + "_first"] = stats_of(rounds[:1])
    steady = rounds[1:] if len(rounds) > 1 else rounds
    reqs = 2 * n_req * len(steady)
    row["cpu_us_per_req"] = max(0.0, sum(r["cpu_ns"] - r["idle_ns"] for r in steady)) / reqs / 1e3
    row["cpu_us_per_req_gross"] = sum(r["cpu_ns"] for r in steady) / reqs / 1e3
    by_thread: dict[str, int] = {}
    for r in steady:
        for name, ns in r.get("threads", {}).items():
            by_thread[name] = by_thread.get(name, 0) + ns
    # gross CPU per request by thread (not net of idle): where the server's CPU goes
    row["cpu_us_per_req_by_thread"] = {name: ns / reqs / 1e3 for name, ns in
                                       sorted(by_thread.items(), key=lambda kv: -kv[1])}
    started = sum(r["s1"].get("gpu_started", 0) - r["s0"].get("gpu_started", 0) for r in steady)
    ns = sum(r["s1"].get("gpu_start_ns", 0) - r["s0"].get("gpu_start_ns", 0) for r in steady)
    row["host_us_per_transfer"] = ns / started / 1e3 if started and ns else float("nan")
    for part in ("plan", "enqueue", "wait", "handoff", "lane"):
        part_ns = sum(r["s1"].get(f"gpu_{part}_ns", 0) - r["s0"].get(f"gpu_{part}_ns", 0) for r in steady)
        row[f"{part}_us_per_transfer"] = part_ns / started / 1e3 if started and part_ns else float("nan")
    flight = sum(r["s1"].get("gpu_flight_ns", 0) - r["s0"].get("gpu_flight_ns", 0) for r in steady)
    finished = sum(r["s1"].get("gpu_finished", 0) - r["s0"].get("gpu_finished", 0) for r in steady)
    row["flight_ms_per_transfer"] = flight / finished / 1e6 if finished and flight else float("nan")
    for kind in ("store", "retrieve"):
        # the server's receipt (decoded) to its reply: the engine's latency minus this is the
        # client, the socket and the engine's own wake-up
        served = sum(r["s1"].get(f"served_ns_{kind}", 0) - r["s0"].get(f"served_ns_{kind}", 0) for r in steady)
        count = sum(r["s1"].get(f"served_{kind}", 0) - r["s0"].get(f"served_{kind}", 0) for r in steady)
        row[f"served_ms_{kind}"] = served / count / 1e6 if count and served else float("nan")
    first = rounds[0]
    for part in ("start", "plan", "enqueue", "wait", "flight"):
        # the first round after registration alone: where a new engine's first requests pay more
        d = first["s1"].get(f"gpu_{part}_ns", 0) - first["s0"].get(f"gpu_{part}_ns", 0)
        n = first["s1"].get("gpu_started", 0) - first["s0"].get("gpu_started", 0)
        row[f"first_{part}_us"] = d / n / 1e3 if n else float("nan")
    row["memcpy_batch"] = rounds[-1]["s1"].get("gpu_memcpy_batch", -1)
    # the waiters' looks at completion events, or the copy lanes' (--gpu-completions lane)
    looks = sum(r["s1"].get(k, 0) - r["s0"].get(k, 0) for r in steady for k in ("gpu_polls", "gpu_lane_looks"))
    row["polls_per_transfer"] = looks / started if started else float("nan")
    row["events_created"] = rounds[-1]["s1"].get("gpu_events_created", -1)
    row["link_gbps"] = {k: rounds[-1]["s1"].get(f"gpu_link_mbps_{k}", 0) / 1e3 for k in ("store", "retrieve")}
    row["link_lat_us"] = {k: rounds[-1]["s1"].get(f"gpu_link_lat_us_{k}", 0) for k in ("store", "retrieve")}
    row["poll_path"] = rounds[-1]["s1"].get("gpu_poll_compiled", -1)
    row["failed"] = rounds[-1]["s1"].get("transfers_failed", rounds[-1]["s1"].get("gpu_failed", 0))
    row["checked"] = all(x.get("check", True) for r in rounds for x in r["res"])
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mpcache-bench gpu-server")
    ap.add_argument("--engines", default="1,2,4", help="engine process counts, comma-separated (default 1,2,4)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per shape; the first is reported separately")
    ap.add_argument("--shapes", default="1x8,32x1,16x8,4x32", help="requests-in-flight x chunks per request, for one engine")
    ap.add_argument("--multi-shapes", default="32x1,16x8", help="shapes for 2+ engines (requests split between them)")
    ap.add_argument("--l1-gb", type=float, default=10.0)
    ap.add_argument("--server-repo", default=REPO, help="checkout to run mpcache-server from (default: this one)")
    ap.add_argument("--no-announce-event", action="store_true",
                    help="engines do not name their interprocess event at registration (the server then opens it on "
                         "the first request, as servers before event_handles did)")
    ap.add_argument("--lone-starts", type=int, default=3,
                    help="fresh servers for the lone-transfer table (0: leave it out; default 3)")
    ap.add_argument("--lone-count", type=int, default=40, help="lone 1 x 8 requests per start (default 40)")
    ap.add_argument("--label", default="", help="a name for this run in the table / json")
    ap.add_argument("--server-cpus", default="", help="pin the server's threads to these CPUs (e.g. \"2\" or \"2,3\"; default: not pinned)")
    ap.add_argument("--server-args", default="", help="extra mpcache-server arguments (e.g. \"--log-level INFO\"), for a before / after of an option")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args(argv)
    args.ceiling = None

    import torch

    if not torch.cuda.is_available():
        print("bench gpu-server: no CUDA GPU; nothing to measure", file=sys.stderr)
        return 2

    def parse(s: str) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in (x.split("x") for x in s.split(",") if x)]

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="mpcache-bench-") as workdir:
        for n in [int(x) for x in args.engines.split(",") if x]:
            if n == 1:
                for shape in parse(args.shapes):  # a fresh server each: the first round is the first after start
                    rows += _run_config(args, 1, [shape], workdir)
            else:
                rows += _run_config(args, n, parse(args.multi_shapes), workdir)
        lone = [_run_lone(args, workdir, k) for k in range(args.lone_starts)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"gpu_server{('_' + args.label) if args.label else ''}.json"), "w") as f:
        json.dump({"ceiling": args.ceiling, "rows": rows, "lone": lone, "label": args.label}, f, indent=1)
    if rows:
        _print(args, rows)
    if lone:
        _print_lone(lone)
    ok = all(r["store"]["ok"] and r["retrieve"]["ok"] and r["checked"] for r in rows) and all(x["checked"] for x in lone)
    return 0 if ok else 1


def _print(args: Any, rows: list[dict[str, Any]]) -> None:
    c = args.ceiling
    print(f"{args.label or 'gpu-server'}: ceiling pinned memcpy 1 GiB D2H {c['d2h']:.1f} GB/s, H2D {c['h2d']:.1f} GB/s; "
          f"server ready {rows[0]['server_ready_s']:.1f} s, registration {rows[0]['registered_s']:.2f} s")
    hdr = (f"{'eng':>3} {'req x chunks':>12} {'dir':>8} {'GB/s':>6} {'%ceil':>6} {'p50 ms':>7} {'p99 ms':>7} | "
           f"{'1st GB/s':>8} {'%ceil':>6} {'p50 ms':>7} {'p99 ms':>7} | {'cpu us/req':>10} {'host us/xfer':>12} {'check':>5}")
    print(hdr)
    tail = []
    for r in rows:
        for kind in ("store", "retrieve"):
            s, f = r[kind], r[kind + "_first"]
            print(f"{r['engines']:>3} {str(r['requests']) + ' x ' + str(r['chunks']):>12} {kind:>8} {s['gbps']:>6.1f} {s['pct']:>5.1f}% "
                  f"{s['p50']:>7.2f} {s['p99']:>7.2f} | {f['gbps']:>8.1f} {f['pct']:>5.1f}% {f['p50']:>7.2f} {f['p99']:>7.2f} | "
                  f"{r['cpu_us_per_req']:>10.0f} {r['host_us_per_transfer']:>12.1f} {'ok' if r['checked'] and s['ok'] else 'FAIL':>5}")
        tail.append(f"{r['engines']} x {r['requests']}x{r['chunks']}: host us/transfer plan {r.get('plan_us_per_transfer', float('nan')):.1f} "
                    f"enqueue {r.get('enqueue_us_per_transfer', float('nan')):.1f} (event wait {r.get('wait_us_per_transfer', float('nan')):.1f}); "
                    f"copy lane: taken {r.get('handoff_us_per_transfer', float('nan')):.1f} after the hand-over, its calls {r.get('lane_us_per_transfer', float('nan')):.1f}; "
                    f"polls/transfer {r.get('polls_per_transfer', float('nan')):.1f}, "
                    f"batched DMAs {r.get('memcpy_batch')}, compiled poller {r.get('poll_path')}, learned link GB/s "
                    f"{r.get('link_gbps', {}).get('store', 0):.1f} / {r.get('link_gbps', {}).get('retrieve', 0):.1f} + latency us "
                    f"{r.get('link_lat_us', {}).get('store', 0)} / {r.get('link_lat_us', {}).get('retrieve', 0)}, server exit {r.get('server_exit')} after {r.get('server_stop_s', float('nan')):.1f} s")
        tail.append(f"{r['engines']} x {r['requests']}x{r['chunks']}: mean ms, server receipt to reply store "
                    f"{r.get('served_ms_store', float('nan')):.2f} retrieve {r.get('served_ms_retrieve', float('nan')):.2f}; "
                    f"GPU enqueued to seen done {r.get('flight_ms_per_transfer', float('nan')):.2f}; "
                    f"engine p50 store {r['store']['p50']:.2f} retrieve {r['retrieve']['p50']:.2f} "
                    f"(of which the client's submit call {r['store']['submit_p50']:.2f} / {r['retrieve']['submit_p50']:.2f})")
        if r.get("cpu_us_per_req_by_thread"):
            tail.append(f"{r['engines']} x {r['requests']}x{r['chunks']}: server CPU us/req by thread (gross "
                        f"{r['cpu_us_per_req_gross']:.0f}): "
                        + ", ".join(f"{name} {us:.0f}" for name, us in r["cpu_us_per_req_by_thread"].items() if us >= 1))
        tail.append(f"{r['engines']} x {r['requests']}x{r['chunks']}: first round, us per transfer: host "
                    + ", ".join(f"{part} {r.get(f'first_{part}_us', float('nan')):.1f}"
                                for part in ("start", "plan", "enqueue", "wait", "flight")))
    print("\n".join(tail))


if __name__ == "__main__":
    sys.exit(main())
