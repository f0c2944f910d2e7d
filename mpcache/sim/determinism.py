"""Determinism self-check: the same seed must give the same trace in another process.

The child process runs with a different `PYTHONHASHSEED`, so any order that leaks from hashing
(sets of str, dict order built from them) or from object ids shows up as a different trace hash.
On a mismatch both traces are produced in full and the first diverging line is reported with its
virtual time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import attrs

from mpcache.sim.runner import run_seed
from mpcache.sim.trace import first_divergence


@attrs.frozen
class Divergence:
    seed: int
    local_hash: str
    other_hash: str
    index: int
    local_line: str
    other_line: str

    def describe(self) -> str:
        return (f"seed {self.seed}: trace hash {self.local_hash} here, {self.other_hash} with another "
                f"PYTHONHASHSEED; first divergence at event {self.index}:\n  here:  {self.local_line}\n"
                f"  there: {self.other_line}")


def _child(args: list[str], hashseed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    proc = subprocess.run([sys.executable, "-m", "mpcache.sim.determinism", *args], env=env, capture_output=True, text=True,
                          check=True)
    return proc.stdout


def check(seeds: list[int], profile: str = "default", hashseed: str | None = None) -> list[Divergence]:
    """Run `seeds` here and in a child process; return every divergence (empty: deterministic)."""
    mine = {s: run_seed(s, profile).trace_hash for s in seeds}
    other_seed = hashseed if hashseed is not None else str((int(os.environ.get("PYTHONHASHSEED", "0") or 0) + 7919) % 4294967295 or 1)
    out = _child(["--profile", profile, *map(str, seeds)], other_seed)
    theirs = {int(k): v for k, v in json.loads(out).items()}
    found = []
    for s in seeds:
        if mine[s] != theirs.get(s):
            local = list(run_seed(s, profile, keep_lines=True).lines)
            remote = json.loads(_child(["--profile", profile, "--lines", str(s)], other_seed))[str(s)]
            d = first_divergence(local, remote) or (len(local), "<same lines>", "<same lines>")
            found.append(Divergence(s, mine[s], theirs.get(s, "?"), d[0], d[1], d[2]))
    return found


def main(argv: list[str] | None = None) -> int:
    """The child's side of `check` (not a user command): print {seed: trace hash}, or with
    --lines {seed: [lines]}, as JSON on stdout."""
    parser = argparse.ArgumentParser(prog="python -m mpcache.sim.determinism")
    parser.add_argument("seeds", type=int, nargs="+")
    parser.add_argument("--profile", default="default")
    parser.add_argument("--lines", action="store_true")
    args = parser.parse_args(argv)
    out: dict[str, object] = {}
    for s in args.seeds:
        r = run_seed(s, args.profile, keep_lines=args.lines)
        out[str(s)] = list(r.lines) if args.lines else r.trace_hash
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
