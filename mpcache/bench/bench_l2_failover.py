"""`mpcache-bench l2_failover [--rounds N] [--node-timeout-ms MS] [--keys K]`: Redis Cluster
failover as mpcache's cluster tier sees it.

Each round starts a fresh local cluster (3 masters + 3 replicas of `redis-server
--cluster-enabled yes` on loopback, as the tests do; needs redis-server and redis-cli), writes K
hash-tagged objects through `RedisClusterTier`, SIGKILLs the master of the first one and reads
all K every 50 ms. It prints, per round: the slowest read while the master is down (a miss must
stay fast), the keys served during the outage, the time until Redis reports the failover done
(every slot served again), and the time until mpcache's tier reads every key again.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

HERE = os.path.dirname(os.path.realpath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "runtime_zmq"))  # the cluster fixture


def _round(node_timeout_ms: int, n_keys: int) -> tuple[float, int, float, float]:
    from redis_cluster import RedisClusterProcesses  # type: ignore[import-not-found]

    from mpcache.runtime_zmq.l2 import L2Unavailable, open_tier

    with RedisClusterProcesses(node_timeout_ms=node_timeout_ms) as cluster:
        tier = open_tier(cluster.url("timeout=0.5"))
        try:
            keys = [f"{{{os.urandom(16).hex()}}}-0".encode() for _ in range(n_keys)]
            tier.write_many([(k, b"v" * 1024) for k in keys])
            time.sleep(0.3)  # asynchronous replication
            victim = cluster.master_of(b"mpcache:" + keys[0])
            redis_done: list[float] = []
            killed = time.monotonic()
            victim.kill()
            waiter = threading.Thread(target=lambda: redis_done.append(cluster.wait_failover(victim, 60.0)))
            waiter.start()
            slowest, served_during, recovered = 0.0, n_keys, float("nan")
            while time.monotonic() - killed < 60:
                t = time.monotonic()
                try:
                    got = sum(v is not None for v in tier.read_many(keys))
                except L2Unavailable:
                    got = 0
                slowest = max(slowest, time.monotonic() - t)
                if got == n_keys and time.monotonic() - killed > 0.1:
                    recovered = time.monotonic() - killed
                    break
                served_during = min(served_during, got)
                time.sleep(0.05)
            waiter.join()
            return slowest, served_during, redis_done[0] if redis_done else float("nan"), recovered
        finally:
            tier.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mpcache-bench l2_failover", description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--node-timeout-ms", type=int, default=1000, help="cluster-node-timeout (default 1000)")
    ap.add_argument("--keys", type=int, default=60, help="objects read per poll (default 60)")
    args = ap.parse_args(argv)
    print(f"| round | slowest read while down (ms) | keys served while down | Redis failover done (s) | "
          f"mpcache reads all {args.keys} again (s) |")
    print("|---:|---:|---:|---:|---:|")
    for r in range(args.rounds):
        slowest, during, redis_s, mpcache_s = _round(args.node_timeout_ms, args.keys)
        print(f"| {r + 1} | {slowest * 1e3:.0f} | {during}/{args.keys} | {redis_s:.2f} | {mpcache_s:.2f} |", flush=True)
    return 0
