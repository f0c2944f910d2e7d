"""`mpcache-bench sim [--seeds N] [--jobs K] [--profile P] [--where N]`: simulator throughput.

Runs the standard scenario set (seeds 0..N-1 of `draw_scenario`, default profile) and prints
seeds per second, events per second, and the virtual:real time ratio (virtual seconds simulated
per second of one core's CPU time). Target: 1000 seeds in <= 60 s on 2 cores.

``--where N`` runs the first N seeds in this process under cProfile and prints where a seed's
CPU goes: each function's own time summed by the part of the house it belongs to (trio's
scheduler, the simulated world and its clock, the oracles, the production machines, the
simulator's vLLM and network models, the adversary, ...), as ms per seed and share.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

from mpcache.sim.runner import run_many


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpcache-bench sim")
    parser.add_argument("--seeds", type=int, default=1000)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--profile", default="default")
    parser.add_argument("--where", type=int, default=0, metavar="N",
                        help="profile N seeds in-process and print where their CPU goes (no throughput rows)")
    args = parser.parse_args(argv)
    if args.where:
        return where(args.where, args.profile)

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


# The parts of the house a profiled function belongs to, first match wins: (name, path piece,
# function-name predicate or None). Oracles are the sim's checkers and every machine's
# ``check_invariants`` family (run after each event by the world, never by production).
_WORLD = "simulated world, its loop, clock, nodes and server runtime (sim/world, timeline, server_host, runtime_trio)"
_PARTS: list[tuple[str, str, tuple[str, ...] | None]] = [
    ("oracles (sim/checks, sim/oracles, check_invariants)", "/mpcache/sim/checks/", None),
    ("oracles (sim/checks, sim/oracles, check_invariants)", "/mpcache/sim/oracles.py", None),
    ("oracles (sim/checks, sim/oracles, check_invariants)", "/mpcache/core_sm/", ("check_invariants", "check", "_check")),
    ("production machines (core_sm)", "/mpcache/core_sm/", None),
    ("trio's scheduler and cancel scopes", "/trio/", None),
    (_WORLD, "/mpcache/sim/world.py", None),
    (_WORLD, "/mpcache/sim/timeline.py", None),
    (_WORLD, "/mpcache/sim/server_host.py", None),
    (_WORLD, "/mpcache/runtime_trio/", None),
    ("vLLM engine and scheduler model (sim/engine, vllm_scheduler, groups)", "/mpcache/sim/engine.py", None),
    ("vLLM engine and scheduler model (sim/engine, vllm_scheduler, groups)", "/mpcache/sim/vllm_scheduler.py", None),
    ("vLLM engine and scheduler model (sim/engine, vllm_scheduler, groups)", "/mpcache/sim/groups.py", None),
    ("network model (sim/net)", "/mpcache/sim/net.py", None),
    ("client transport (sim/transport: the nodes' ServerLinks)", "/mpcache/sim/transport.py", None),
    ("adversarial tenant (sim/adversary)", "/mpcache/sim/adversary.py", None),
    ("scenario drawing, runner, trace (sim/scenario, runner, trace, profiles)", "/mpcache/sim/", None),
    ("imports and module set-up", "<frozen importlib", None),
]


_OTHER = "other (stdlib, attrs-generated methods, builtins, called from no part above)"


def _part_of(filename: str, function: str) -> str:
    for name, piece, functions in _PARTS:
        if piece in filename and (functions is None or function.startswith(functions)):
            return name
    return _OTHER


def where(seeds: int, profile: str) -> int:
    import cProfile
    import pstats

    from mpcache.sim.runner import run_seed

    profiler = cProfile.Profile(time.process_time)  # CPU, as the plain run reports
    started = time.process_time()
    profiler.enable()
    results = [run_seed(s, profile, hash_trace=False) for s in range(seeds)]  # as a sweep runs them
    profiler.disable()
    cpu = time.process_time() - started
    stats = pstats.Stats(profiler)
    table: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    own: dict[str, float] = {}

    def charge(func: Any, seconds: float, depth: int) -> None:
        """A library function's own time goes to the part that called it (split by the time
        each caller accounts for), up to a few frames up; the house's own functions keep theirs."""
        part = _part_of(func[0], func[2])
        callers = table[func][4] if func in table else {}
        if part != _OTHER or depth == 0 or not callers:
            own[part] = own.get(part, 0.0) + seconds
            return
        shares = {caller: row[2] for caller, row in callers.items()}
        whole = sum(shares.values()) or float(len(shares))
        for caller, share in shares.items():
            charge(caller, seconds * ((share / whole) if sum(shares.values()) else 1 / whole), depth - 1)

    for func, row in table.items():
        charge(func, row[2], 6)
    total = sum(own.values())
    events = sum(r.events for r in results)
    failed = sum(1 for r in results if not r.ok)
    print(f"# mpcache-bench sim --where {seeds} (profile {profile}): {seeds} seeds, {failed} failed, "
          f"{events / seeds:.0f} events per seed, {cpu / seeds * 1e3:.0f} ms CPU per seed under the profiler "
          f"(its own overhead included: compare shares, not totals, with the plain run). A library "
          f"function's own time is charged to the part that called it.")
    width = max(len(k) for k in own)
    print(f"| {'part':<{width}} | ms per seed | share |")
    print(f"|{'-' * (width + 2)}|---:|---:|")
    for part, seconds in sorted(own.items(), key=lambda kv: -kv[1]):
        print(f"| {part:<{width}} | {seconds / seeds * 1e3:.1f} | {100 * seconds / total:.1f}% |")
    print(f"| {'total':<{width}} | {total / seeds * 1e3:.1f} | 100% |")
    return 1 if failed else 0
