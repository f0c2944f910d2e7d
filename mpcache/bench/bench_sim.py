"""`mpcache-bench sim [--seeds N] [--jobs K] [--profile P]`: simulator throughput.

Runs the standard scenario set (seeds 0..N-1 of `draw_scenario`, default profile) and prints
seeds per second, events per second, and the virtual:real time ratio (virtual seconds simulated
per second of one core's CPU time). Target: 1000 seeds in <= 60 s on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from mpcache.sim.runner import run_many


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpcache-bench sim")
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--profile", default="default")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    results = run_many(range(args.seeds), args.profile, jobs=args.jobs)
    wall = time.perf_counter() - started
    per_seed = [r.cpu_time for r in results]
    events = sum(r.events for r in results)
    virtual = sum(r.virtual_time for r in results)
    cpu = sum(per_seed)
    failed = sum(1 for r in results if not r.ok)
    rows = [
        ("machine", f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}"),
        ("profile / seeds / jobs", f"{args.profile} / {len(results)} / {args.jobs}"),
        ("failed seeds", str(failed)),
        ("wall time", f"{wall:.1f} s"),
        ("CPU time (sum over seeds)", f"{cpu:.1f} s = {len(results) / cpu:.1f} seeds per CPU-second"),
        ("seeds per second", f"{len(results) / wall:.1f}"),
        ("events handled", f"{events} ({events / wall:.0f} per s)"),
        ("seed CPU time p50 / p99 / max", f"{statistics.median(per_seed) * 1e3:.0f} / "
                                      f"{sorted(per_seed)[int(0.99 * (len(per_seed) - 1))] * 1e3:.0f} / "
                                      f"{max(per_seed) * 1e3:.0f} ms"),
        ("virtual time simulated", f"{virtual:.0f} s"),
        ("virtual : real (one core)", f"{virtual / cpu:.0f} : 1"),
        ("1000 seeds at this rate", f"{1000 * wall / len(results):.1f} s wall; {1000 * cpu / len(results) / 2:.1f} s "
                                    f"on 2 idle cores (target <= 60 s)"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"| {'metric':<{width}} | value |")
    print(f"|{'-' * (width + 2)}|-------|")
    for k, v in rows:
        print(f"| {k:<{width}} | {v} |")
    return 0
