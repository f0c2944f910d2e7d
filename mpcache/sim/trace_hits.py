"""Hit rate on hashed-block traces: L1's eviction against Belady's bound and an infinite cache.

Two public traces report prefix reuse in hashed blocks: Mooncake's (FAST'25: 512-token
``hash_ids`` per request, JSONL) and Qwen-Bailian's ("KVCache Cache in the Wild": 16-token block
ids, sessions of turns). Mooncake's conversation and synthetic traces are in the checkout
(``data/traces/``, see its README; ``load_trace`` reads them, gzipped or not). The Bailian files
are not obtainable here (large-file storage), so ``synthesize`` makes traces with their
published shape (seeded, so a table is reproducible): sessions of turns whose prompt is the
previous turn's prompt and answer plus a new input, over a system prompt drawn from a small pool
with Zipf popularity. ``TRACES`` holds the two shapes; ``reuse_concentration`` measures the
statistic the Bailian paper gives (10% of blocks take 77% of reuses) on what was made, so a table
says how close the synthetic trace came.

``replay`` runs a trace through ``core_sm``'s ``L1Index`` at one capacity (in blocks), as the
server does: a request's hit is its longest prefix of readable blocks (a chunk's KV depends on
every token before it), which it leases and releases, then the missing blocks are stored. Two
policies of the same LRU index:

* ``lru`` -- what the server does today: a lookup's leases are released in chunk order and a
  store writes chunks in order, so a request's *first* block becomes its least recently used
  and is evicted first, which takes the whole prefix with it;
* ``lru-tail`` -- the same LRU with a request's blocks made recent tail first, so its *last*
  block goes first and what stays is still a prefix (vLLM's own prefix cache frees a
  request's blocks in reverse for this reason);
* ``lru+admit2`` -- today's LRU behind ``core_sm``'s store admission at threshold 2
  (``--store-threshold 2``): a block is stored only once lookups asked for it twice, so
  one-off inputs do not evict what is reused.

* ``slru-tail`` -- a frequency-aware candidate (segmented LRU, a model here, not the server's
  index): a block read again moves to a protected segment (80% of the room) that one-off
  blocks cannot flush; blocks are made recent tail first, as ``lru-tail``.

``belady`` is the offline bound (evict the block used again farthest in the future, or do not
store a block used again later than every cached one), and ``infinite`` the hit rate with no
eviction at all. ``table`` prints hit rates per trace, capacity and policy.
"""
from __future__ import annotations

import gzip
import hashlib
import heapq
import json
import math
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

from mpcache.core_sm.admission import StoreAdmission
from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.l1_index import L1Index, ReleaseReason

Trace = list[tuple[int, ...]]  # per request, its prompt's block ids in order (shared ids: shared prefix)


@attrs.frozen
class TraceShape:
    """What a synthetic trace is made of (lengths in blocks; means of lognormal draws)."""

    name: str
    block_tokens: int
    system_prompts: int  # the pool of shared system prompts
    zipf_s: float  # their popularity: P(k) ~ 1 / k**s
    system_blocks: float
    input_blocks: float
    answer_blocks: float
    mean_turns: float  # turns per session (geometric)
    concurrent_sessions: int  # sessions interleaved at any time
    source: str


TRACES: dict[str, TraceShape] = {
    # Mooncake conversation trace: ~12k-token inputs in 512-token blocks, multi-turn sessions
    "mooncake": TraceShape("mooncake", 512, system_prompts=64, zipf_s=1.1, system_blocks=4.0,
                           input_blocks=6.0, answer_blocks=1.0, mean_turns=4.0, concurrent_sessions=48,
                           source="Mooncake FAST'25 (512-token hash_ids)"),
    # Bailian to-C: 16-token blocks, chat sessions, a few popular system prompts
    "bailian": TraceShape("bailian", 16, system_prompts=200, zipf_s=1.5, system_blocks=60.0,
                          input_blocks=25.0, answer_blocks=20.0, mean_turns=2.5, concurrent_sessions=64,
                          source="Qwen-Bailian traceA (16-token blocks, sessions)"),
}


def _lognormal(rng: random.Random, mean: float) -> int:
    sigma = 0.8
    return max(1, int(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def synthesize(shape: TraceShape, requests: int, seed: int = 0) -> Trace:
    """``requests`` prompts of sessions interleaved over time (see the module doc)."""
    rng = random.Random(seed)
    weights = [1.0 / (k ** shape.zipf_s) for k in range(1, shape.system_prompts + 1)]
    next_id = 0

    def fresh(n: int) -> tuple[int, ...]:
        nonlocal next_id
        next_id += n
        return tuple(range(next_id - n, next_id))

    systems = [fresh(_lognormal(rng, shape.system_blocks)) for _ in range(shape.system_prompts)]
    live: list[tuple[tuple[int, ...], int]] = []  # (context so far, turns left)
    out: Trace = []
    while len(out) < requests:
        while len(live) < shape.concurrent_sessions:
            system = systems[rng.choices(range(shape.system_prompts), weights)[0]]
            turns = 1 + int(rng.expovariate(1.0 / max(1e-9, shape.mean_turns - 1)))
            live.append((system, turns))
        i = rng.randrange(len(live))
        context, turns = live[i]
        prompt = context + fresh(_lognormal(rng, shape.input_blocks))
        out.append(prompt)
        if turns > 1:
            live[i] = (prompt + fresh(_lognormal(rng, shape.answer_blocks)), turns - 1)
        else:
            live.pop(i)
    return out


def load_trace(path: str | Path, requests: int | None = None) -> Trace:
    """A Mooncake-format trace (JSONL, one request per line with its ``hash_ids``; ``.gz``
    read as gzip), in file order (the arrival order), at most ``requests`` of them."""
    opener = gzip.open if str(path).endswith(".gz") else open
    out: Trace = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if requests is not None and len(out) >= requests:
                break
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["hash_ids"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a request with hash_ids ({e})") from None
            if not isinstance(ids, list) or not all(type(b) is int for b in ids):
                raise ValueError(f"{path}:{n}: hash_ids must be a list of ints")
            out.append(tuple(ids))
    return out


def reuse_concentration(trace: Trace, top: float = 0.10) -> float:
    """The share of all reuses (accesses after a block's first) taken by the ``top`` fraction of
    blocks most reused."""
    counts: dict[int, int] = {}
    for prompt in trace:
        for b in prompt:
            counts[b] = counts.get(b, 0) + 1
    reuses = sorted((c - 1 for c in counts.values()), reverse=True)
    total = sum(reuses)
    if not total:
        return 0.0
    return sum(reuses[: max(1, int(len(reuses) * top))]) / total


def _key(block: int) -> ObjectKey:
    # a hash, as chunk keys are (the admission sketch indexes by slices of it)
    return ObjectKey(hashlib.blake2b(block.to_bytes(8, "little"), digest_size=16).digest(), 0)


def replay(trace: Trace, capacity: int, policy: str) -> float:
    """Block hit rate (hit blocks / prompt blocks) of ``policy`` (``lru``, ``lru-tail``,
    ``belady``, ``infinite``) at ``capacity`` blocks."""
    if policy == "infinite":
        return _infinite(trace)
    if policy == "belady":
        return _belady(trace, capacity)
    if policy == "slru-tail":
        return _slru(trace, capacity)
    if policy not in ("lru", "lru-tail", "lru+admit2"):
        raise ValueError(f"unknown policy {policy!r}")
    idx = L1Index(num_slots=capacity, slot_bytes=1, lease_ttl=1e18)
    admission = StoreAdmission(2) if policy == "lru+admit2" else None
    hits = total = 0
    for n, prompt in enumerate(trace):
        keys = [_key(b) for b in prompt]
        hashes = [k.chunk_hash for k in keys]
        owner = ("lookup", n)
        prefix = idx.lease_prefix(hashes, [0], owner, 1, 0.0)
        hits += prefix
        total += len(keys)
        if admission is not None:  # as the server: a lookup counts its chunks, a store asks
            admission.record(hashes)
            idx.release_owner(owner, ReleaseReason.RETRIEVE, 0.0)
            for i in range(prefix, len(keys)):
                if not admission.admits(hashes[i]):
                    break  # the chunks after a refused one are no prefix's hit either
                if idx.reserve_write(keys[i], "store", 1, 0.0) is not None:
                    idx.finish_write(keys[i], "store", 0.0)
            continue
        if policy == "lru":  # as the server: released in chunk order, stored in chunk order
            idx.release_owner(owner, ReleaseReason.RETRIEVE, 0.0)
            order: Iterable[int] = range(prefix, len(keys))
        else:  # the tail made least recent: stored last chunk first, the hits released tail first
            idx.release_reads(reversed(keys[:prefix]), owner, None, ReleaseReason.RETRIEVE, 0.0)
            order = reversed(range(prefix, len(keys)))
        for i in order:
            if idx.reserve_write(keys[i], "store", 1, 0.0) is not None:
                idx.finish_write(keys[i], "store", 0.0)
    return hits / total if total else 0.0


def _slru(trace: Trace, capacity: int, protected_share: float = 0.8) -> float:
    """Segmented LRU over blocks: new blocks enter probation; a block hit again moves to the
    protected segment (``protected_share`` of the room), whose overflow goes back to probation;
    eviction takes probation's least recent. A request touches its blocks last first."""
    probation: OrderedDict[int, None] = OrderedDict()  # least recent first
    protected: OrderedDict[int, None] = OrderedDict()
    room = max(0, int(capacity * protected_share))
    hits = total = 0
    for prompt in trace:
        prefix = 0
        while prefix < len(prompt) and (prompt[prefix] in protected or prompt[prefix] in probation):
            prefix += 1
        hits += prefix
        total += len(prompt)
        if capacity <= 0:
            continue
        for i in range(len(prompt) - 1, -1, -1):
            b = prompt[i]
            if b in protected:
                protected.move_to_end(b)
                continue
            if b in probation and i < prefix:  # read again: protect it
                del probation[b]
                protected[b] = None
                while len(protected) > room:
                    demoted, _ = protected.popitem(last=False)
                    probation[demoted] = None
                continue
            if b in probation:
                probation.move_to_end(b)
                continue
            while probation and len(probation) + len(protected) >= capacity:
                probation.popitem(last=False)
            if len(probation) + len(protected) < capacity:
                probation[b] = None
    return hits / total if total else 0.0


def _infinite(trace: Trace) -> float:
    seen: set[int] = set()
    hits = total = 0
    for prompt in trace:
        prefix = 0
        while prefix < len(prompt) and prompt[prefix] in seen:
            prefix += 1
        hits += prefix
        total += len(prompt)
        seen.update(prompt)
    return hits / total if total else 0.0


def _belady(trace: Trace, capacity: int) -> float:
    """Offline: on a miss, store the block unless every cached block is used again sooner; evict
    the one used again farthest in the future."""
    never = len(trace)
    next_use: list[list[int]] = [[] for _ in trace]  # per request, each block's next request
    last: dict[int, int] = {}
    for n in range(len(trace) - 1, -1, -1):
        next_use[n] = [last.get(b, never) for b in trace[n]]
        for b in trace[n]:
            last[b] = n
    cached: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hits = total = 0
    for n, prompt in enumerate(trace):
        prefix = 0
        while prefix < len(prompt) and prompt[prefix] in cached:
            prefix += 1
        hits += prefix
        total += len(prompt)
        for b, nu in zip(prompt, next_use[n]):
            if b in cached:
                cached[b] = nu
                heapq.heappush(heap, (-nu, b))
                continue
            if capacity <= 0 or nu == never:
                continue
            while len(cached) >= capacity:
                far, victim = heapq.heappop(heap)
                if cached.get(victim) != -far:
                    continue  # stale
                if -far <= nu:  # every cached block is needed sooner: do not store this one
                    heapq.heappush(heap, (far, victim))
                    break
                del cached[victim]
            if len(cached) < capacity:
                cached[b] = nu
                heapq.heappush(heap, (-nu, b))
    return hits / total if total else 0.0


POLICIES = ("lru", "lru-tail", "lru+admit2", "slru-tail", "belady", "infinite")


def table(names: Sequence[str], requests: int, fractions: Sequence[float], seed: int = 0,
          files: Sequence[str | Path] = ()) -> list[str]:
    """Markdown rows: per trace and capacity (a fraction of the trace's distinct blocks), the hit
    rate of each policy. ``names``: synthetic shapes (``requests`` each, ``seed``); ``files``:
    Mooncake-format trace files (their first ``requests``)."""
    lines = [f"| trace ({requests:,} requests; synthetic: seed {seed}) | capacity blocks | of distinct | "
             + " | ".join(POLICIES) + " |", "|---|---:|---:|" + "---:|" * len(POLICIES)]
    traces: list[tuple[str, Trace]] = []
    for name in names:
        shape = TRACES[name]
        trace = synthesize(shape, requests, seed)
        traces.append((f"{name}, synthetic ({shape.block_tokens}-token blocks; top 10% of blocks take "
                       f"{reuse_concentration(trace):.0%} of reuses)", trace))
    for path in files:
        trace = load_trace(path, requests)
        stem = Path(path).name.split(".")[0]
        traces.append((f"{stem}, real (top 10% of blocks take {reuse_concentration(trace):.0%} of reuses)", trace))
    for label, trace in traces:
        distinct = len({b for p in trace for b in p})
        for f in fractions:
            cap = max(1, int(distinct * f))
            rates = [replay(trace, cap, p) for p in POLICIES]
            lines.append(f"| {label} | {cap:,} | {f:.0%} | " + " | ".join(f"{r:.1%}" for r in rates) + " |")
    return lines
