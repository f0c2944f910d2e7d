"""`mpcache-bench sweep [--slots N] [--requests R] [--prompts P] [--sizes S1,S2,...]`: capacity
planning end to end. Starts a real ``mpcache-server --trace`` with an L1 of ``--slots`` 1 MiB
slots, sends it a Pareto-skewed workload as an engine-driven vLLM worker does (lookup, status,
``prepare_retrieve``/``commit_retrieve`` of the hit, ``prepare_store``/``commit_store`` of the
whole prompt on a miss, end of session; no KV bytes are copied, the control plane is what the
trace records), stops it, then runs ``mpcache-sim sweep`` on the trace at ``--sizes`` slots and
prints its table (the last row is what the live server answered).
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

from mpcache.runtime_zmq.client import MPCacheClient
from mpcache.bench.server_process import ServerProcess

CHUNK = 64
SLOT_GB = 1 / 1024


def drive(url: str, args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(50_000) for _ in range(args.chunks * CHUNK)] for _ in range(args.prompts)]
    with MPCacheClient(url, request_timeout=10.0) as client:
        client.register_instance(1, {"model_name": "bench", "world_size": 1, "object_bytes": 1 << 16,
                                     "engine_driven": True}).result(10)
        for i in range(args.requests):
            tokens = prompts[min(int(rng.paretovariate(args.alpha)) - 1, args.prompts - 1)]
            rid = f"r{i}"
            key = {"model_name": "bench", "world_size": 1, "token_ids": tokens, "start": 0,
                   "end": len(tokens), "request_id": rid}
            client.lookup(key).result(10)
            hit = None
            while hit is None:
                hit = client.query_prefetch_status(rid).result(10)
            wkey = dict(key, worker_id=0)
            if hit:
                plan = client.prepare_retrieve(dict(wkey, end=hit * CHUNK), 1).result(10)
                if plan["ok"]:  # a plan on the wire is a dict (runtime_zmq.wire.plan_to_wire)
                    client.commit_retrieve(plan["transfer_id"]).result(10)
            if hit < args.chunks:
                plan = client.prepare_store(wkey, 1).result(10)
                client.commit_store(plan["transfer_id"]).result(10)
            client.end_session(rid).result(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpcache-bench sweep")
    parser.add_argument("--slots", type=int, default=32, help="L1 slots of the live server")
    parser.add_argument("--sizes", default="4,8,16,32,64,128", help="L1 sizes to sweep, in slots")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--chunks", type=int, default=4, help="chunks per prompt")
    parser.add_argument("--alpha", type=float, default=0.8, help="Pareto shape of prompt reuse")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--png", metavar="OUT.png")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mpcache-sweep-") as tmp:
        path = os.path.join(tmp, "server.trace")
        server = ServerProcess(["--port", "0", "--chunk-size", str(CHUNK), "--slot-mb", "1", "--no-metrics",
                                "--l1-size-gb", str(args.slots * SLOT_GB), "--trace", path])
        t0 = time.perf_counter()
        try:
            drive(server.url, args)
        finally:
            rc = server.stop()
        print(f"live server: {args.requests} requests over {args.prompts} prompts of {args.chunks} chunks "
              f"(Pareto {args.alpha}) in {time.perf_counter() - t0:.1f} s, {args.slots} slots; exit {rc}")
        from mpcache.sim.cli import main as sim_main

        sizes = ",".join(repr(int(s) * SLOT_GB) for s in args.sizes.split(","))
        return sim_main(["sweep", path, "--l1-size-gb", sizes, *(["--png", args.png] if args.png else [])])


if __name__ == "__main__":
    raise SystemExit(main())
