"""What a server has told routers it holds: the source of its KV events.

``HeldChunks`` turns the server's own facts into ``ChunksStored`` / ``ChunksRemoved`` /
``AllChunksCleared`` effects (``mpcache.core_sm.effects``), which a runtime publishes (runtime_zmq's
``kv_events``: vLLM's KV-events wire format). The server calls it at four points:

* a STORE's objects became READY (``stored_l1``): each chunk whose objects are now readable for
  every KV rank, and not reported yet, is reported stored in L1;
* objects left L1 (``dropped_l1``: eviction, clear, expiry -- the L1 index lists every drop):
  each reported chunk that lost an object is reported removed from L1;
* an L2 write finished ok (``written_l2``): a chunk whose every rank is now written is reported
  stored in L2 once (L2 removals are invisible -- a tier may drop objects on its own -- so L2
  reports are hints, deduplicated in a bounded set);
* a clear (``cleared``): one ``AllChunksCleared``; what survived the clear is not reported again.

Bounded: the L1 set holds only chunks resident in L1 (at most its slots); the L2 set and the
per-chunk rank sets of partly written L2 chunks are capped, oldest forgotten first (a
forgotten L2 chunk may be reported again: a harmless duplicate).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import AllChunksCleared, ChunksRemoved, ChunksStored, Effect, Medium, StoredChunk
from mpcache.core_sm.messages import CacheKey

L2_REPORTED_CAP = 1 << 20
L2_PARTIAL_CAP = 1 << 16


class HeldChunks:
    """The chunks reported held per medium (see the module doc). Pure bookkeeping: every
    method appends its effects to ``out``."""

    def __init__(self, l2_reported_cap: int = L2_REPORTED_CAP, l2_partial_cap: int = L2_PARTIAL_CAP) -> None:
        self._l1: dict[bytes, None] = {}
        self._l2: OrderedDict[bytes, None] = OrderedDict()
        self._l2_ranks: OrderedDict[bytes, set[int]] = OrderedDict()
        self._l2_reported_cap = l2_reported_cap
        self._l2_partial_cap = l2_partial_cap

    @staticmethod
    def describe(key: CacheKey, hashes: Sequence[bytes], chunk_size: int, first: int, count: int) -> tuple[StoredChunk, ...]:
        """``StoredChunk``s for chunks ``[first, first + count)`` of ``key`` (``hashes``: its
        chain from chunk 0 on, at least ``first + count`` long)."""
        extras = key.extras.chunk_extras
        out = []
        for i in range(first, first + count):
            out.append(StoredChunk(
                hashes[i],
                hashes[i - 1] if i > 0 else None,
                key.token_ids[i * chunk_size : (i + 1) * chunk_size],
                key.cache_salt,
                key.extras.identity,
                extras[i] if i < len(extras) else b"",
            ))
        return tuple(out)

    def reported(self, medium: Medium) -> int:
        return len(self._l1 if medium is Medium.L1 else self._l2)

    def stored_l1(self, chunks: Iterable[StoredChunk], world_size: int,
                  readable: Callable[[ObjectKey], bool], out: list[Effect]) -> None:
        new = []
        for chunk in chunks:
            h = chunk.chunk_hash
            if h in self._l1:
                continue
            if all(readable(ObjectKey(h, rank)) for rank in range(world_size)):
                self._l1[h] = None
                new.append(chunk)
        if new:
            out.append(ChunksStored(Medium.L1, tuple(new)))

    def dropped_l1(self, keys: Iterable[ObjectKey], out: list[Effect]) -> None:
        gone: dict[bytes, None] = {}
        for key in keys:
            if key.chunk_hash in self._l1:
                del self._l1[key.chunk_hash]
                gone[key.chunk_hash] = None
        if gone:
            out.append(ChunksRemoved(Medium.L1, tuple(gone)))

    def written_l2(self, objects: Iterable[ObjectKey], chunks: dict[bytes, StoredChunk], world_size: int,
                   out: list[Effect]) -> None:
        new = []
        for key in objects:
            h = key.chunk_hash
            chunk = chunks.get(h)
            if chunk is None or h in self._l2:
                continue
            ranks = self._l2_ranks.get(h)
            if ranks is None:
                if len(self._l2_ranks) >= self._l2_partial_cap:
                    self._l2_ranks.popitem(last=False)
                ranks = self._l2_ranks[h] = set()
            ranks.add(key.kv_rank)
            if len(ranks) < world_size:
                continue
            del self._l2_ranks[h]
            if len(self._l2) >= self._l2_reported_cap:
                self._l2.popitem(last=False)
            self._l2[h] = None
            new.append(chunk)
        if new:
            out.append(ChunksStored(Medium.L2, tuple(new)))

    def cleared(self, out: list[Effect]) -> None:
        self._l1.clear()
        self._l2.clear()
        self._l2_ranks.clear()
        out.append(AllChunksCleared())
