"""The loop's host time per transfer on the copy-lane path, without a GPU: ``GpuTransferExecutor``
with copy lanes on the fake driver of ``tests/runtime_zmq/test_gpu_lanes.py`` (the compiled lane
and enqueue run for real; the driver calls are ctypes callbacks). Prints the executor's own
``start_ns / started`` (plan, check, row write, hand-over), hot (transfers back to back) and cold
(each after 5 ms asleep and 32 MiB of other memory traffic, as a lone request finds the loop),
for 1- and 4-chunk stores, and the waiter thread's CPU per transfer (its Python, the GIL's to
share with the loop: the fake's events are done when first looked at). With ``--completions``, a
second table: who sees a copy end, the waiter thread or the copy lane (``--gpu-completions``),
each fake copy taking ``--copy-us`` (its event, recorded and queried by compiled callbacks as
cheap as the driver's, reads pending until then; the link model is configured to expect about
that): the process's CPU per transfer (loop, lane, waiter: all of it)
and the time from the copy's end to the loop handling its completion (through the server's own
``CompletionChannel``), lone (5 ms apart) and in bursts of 8. What it cannot show: the
H200 host's own speed and the real driver's event handles. A command that prints a table, kept with the tests because it runs their fake
(not collected by pytest); from the repo root, with the dev venv:

    .venv/bin/python tests/runtime_zmq/lane_host_time.py [--rounds 3] [--completions]
"""
from __future__ import annotations

import argparse
import itertools
import os
import select
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests", "runtime_zmq")]

import pytest  # noqa: E402  (its MonkeyPatch swaps in the fake driver, as the tests do)

import mpcache.kernels.gpu as kg  # noqa: E402
import tests.runtime_zmq.test_gpu_lanes as fake  # noqa: E402
from mpcache.runtime_zmq import gpu_ipc  # noqa: E402
from mpcache.runtime_zmq.gpu_transfer import GpuTransferExecutor  # noqa: E402
from mpcache.runtime_zmq.server import CompletionChannel  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hot", type=int, default=2000, help="transfers per hot row")
    ap.add_argument("--cold", type=int, default=200, help="transfers per cold row")
    ap.add_argument("--completions", action="store_true", help="the waiter / lane completions table instead")
    ap.add_argument("--copy-us", type=float, default=1000.0, help="each fake copy's time (--completions)")
    args = ap.parse_args()
    dev = fake.Device()
    events: Any = itertools.count(1)
    lib: Any = dev
    if args.completions:  # events whose record and query are compiled: a look costs what a driver's does
        lib = CompiledEvents(dev, args.copy_us)
        events = iter(lib.handles)
    lane = kg.make_copy_lane(kg._make_enqueue(lib))
    kg.warm_copy_lane(lane)
    mp = pytest.MonkeyPatch()
    mp.setattr(kg, "fast_copy_lane", lambda: lane)
    for name, value in (("driver", lambda: dev), ("ensure_context", lambda ordinal=0: None),
                        ("create_completion_event", lambda: next(events)), ("destroy_event", lambda ev: None),
                        ("open_event", lambda h: 9000 + h[0]), ("open_memory", lambda h: 0x1000 * h[0]),
                        ("close_memory", lambda address: None)):
        mp.setattr(gpu_ipc, name, value)
    if args.completions:
        try:
            return completions_table(args, dev, lib, mp)
        finally:
            mp.undo()
    ex = GpuTransferExecutor(fake.C, copy_lanes=True)
    inst, _ = fake.add(ex, dev, 1, b"\x01" * 64)
    waiter = inst.waiter.native_id

    def waiter_cpu_s() -> float:  # the waiter thread's time on a CPU so far (schedstat, ns)
        with open(f"/proc/self/task/{waiter}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    done = fake.Done()
    junk = np.ones(32 << 17)
    tids = itertools.count(1)

    def row(n_chunks: int, cold: bool) -> tuple[float, float, float, float, float]:
        s0, w0 = ex.stats(), waiter_cpu_s()
        for i in range(args.cold if cold else args.hot):
            if cold:
                junk.sum()
                time.sleep(0.005)
            elif i % 16 == 15:
                time.sleep(0.002)  # let the lane and the waiter keep up
            tid = next(tids)
            ex.start(fake.st(tid, 1, 4 * (tid % 500), n_chunks), b"", done)
        time.sleep(0.05)
        s1, w1 = ex.stats(), waiter_cpu_s()
        n = (s1["started"] - s0["started"]) * 1e3
        d = {k: (s1[k] - s0[k]) / n for k in ("start_ns", "plan_ns", "wait_ns", "enqueue_ns")}
        # plan: plan_rows; check + event: the shapes, the worker's event, a completion event;
        # row: the row written (checked) and handed over, then the pending entry
        return (d["start_ns"], d["plan_ns"], d["wait_ns"], d["start_ns"] - d["plan_ns"] - d["wait_ns"],
                (w1 - w0) / n * 1e9)  # (n counts thousands: ns to µs)

    row(1, False)
    cells: dict[tuple[int, bool], list[tuple[float, float, float, float, float]]] = {}
    for _ in range(args.rounds):
        for n in (1, 4):
            for cold in (False, True):
                cells.setdefault((n, cold), []).append(row(n, cold))
    ex.close()
    mp.undo()
    print(f"# the loop's host time per transfer, copy lanes on a fake driver, {args.rounds} rounds "
          "(µs; the median round by total, and each round's total)")
    print("| store | when | total | plan_rows | check + events | row + hand-over | each round | waiter CPU |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for n in (1, 4):
        for cold in (False, True):
            rounds = sorted(cells[(n, cold)])
            mid = rounds[len(rounds) // 2]
            print(f"| {n} chunk{'s' if n > 1 else ''} | {'cold (5 ms asleep)' if cold else 'hot'} | {mid[0]:.1f} | "
                  f"{mid[1]:.1f} | {mid[2]:.1f} | {mid[3]:.1f} | {', '.join(f'{r[0]:.1f}' for r in cells[(n, cold)])} | "
                  f"{mid[4]:.1f} |")
    return 0


class CompiledEvents:
    """The fake driver with ``cuEventRecord`` / ``cuEventQuery`` as compiled C callbacks (no GIL,
    no Python): a completion event is the address of an int64 that its record sets to when its
    copy will end: ``copy_us`` after the later of now and the previous copy's end (one stream:
    copies run one after another, as the link model expects); a query reads it against the
    clock. Other events (the descriptor ring's) read done. The rest of the driver is ``dev``'s."""

    def __init__(self, dev: Any, copy_us: float, n: int = 4096) -> None:
        import ctypes

        import numba
        from numba import types
        from numba.extending import intrinsic

        self.dev = dev
        self.ends = np.zeros(n, np.int64)
        base, top = self.ends.ctypes.data, self.ends.ctypes.data + 8 * n
        self.handles = [base + 8 * i for i in range(1, n)]  # (ends[0]: the last copy's end)
        copy_ns = int(copy_us * 1e3)
        libc = ctypes.CDLL(None)
        now_fn = libc["clock_gettime"]
        now_fn.argtypes = [ctypes.c_int, ctypes.c_uint64]
        now_fn.restype = ctypes.c_int

        @intrinsic
        def int64_at(typingctx: Any, address: Any) -> Any:  # *(int64 *)address, as a 1-array
            sig = types.CPointer(types.int64)(address)

            def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
                return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.int64)))
            return sig, codegen

        @numba.njit
        def now_ns() -> Any:
            ts = np.zeros(2, np.int64)
            now_fn(1, ts.ctypes.data)
            return ts[0] * 1_000_000_000 + ts[1]

        @numba.cfunc(types.int32(types.uint64, types.uint64))
        def record(ev: Any, stream: Any) -> Any:
            if base < ev < top:
                last = int64_at(base)
                end = max(now_ns(), last[0]) + copy_ns
                last[0] = end
                int64_at(ev)[0] = end
            return 0

        @numba.cfunc(types.int32(types.uint64))
        def query(ev: Any) -> Any:
            if base < ev < top and now_ns() < int64_at(ev)[0]:
                return fake.NOT_READY
            return fake.SUCCESS

        self._fns = {"cuEventRecord": (ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64), record.address),
                     "cuEventQuery": (ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64), query.address)}
        self._keep = (record, query)

    def __getitem__(self, name: str) -> Any:
        if name not in self._fns:
            return self.dev[name]
        proto, address = self._fns[name]
        return proto(address)  # a new function object each time (its caller sets its argtypes)

    def copy_end_s(self, ev: int) -> float:
        return int(self.ends[(ev - self.ends.ctypes.data) // 8]) / 1e9


def thread_cpu_s(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def completions_table(args: argparse.Namespace, dev: Any, lib: CompiledEvents, mp: pytest.MonkeyPatch) -> int:
    """Alternating rounds of waiter / lane completions on the same fake, lone and burst rows. The
    waiters poll with the compiled poller (as on a GPU), here on the fake's query."""
    link_gbps = fake.SLOT_LANES * fake.LANE / (args.copy_us / 1e6) / 1e9  # the model expects the fake's copy time
    poller = kg.make_event_poller(lib)
    mp.setattr(kg, "fast_poller", lambda: poller)
    junk = np.ones(32 << 17)
    tids = itertools.count(1)
    cells: dict[tuple[str, str], list[tuple[float, ...]]] = {}

    def one(mode: str, burst: int) -> tuple[float, ...]:
        channel = CompletionChannel()
        ex = GpuTransferExecutor(fake.C, copy_lanes=True, lane_completions=mode == "lane", link_gbps=link_gbps)
        ex._use_compiled_poller()  # (warm_up would, on a GPU)
        ex.wake_loop_with(channel.wake_fd)
        inst, _ = fake.add(ex, dev, 1, b"\x01" * 64)
        handled: dict[int, float] = {}
        arrived = threading.Event()
        stop = False
        collect = ex.collect_completions if mode == "lane" else None

        def loop() -> None:  # the server loop's part: woken by the channel, it drains (and collects)
            while not stop:
                if select.select([channel.fd], [], [], 0.05)[0]:
                    for tid in channel.drain(collect):
                        handled[tid] = time.monotonic()  # type: ignore[index]
                    arrived.set()

        lt = threading.Thread(target=loop, daemon=True)
        lt.start()
        ids = [lt.native_id, inst.waiter.native_id, inst.lane.thread.native_id]
        n = args.cold
        lat: list[float] = []
        start_cpu = 0.0
        th0 = [thread_cpu_s(i) for i in ids]  # type: ignore[arg-type]
        for _ in range(n // burst):
            junk.sum()
            time.sleep(0.005)
            want = [next(tids) for _ in range(burst)]
            events = []
            c0 = time.thread_time()
            for tid in want:
                ex.start(fake.st(tid, 1, 4 * (tid % 500)), b"", lambda t, ok: channel.post(t))
                events.append(inst.pending[-1].event)
            start_cpu += time.thread_time() - c0
            while not all(t in handled for t in want):
                arrived.wait(1.0)
                arrived.clear()
            lat += [handled[t] - lib.copy_end_s(ev) for t, ev in zip(want, events)]
        th1 = [thread_cpu_s(i) for i in ids]  # type: ignore[arg-type]
        stop = True
        lt.join(1.0)
        ex.close()
        channel.close()
        done = (n // burst) * burst
        loop_s, waiter_s, lane_s = ((b - a) for a, b in zip(th0, th1))
        lat.sort()
        return tuple(x / done * 1e6 for x in (start_cpu + loop_s + waiter_s + lane_s, start_cpu, loop_s, waiter_s, lane_s)) + (
            statistics.median(lat) * 1e6, lat[int(0.99 * (len(lat) - 1))] * 1e6)

    for _ in range(args.rounds):
        for burst in (1, 8):
            for mode in ("waiter", "lane"):
                cells.setdefault((mode, "lone" if burst == 1 else "burst of 8"), []).append(one(mode, burst))
    print(f"# who sees a copy end, on a fake driver (each copy {args.copy_us:.0f} µs), {args.rounds} rounds "
          f"alternating, {args.cold} transfers each (CPU µs per transfer of the threads that serve it; the median "
          "round by their sum)")
    print("| completions | transfers | CPU, all | start (loop) | drain (loop) | waiter | lane | copy end -> loop p50 µs "
          "| p99 | CPU, all, each round |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for (mode, what), rounds in cells.items():
        mid = sorted(rounds)[len(rounds) // 2]
        print(f"| {mode} | {what} | " + " | ".join(f"{x:.1f}" for x in mid) + f" | {', '.join(f'{r[0]:.1f}' for r in rounds)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
