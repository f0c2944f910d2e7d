"""`mpcache-bench l2 [--mib N] [--repeat R]`: the cost of sealing L2 objects.

Prints, per MAC algorithm (keyed BLAKE2b from the standard library, keyed BLAKE3 when the
`blake3` package is installed), the best-of-R time to seal and to check one N-MiB object (the
default 32 MiB is the default L1 slot), and the throughput. Sealing copies the object once
(header + payload); checking is a MAC over the payload, no copy.
"""
from __future__ import annotations

import argparse
import os
import time

from mpcache.runtime_zmq.l2_seal import MacAlgorithm, Sealer


def _best(fn: object, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mpcache-bench l2", description=__doc__)
    ap.add_argument("--mib", type=float, default=32.0, help="object size in MiB (default 32)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per measurement; the best is shown (default 5)")
    args = ap.parse_args(argv)
    size = int(args.mib * (1 << 20))
    payload = os.urandom(size)
    key = b"{00112233445566778899aabbccddeeff}-0"
    print(f"| algorithm ({args.mib:g} MiB object) | seal ms | check ms | check GiB/s |")
    print("|---|---:|---:|---:|")
    for alg in MacAlgorithm:
        try:
            sealer = Sealer(os.urandom(32), alg)
        except ValueError as e:
            print(f"| {alg.name} | - | - | ({e}) |")
            continue
        blob = sealer.seal(key, payload)
        seal_s = _best(lambda: sealer.seal(key, payload), args.repeat)
        check_s = _best(lambda: sealer.open(key, blob), args.repeat)
        print(f"| {alg.name} keyed | {seal_s * 1e3:.1f} | {check_s * 1e3:.1f} | {size / check_s / (1 << 30):.2f} |")
    return 0
