"""Summarise a py-spy ``--format raw`` (folded stacks) profile: per process, the functions with
the most samples by self time and by inclusive time, so a profile taken on a remote machine can
be read as a table without a flame-graph viewer.

    py-spy record --subprocesses --format raw -o prof.txt -- python -m mpcache.bench.bench_cli gpu-server ...
    python3 tools/folded_top.py prof.txt --match runtime_zmq.cli --top 30

A folded line is ``frame;frame;...;leaf COUNT``; with ``--subprocesses`` the first frame names
the process (``process PID:"cmdline"``; a child's stack sits under its parents'). ``--match`` keeps the processes whose first frame
contains the text. Frames are reduced to ``function (file:line)`` without the line for grouping.
"""
from __future__ import annotations

import argparse
import gzip
import re
import sys
from collections import Counter, defaultdict

_LINE_NO = re.compile(r":\d+\)$")


def _frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``: one row per function, not per line."""
    frame = _LINE_NO.sub(")", frame.strip())
    if "(" in frame:
        func, _, where = frame.partition(" (")
        where = where.rstrip(")").rsplit("/", 1)[-1]
        return f"{func} ({where})"
    return frame


def summarise(lines: list[str], match: str, top: int, exclude: tuple[str, ...] = ()) -> str:
    per_proc: dict[str, tuple[Counter[str], Counter[str], list[int]]] = defaultdict(
        lambda: (Counter(), Counter(), [0]))
    for line in lines:
        line = line.rstrip("\n")
        if not line or " " not in line:
            continue
        stack, _, count_s = line.rpartition(" ")
        try:
            count = int(count_s)
        except ValueError:
            continue
        frames = stack.split(";")
        # With --subprocesses a child's stack sits under its parents' ``process`` frames: the
        # innermost one names the process the sample belongs to.
        cut = max((i for i, f in enumerate(frames) if f.startswith("process ")), default=-1)
        proc = frames[cut] if cut >= 0 else "(one process)"
        if match and match not in proc:
            continue
        body = frames[cut + 1:]
        if exclude and any(text in f for f in body for text in exclude):
            continue
        selfc, incl, total = per_proc[proc]
        total[0] += count
        names = [_frame_name(f) for f in body]
        if names:
            selfc[names[-1]] += count
        for name in set(names):
            incl[name] += count
    out: list[str] = []
    for proc, (selfc, incl, total) in sorted(per_proc.items(), key=lambda kv: -kv[1][2][0]):
        n = total[0]
        out.append(f"{proc[:160]}: {n} samples")
        out.append(f"  {'self %':>7} {'incl %':>7}  function")
        rows = sorted(set(list(dict(selfc.most_common(top))) + list(dict(incl.most_common(top)))),
                      key=lambda name: (-incl[name], -selfc[name]))
        for name in rows[: 2 * top]:
            out.append(f"  {100 * selfc[name] / n:7.1f} {100 * incl[name] / n:7.1f}  {name[:150]}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="py-spy --format raw output")
    ap.add_argument("--match", default="", help="keep only processes whose first frame contains this")
    ap.add_argument("--exclude", action="append", default=[],
                    help="drop samples with a frame containing this (e.g. warm_up: start-up compiles); repeatable")
    ap.add_argument("--top", type=int, default=25, help="rows by self and by inclusive samples (default 25)")
    args = ap.parse_args(argv)
    opener = gzip.open if args.profile.endswith(".gz") else open
    with opener(args.profile, "rt", encoding="utf-8", errors="replace") as f:
        print(summarise(f.readlines(), args.match, args.top, tuple(args.exclude)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
