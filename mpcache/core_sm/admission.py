"""Store admission: store a chunk only once its prefix has been looked up ``threshold`` times.

vLLM's ``store_threshold`` and Dynamo KVBM's ``presence_lfu`` do the same: a prompt seen once is
not worth the L1 slot it would take from a prompt that is reused. ``StoreAdmission`` counts, per
chunk hash (a chunk's hash names its whole prefix), how many lookups asked for it, in a bounded
counting sketch, and admits a store of the chunk when the count has reached ``threshold``.

* **Count-min sketch**: ``depth`` rows of ``width`` one-byte counters; a chunk's counter in row
  ``r`` is picked by 4 bytes of its hash (already uniform: no second hash needed). Its count is
  the minimum over the rows -- never below the true count since the last aging, possibly above
  it by collisions (then a chunk is admitted early: the safe direction, a store too many).
  Memory: ``width * depth`` bytes, whatever the traffic (default 4 × 65,536 = 256 KiB).
* **Aging** (TinyLFU's reset): after ``window`` recorded chunks (default 8 × width), every
  counter is halved, so old popularity fades and counters never saturate for long (capped at 255).
* ``threshold`` 0 or 1 admits everything (off: the default). A lookup counts each chunk once,
  the whole requested prefix; a duplicate lookup of the same request id is not counted again
  (the server calls ``record`` only for a new job).

Pure and deterministic: the same lookups give the same decisions.
"""
from __future__ import annotations

from collections.abc import Iterable

_MAX_COUNT = 255
_HALVE = bytes(v >> 1 for v in range(256))  # aging in C (bytes.translate), microseconds a row


class StoreAdmission:
    """The bounded lookup counter that gates stores (see the module doc)."""

    def __init__(self, threshold: int, width: int = 1 << 16, depth: int = 4, window: int | None = None) -> None:
        if threshold < 0 or threshold > _MAX_COUNT:
            raise ValueError(f"store threshold must be in [0, {_MAX_COUNT}], not {threshold}")
        if width < 1 or width & (width - 1):
            raise ValueError(f"width must be a power of two, not {width}")
        if not 1 <= depth <= 4:
            raise ValueError(f"depth must be in [1, 4], not {depth}")
        self.threshold = threshold
        self.width = width
        self.depth = depth
        self.window = window if window is not None else 8 * width
        self._mask = width - 1
        self._rows = [bytearray(width) for _ in range(depth)]
        self._recorded = 0
        self.stats = {"recorded": 0, "admitted": 0, "refused": 0, "agings": 0}

    @property
    def enabled(self) -> bool:
        return self.threshold > 1

    def _slots(self, chunk_hash: bytes) -> list[int]:
        # Chunk hashes are >= 16 bytes of hash output: 4 disjoint 4-byte slices, one per row.
        return [int.from_bytes(chunk_hash[4 * r : 4 * r + 4], "little") & self._mask for r in range(self.depth)]

    def count(self, chunk_hash: bytes) -> int:
        """The estimated lookups of ``chunk_hash`` since aging (never below the true count)."""
        return min(row[slot] for row, slot in zip(self._rows, self._slots(chunk_hash)))

    def record(self, chunk_hashes: Iterable[bytes]) -> None:
        """One lookup asked for these chunks."""
        if not self.enabled:
            return
        for h in chunk_hashes:
            # Conservative update: raise only the counters at the minimum (less overestimate).
            slots = self._slots(h)
            low = min(row[slot] for row, slot in zip(self._rows, slots))
            if low < _MAX_COUNT:
                for row, slot in zip(self._rows, slots):
                    if row[slot] == low:
                        row[slot] = low + 1
            self._recorded += 1
            self.stats["recorded"] += 1
            if self._recorded >= self.window:
                self._age()

    def admits(self, chunk_hash: bytes) -> bool:
        """Whether a store of ``chunk_hash`` may take an L1 slot now."""
        if not self.enabled:
            return True
        ok = self.count(chunk_hash) >= self.threshold
        self.stats["admitted" if ok else "refused"] += 1
        return ok

    def _age(self) -> None:
        self._recorded = 0
        self.stats["agings"] += 1
        for row in self._rows:
            row[:] = row.translate(_HALVE)
