"""One line per (profile, seed): what the simulator concluded -- events, virtual time, trace hash,
verdict and a digest of the coverage counters. A change that only makes the simulator faster must
leave this output byte-identical:

    PYTHONPATH=$PWD python tools/sim_outcomes.py > before.txt   # on the base tree
    PYTHONPATH=$PWD python tools/sim_outcomes.py > after.txt    # on the changed tree
    diff before.txt after.txt

Default: seeds 0-199 of the default profile and seeds 0-39 of every legacy profile.
"""
from __future__ import annotations

import argparse
import hashlib
import sys

from mpcache.sim.profiles import LEGACY
from mpcache.sim.runner import run_seed


def outcome_line(seed: int, profile: str) -> str:
    r = run_seed(seed, profile, hash_trace=True)
    verdict = "ok" if r.violation is None else f"{r.violation.code}@{r.violation.t:.6f}:{r.violation.node}"
    detail = "" if r.violation is None else hashlib.sha256(r.violation.message.encode()).hexdigest()[:12]
    coverage = hashlib.sha256(repr(r.coverage).encode()).hexdigest()[:12]
    return (f"{profile} {seed} events={r.events} vt={r.virtual_time:.6f} hash={r.trace_hash} "
            f"verdict={verdict} {detail} coverage={coverage}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--default-seeds", type=int, default=200)
    p.add_argument("--legacy-seeds", type=int, default=40)
    p.add_argument("--profile", action="append", help="only these profiles (repeatable)")
    args = p.parse_args(argv)
    plan = [("default", args.default_seeds)] + [(name, args.legacy_seeds) for name in LEGACY]
    for profile, n in plan:
        if args.profile and profile not in args.profile:
            continue
        for seed in range(n):
            print(outcome_line(seed, profile), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
