"""Where the host time of one CudaKVTransfer call goes (GPU host): `python -m tools.host_profile_kernels`.

Times, per chunk count, the pieces of a zero-copy call: request validation, filling the
descriptor (into mapped pinned, plain pinned and pageable memory), and the packed launch.
"""
from __future__ import annotations

import statistics
import time

import numpy as np


def main() -> None:
    import torch
    from numba import cuda

    from kernels.cpu import check_request
    from kernels.gpu import CudaKVTransfer, span_device_buffers
    from kernels.layouts import KVGeometry, PagedLayout

    g = KVGeometry(PagedLayout.NHD, 32, 1024, 16, 8, 128, 2, 256)
    layers = [torch.empty(g.layer_shape(), dtype=torch.bfloat16, device="cuda") for _ in range(g.num_layers)]
    span, offs = span_device_buffers([t.data_ptr() for t in layers], layers[0].nbytes, g.lane_dtype)
    pool_t = torch.empty(40 * g.slot_bytes, dtype=torch.uint8, pin_memory=True)
    pool = cuda.from_cuda_array_interface({"shape": (pool_t.numel() // 8,), "typestr": "<u8", "data": (pool_t.data_ptr(), False),
                                           "version": 3, "strides": None}, owner=None, sync=False)
    x = CudaKVTransfer(g, span, offs, pool, max_chunks=32)
    mapped = np.asarray(cuda.mapped_array(4096, dtype=np.int64))
    pinned = cuda.pinned_array(4096, dtype=np.int64)
    plain = np.zeros(4096, dtype=np.int64)
    rng = np.random.default_rng(0)

    def t_us(fn, n=300) -> float:  # type: ignore[no-untyped-def]
        v = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            fn()
            v.append(time.perf_counter_ns() - t0)
        return statistics.median(v) / 1e3

    print(f"launch path {x.launch_path} {x.launch_error}")
    print(f"{'chunks':>6} {'validate':>9} {'fill mapped':>12} {'fill pinned':>12} {'fill plain':>11} {'whole call':>11} {'call+sync':>10} {'idle call':>10} {'idle+ev':>8}")
    for n in (1, 8, 32):
        ids = rng.permutation(g.num_blocks)[: n * 16].reshape(n, 16).astype(np.int64)
        so = (np.arange(n, dtype=np.int64) * g.slot_bytes)
        flat = ids.reshape(-1)
        a = t_us(lambda: check_request(g, pool.shape[0], ids, so, 0))

        def fill(buf):  # type: ignore[no-untyped-def]
            buf[0] = n
            buf[1] = 0
            buf[2 : 2 + n] = so
            buf[2 + n : 2 + n + flat.size] = flat
        b = t_us(lambda: fill(mapped))
        c = t_us(lambda: fill(pinned))
        d = t_us(lambda: fill(plain))
        x.gather(ids, so)
        x.stream.synchronize()
        e = t_us(lambda: x.gather(ids, so), 50)
        x.stream.synchronize()

        def call_sync() -> None:
            x.gather(ids, so)
            x.stream.synchronize()
        f = t_us(call_sync, 20)

        def idle(with_event: bool) -> float:
            v = []
            for _ in range(20):
                x.stream.synchronize()
                if with_event:
                    ev = cuda.event()
                    ev.record(x.stream)
                t0 = time.perf_counter_ns()
                x.gather(ids, so)
                v.append(time.perf_counter_ns() - t0)
            x.stream.synchronize()
            return statistics.median(v) / 1e3
        h1, h2 = idle(False), idle(True)
        print(f"{n:>6} {a:>9.1f} {b:>12.1f} {c:>12.1f} {d:>11.1f} {e:>11.1f} {f:>10.1f} {h1:>10.1f} {h2:>8.1f}")


if __name__ == "__main__":
    main()
