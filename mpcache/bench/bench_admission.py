"""`mpcache-bench admission`: hit rate with and without store admission (``--store-threshold``)
on a Zipf-skewed synthetic workload with one-off prompts mixed in.

The server machine itself (core_sm ``LookupServer``, no runtime) serves every request as vLLM's
connector would: LOOKUP, status query, STORE of what missed (server-driven, completed at once),
END_SESSION. Reused prompts are drawn from a Zipf(s) law over ``--prompts`` prompts; with
probability ``--one-off`` a request is a prompt never seen before. L1 holds ``--slots`` chunks.
Prints one row per threshold: hit rate over all requested chunks and over reused prompts' chunks,
stores admitted / refused, L1 evictions.
"""
from __future__ import annotations

import argparse
import random
import time
from typing import Any

from mpcache.core_sm.messages import CacheKey, EndSession, Lookup, QueryPrefetchStatus, RegisterInstance, Store, TransferFinished
from mpcache.core_sm.effects import Reply, StartTransfer
from mpcache.core_sm.server import LookupServer, ServerConfig

CHUNK = 16


def zipf_sampler(n: int, s: float, rng: random.Random) -> Any:
    weights = [1.0 / (rank ** s) for rank in range(1, n + 1)]
    population = list(range(n))
    return lambda: rng.choices(population, weights)[0]


def run(threshold: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    draw = zipf_sampler(args.prompts, args.zipf, rng)
    server = LookupServer(ServerConfig(chunk_size=CHUNK, num_slots=args.slots, slot_bytes=1, store_threshold=threshold))
    now = 0.0
    counter = [0]

    def call(event: Any) -> list[Any]:
        counter[0] += 1
        return server.handle(event, now)

    call(RegisterInstance(1, "bench", 1, 1, False, reply_to=("r", 0)))
    tokens_per_prompt = args.chunks * CHUNK
    requested = hits = reused_requested = reused_hits = 0
    for i in range(args.requests):
        now += 0.001
        if rng.random() < args.one_off:
            prompt = tuple(rng.randrange(1 << 30) for _ in range(tokens_per_prompt))
            reused = False
        else:
            p = draw()
            prompt = tuple(p * 100_000 + j for j in range(tokens_per_prompt))
            reused = True
        rid = f"q{i}"
        key = CacheKey("bench", 1, None, prompt, 0, tokens_per_prompt, rid)
        call(Lookup(key, 1, reply_to=("lookup", i)))
        (reply,) = [e for e in call(QueryPrefetchStatus(rid, reply_to=("query", i))) if isinstance(e, Reply)]
        got = int(reply.result or 0)
        requested += args.chunks
        hits += got
        if reused:
            reused_requested += args.chunks
            reused_hits += got
        call(EndSession(rid, reply_to=("end", i)))
        if got < args.chunks:
            store_key = CacheKey("bench", 1, 0, prompt, got * CHUNK, tokens_per_prompt, rid)
            for e in call(Store(store_key, 1, block_ids=tuple(range(args.chunks - got)), reply_to=("store", i))):
                if isinstance(e, StartTransfer):
                    call(TransferFinished(e.transfer_id, True))
    stats = server.stats()
    return {
        "threshold": threshold,
        "hit rate": hits / requested,
        "reused hit rate": reused_hits / max(1, reused_requested),
        "stored": stats.get("objects", 0) + stats.get("evictions", 0),
        "refused": stats.get("stores_not_admitted", 0),
        "evictions": stats.get("evictions", 0),
        "events": counter[0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpcache-bench admission", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--prompts", type=int, default=1_000, help="distinct reused prompts (Zipf-ranked)")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent s")
    parser.add_argument("--one-off", type=float, default=0.5, help="fraction of requests that are new prompts")
    parser.add_argument("--chunks", type=int, default=4, help="chunks per prompt")
    parser.add_argument("--slots", type=int, default=400, help="L1 slots (chunks)")
    parser.add_argument("--thresholds", default="0,2,3", help="comma-separated store thresholds (0: off)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"{args.requests} requests, {args.prompts} reused prompts (Zipf s={args.zipf}), {args.one_off:.0%} one-off, "
          f"{args.chunks} chunks per prompt, L1 {args.slots} chunks")
    print(f"| {'store threshold':>15} | {'hit rate':>8} | {'reused hit rate':>15} | {'chunks stored':>13} | "
          f"{'stores refused':>14} | {'evictions':>9} | {'s':>5} |")
    print(f"|{'-' * 17}|{'-' * 10}|{'-' * 17}|{'-' * 15}|{'-' * 16}|{'-' * 11}|{'-' * 7}|")
    for threshold in (int(t) for t in args.thresholds.split(",")):
        t0 = time.perf_counter()
        r = run(threshold, args)
        label = "off" if threshold <= 1 else str(threshold)
        print(f"| {label:>15} | {r['hit rate']:>8.1%} | {r['reused hit rate']:>15.1%} | {r['stored']:>13} | "
              f"{r['refused']:>14} | {r['evictions']:>9} | {time.perf_counter() - t0:>5.1f} |", flush=True)
    return 0
