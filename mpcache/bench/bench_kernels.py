"""`mpcache-bench kernels [--quick] [--out DIR]`: the KV transfer kernels on a CUDA GPU.

Llama-3-8B-like KV (32 layers, 8 KV heads, head 128, bf16, block 16, chunk 256 → 32 MiB per chunk
slot), vLLM flash-attn NHD layout, block ids in random order, L1 slots in random order in a
pinned host pool. In one run:

* ceilings: pinned cudaMemcpyAsync of 1 GiB, H2D and D2H, and both at once on two streams;
* torch baseline: index_select per layer into a device buffer + one copy per chunk to pinned
  (store), and the mirror image with index_copy_ (retrieve);
* mpcache store (gather) and retrieve (scatter) at 1, 8 and 32 chunks per call, zero-copy and
  staging modes, CTA cap 16 (512 threads);
* store and retrieve concurrently (two streams);
* host time per call (enqueue, median);
* bandwidth vs CTA cap at 8 chunks.

Every mpcache and torch result is checked bitwise (poisoned destination before the checked call).
Prints a table and the targets; writes kernels.json and kernels_bw.png under --out.

`--cpu` (no GPU needed): the CPU gather (store) and scatter (retrieve) of ``kernels/cpu.py`` that
a CPU vLLM worker runs, against numpy memcpy of the same bytes timed in the same loop (so the
ratio is from one load of the box): the ttft bench's vLLM CPU layout (16 chunks, 32 MiB,
contiguous runs of one head, 256 B) and a Llama-3-8B NHD layout (1 chunk, 32 MiB, runs of a
whole block); then a store into a freshly mapped shared-memory segment, first touch against
pre-faulted (``kernels.cpu.prefault``, what the worker does when it maps the server's L1).
Every copy is checked (gather, then scatter into other blocks: they must equal the sources).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

GiB = 1 << 30


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mpcache-bench kernels")
    ap.add_argument("--quick", action="store_true", help="few repetitions, small sweep (smoke test)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for kernels.json and kernels_bw.png")
    ap.add_argument("--threads", type=int, default=512)
    ap.add_argument("--ctas", type=int, default=16)
    ap.add_argument("--cpu", action="store_true", help="the CPU gather/scatter against numpy memcpy instead (no GPU)")
    args = ap.parse_args(argv)
    if args.cpu:
        return cpu_main(args.quick)

    import torch

    if not torch.cuda.is_available():
        print("bench kernels: no CUDA GPU; nothing to measure", file=sys.stderr)
        return 2
    from numba import cuda

    from mpcache.kernels.gpu import CudaKVTransfer, raw_stream, span_device_buffers
    from mpcache.kernels.layouts import KVGeometry, PagedLayout

    torch.cuda.init()
    dev = torch.device("cuda")
    cuda.current_context()
    reps = 3 if args.quick else 10
    chunk_counts = [1, 8, 32]
    max_chunks = 32
    g = KVGeometry(PagedLayout.NHD, num_layers=32, num_blocks=4 * max_chunks * 16 + 64, block_size=16,
                   num_heads=8, head_size=128, itemsize=2, chunk_tokens=256)
    slot = g.slot_bytes
    rng = np.random.default_rng(2026)
    results: dict[str, Any] = {"geometry": g.__dict__ | {"layout": g.layout.value}, "device": torch.cuda.get_device_name(),
                               "ctas": args.ctas, "threads": args.threads}
    print(f"device {results['device']}; {g.num_layers} layers x {g.num_heads} heads x {g.head_size}, bf16, "
          f"block {g.block_size}, chunk {g.chunk_tokens} = {slot / 2**20:.0f} MiB/slot", flush=True)

    # ---- memory: engine KV (torch, as vLLM allocates it), pinned pool, bitwise-random data
    layers = []
    for _ in range(g.num_layers):
        t = torch.empty(g.layer_shape(), dtype=torch.bfloat16, device=dev)
        t.view(torch.int16).random_(-32768, 32767)
        layers.append(t)
    n_slots = 4 * max_chunks
    pool_t = torch.empty(n_slots * slot, dtype=torch.uint8, pin_memory=True)
    pool_ptr = pool_t.data_ptr()
    pool = cuda.from_cuda_array_interface(
        {"shape": (n_slots * slot // 8,), "typestr": "<u8", "data": (pool_ptr, False), "version": 3, "strides": None},
        owner=None, sync=False)
    span, offsets = span_device_buffers([t.data_ptr() for t in layers], layers[0].nbytes, g.lane_dtype)
    torch.cuda.synchronize()

    perm = rng.permutation(g.num_blocks)
    bpc = g.blocks_per_chunk
    src_ids = perm[: max_chunks * bpc].reshape(max_chunks, bpc)  # store from these
    dst_ids = perm[max_chunks * bpc : 2 * max_chunks * bpc].reshape(max_chunks, bpc)  # retrieve into these
    src2 = perm[2 * max_chunks * bpc : 3 * max_chunks * bpc].reshape(max_chunks, bpc)  # concurrent store
    slot_perm = rng.permutation(n_slots)
    slots_a = slot_perm[:max_chunks] * slot  # never adjacent in order: worst case for staging DMAs
    slots_b = slot_perm[max_chunks : 2 * max_chunks] * slot

    def expected_chunks(ids: np.ndarray) -> torch.Tensor:
        """[n, 2, L, C, D] on the device, from torch indexing (the reference)."""
        idx = torch.as_tensor(ids.reshape(-1), device=dev)
        out = torch.empty((ids.shape[0], 2, g.num_layers, g.chunk_tokens, g.hidden), dtype=torch.bfloat16, device=dev)
        for li, t in enumerate(layers):
            out[:, :, li] = t.index_select(1, idx).view(2, ids.shape[0], g.chunk_tokens, g.hidden).transpose(0, 1)
        return out

    def slot_view(off: int) -> torch.Tensor:
        return pool_t[off : off + slot].view(torch.bfloat16).view(2, g.num_layers, g.chunk_tokens, g.hidden)

    def check_store(ids: np.ndarray, offs: np.ndarray) -> bool:
        want = expected_chunks(ids).cpu()
        return all(torch.equal(slot_view(int(o)).view(torch.int16), want[i].view(torch.int16)) for i, o in enumerate(offs))

    def poison_slots(offs: np.ndarray) -> None:
        for o in offs:
            pool_t[int(o) : int(o) + slot].fill_(0xA5)

    def poison_blocks(ids: np.ndarray) -> None:
        idx = torch.as_tensor(ids.reshape(-1), device=dev)
        for t in layers:
            t.view(torch.int16).index_fill_(1, idx, -23131)
        torch.cuda.synchronize()

    def check_retrieve(ids_written: np.ndarray, from_ids: np.ndarray, skip: int = 0) -> bool:
        w = torch.as_tensor(ids_written.reshape(-1), device=dev)
        f = torch.as_tensor(from_ids.reshape(-1), device=dev)
        ok = True
        for t in layers:
            a = t.view(torch.int16).index_select(1, w[skip:])
            b = t.view(torch.int16).index_select(1, f[skip:])
            ok &= bool(torch.equal(a, b))
            if skip:
                ok &= bool((t.view(torch.int16).index_select(1, w[:skip]) == -23131).all())
        return ok

    def time_cuda(stream: Any, fn: Callable[[], None], n: int) -> tuple[float, float]:
        """(median device seconds per call, median host seconds per call)."""
        dev_t, host_t = [], []
        for _ in range(n):
            e0, e1 = cuda.event(), cuda.event()
            e0.record(stream)
            h0 = time.perf_counter()
            fn()
            h1 = time.perf_counter()
            e1.record(stream)
            e1.synchronize()
            dev_t.append(cuda.event_elapsed_time(e0, e1) / 1e3)
            host_t.append(h1 - h0)
        return statistics.median(dev_t), statistics.median(host_t)

    # (method, direction, chunks, GB/s back-to-back, GB/s isolated, host us back-to-back, host us isolated, check)
    rows: list[tuple[str, str, int, float, float, float, float, str]] = []

    def burst(stream: Any, fn: Callable[[], None], n_bytes: int, k: int) -> tuple[float, float]:
        """Calls issued back to back (a server with requests queued): (GB/s, host us per call)."""
        vals, hosts = [], []
        for _ in range(3):
            e0, e1 = cuda.event(), cuda.event()
            e0.record(stream)
            h0 = time.perf_counter()
            for _ in range(k):
                fn()
            h1 = time.perf_counter()
            e1.record(stream)
            e1.synchronize()
            vals.append(k * n_bytes / (cuda.event_elapsed_time(e0, e1) / 1e3) / 1e9)
            hosts.append((h1 - h0) / k * 1e6)
        return statistics.median(vals), statistics.median(hosts)

    def row(meth: str, d: str, n: int, stream: Any, fn: Callable[[], None], ok: bool) -> float:
        dt, ht = time_cuda(stream, fn, reps)
        bw_b, ht_b = burst(stream, fn, n * slot, 4 if n >= 32 else 8)
        rows.append((meth, d, n, bw_b, n * slot / dt / 1e9, ht_b, ht * 1e6, "ok" if ok else "FAIL"))
        return bw_b

    # ---- ceilings: pinned memcpy 1 GiB
    from cuda.bindings import driver as drv

    s_a, s_b = cuda.stream(), cuda.stream()
    dbuf = cuda.device_array(GiB // 8, dtype=np.uint64)
    dbuf2 = cuda.device_array(GiB // 8, dtype=np.uint64)
    d_ptr = int(dbuf.__cuda_array_interface__["data"][0])
    d_ptr2 = int(dbuf2.__cuda_array_interface__["data"][0])

    def memcpy(dst: int, src: int, n: int, stream: Any) -> None:
        (err,) = drv.cuMemcpyAsync(dst, src, n, raw_stream(stream))
        assert err == drv.CUresult.CUDA_SUCCESS, err

    for _ in range(2):
        memcpy(d_ptr, pool_ptr, GiB, s_a)
    s_a.synchronize()
    t_h2d, _ = time_cuda(s_a, lambda: memcpy(d_ptr, pool_ptr, GiB, s_a), max(3, reps // 2))
    t_d2h, _ = time_cuda(s_a, lambda: memcpy(pool_ptr, d_ptr, GiB, s_a), max(3, reps // 2))
    ceil_h2d, ceil_d2h = GiB / t_h2d / 1e9, GiB / t_d2h / 1e9

    def bidir() -> float:
        e0, ea, eb = cuda.event(), cuda.event(), cuda.event()
        e0.record(s_a)
        e0.wait(s_b)
        memcpy(d_ptr, pool_ptr, GiB, s_a)
        memcpy(pool_ptr + GiB, d_ptr2, GiB, s_b)
        ea.record(s_a)
        eb.record(s_b)
        ea.synchronize()
        eb.synchronize()
        return 2 * GiB / (max(cuda.event_elapsed_time(e0, ea), cuda.event_elapsed_time(e0, eb)) / 1e3) / 1e9

    ceil_bi = statistics.median(bidir() for _ in range(3))
    results["ceiling"] = {"h2d": ceil_h2d, "d2h": ceil_d2h, "bidirectional": ceil_bi}
    print(f"ceiling: pinned memcpy 1 GiB H2D {ceil_h2d:.1f} GB/s, D2H {ceil_d2h:.1f} GB/s, both at once {ceil_bi:.1f} GB/s", flush=True)
    rows.append(("memcpy 1 GiB", "store (D2H)", 32, ceil_d2h, ceil_d2h, 0.0, 0.0, "-"))
    rows.append(("memcpy 1 GiB", "retrieve (H2D)", 32, ceil_h2d, ceil_h2d, 0.0, 0.0, "-"))

    # ---- torch baseline
    ts = torch.cuda.Stream()
    tbuf = torch.empty((max_chunks, 2, g.num_layers, g.chunk_tokens, g.hidden), dtype=torch.bfloat16, device=dev)
    slot_views = {int(o): slot_view(int(o)) for o in np.concatenate([slots_a, slots_b])}
    ts_numba = cuda.external_stream(ts.cuda_stream)

    def torch_store(ids: np.ndarray, offs: np.ndarray) -> Callable[[], None]:
        n = ids.shape[0]
        idx = torch.as_tensor(ids.reshape(-1), device=dev)

        def run() -> None:
            with torch.cuda.stream(ts):
                for li, t in enumerate(layers):
                    tbuf[:n, :, li] = t.index_select(1, idx).view(2, n, g.chunk_tokens, g.hidden).transpose(0, 1)
                for i in range(n):
                    slot_views[int(offs[i])].copy_(tbuf[i], non_blocking=True)
        return run

    def torch_retrieve(ids: np.ndarray, offs: np.ndarray) -> Callable[[], None]:
        n = ids.shape[0]
        idx = torch.as_tensor(ids.reshape(-1), device=dev)

        def run() -> None:
            with torch.cuda.stream(ts):
                for i in range(n):
                    tbuf[i].copy_(slot_views[int(offs[i])], non_blocking=True)
                for li, t in enumerate(layers):
                    t.index_copy_(1, idx, tbuf[:n, :, li].transpose(0, 1).reshape(2, n * bpc, g.block_size, g.num_heads, g.head_size))
        return run

    for n in chunk_counts:
        ids, offs = src_ids[:n], slots_a[:n]
        fn = torch_store(ids, offs)
        fn()
        torch.cuda.synchronize()
        poison_slots(offs)
        fn()
        torch.cuda.synchronize()
        ok = check_store(ids, offs)
        row("torch index_select+copy", "store (D2H)", n, ts_numba, fn, ok)
        fn = torch_retrieve(dst_ids[:n], offs)
        poison_blocks(dst_ids[:n])
        fn()
        torch.cuda.synchronize()
        ok = check_retrieve(dst_ids[:n], ids)
        row("torch index_select+copy", "retrieve (H2D)", n, ts_numba, fn, ok)
        print(f"torch {n} chunks done", flush=True)

    # ---- mpcache, both modes
    def make(mode: str, ctas: int, stream: Any = None) -> CudaKVTransfer:
        return CudaKVTransfer(g, span, offsets, pool, mode=mode, max_ctas=ctas, threads=args.threads,
                              stream=stream, max_chunks=max_chunks, ring=128)

    t0 = time.perf_counter()
    xfers = {m: make(m, args.ctas) for m in ("zerocopy", "staging", "auto")}
    # first calls compile both kernels (once per process; the server warms them at registration)
    for x in xfers.values():
        x.gather(src_ids[:1], slots_a[:1])
        x.scatter(slots_a[:1], dst_ids[:1])
        x.stream.synchronize()
    results["first_use_s"] = time.perf_counter() - t0
    results["launch_path"] = {m: (x.launch_path, x.launch_error) for m, x in xfers.items()}
    print(f"kernels compiled and warmed in {results['first_use_s']:.2f} s; launch path {results['launch_path']}", flush=True)

    best: dict[tuple[str, int], float] = {}
    for mode, x in xfers.items():
        for n in chunk_counts:
            ids, offs = src_ids[:n], slots_a[:n]
            poison_slots(offs)
            x.gather(ids, offs)
            x.stream.synchronize()
            ok = check_store(ids, offs)
            bw = row(f"mpcache {mode}", "store (D2H)", n, x.stream, lambda: x.gather(ids, offs), ok)
            best[("store", n)] = max(best.get(("store", n), 0.0), bw)
            # retrieve into other blocks; the checked call skips 5 blocks (already held)
            skip = min(5, n * bpc - 1)
            poison_blocks(dst_ids[:n])
            x.scatter(offs, dst_ids[:n], skip_blocks=skip)
            x.stream.synchronize()
            ok = check_retrieve(dst_ids[:n], ids, skip)
            bw = row(f"mpcache {mode}", "retrieve (H2D)", n, x.stream, lambda: x.scatter(offs, dst_ids[:n]), ok)
            ok = check_retrieve(dst_ids[:n], ids)  # after the timed full (no skip) calls
            if not ok:
                rows[-1] = rows[-1][:7] + ("FAIL",)
            best[("retrieve", n)] = max(best.get(("retrieve", n), 0.0), bw)
            print(f"mpcache {mode} {n} chunks done", flush=True)

    # ---- concurrent store + retrieve (8 chunks each, 4 rounds), per mode
    conc: dict[str, float] = {}
    n = 8
    for mode in ("zerocopy", "staging", "auto"):
        xs = make(mode, args.ctas, cuda.stream())
        xr = make(mode, args.ctas, cuda.stream())
        rounds = 2 if args.quick else 6
        vals = []
        for _ in range(3):
            e0 = cuda.event()
            e0.record(xs.stream)
            e0.wait(xr.stream)
            for r in range(rounds):
                xs.gather(src2[:n], slots_b[:n])
                xr.scatter(slots_a[:n], dst_ids[:n])
            es, er = cuda.event(), cuda.event()
            es.record(xs.stream)
            er.record(xr.stream)
            es.synchronize()
            er.synchronize()
            t = max(cuda.event_elapsed_time(e0, es), cuda.event_elapsed_time(e0, er)) / 1e3
            vals.append(2 * rounds * n * slot / t / 1e9)
        ok = check_store(src2[:n], slots_b[:n]) and check_retrieve(dst_ids[:n], src_ids[:n])
        conc[mode] = statistics.median(vals)
        rows.append((f"mpcache {mode}", "store+retrieve concurrent", n, conc[mode], conc[mode], 0.0, 0.0, "ok" if ok else "FAIL"))
    print("concurrent done", flush=True)

    # ---- CTA cap sweep (8 chunks)
    caps = [1, 2, 4, 8, 16, 32] if args.quick else [1, 2, 4, 8, 12, 16, 24, 32, 64, 132]
    sweep: dict[str, dict[int, float]] = {}
    for mode in ("zerocopy", "staging"):
        for d in ("store", "retrieve"):
            sweep[f"{mode} {d}"] = {}
        for c in caps:
            x = make(mode, c)
            ids, offs = src_ids[:8], slots_a[:8]
            x.gather(ids, offs)
            x.scatter(offs, dst_ids[:8])
            sweep[f"{mode} store"][c] = burst(x.stream, lambda: x.gather(ids, offs), 8 * slot, 4)[0]
            sweep[f"{mode} retrieve"][c] = burst(x.stream, lambda: x.scatter(offs, dst_ids[:8]), 8 * slot, 4)[0]
    print("cta sweep done", flush=True)

    # ---- report
    results["rows"] = [dict(zip(("method", "direction", "chunks", "GBps", "GBps_isolated", "host_us", "host_us_isolated", "check"), r))
                       for r in rows]
    results["concurrent"] = conc
    results["cta_sweep"] = sweep
    print()
    print("back-to-back: calls issued while earlier ones run (throughput; host = enqueue cost per call);")
    print("isolated: one call on an idle stream, timed from before the host call (latency view)")
    print(f"{'method':<26} {'direction':<27} {'chunks':>6} {'GB/s':>7} {'% ceil':>7} {'host us':>8} "
          f"{'isol GB/s':>10} {'% ceil':>7} {'isol host us':>13}  check")
    for meth, d, n, bw, bwi, ht, hti, ok in rows:
        ceil = ceil_bi if "concurrent" in d else (ceil_d2h if "D2H" in d else ceil_h2d)
        print(f"{meth:<26} {d:<27} {n:>6} {bw:>7.1f} {100 * bw / ceil:>6.1f}% {ht:>8.1f} "
              f"{bwi:>10.1f} {100 * bwi / ceil:>6.1f}% {hti:>13.1f}  {ok}")
    print()
    print("bandwidth (GB/s) vs CTA cap, 8 chunks per call, " f"{args.threads} threads per CTA")
    print(f"{'':<20}" + "".join(f"{c:>7}" for c in caps))  # back-to-back calls
    for k, v in sweep.items():
        print(f"{k:<20}" + "".join(f"{v[c]:>7.1f}" for c in caps))

    def mp_host_max(mode: str = "zerocopy") -> float:
        return max(r[5] for r in rows if r[0] == f"mpcache {mode}" and r[5] > 0)

    def min_ctas_90(d: str, ceil: float) -> int | None:
        for c in caps:
            if max(sweep[f"zerocopy {d}"][c], sweep[f"staging {d}"][c]) >= 0.9 * ceil:
                return c
        return None

    targets = [
        ("store 8 chunks >= 95% of D2H ceiling (best mode)", best[("store", 8)] >= 0.95 * ceil_d2h, f"{100 * best[('store', 8)] / ceil_d2h:.1f}%"),
        ("retrieve 8 chunks >= 95% of H2D ceiling (best mode)", best[("retrieve", 8)] >= 0.95 * ceil_h2d, f"{100 * best[('retrieve', 8)] / ceil_h2d:.1f}%"),
        ("store 1 chunk >= 90% of D2H ceiling (best mode)", best[("store", 1)] >= 0.90 * ceil_d2h, f"{100 * best[('store', 1)] / ceil_d2h:.1f}%"),
        ("retrieve 1 chunk >= 90% of H2D ceiling (best mode)", best[("retrieve", 1)] >= 0.90 * ceil_h2d, f"{100 * best[('retrieve', 1)] / ceil_h2d:.1f}%"),
        ("concurrent store+retrieve >= 90 GB/s", max(conc.values()) >= 90, f"{max(conc.values()):.1f} GB/s"),
        ("host time per call <= 50 us (<= 32 chunks), zero-copy", mp_host_max() <= 50, f"max {mp_host_max():.1f} us"),
        ("host time per call <= 50 us (<= 32 chunks), staging", mp_host_max("staging") <= 50, f"max {mp_host_max('staging'):.1f} us"),
        ("host time per call <= 50 us (<= 32 chunks), auto", mp_host_max("auto") <= 50, f"max {mp_host_max('auto'):.1f} us"),
        ("store >= 90% of ceiling with <= 16 CTAs", (min_ctas_90("store", ceil_d2h) or 999) <= 16, f"from {min_ctas_90('store', ceil_d2h)} CTAs"),
        ("retrieve >= 90% of ceiling with <= 16 CTAs", (min_ctas_90("retrieve", ceil_h2d) or 999) <= 16, f"from {min_ctas_90('retrieve', ceil_h2d)} CTAs"),
        ("every result bitwise equal", all(r[7] != "FAIL" for r in rows), ""),
        ("environment: memcpy ceiling >= 50 GB/s", min(ceil_h2d, ceil_d2h) >= 50, ""),
    ]
    results["targets"] = [{"target": t, "met": bool(m), "value": v} for t, m, v in targets]
    print()
    for t, m, v in targets:
        print(f"[{'met' if m else 'MISSED'}] {t}: {v}")

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kernels.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    _plot(rows, sweep, caps, ceil_h2d, ceil_d2h, os.path.join(args.out, "kernels_bw.png"), results["device"])
    return 0 if all(r[7] != "FAIL" for r in rows) else 1


def _plot(rows: list[tuple[str, str, int, float, float, float, float, str]], sweep: dict[str, dict[int, float]], caps: list[int],
          ceil_h2d: float, ceil_d2h: float, path: str, device: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    for ax, d, ceil in ((axes[0], "store (D2H)", ceil_d2h), (axes[1], "retrieve (H2D)", ceil_h2d)):
        for meth in sorted({r[0] for r in rows if r[1] == d and not r[0].startswith("memcpy")}):
            pts = sorted((r[2], r[3]) for r in rows if r[0] == meth and r[1] == d)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=meth)
        ax.axhline(ceil, color="k", ls="--", label=f"memcpy 1 GiB ceiling {ceil:.1f}")
        ax.axhline(0.95 * ceil, color="gray", ls=":", label="95% of ceiling")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 8, 32], ["1", "8", "32"])
        ax.set_xlabel("chunks per call (32 MiB each)")
        ax.set_ylabel("GB/s")
        ax.set_ylim(0, ceil * 1.1)
        ax.set_title(d)
        ax.legend(fontsize=8, loc="lower right")
    ax = axes[2]
    for k, v in sweep.items():
        ax.plot(caps, [v[c] for c in caps], marker="o", label=k)
    ax.axhline(0.9 * min(ceil_h2d, ceil_d2h), color="gray", ls=":", label="90% of ceiling")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("CTA cap (8 chunks per call)")
    ax.set_ylabel("GB/s")
    ax.set_title("bandwidth vs CTA cap")
    ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"mpcache KV transfer kernels, {device} (calls back to back; Llama-3-8B-like KV, bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())


def cpu_main(quick: bool = False) -> int:
    """`mpcache-bench kernels --cpu`: prints the CPU copy table; returns 1 if a check failed."""
    import mmap
    import tempfile

    import torch

    from mpcache.kernels.cpu import CpuKVTransfer, prefault
    from mpcache.kernels.layouts import KVGeometry, PagedLayout

    reps = 5 if quick else 21
    rng = np.random.default_rng(2026)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {reps} rounds, each: memcpy, scatter, gather", flush=True)
    cases = [
        ("vLLM CPU fp32, 4 layers x 4 heads x 64, block 128", PagedLayout.CPU, 4, 128, 4, 64, 4, 16),
        ("NHD bf16, 32 layers x 8 heads x 128, block 16", PagedLayout.NHD, 32, 16, 8, 128, 2, 1),
    ]
    print()
    print("| layout | chunks | MiB | run bytes | copy | best ms | median ms | GB/s (median) | % of memcpy (median) | % of memcpy (best) | check |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|")
    failed = False
    first_touch: tuple[KVGeometry, list[np.ndarray], np.ndarray] | None = None
    for label, layout, n_layers, bs, nh, hs, itemsize, n_chunks in cases:
        bpc = 256 // bs
        g = KVGeometry(layout, num_layers=n_layers, num_blocks=2 * n_chunks * bpc + 8, block_size=bs, num_heads=nh,
                       head_size=hs, itemsize=itemsize, chunk_tokens=256)
        # As vLLM and the server allocate them: torch tensors, a page-aligned mapping for the pool.
        src = [torch.randint(0, 256, (g.layer_elements() * itemsize,), dtype=torch.uint8).numpy() for _ in range(n_layers)]
        dst = [torch.zeros(g.layer_elements() * itemsize, dtype=torch.uint8).numpy() for _ in range(n_layers)]
        pool = np.frombuffer(mmap.mmap(-1, (2 * n_chunks) * g.slot_bytes), dtype=np.uint8)
        perm = rng.permutation(g.num_blocks)
        src_ids = perm[: n_chunks * bpc].reshape(n_chunks, bpc).astype(np.int64)
        dst_ids = perm[n_chunks * bpc : 2 * n_chunks * bpc].reshape(n_chunks, bpc).astype(np.int64)
        offs = rng.permutation(2 * n_chunks)[:n_chunks].astype(np.int64) * g.slot_bytes
        store, load = CpuKVTransfer(g, src, pool), CpuKVTransfer(g, dst, pool)
        n_bytes = n_chunks * g.slot_bytes
        a, b = np.ones(n_bytes, dtype=np.uint8), np.zeros(n_bytes, dtype=np.uint8)
        calls: dict[str, Callable[[], None]] = {"numpy memcpy": lambda: np.copyto(b, a),
                                                "scatter (retrieve)": lambda: load.scatter(offs, dst_ids),
                                                "gather (store)": lambda: store.gather(src_ids, offs)}
        times: dict[str, list[float]] = {k: [] for k in calls}
        for fn in calls.values():
            fn()  # compiled, pages touched
        for _ in range(reps):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        ok = _cpu_check(g, src, dst, src_ids, dst_ids)
        failed |= not ok
        run = hs * itemsize if layout is PagedLayout.CPU else bs * nh * hs * itemsize
        mc_best, mc_med = min(times["numpy memcpy"]), statistics.median(times["numpy memcpy"])
        for name, ts in times.items():
            best, med = min(ts), statistics.median(ts)
            print(f"| {label} | {n_chunks} | {n_bytes / 2**20:.0f} | {run} | {name} | {best * 1e3:.2f} | {med * 1e3:.2f} | "
                  f"{n_bytes / med / 1e9:.1f} | {mc_med / med:.0%} | {mc_best / best:.0%} | "
                  f"{'-' if name == 'numpy memcpy' else 'ok' if ok else 'FAIL'} |", flush=True)
        if first_touch is None:
            first_touch = (g, src, src_ids)
    assert first_touch is not None
    g, src, src_ids = first_touch
    n_chunks = src_ids.shape[0]
    print()
    print(f"A store of {n_chunks} chunks ({n_chunks * g.slot_bytes / 2**20:.0f} MiB, the first layout) into a freshly mapped "
          f"/dev/shm segment of {2 * n_chunks * g.slot_bytes / 2**20:.0f} MiB (fallocated, as the server reserves L1):")
    print()
    print("| mapping | prefault ms | gather ms (1st) | gather ms (2nd) |")
    print("|---|---:|---:|---:|")
    for pre in (False, True):
        with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="mpcache-bench-") as f:
            size = 2 * n_chunks * g.slot_bytes
            os.posix_fallocate(f.fileno(), 0, size)
            mapping = mmap.mmap(f.fileno(), size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            view = np.frombuffer(mapping, dtype=np.uint8)
            t0 = time.perf_counter()
            supported = prefault(view) if pre else True
            t_pre = time.perf_counter() - t0
            xfer = CpuKVTransfer(g, src, view)
            offs = np.arange(n_chunks, dtype=np.int64) * g.slot_bytes
            t1 = time.perf_counter()
            xfer.gather(src_ids, offs)
            t2 = time.perf_counter()
            xfer.gather(src_ids, offs)
            t3 = time.perf_counter()
            name = ("prefaulted" if supported else "prefault not supported by this kernel") if pre else "first touch"
            print(f"| {name} | {t_pre * 1e3:.1f} | {(t2 - t1) * 1e3:.2f} | {(t3 - t2) * 1e3:.2f} |", flush=True)
            del xfer, view
            mapping.close()
    print()
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 1 if failed else 0


def _cpu_check(g: Any, src: list[np.ndarray], dst: list[np.ndarray], src_ids: np.ndarray, dst_ids: np.ndarray) -> bool:
    """After gather(src_ids) then scatter(dst_ids): every destination block equals its source."""
    from mpcache.kernels.layouts import PagedLayout

    axis = 1 if g.layout in (PagedLayout.NHD, PagedLayout.HND) else 0
    shape = g.layer_shape()[:-1] + (g.layer_shape()[-1] * g.itemsize,)
    return all(np.array_equal(np.take(d.reshape(shape), dst_ids.reshape(-1), axis=axis),
                              np.take(s.reshape(shape), src_ids.reshape(-1), axis=axis)) for s, d in zip(src, dst))
