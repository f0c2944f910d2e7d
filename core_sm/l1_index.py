"""The L1 object index: which objects live in which slots, who leases them, what to evict.

Per ``ObjectKey`` the lifecycle is::

    ABSENT --reserve_write--> WRITING --finish_write--> READY <--lease_read/release_read--> READ_LEASED
    WRITING --abort_write / write lease expired--> ABSENT
    READY --evict (LRU, unleased only) / clear--> ABSENT
    READ_LEASED --clear(force), unless a protected owner holds it--> ABSENT

A clear never drops a WRITING object: its slot is being written right now, and freeing it
could hand the slot to another writer mid-copy. The writer finishes or aborts it.

Leases have owners (a request id, or a tuple such as ``("transfer", 7)`` for internal holders),
so a release is exact: it never touches another owner's count. A read lease is a count plus an
expiry (default TTL 300 s, refreshed by every ``lease_read``); once expired it counts as
released (``ReleaseReason.TTL``) whatever its count. A write reservation expires the same way.

Capacity is ``num_slots`` fixed-size slots of ``slot_bytes``. Eviction picks the least recently
used READY, unleased object; when the used slots pass ``high_watermark`` it evicts down to
``low_watermark``; a reservation that finds no free slot evicts one object first.

Every mutating method takes ``now`` and first expires what is due, so an expired lease is never
observed as held. Methods never raise for protocol-level misuse: they return False / 0 / None.
"""
from __future__ import annotations

import enum
import heapq
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

import attrs

from core_sm.chunks import ObjectKey

Owner = Hashable


class ObjectState(enum.Enum):
    ABSENT = "absent"
    WRITING = "writing"
    READY = "ready"
    READ_LEASED = "read_leased"


class ReleaseReason(enum.Enum):
    """Who released a read lease. Lookup leases end by exactly one of the first five (plus
    CLEAR for a forced clear); TRANSFER and L2_WRITE are the server's own short holds."""

    RETRIEVE = "retrieve"
    FREE = "free"
    END_SESSION = "end_session"
    REAP = "reap"
    TTL = "ttl"
    CLEAR = "clear"
    TRANSFER = "transfer"
    L2_WRITE = "l2_write"


# (state, operation) -> next state: the index's one transition table. Operations not listed
# for a state are refused (the method returns False/None and nothing changes).
TRANSITIONS: dict[tuple[ObjectState, str], frozenset[ObjectState]] = {
    (ObjectState.ABSENT, "reserve_write"): frozenset({ObjectState.WRITING, ObjectState.ABSENT}),
    (ObjectState.WRITING, "finish_write"): frozenset({ObjectState.READY}),
    (ObjectState.WRITING, "abort_write"): frozenset({ObjectState.ABSENT}),
    (ObjectState.WRITING, "expire"): frozenset({ObjectState.ABSENT, ObjectState.WRITING}),
    (ObjectState.READY, "lease_read"): frozenset({ObjectState.READ_LEASED}),
    (ObjectState.READY, "evict"): frozenset({ObjectState.ABSENT}),
    (ObjectState.READY, "clear"): frozenset({ObjectState.ABSENT}),
    (ObjectState.READY, "clear_force"): frozenset({ObjectState.ABSENT}),
    (ObjectState.READ_LEASED, "lease_read"): frozenset({ObjectState.READ_LEASED}),
    (ObjectState.READ_LEASED, "release_read"): frozenset(
        {ObjectState.READY, ObjectState.READ_LEASED}
    ),
    (ObjectState.READ_LEASED, "expire"): frozenset({ObjectState.READY, ObjectState.READ_LEASED}),
    (ObjectState.READ_LEASED, "clear_force"): frozenset({ObjectState.ABSENT, ObjectState.READ_LEASED}),
}
OPERATIONS = ("reserve_write", "finish_write", "abort_write", "lease_read", "release_read",
              "expire", "evict", "clear", "clear_force")


@attrs.define
class _Lease:
    count: int
    expiry: float


@attrs.define
class _Object:
    key: ObjectKey
    slot: int
    nbytes: int
    writer: Owner | None  # not None while WRITING
    write_expiry: float
    readers: dict[Owner, _Lease] = attrs.Factory(dict)


class L1Index:
    """Objects → slots, owned TTL leases, LRU with watermark, bytes accounting."""

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int,
        lease_ttl: float = 300.0,
        high_watermark: float = 1.0,
        low_watermark: float = 1.0,
    ) -> None:
        if num_slots < 0 or slot_bytes < 1:
            raise ValueError("num_slots must be >= 0 and slot_bytes >= 1")
        if not 0.0 < low_watermark <= high_watermark <= 1.0:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.lease_ttl = lease_ttl
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self._objects: dict[ObjectKey, _Object] = {}
        self._free_slots: list[int] = list(range(num_slots))  # a heap: lowest slot first
        self._evictable: OrderedDict[ObjectKey, None] = OrderedDict()  # READY, unleased; LRU first
        self._by_owner: dict[Owner, dict[ObjectKey, None]] = {}
        # (expiry, seq, key, owner or None for the write reservation); stale entries skipped
        self._expiries: list[tuple[float, int, ObjectKey, Owner | None]] = []
        self._seq = 0
        self._bytes = 0
        self._leases_taken = 0
        self._leases_released: dict[ReleaseReason, int] = {r: 0 for r in ReleaseReason}
        self._leases_held = 0
        self._evictions = 0
        self._write_expirations = 0

    # ----------------------------------------------------------------------------- queries

    def state(self, key: ObjectKey) -> ObjectState:
        obj = self._objects.get(key)
        if obj is None:
            return ObjectState.ABSENT
        if obj.writer is not None:
            return ObjectState.WRITING
        return ObjectState.READ_LEASED if obj.readers else ObjectState.READY

    def is_readable(self, key: ObjectKey) -> bool:
        obj = self._objects.get(key)
        return obj is not None and obj.writer is None

    def slot_of(self, key: ObjectKey) -> int | None:
        obj = self._objects.get(key)
        return None if obj is None else obj.slot

    def writer_of(self, key: ObjectKey) -> Owner | None:
        obj = self._objects.get(key)
        return None if obj is None else obj.writer

    def read_count(self, key: ObjectKey, owner: Owner) -> int:
        obj = self._objects.get(key)
        if obj is None:
            return 0
        lease = obj.readers.get(owner)
        return 0 if lease is None else lease.count

    def total_read_count(self, key: ObjectKey) -> int:
        obj = self._objects.get(key)
        return 0 if obj is None else sum(lease.count for lease in obj.readers.values())

    def owners_of(self, key: ObjectKey) -> tuple[Owner, ...]:
        obj = self._objects.get(key)
        return () if obj is None else tuple(obj.readers)

    def keys_leased_by(self, owner: Owner) -> tuple[ObjectKey, ...]:
        return tuple(self._by_owner.get(owner, ()))

    def leases_by_owner(self) -> dict[Owner, int]:
        """Owner → total read counts it holds (only owners holding something)."""
        out: dict[Owner, int] = {}
        for owner, keys in self._by_owner.items():
            out[owner] = sum(self._objects[k].readers[owner].count for k in keys)
        return out

    @property
    def used_slots(self) -> int:
        return len(self._objects)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def next_expiry(self) -> float | None:
        """Earliest lease or write-reservation expiry (may be a stale, already-released one)."""
        while self._expiries and not self._expiry_live(self._expiries[0]):
            heapq.heappop(self._expiries)
        return self._expiries[0][0] if self._expiries else None

    def stats(self) -> dict[str, int]:
        out = {
            "objects": len(self._objects),
            "bytes": self._bytes,
            "free_slots": len(self._free_slots),
            "leases_held": self._leases_held,
            "leases_taken": self._leases_taken,
            "lease_owners": len(self._by_owner),
            "evictions": self._evictions,
            "write_expirations": self._write_expirations,
            "writing": sum(1 for o in self._objects.values() if o.writer is not None),
        }
        for reason, n in self._leases_released.items():
            out[f"leases_released_{reason.value}"] = n
        return out

    def released_by(self, reason: ReleaseReason) -> int:
        return self._leases_released[reason]

    # ----------------------------------------------------------------------------- writes

    def reserve_write(self, key: ObjectKey, owner: Owner, nbytes: int, now: float) -> int | None:
        """ABSENT → WRITING owned by ``owner``; returns the slot, or None (present already,
        object too large, or no slot even after evicting)."""
        self.expire(now)
        if key in self._objects or nbytes > self.slot_bytes or nbytes < 0:
            return None
        if not self._free_slots and not self._evict_one():
            return None
        slot = heapq.heappop(self._free_slots)
        expiry = now + self.lease_ttl
        self._objects[key] = _Object(key, slot, nbytes, owner, expiry)
        self._bytes += nbytes
        self._push_expiry(expiry, key, None)
        self._evict_to_watermark()
        return slot

    def finish_write(self, key: ObjectKey, owner: Owner, now: float) -> bool:
        """WRITING (by ``owner``) → READY (most recently used). False if not ``owner``'s write."""
        self.expire(now)
        obj = self._objects.get(key)
        if obj is None or obj.writer is None or obj.writer != owner:
            return False
        obj.writer = None
        self._evictable[key] = None
        return True

    def abort_write(self, key: ObjectKey, owner: Owner, now: float) -> bool:
        """WRITING (by ``owner``) → ABSENT, freeing the slot."""
        self.expire(now)
        obj = self._objects.get(key)
        if obj is None or obj.writer is None or obj.writer != owner:
            return False
        self._drop(obj)
        return True

    # ----------------------------------------------------------------------------- reads

    def lease_read(self, key: ObjectKey, owner: Owner, count: int, now: float) -> bool:
        """Add ``count`` read counts for ``owner`` on a readable object; refresh its expiry."""
        self.expire(now)
        obj = self._objects.get(key)
        if obj is None or obj.writer is not None or count < 1:
            return False
        expiry = now + self.lease_ttl
        lease = obj.readers.get(owner)
        if lease is None:
            obj.readers[owner] = _Lease(count, expiry)
            self._by_owner.setdefault(owner, {})[key] = None
            self._evictable.pop(key, None)
        else:
            lease.count += count
            lease.expiry = expiry
        self._leases_taken += count
        self._leases_held += count
        self._push_expiry(expiry, key, owner)
        return True

    def release_read(
        self, key: ObjectKey, owner: Owner, count: int | None, reason: ReleaseReason, now: float
    ) -> int:
        """Release up to ``count`` (None: all) of ``owner``'s counts on ``key``; returns how many."""
        self.expire(now)
        return self._release(key, owner, count, reason)

    def release_owner(self, owner: Owner, reason: ReleaseReason, now: float) -> int:
        """Release every count ``owner`` holds, on every object."""
        self.expire(now)
        released = 0
        for key in tuple(self._by_owner.get(owner, ())):
            released += self._release(key, owner, None, reason)
        return released

    def touch(self, key: ObjectKey) -> None:
        """Mark a READY object most recently used."""
        if key in self._evictable:
            self._evictable.move_to_end(key)

    # ----------------------------------------------------------------------------- time, capacity

    def expire(self, now: float) -> None:
        """Release every lease and drop every write reservation whose expiry is ``<= now``."""
        heap = self._expiries
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if not self._expiry_live(entry):
                continue
            _expiry, _seq, key, owner = entry
            obj = self._objects[key]
            if owner is None:
                self._write_expirations += 1
                self._drop(obj)
            else:
                self._release(key, owner, None, ReleaseReason.TTL)

    def clear(self, force: bool, protected: Callable[[Owner], bool] | None = None) -> int:
        """Drop READY unleased objects; with ``force`` also leased ones (their leases released as
        CLEAR), except objects a ``protected`` owner holds (an in-flight copy reads them).
        WRITING objects are never dropped. Returns the number dropped."""
        dropped = 0
        for obj in tuple(self._objects.values()):
            if obj.writer is not None:
                continue
            if obj.readers:
                if not force or (protected is not None and any(protected(o) for o in obj.readers)):
                    continue
                for owner in tuple(obj.readers):
                    self._release(obj.key, owner, None, ReleaseReason.CLEAR)
            self._drop(obj)
            dropped += 1
        return dropped

    def evict_to_watermark(self) -> int:
        return self._evict_to_watermark()

    # ----------------------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (cheap enough per event)."""
        assert self._bytes == sum(o.nbytes for o in self._objects.values()), "bytes accounting"
        slots = {o.slot for o in self._objects.values()}
        assert len(slots) == len(self._objects), "two objects share a slot"
        assert not slots & set(self._free_slots), "a used slot is on the free list"
        assert len(slots) + len(self._free_slots) == self.num_slots, "slots lost"
        held = 0
        for obj in self._objects.values():
            for owner, lease in obj.readers.items():
                assert lease.count > 0, "non-positive lease count"
                assert obj.key in self._by_owner[owner], "owner map misses a lease"
                held += lease.count
            ready_unleased = obj.writer is None and not obj.readers
            assert ready_unleased == (obj.key in self._evictable), "LRU set out of sync"
            assert not (obj.writer is not None and obj.readers), "read lease on a writing object"
        for owner, keys in self._by_owner.items():
            assert keys, "empty owner entry"
            for k in keys:
                assert owner in self._objects[k].readers, "owner map has a stale lease"
        assert held == self._leases_held, "held lease counter"
        released = sum(self._leases_released.values())
        assert self._leases_taken == held + released, "a lease was neither held nor released once"

    # ----------------------------------------------------------------------------- internals

    def _push_expiry(self, expiry: float, key: ObjectKey, owner: Owner | None) -> None:
        self._seq += 1
        heapq.heappush(self._expiries, (expiry, self._seq, key, owner))

    def _expiry_live(self, entry: tuple[float, int, ObjectKey, Owner | None]) -> bool:
        expiry, _seq, key, owner = entry
        obj = self._objects.get(key)
        if obj is None:
            return False
        if owner is None:
            return obj.writer is not None and obj.write_expiry == expiry
        lease = obj.readers.get(owner)
        return lease is not None and lease.expiry == expiry

    def _release(self, key: ObjectKey, owner: Owner, count: int | None, reason: ReleaseReason) -> int:
        obj = self._objects.get(key)
        if obj is None:
            return 0
        lease = obj.readers.get(owner)
        if lease is None:
            return 0
        n = lease.count if count is None else max(0, min(count, lease.count))
        lease.count -= n
        self._leases_held -= n
        self._leases_released[reason] += n
        if lease.count == 0:
            del obj.readers[owner]
            keys = self._by_owner[owner]
            del keys[key]
            if not keys:
                del self._by_owner[owner]
            if not obj.readers and obj.writer is None:
                self._evictable[key] = None  # released objects are the most recently used
        return n

    def _drop(self, obj: _Object) -> None:
        for owner in tuple(obj.readers):
            self._release(obj.key, owner, None, ReleaseReason.CLEAR)
        del self._objects[obj.key]
        self._evictable.pop(obj.key, None)
        self._bytes -= obj.nbytes
        heapq.heappush(self._free_slots, obj.slot)

    def _evict_one(self) -> bool:
        if not self._evictable:
            return False
        key, _ = self._evictable.popitem(last=False)
        self._drop(self._objects[key])
        self._evictions += 1
        return True

    def _evict_to_watermark(self) -> int:
        if self.num_slots == 0 or self.used_slots <= self.high_watermark * self.num_slots:
            return 0
        evicted = 0
        while self.used_slots > self.low_watermark * self.num_slots and self._evict_one():
            evicted += 1
        return evicted

    def objects(self) -> Iterable[ObjectKey]:
        return tuple(self._objects)
