"""The loop's host time per transfer on the copy-lane path, without a GPU: ``GpuTransferExecutor``
with copy lanes on the fake driver of ``tests/runtime_zmq/test_gpu_lanes.py`` (the compiled lane
and enqueue run for real; the driver calls are ctypes callbacks). Prints the executor's own
``start_ns / started`` (plan, check, row write, hand-over), hot (transfers back to back) and cold
(each after 5 ms asleep and 32 MiB of other memory traffic, as a lone request finds the loop),
for 1- and 4-chunk stores, and the waiter thread's CPU per transfer (its Python, the GIL's to
share with the loop: the fake's events are done when first looked at). What it cannot show: the
H200 host's own speed and the real driver's event handles. A command that prints a table, kept with the tests because it runs their fake
(not collected by pytest); from the repo root, with the dev venv:

    .venv/bin/python tests/runtime_zmq/lane_host_time.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hot", type=int, default=2000, help="transfers per hot row")
    ap.add_argument("--cold", type=int, default=200, help="transfers per cold row")
    args = ap.parse_args()
    dev = fake.Device()
    lane = kg.make_copy_lane(kg._make_enqueue(dev))
    kg.warm_copy_lane(lane)
    events = itertools.count(1)
    mp = pytest.MonkeyPatch()
    mp.setattr(kg, "fast_copy_lane", lambda: lane)
    for name, value in (("driver", lambda: dev), ("ensure_context", lambda ordinal=0: None),
                        ("create_completion_event", lambda: next(events)), ("destroy_event", lambda ev: None),
                        ("open_event", lambda h: 9000 + h[0]), ("open_memory", lambda h: 0x1000 * h[0]),
                        ("close_memory", lambda address: None)):
        mp.setattr(gpu_ipc, name, value)
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


if __name__ == "__main__":
    raise SystemExit(main())
