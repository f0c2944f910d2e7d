"""Where the host time of a CudaKVTransfer call goes (GPU host): `python3 tools/host_profile_kernels.py`.

Llama-3-8B KV geometry (32 layers, 8 KV heads, head 128, bf16, block 16, chunk 256 = 32 MiB).

1. The cost of each driver call of the enqueue path, through ``mpcache.kernels.gpu.FastDriver`` (ctypes
   into libcuda) and through cuda-bindings (what the path used before): event record, stream
   wait, event query, kernel launch, and a batch of 17 DMAs against 17 single ones.
2. Per mode (zero-copy, staging, auto), staging piece growth, staging grid and enqueue path
   (compiled or Python), per chunk count (1, 8, 32):
   host time per call as the server's executor makes them (``join=False``, ``busy``), the
   device time of one call alone (store / retrieve), and GB/s of calls back to back. Every
   configuration is checked bit for bit (store into poisoned slots, retrieve into poisoned
   blocks) against torch indexing.
3. Two engines' staging calls in the same direction at once (two stream pairs) against one
   engine making both calls: whether the link loses rate to copies from several streams.
Prints three tables; exits 1 if a check fails.
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable

import numpy as np


def _us(fn: Callable[[], Any], n: int = 200) -> float:
    v = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        v.append(time.perf_counter_ns() - t0)
    return statistics.median(v) / 1e3


def main() -> int:
    import torch
    from cuda.bindings import driver as drv
    from numba import cuda

    from mpcache.kernels.gpu import CudaKVTransfer, as_handle, fast_driver, raw_stream, span_device_buffers
    from mpcache.kernels.layouts import KVGeometry, PagedLayout

    torch.cuda.init()
    dev = torch.device("cuda")
    g = KVGeometry(PagedLayout.NHD, 32, 2 * 32 * 16 + 64, 16, 8, 128, 2, 256)
    slot = g.slot_bytes
    layers = []
    for _ in range(g.num_layers):
        t = torch.empty(g.layer_shape(), dtype=torch.bfloat16, device=dev)
        t.view(torch.int16).random_(-32768, 32767)
        layers.append(t)
    span, offs = span_device_buffers([t.data_ptr() for t in layers], layers[0].nbytes, g.lane_dtype)
    n_slots = 64
    pool_t = torch.empty(n_slots * slot, dtype=torch.uint8, pin_memory=True)
    pool = cuda.from_cuda_array_interface({"shape": (pool_t.numel() // 8,), "typestr": "<u8", "data": (pool_t.data_ptr(), False),
                                           "version": 3, "strides": None}, owner=None, sync=False)
    torch.cuda.synchronize()
    rng = np.random.default_rng(11)
    bpc = g.blocks_per_chunk
    perm = rng.permutation(g.num_blocks)
    src_ids = perm[: 32 * bpc].reshape(32, bpc).astype(np.int64)
    dst_ids = perm[32 * bpc : 64 * bpc].reshape(32, bpc).astype(np.int64)
    slots = rng.permutation(n_slots)[:32].astype(np.int64) * slot  # scattered: one DMA per chunk

    # ---- 1. driver calls
    fd = fast_driver()
    s = cuda.stream()
    s_raw = raw_stream(s)
    s_h = as_handle(s_raw)
    ev = cuda.event(timing=False)
    ev_raw = ev.handle
    ev_h = as_handle(ev_raw)
    scratch = torch.empty(17 * (1 << 16), dtype=torch.uint8, device=dev)
    host = torch.empty(17 * (1 << 16), dtype=torch.uint8, pin_memory=True)
    dsts = [host.data_ptr() + i * (1 << 16) for i in range(17)]
    srcs = [scratch.data_ptr() + i * (1 << 16) for i in range(17)]
    runs = np.array([dsts, srcs, [1 << 16] * 17], dtype=np.int64)
    rows_addr = [int(runs[k].ctypes.data) for k in range(3)]
    attr = drv.CUmemcpyAttributes()
    attr.srcAccessOrder = drv.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM

    def bind_batch() -> None:
        drv.cuMemcpyBatchAsync([drv.CUdeviceptr(d) for d in dsts], [drv.CUdeviceptr(x) for x in srcs], [1 << 16] * 17, 17,
                               [attr], [0], 1, s_raw)

    def bind_each() -> None:
        for d, x in zip(dsts, srcs):
            drv.cuMemcpyAsync(d, x, 1 << 16, s_raw)

    def fast_each() -> None:
        for d, x in zip(dsts, srcs):
            fd.memcpy(d, x, 1 << 16, s_h)

    calls = [
        ("cuEventRecord", lambda: drv.cuEventRecord(ev_raw, s_raw), lambda: fd.record(ev_h, s_h)),
        ("cuStreamWaitEvent", lambda: drv.cuStreamWaitEvent(s_raw, ev_raw, 0), lambda: fd.wait(s_h, ev_h, 0)),
        ("cuEventQuery", lambda: drv.cuEventQuery(ev_raw), lambda: fd.query(ev_h)),
        ("17 x cuMemcpyAsync 64 KiB", bind_each, fast_each),
        ("cuMemcpyBatchAsync 17 x 64 KiB", bind_batch,
         (lambda: fd.batch(rows_addr[0], rows_addr[1], rows_addr[2], 17, fd.batch_attrs, fd.batch_attr_idx, 1, s_h))
         if fd.batch is not None else None),
    ]
    print(f"{'driver call':<32} {'cuda-bindings us':>17} {'FastDriver us':>14}")
    for name, a, b in calls:
        ta = _us(a, 100)
        s.synchronize()
        tb = _us(b, 100) if b is not None else float("nan")
        s.synchronize()
        print(f"{name:<32} {ta:>17.2f} {tb:>14.2f}")
    err = fd.batch(rows_addr[0], rows_addr[1], rows_addr[2], 17, fd.batch_attrs, fd.batch_attr_idx, 1, s_h) if fd.batch else -1
    print(f"batch copy path: {'cuMemcpyBatchAsync_v2' if fd.batch is not None else 'none'} (test call: CUDA error {err})")
    s.synchronize()

    # ---- 2. calls
    def slot_chunks(offsets: np.ndarray) -> torch.Tensor:
        return torch.stack([pool_t[int(o) : int(o) + slot].view(torch.int16) for o in offsets])

    def want_chunks(ids: np.ndarray) -> torch.Tensor:
        idx = torch.as_tensor(ids.reshape(-1), device=dev)
        out = torch.empty((ids.shape[0], 2, g.num_layers, g.chunk_tokens, g.hidden), dtype=torch.int16, device=dev)
        for li, t in enumerate(layers):
            out[:, :, li] = t.view(torch.int16).index_select(1, idx).view(2, ids.shape[0], g.chunk_tokens, g.hidden).transpose(0, 1)
        return out.reshape(ids.shape[0], -1).cpu()

    def blocks(ids: np.ndarray) -> torch.Tensor:
        idx = torch.as_tensor(ids.reshape(-1), device=dev)
        return torch.stack([t.view(torch.int16).index_select(1, idx) for t in layers])

    # (mode, staging piece growth, staging grid, compiled enqueue); 16 CTAs and growth 2 were the
    # staging defaults before, the Python enqueue the only one
    configs = [("zerocopy", 4, 64, False), ("zerocopy", 4, 64, True), ("staging", 2, 16, False), ("staging", 4, 64, False),
               ("staging", 4, 64, True), ("auto", 4, 64, False), ("auto", 4, 64, True)]
    print(f"\n{'mode':<9} {'growth':>6} {'st.ctas':>7} {'enqueue':>8} {'chunks':>6} {'store host us':>13} {'retr host us':>12} {'store alone ms':>14} "
          f"{'retr alone ms':>13} {'memcpy ms':>9} {'store GB/s':>10} {'retr GB/s':>9} {'check':>5}")
    ok_all = True
    for mode, growth, st_ctas, compiled in configs:
        x = CudaKVTransfer(g, span, offs, pool, mode=mode, max_chunks=32, ring=256, piece_growth=growth, staging_ctas=st_ctas,
                           compiled_enqueue=compiled)
        if compiled and x.enqueue_path != "compiled":
            print(f"compiled enqueue not in use: {x.enqueue_error}")
        st = x.stream
        for n in (1, 8, 32):
            ids, so, out = src_ids[:n], slots[:n], dst_ids[:n]
            for o in so:
                pool_t[int(o) : int(o) + slot].fill_(0x5A)
            x.gather(ids, so, join=False, busy=True)
            ev_done = cuda.event(timing=False)
            ev_done.record(st)
            x.record_completion(ev_done.handle)
            ev_done.synchronize()
            cuda.synchronize()
            ok = bool(torch.equal(slot_chunks(so), want_chunks(ids)))
            for t in layers:
                t.view(torch.int16).index_fill_(1, torch.as_tensor(out.reshape(-1), device=dev), -23131)
            torch.cuda.synchronize()
            x.scatter(so, out, 0, join=False, busy=True)
            cuda.synchronize()
            ok &= bool(torch.equal(blocks(out), blocks(ids)))
            ok_all &= ok

            def host_us(call: Callable[[], Any], k: int) -> float:
                v = []
                for _ in range(5):
                    cuda.synchronize()
                    for _ in range(k):
                        t0 = time.perf_counter_ns()
                        call()
                        v.append(time.perf_counter_ns() - t0)
                cuda.synchronize()
                return statistics.median(v) / 1e3

            k = 4 if n == 32 else 8
            h_store = host_us(lambda: x.gather(ids, so, join=False, busy=True), k)
            h_retr = host_us(lambda: x.scatter(so, out, 0, join=False, busy=True), k)

            def alone(call: Callable[[], Any]) -> float:
                v = []
                for _ in range(5):
                    cuda.synchronize()
                    e0, e1 = cuda.event(), cuda.event()
                    e0.record(st)
                    call()
                    x.record_completion(e1.handle)
                    e1.synchronize()
                    v.append(cuda.event_elapsed_time(e0, e1))
                return statistics.median(v)

            a_store = alone(lambda: x.gather(ids, so, join=False, busy=False))
            a_retr = alone(lambda: x.scatter(so, out, 0, join=False, busy=False))

            def burst(call: Callable[[], Any]) -> float:
                cuda.synchronize()
                e0, e1 = cuda.event(), cuda.event()
                e0.record(st)
                for _ in range(k):
                    call()
                x.record_completion(e1.handle)
                e1.synchronize()
                return k * n * slot / (cuda.event_elapsed_time(e0, e1) / 1e3) / 1e9

            b_store = burst(lambda: x.gather(ids, so, join=False, busy=True))
            b_retr = burst(lambda: x.scatter(so, out, 0, join=False, busy=True))
            memcpy_ms = n * slot / 55.2e9 * 1e3
            print(f"{mode:<9} {growth:>6} {st_ctas:>7} {x.enqueue_path:>8} {n:>6} {h_store:>13.1f} {h_retr:>12.1f} {a_store:>14.2f} {a_retr:>13.2f} "
                  f"{memcpy_ms:>9.2f} {b_store:>10.1f} {b_retr:>9.1f} {'ok' if ok else 'FAIL':>5}", flush=True)
        del x

    # ---- 3. two engines' copies in the same direction at once (separate streams, as two
    # registered instances have) against one engine doing both calls
    xa = CudaKVTransfer(g, span, offs, pool, mode="staging", max_chunks=32, ring=256)
    xb = CudaKVTransfer(g, span, offs, pool, mode="staging", max_chunks=32, ring=256)
    print(f"\n{'8-chunk calls x 2, back to back':<44} {'store GB/s':>10} {'retr GB/s':>9}")
    for label, second in (("one engine (one stream pair)", xa), ("two engines (two stream pairs) at once", xb)):
        res = []
        for scatter in (False, True):
            v = []
            for _ in range(5):
                cuda.synchronize()
                e0, ea, eb = cuda.event(), cuda.event(), cuda.event()
                e0.record(xa.stream)
                e0.wait(second.stream)
                for x, half in ((xa, 0), (second, 1)):
                    ids, so = (dst_ids if scatter else src_ids)[half * 8 : half * 8 + 8], slots[half * 8 : half * 8 + 8]
                    if scatter:
                        x.scatter(so, ids, 0, join=False, busy=True)
                    else:
                        x.gather(ids, so, join=False, busy=True)
                xa.record_completion(ea.handle)
                if second is not xa:
                    second.record_completion(eb.handle)
                ea.synchronize()
                t = cuda.event_elapsed_time(e0, ea)
                if second is not xa:
                    eb.synchronize()
                    t = max(t, cuda.event_elapsed_time(e0, eb))
                v.append(16 * slot / (t / 1e3) / 1e9)
            res.append(statistics.median(v))
        print(f"{label:<44} {res[0]:>10.1f} {res[1]:>9.1f}", flush=True)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
