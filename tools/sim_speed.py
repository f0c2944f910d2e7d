"""CPU time per seed of `mpcache-sim run`'s sweep, for two source trees measured alternately.

On a shared, loaded machine wall time says little and even CPU time drifts (caches, frequency),
so the trees take turns: each round runs the same seeds once per tree, each in a fresh process
(imports excluded: one warm-up seed first), and the medians over the rounds are compared.

    python tools/sim_speed.py BASE_TREE NEW_TREE [--rounds 6] [--seeds 60] [--start 0]

A tree is a directory holding the ``mpcache`` package (a worktree, or ``git archive`` of a
commit unpacked somewhere). Prints each round and the medians in ms of CPU per seed and seeds
per CPU-second.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_CHILD = """
import sys, time
from mpcache.sim.runner import run_many, run_seed
start, n = int(sys.argv[1]), int(sys.argv[2])
run_seed(10_000, hash_trace=False)  # warm: imports, first-call caches
t = time.process_time()
run_many(range(start, start + n), "default", jobs=1)
print(time.process_time() - t)
"""


def measure(tree: str, start: int, seeds: int) -> float:
    """Seconds of CPU (this process, user + system) for ``seeds`` seeds of ``tree``."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(start), str(seeds)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return float(out.split()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+", help="source trees (each holds the mpcache package)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seeds", type=int, default=60)
    p.add_argument("--start", type=int, default=0)
    args = p.parse_args(argv)
    per_tree: dict[str, list[float]] = {t: [] for t in args.trees}
    for r in range(args.rounds):
        for tree in args.trees:
            ms = measure(tree, args.start, args.seeds) / args.seeds * 1000
            per_tree[tree].append(ms)
            print(f"round {r}: {tree}: {ms:.1f} ms CPU per seed", flush=True)
    for tree, values in per_tree.items():
        med = statistics.median(values)
        print(f"{tree}: median {med:.1f} ms CPU per seed = {1000 / med:.1f} seeds per CPU-second "
              f"(min {min(values):.1f}, max {max(values):.1f}, {len(values)} rounds of {args.seeds} seeds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
