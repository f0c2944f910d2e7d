"""The L1 index against another revision of itself: random operation sequences run on both, every
return value and the whole state after every operation compared byte for byte.

For a change to ``mpcache/core_sm/l1_index.py`` that must not change behaviour (a refactor, a
move onto a shared mechanism): ``--rev`` names the commit whose index is the reference (loaded
from git, beside the working tree's). A state is everything the index holds -- objects with
their slots, leases, write batches and recency, the owner maps, the releases in slices, the
free-slot heap as a list, the quota's LRU sets, the counters, the dropped keys -- and the expiry
heap entry by entry, in heap order: ``(deadline, seq, keys, owner)``, a write batch's owner None.
So equal traces mean the same expiry order, the same batch ids and the same heap size (the same
rebuilds). A share of the sequences run with ``RELEASE_SLICE`` and the heap's rebuild floor cut
small (both modules alike) so that slices and rebuilds happen within a few dozen operations.

    PYTHONPATH=$PWD python tools/l1_index_differential.py --rev <commit> [--sequences 3000]

Exit status 0 when every trace is equal; else the first operation whose result or state differs.
"""
from __future__ import annotations

import argparse
import hashlib
import random
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpcache.core_sm import l1_index
from mpcache.core_sm.chunks import ObjectKey

ROOT = Path(__file__).resolve().parents[1]
HASHES = [bytes([i]) * 4 for i in range(6)]
OWNERS = ["a", "b", "c", "d"]
TENANTS: list[Any] = [None, 1, 2]


def load_rev(rev: str) -> types.ModuleType:
    """``mpcache/core_sm/l1_index.py`` as it is at ``rev``, as a module of its own (the modules
    it imports are the working tree's)."""
    src = subprocess.check_output(["git", "show", f"{rev}:mpcache/core_sm/l1_index.py"], cwd=ROOT)
    mod = types.ModuleType("l1_index_at_rev")
    mod.__file__ = f"{rev}:mpcache/core_sm/l1_index.py"
    sys.modules[mod.__name__] = mod
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    return mod


def expiry_entries(idx: Any) -> list[tuple[Any, ...]]:
    """The expiry heap as ``(deadline, seq, keys, owner)`` entries, in heap order."""
    heap = idx._expiries
    if isinstance(heap, list):  # a heapq list of (expiry, seq, keys, owner)
        return [tuple(e) for e in heap]
    out = []
    for deadline, seq, timer in heap._heap:
        assert timer.expiry == deadline, "a timer's expiry is not its deadline"
        if hasattr(timer, "batch"):
            assert timer.batch == seq, "a write batch's id is not its entry's seq"
        out.append((deadline, seq, timer.keys, getattr(timer, "owner", None)))
    return out


def state(idx: Any) -> str:
    objects = [(k, o.slot, o.nbytes, o.writer, o.write_expiry, o.tenant, o.used, tuple(o.readers.items()),
                o.batch, k in o.lru) for k, o in idx._objects.items()]
    releasing = [(owner, asked, [(p.reason.value, p.keys, None if p.chunks is None else sorted(p.chunks), p.ranks,
                                  p.expiry, p.pos, p.done) for p in parts])
                 for owner, (parts, asked) in idx._releasing.items()]
    quota = idx.quota
    lrus = [(t, tuple(lru)) for t, lru in quota.lru_sets.items()]
    parts = (objects, expiry_entries(idx), list(idx._free_slots), sorted(idx._writing.items()),
             [(o, tuple(keys)) for o, keys in idx._by_owner.items()], releasing,
             [(r, tuple(m)) for r, m in idx._readable.items()], sorted(idx._quarantined), sorted(idx._pinned.items()),
             lrus, quota.orphan_runs, quota.evictions, quota.evictions_for_others, sorted(idx.stats().items()),
             idx._use_seq, idx.dropped, idx.num_slots, idx.slot_bytes, idx.releasing, idx.next_release())
    return repr(parts)


def _canon(value: Any) -> Any:
    """A return value with the modules' own enums written by value."""
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    return getattr(value, "value", value)


class OpSequence:
    """One random operation sequence, drawn from ``seed``: the same calls for any index module."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        rng = random.Random(seed)
        self.small = rng.random() < 0.6
        self.num_slots = rng.randint(2, 12)
        self.ttl = rng.choice([1.0, 5.0, 10.0, 20.0])
        self.watermarks = rng.choice([(1.0, 1.0), (0.8, 0.5)])
        self.share = rng.choice([None, 2, 4])
        self.length = rng.randint(20, 240)

    def run(self, mod: Any, check: bool = True) -> list[str]:
        """The trace: each operation, its result and the state after it."""
        saved = mod.RELEASE_SLICE, mod._MIN_COMPACT
        if self.small:
            mod.RELEASE_SLICE, mod._MIN_COMPACT = 3, 4
        try:
            return self._run(mod, check)
        finally:
            mod.RELEASE_SLICE, mod._MIN_COMPACT = saved

    def _run(self, mod: Any, check: bool) -> list[str]:
        rng = random.Random(self.seed * 7919 + 1)
        idx = mod.L1Index(self.num_slots, 8, lease_ttl=self.ttl, high_watermark=self.watermarks[0],
                          low_watermark=self.watermarks[1])
        idx.quota.tenant_share = self.share
        idx.dropped = []
        reasons = list(mod.ReleaseReason)
        now = 0.0
        trace = []

        def key() -> ObjectKey:
            return ObjectKey(rng.choice(HASHES), rng.randint(0, 1))

        def keys() -> list[ObjectKey]:
            return [key() for _ in range(rng.randint(0, 6))]

        def chain() -> list[bytes]:
            start = rng.randint(0, 3)
            return HASHES[start:start + rng.randint(0, 5)]

        def ranks() -> list[int]:
            return rng.choice([[0], [0, 1], [1], [1, 0], []])

        def count() -> int | None:
            return rng.choice([None, 0, 1, 2, 5])

        ops: list[tuple[int, Callable[[], Any]]] = [
            (6, lambda: idx.reserve_write(key(), rng.choice(OWNERS), rng.choice([0, 8, 9]), now, rng.choice(TENANTS))),
            (6, lambda: idx.reserve_writes(keys(), rng.choice(OWNERS), rng.choice([0, 8]), now, rng.choice(TENANTS),
                                           rng.choice([None, 0, 2, 4]), rng.choice([None, 0, 1, 3]))),
            (4, lambda: idx.finish_write(key(), rng.choice(OWNERS), now)),
            (8, lambda: idx.finish_writes(list(idx._objects) if rng.random() < 0.7 else keys(),
                                          rng.choice(OWNERS), now)),
            (2, lambda: idx.abort_write(key(), rng.choice(OWNERS), now)),
            (2, lambda: idx.abort_writes(keys(), rng.choice(OWNERS), now)),
            (4, lambda: idx.lease_read(key(), rng.choice(OWNERS), rng.randint(0, 3), now)),
            (5, lambda: idx.lease_reads(keys(), rng.choice(OWNERS), rng.randint(0, 3), now,
                                        top_up=rng.random() < 0.5, refresh=rng.random() < 0.5)),
            (2, lambda: idx.lease_slots(keys(), rng.choice(OWNERS), now)),
            (9, lambda: idx.lease_prefix(chain(), ranks(), rng.choice(OWNERS), rng.randint(0, 3), now)),
            (3, lambda: idx.release_read(key(), rng.choice(OWNERS), count(), rng.choice(reasons), now)),
            (2, lambda: idx.release_reads(keys(), rng.choice(OWNERS), count(), rng.choice(reasons), now)),
            (3, lambda: idx.release_chunks(rng.choice(OWNERS), chain(), rng.randint(0, 2), rng.choice(reasons), now)),
            (3, lambda: idx.release_chunks_in_slices(rng.choice(OWNERS), chain(), rng.randint(0, 2),
                                                     rng.choice(reasons), now)),
            (2, lambda: idx.release_owner_in_slices(rng.choice(OWNERS), rng.choice(reasons), now)),
            (2, lambda: idx.release_owner(rng.choice(OWNERS), rng.choice(reasons), now)),
            (3, lambda: idx.release_slice()),
            (3, lambda: idx.expire(now)),
            (2, lambda: idx.next_expiry()),
            (1, lambda: idx.clear(rng.random() < 0.5, rng.choice([None, lambda o: o == "a"]))),
            (2, lambda: idx.touch(key())),
            (2, lambda: idx.pin_slots([rng.randrange(max(1, idx.num_slots)) for _ in range(rng.randint(1, 3))])),
            (2, lambda: idx.unpin_slots([rng.randrange(max(1, idx.num_slots)) for _ in range(rng.randint(1, 3))])),
            (1, lambda: idx.pin_slot(rng.randrange(max(1, idx.num_slots)))),
            (1, lambda: idx.unpin_slot(rng.randrange(max(1, idx.num_slots)))),
            (1, lambda: idx.can_recarve(rng.randint(2, 8), 8, drop_ready=rng.random() < 0.5)),
            (1, lambda: idx.recarve(rng.randint(2, 8), 8)),
            (1, lambda: idx.quota.forget_tenant(rng.choice([1, 2]))),
        ]
        weights = [w for w, _op in ops]
        for step in range(self.length):
            r = rng.random()  # the clock: often still (equal expiries), sometimes past every lease
            if r < 0.35:
                pass
            elif r < 0.95:
                now += rng.choice([0.25, 0.5, 1.0, 1.5])
            else:
                now += self.ttl * rng.choice([1.0, 2.0])
            i = rng.choices(range(len(ops)), weights)[0]
            result = ops[i][1]()
            if check:
                idx.check_invariants()
            trace.append(f"{step} op{i} t={now} -> {_canon(result)!r}\n{state(idx)}")
        return trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="the commit whose l1_index.py is the reference")
    parser.add_argument("--sequences", type=int, default=3000)
    parser.add_argument("--first-seed", type=int, default=0)
    args = parser.parse_args(argv)
    ref = load_rev(args.rev)
    total = hashlib.sha256()
    ops = small = 0
    for seed in range(args.first_seed, args.first_seed + args.sequences):
        seq = OpSequence(seed)
        want, got = seq.run(ref), seq.run(l1_index)
        for a, b in zip(want, got):
            if a != b:
                print(f"seed {seed}: first difference\n  {args.rev}: {a}\n  working tree: {b}")
                return 1
        assert len(want) == len(got)
        ops += len(got)
        small += seq.small
        for line in got:
            total.update(line.encode())
    print(f"{args.sequences} sequences ({small} with small slices and rebuild floor), {ops} operations: "
          f"every result and state equal; trace sha256 {total.hexdigest()[:16]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
