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

**L1 is shared by quota** (``index.quota``, a ``TenantQuota`` of ``mpcache.core_sm.l1_quota``):
every object is charged to one tenant, and the victim of an eviction is chosen by who asked. The
index tells the quota what it charges and drops, asks it for each victim and drops it itself
(that module's doc: the interface between them).

Every mutating method takes ``now`` and first expires what is due, so an expired lease is never
observed as held. Methods never raise for protocol-level misuse: they return False / 0 / None.
The expiries are core_sm's one timer mechanism, a ``TimerHeap`` (``mpcache.core_sm.timers``) of
``LeasesExpire`` and ``WritesExpire`` timers; the expiry step takes every due entry, stale ones
too (``pop_due_entry``), and judges it itself (``expire``).

Batch forms for a request's whole prefix (``readable_prefix``, ``lease_prefix``, ``lease_reads``,
``release_reads``, ``release_owner``) and a transfer's chunks (``reserve_writes``,
``finish_writes``, ``abort_writes``, ``lease_slots``) do the same per object as the single forms,
with one expiry step and one expiry-heap entry per call; a lease is a ``(count, expiry)`` pair
per owner, not an object. ``lease_prefix`` is a lookup's whole L1 part in one walk: the readable objects are
found by chunk hash in one map per KV rank (no key object built per chunk), and a new owner's
leases are one ``(count, expiry)`` tuple shared by the batch; the owner map (key -> object)
and the expiry entry hold the index's own keys, so a lookup leaves no new object per chunk
behind, and ``release_owner`` reaches the objects without a second index lookup.

``release_owner_in_slices`` is ``release_owner`` for a loop that must not stop long: an owner
holding more than ``RELEASE_SLICE`` objects keeps them held (counted, unevictable) until
``release_slice`` calls release them, at most ``RELEASE_SLICE`` a call, oldest owner first
(``releasing`` says whether any is left). The same slices carry ``release_chunks_in_slices``
(a free of a chunk range: each call walks at most ``RELEASE_SLICE`` of the objects the owner
held when it asked) and TTL expiry: one ``expire`` releases at most ``RELEASE_SLICE`` leases
at once, and queues the batches past that (each slice walks that many of a batch's keys,
releasing those still ending at that expiry, so a lease refreshed meanwhile stays); an owner's
parts run in the order asked. Anything that leases for such an owner again, or releases it at
once, first finishes its pending parts, so a request id used again after its end never has its
new leases released by the old end, and every count is released once, under its own reason.
"""
from __future__ import annotations

import enum
import itertools
import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import attrs

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.l1_object import Account, L1Object, Lease, Owner, Tenant
from mpcache.core_sm.l1_quota import TenantQuota
from mpcache.core_sm.timers import Timer, TimerHeap


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


@attrs.frozen
class LeasesExpire(Timer):
    """``owner``'s read leases on ``keys``, taken or renewed by one call to end at ``expiry``:
    at ``expiry`` those still ending then are released (TTL). Stale once none of them does."""

    owner: Owner
    keys: tuple[ObjectKey, ...]
    expiry: float


@attrs.frozen
class WritesExpire(Timer):
    """The write reservations of reservation batch ``batch`` (its keys ``keys``), made to end
    at ``expiry``: at it, those still WRITING are dropped. Stale once none of the batch is
    WRITING. ``batch`` is the ``seq`` its expiry-heap entry gets (``L1Object.batch``)."""

    batch: int
    keys: tuple[ObjectKey, ...]
    expiry: float


# The expiry heap (a ``TimerHeap``) is rebuilt without stale entries when it holds more than
# twice the live entries of the last rebuild, and more than this.
_MIN_COMPACT = 1024
RELEASE_SLICE = 2048  # objects ``release_slice`` releases at most per call


@attrs.define
class _Release:
    """One part of an owner's release in slices: everything the owner holds (``keys`` None), or
    its leases on ``keys`` -- only those of ``chunks`` x ranks ``[0, ranks)`` when ``chunks`` is
    set (a free), only those still ending at ``expiry`` when it is set (a TTL expiry).
    ``pos``: how far the slices have walked ``keys``."""

    reason: ReleaseReason
    keys: tuple[ObjectKey, ...] | None = None
    chunks: frozenset[bytes] | None = None
    ranks: int = 0
    expiry: float | None = None
    pos: int = 0
    done: bool = False


class L1Index:
    """Objects → slots, owned TTL leases, LRU with watermark, bytes accounting."""

    # What the server's ``state_values`` carries of this part, and the wiring it leaves out
    # (core_sm/values.py; tests/core_sm/test_state_values.py holds every attribute to one).
    STATE_FIELDS: tuple[str, ...] = (
        "num_slots", "slot_bytes",  # recarve changes them
        "_objects", "_readable", "_free_slots", "_use_seq", "_by_owner", "_bytes", "_leases_taken", "_leases_released",
        "_leases_held", "_write_expirations", "_pinned", "_writing", "_quarantined", "_releasing", "dropped")
    WIRING_FIELDS: tuple[str, ...] = ("lease_ttl", "high_watermark", "low_watermark", "quota", "_expiries")

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
        self._objects: dict[ObjectKey, L1Object] = {}
        # The READY / READ_LEASED objects (not WRITING) per KV rank, by chunk hash: a lookup
        # finds its prefix with no key object built per chunk. A rank with none has no entry.
        self._readable: dict[int, dict[bytes, L1Object]] = {}
        self._free_slots: list[int] = list(range(num_slots))  # a heap: lowest slot first
        self.quota = TenantQuota()  # charges per tenant, LRU sets, eviction victims
        self._use_seq = 0
        self._by_owner: dict[Owner, dict[ObjectKey, L1Object]] = {}  # in lease order
        # one entry per call that leased or reserved (module doc); stale entries skipped, compacted
        self._expiries = TimerHeap(self._expiry_live, slack=0, floor=_MIN_COMPACT)
        self._bytes = 0
        self._leases_taken = 0
        self._leases_released: dict[ReleaseReason, int] = {r: 0 for r in ReleaseReason}
        self._leases_held = 0
        self._write_expirations = 0
        # Slots an in-flight effect (L2 read/write, copy, plan) still uses: never handed out
        # until it ends. A pinned slot whose object is dropped waits in _quarantined.
        self._pinned: dict[int, int] = {}
        # WRITING objects per reservation batch (the seq of its expiry entry): a batch's entry is
        # stale, and skipped at once, when it has none
        self._writing: dict[int, int] = {}
        self._quarantined: set[int] = set()
        # owners with a release in slices not done: owner -> (its parts, in order; when asked)
        self._releasing: dict[Owner, tuple[list[_Release], float]] = {}
        # When a list, every dropped object's key is appended (the server drains it into its
        # KV-event reports after each event); None: not tracked.
        self.dropped: list[ObjectKey] | None = None

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

    def tenant_of(self, key: ObjectKey) -> Tenant | None:
        """Whose charge ``key``'s object is (None: no tenant's, or no such object)."""
        obj = self._objects.get(key)
        return None if obj is None else obj.tenant

    def writer_of(self, key: ObjectKey) -> Owner | None:
        obj = self._objects.get(key)
        return None if obj is None else obj.writer

    def read_count(self, key: ObjectKey, owner: Owner) -> int:
        obj = self._objects.get(key)
        if obj is None:
            return 0
        lease = obj.readers.get(owner)
        return 0 if lease is None else lease[0]

    def lease_expiry(self, key: ObjectKey, owner: Owner) -> float | None:
        """When ``owner``'s read lease on ``key`` expires (None: it holds none)."""
        obj = self._objects.get(key)
        lease = None if obj is None else obj.readers.get(owner)
        return None if lease is None else lease[1]

    def total_read_count(self, key: ObjectKey) -> int:
        obj = self._objects.get(key)
        return 0 if obj is None else sum(lease[0] for lease in obj.readers.values())

    def owners_of(self, key: ObjectKey) -> tuple[Owner, ...]:
        obj = self._objects.get(key)
        return () if obj is None else tuple(obj.readers)

    def keys_leased_by(self, owner: Owner) -> tuple[ObjectKey, ...]:
        return tuple(self._by_owner.get(owner, ()))

    def holds(self, owner: Owner) -> bool:
        """Whether ``owner`` holds any read lease (O(1))."""
        return bool(self._by_owner.get(owner))

    def leases_by_owner(self) -> dict[Owner, int]:
        """Owner → total read counts it holds (only owners holding something)."""
        out: dict[Owner, int] = {}
        for owner, keys in self._by_owner.items():
            out[owner] = sum(self._objects[k].readers[owner][0] for k in keys)
        return out

    @property
    def used_slots(self) -> int:
        return len(self._objects)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def next_expiry(self) -> float | None:
        """Earliest lease or write-reservation expiry (may be a stale, already-released one)."""
        return self._expiries.next_deadline()

    def stats(self) -> dict[str, int]:
        out = {
            "objects": len(self._objects),
            "bytes": self._bytes,
            "free_slots": len(self._free_slots),
            "leases_held": self._leases_held,
            "leases_taken": self._leases_taken,
            "lease_owners": len(self._by_owner),
            "evictions": self.quota.evictions,
            "evictions_for_others": self.quota.evictions_for_others,
            "tenants": self.quota.tenants,
            "write_expirations": self._write_expirations,
            "writing": sum(1 for o in self._objects.values() if o.writer is not None),
            "quarantined_slots": len(self._quarantined),
            "pinned_slots": len(self._pinned),
        }
        for reason, n in self._leases_released.items():
            out[f"leases_released_{reason.value}"] = n
        return out

    def pinned_count(self) -> int:
        """Slots pinned by transfers in flight (``stats()["pinned_slots"]`` without the rest of
        the stats, one of which walks every object)."""
        return len(self._pinned)

    def released_by(self, reason: ReleaseReason) -> int:
        return self._leases_released[reason]

    # ----------------------------------------------------------------------------- writes

    def reserve_write(self, key: ObjectKey, owner: Owner, nbytes: int, now: float,
                      tenant: Tenant | None = None) -> int | None:
        """ABSENT → WRITING owned by ``owner``, the object charged to ``tenant``; returns the
        slot, or None (present already, object too large, or no slot even after evicting what
        the quota lets ``tenant`` evict)."""
        self.expire(now)
        if key in self._objects or nbytes > self.slot_bytes or nbytes < 0:
            return None
        while not self._free_slots:  # an evicted object's slot may go to quarantine instead
            if not self._evict_one(tenant):
                return None
        slot = heapq.heappop(self._free_slots)
        expiry = now + self.lease_ttl
        account = self.quota.charge(tenant)
        batch = self._expiries.seq + 1  # the seq its expiry entry gets
        self._objects[key] = L1Object(key, slot, nbytes, owner, expiry, account, account.lru, 0, {}, batch)
        self._writing[batch] = 1
        self._bytes += nbytes
        self._expiries.push(expiry, WritesExpire(batch, (key,), expiry))
        self._evict_to_watermark(tenant)
        return slot

    def reserve_writes(self, keys: Sequence[ObjectKey], owner: Owner, nbytes: int, now: float,
                       tenant: Tenant | None = None, limit: int | None = None,
                       max_evictions: int | None = None) -> list[int | None]:
        """``reserve_write`` for each of ``keys``, in order, with one expiry step and one expiry
        entry for them all; stops once ``limit`` keys are reserved, or before a key that needs
        an eviction past ``max_evictions``. Returns one entry per key tried (its slot, or
        None): shorter than ``keys`` when it stopped."""
        self.expire(now)
        if limit is None:
            limit = len(keys)
        if limit <= 0:
            return []
        if nbytes > self.slot_bytes or nbytes < 0:
            return [None] * len(keys)
        objects = self._objects
        free = self._free_slots
        quota = self.quota
        heappop = heapq.heappop
        expiry = now + self.lease_ttl
        # the watermark can only be passed below a full L1
        over = self.high_watermark * self.num_slots if self.num_slots and self.high_watermark < 1.0 else None
        slots: list[int | None] = []
        add_slot = slots.append
        reserved: list[ObjectKey] = []
        add_key = reserved.append
        batch = self._expiries.seq + 1  # the seq their expiry entry gets (evictions push no entry)
        account: Account | None = None  # the tenant's, once charged here (it lasts while charged)
        uncounted = 0  # reservations not yet charged (the charges are exact whenever the quota reads them)
        evictions = 0
        for key in keys:
            if key in objects:
                add_slot(None)
                continue
            if not free:
                if uncounted:
                    quota.charge(tenant, uncounted)
                    uncounted = 0
                if max_evictions is not None and evictions >= max_evictions:
                    break
                while not free and self._evict_one(tenant):
                    evictions += 1
                if not free:
                    add_slot(None)
                    continue
            slot = heappop(free)
            if account is None:
                account = quota.charge(tenant)
            else:
                uncounted += 1
            objects[key] = L1Object(key, slot, nbytes, owner, expiry, account, account.lru, 0, {}, batch)
            add_slot(slot)
            add_key(key)
            if over is not None and len(objects) > over:
                if uncounted:
                    quota.charge(tenant, uncounted)
                    uncounted = 0
                self._evict_to_watermark(tenant)
            if len(reserved) >= limit:
                break
        if uncounted:
            quota.charge(tenant, uncounted)
        self._bytes += nbytes * len(reserved)
        if reserved:
            self._writing[batch] = len(reserved)
            self._expiries.push(expiry, WritesExpire(batch, tuple(reserved), expiry))
            assert self._expiries.seq == batch
        return slots

    def finish_writes(self, keys: Iterable[ObjectKey], owner: Owner, now: float) -> list[ObjectKey]:
        """``finish_write`` for each of ``keys``, in order, with one expiry step; returns the
        keys it finished (those ``owner`` was writing)."""
        self.expire(now)
        objects = self._objects
        by_rank = self._readable
        seq = self._use_seq
        done: list[ObjectKey] = []
        for key in keys:
            obj = objects.get(key)
            if obj is None or obj.writer is None or obj.writer != owner:
                continue
            obj.writer = None
            self._written(obj.batch)
            readable = by_rank.get(key.kv_rank)
            if readable is None:
                readable = by_rank[key.kv_rank] = {}
            readable[key.chunk_hash] = obj
            # ``_mark_evictable`` inlined (a WRITING object is in no LRU set: it enters last)
            lru = obj.lru = obj.account.lru
            lru[key] = obj
            seq += 1
            obj.used = seq
            done.append(key)
        self._use_seq = seq
        return done

    def abort_writes(self, keys: Iterable[ObjectKey], owner: Owner, now: float) -> int:
        """``abort_write`` for each of ``keys``, with one expiry step; returns how many it dropped."""
        self.expire(now)
        objects = self._objects
        dropped = 0
        for key in keys:
            obj = objects.get(key)
            if obj is not None and obj.writer is not None and obj.writer == owner:
                self._drop(obj)
                dropped += 1
        return dropped

    def finish_write(self, key: ObjectKey, owner: Owner, now: float) -> bool:
        """WRITING (by ``owner``) → READY (most recently used). False if not ``owner``'s write."""
        self.expire(now)
        obj = self._objects.get(key)
        if obj is None or obj.writer is None or obj.writer != owner:
            return False
        obj.writer = None
        self._written(obj.batch)
        readable = self._readable.get(key.kv_rank)
        if readable is None:
            readable = self._readable[key.kv_rank] = {}
        readable[key.chunk_hash] = obj
        self._mark_evictable(obj)
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
        return self.lease_reads((key,), owner, count, now) == 1

    def lease_reads(
        self, keys: Sequence[ObjectKey], owner: Owner, count: int, now: float, *, top_up: bool = False,
        refresh: bool = False,
    ) -> int:
        """``lease_read`` for each of ``keys``, in order, with one expiry step and one expiry
        entry. ``top_up``: instead of adding ``count``, make ``owner`` hold at least ``count`` on
        each (adding the shortfall and refreshing the expiry only where something is added;
        ``refresh``: where nothing is added too -- a lease renewal). Unreadable keys are
        skipped. Returns how many keys ``owner`` now holds (at least ``count``, with
        ``top_up``) through this call or before it."""
        self.expire(now)
        if count < 1:
            return 0
        return self._lease_keys(keys, owner, count, now + self.lease_ttl, top_up, refresh)

    def _lease_keys(self, keys: Iterable[ObjectKey], owner: Owner, count: int, expiry: float,
                    top_up: bool, refresh: bool) -> int:
        if self._releasing and owner in self._releasing:
            self._finish_release(owner)
        objects = self._objects
        leased: list[ObjectKey] = []
        held = 0
        added = 0
        by_owner: dict[ObjectKey, L1Object] | None = None
        for key in keys:
            obj = objects.get(key)
            if obj is None or obj.writer is not None:
                continue
            readers = obj.readers
            lease = readers.get(owner)
            if lease is None:
                readers[owner] = (count, expiry)
                if by_owner is None:
                    by_owner = self._by_owner.setdefault(owner, {})
                by_owner[key] = obj
                obj.lru.pop(key, None)
                added += count
            else:
                n = count - lease[0] if top_up else count
                if n > 0:
                    readers[owner] = (lease[0] + n, expiry)
                    added += n
                elif refresh:
                    readers[owner] = (lease[0], expiry)
                else:
                    held += 1
                    continue
            leased.append(key)
        self._leases_taken += added
        self._leases_held += added
        if leased:
            self._expiries.push(expiry, LeasesExpire(owner, tuple(leased), expiry))
        return held + len(leased)

    def lease_slots(self, keys: Sequence[ObjectKey], owner: Owner, now: float) -> list[tuple[ObjectKey, int]]:
        """A copy's holder (``owner``, holding nothing yet) takes one read count on each readable
        key of ``keys``: ``lease_reads(keys, owner, 1, now)``; returns ``(key, slot)`` of those
        it leased, in order."""
        if not self.lease_reads(keys, owner, 1, now):
            return []
        held = self._by_owner[owner]
        return [(k, held[k].slot) for k in keys if k in held]

    def unreadable(self, chunk_hashes: Iterable[bytes], ranks: Sequence[int]) -> list[ObjectKey]:
        """The keys of ``chunk_hashes`` x ``ranks`` that are not readable, chunk by chunk, ranks
        in the order given (found in the per-rank maps: no key built for a readable one)."""
        per_rank = [(r, self._readable.get(r, {})) for r in ranks]
        return [ObjectKey(h, r) for h in chunk_hashes for r, by_hash in per_rank if h not in by_hash]

    def readable_prefix(
        self, chunk_hashes: Sequence[bytes], ranks: Sequence[int]
    ) -> tuple[int, list[ObjectKey]]:
        """How many leading chunks have every rank in ``ranks`` readable, and the keys of those
        chunks (chunk by chunk, ranks in the order given)."""
        if not ranks:
            return len(chunk_hashes), []
        objs = self._prefix_objects(chunk_hashes, ranks)
        return len(objs) // len(ranks), [obj.key for obj in objs]

    def lease_prefix(
        self, chunk_hashes: Sequence[bytes], ranks: Sequence[int], owner: Owner, count: int, now: float
    ) -> int:
        """A lookup's L1 part in one walk: ``readable_prefix`` (after the expiry step), then
        ``owner`` holds at least ``count`` on every object of that prefix, with its expiry
        renewed -- exactly ``lease_reads(keys, owner, count, now, top_up=True, refresh=True)``
        on the prefix's keys. Returns the prefix length in chunks."""
        self.expire(now)
        if not ranks:
            return len(chunk_hashes)
        objs = self._prefix_objects(chunk_hashes, ranks)
        chunks = len(objs) // len(ranks)
        if count < 1 or not objs:
            return chunks
        expiry = now + self.lease_ttl
        if self._releasing and owner in self._releasing:
            self._finish_release(owner)
        if owner in self._by_owner:  # a repeat lookup: top up and renew what it holds
            self._lease_keys([obj.key for obj in objs], owner, count, expiry, top_up=True, refresh=True)
            return chunks
        # A new owner holds nothing: every object gets the same fresh lease and leaves its LRU
        # set (a no-op for one another owner leases already).
        lease = (count, expiry)
        held: dict[ObjectKey, L1Object] = {}
        for obj in objs:
            key = obj.key
            obj.readers[owner] = lease
            obj.lru.pop(key, None)
            held[key] = obj
        added = count * len(held)
        self._by_owner[owner] = held
        self._leases_taken += added
        self._leases_held += added
        self._expiries.push(expiry, LeasesExpire(owner, tuple(held), expiry))
        return chunks

    def _prefix_objects(self, chunk_hashes: Sequence[bytes], ranks: Sequence[int]) -> list[L1Object]:
        """The readable objects of the leading chunks that have every rank of ``ranks``
        readable, chunk by chunk, ranks in the order given (``ranks`` not empty)."""
        readable = self._readable
        if len(ranks) == 1:
            by_hash = readable.get(ranks[0])
            if by_hash is None:
                return []
            objs = list(map(by_hash.get, chunk_hashes))
            if None in objs:
                del objs[objs.index(None):]
            return objs  # type: ignore[return-value]
        per_rank = [readable.get(r, {}) for r in ranks]
        out: list[L1Object] = []
        for h in chunk_hashes:
            row = [by_hash.get(h) for by_hash in per_rank]
            if None in row:
                break
            out.extend(row)  # type: ignore[arg-type]
        return out

    def release_read(
        self, key: ObjectKey, owner: Owner, count: int | None, reason: ReleaseReason, now: float
    ) -> int:
        """Release up to ``count`` (None: all) of ``owner``'s counts on ``key``; returns how many."""
        self.expire(now)
        return self._release(key, owner, count, reason)

    def release_reads(
        self, keys: Iterable[ObjectKey], owner: Owner, count: int | None, reason: ReleaseReason, now: float
    ) -> int:
        """``release_read`` for each of ``keys``, in order, with one expiry step; returns the
        counts released in all."""
        self.expire(now)
        released = 0
        for key in keys:
            released += self._release(key, owner, count, reason)
        return released

    def release_chunks(self, owner: Owner, chunk_hashes: Sequence[bytes], ranks: int,
                       reason: ReleaseReason, now: float) -> int:
        """Every count ``owner`` holds on the objects of ``chunk_hashes`` x ranks ``[0, ranks)``:
        ``release_reads`` of those keys, walking only what ``owner`` holds (no key built per
        object it does not hold; what it holds, in the order it leased them). Returns the
        counts released."""
        self.expire(now)
        if self._releasing and owner in self._releasing:
            self._finish_release(owner)
        held = self._by_owner.get(owner)
        if not held:
            return 0
        keys = tuple(held)
        return self._release_part(owner, held, _Release(reason, keys, frozenset(chunk_hashes), ranks), len(keys))

    def release_chunks_in_slices(self, owner: Owner, chunk_hashes: Sequence[bytes], ranks: int,
                                 reason: ReleaseReason, now: float) -> None:
        """``release_chunks`` at once when ``owner`` holds at most ``RELEASE_SLICE`` objects;
        else by later ``release_slice`` calls, each walking at most ``RELEASE_SLICE`` of the
        objects it holds now (module doc): the free's own turn has its hashing to do."""
        self.expire(now)
        held = self._by_owner.get(owner)
        if not held:
            return
        keys = tuple(held)
        part = _Release(reason, keys, frozenset(chunk_hashes), ranks)
        if len(keys) <= RELEASE_SLICE and owner not in self._releasing:
            self._release_part(owner, held, part, len(keys))
            return
        self._queue(owner, part, now, run=False)

    def release_owner_in_slices(self, owner: Owner, reason: ReleaseReason, now: float) -> None:
        """``release_owner``, at most ``RELEASE_SLICE`` objects now and the rest by later
        ``release_slice`` calls (module doc)."""
        self.expire(now)
        held = self._by_owner.get(owner)
        if not held:
            return
        if len(held) <= RELEASE_SLICE and owner not in self._releasing:
            self.release_owner(owner, reason, now)
            return
        self._queue(owner, _Release(reason), now)

    def _queue(self, owner: Owner, part: _Release, now: float, run: bool = True) -> None:
        """Queue ``part`` behind ``owner``'s pending releases (the owner joins the queue of
        owners, with ``now`` as when it asked, if it has none); ``run``: and run one slice."""
        pending = self._releasing.get(owner)
        if pending is None:
            self._releasing[owner] = ([part], now)
        else:
            pending[0].append(part)
        if run:
            self.release_slice()

    @property
    def releasing(self) -> bool:
        """Whether a release in slices has objects left (``release_slice``)."""
        return bool(self._releasing)

    def next_release(self) -> float | None:
        """When the oldest release in slices was asked (its slices are due since), or None."""
        return next(iter(self._releasing.values()))[1] if self._releasing else None

    def release_slice(self) -> int:
        """Walk up to ``RELEASE_SLICE`` objects of the oldest release in slices, releasing what
        it releases; returns the counts released."""
        if not self._releasing:
            return 0
        owner, (parts, _asked) = next(iter(self._releasing.items()))
        held = self._by_owner.get(owner)
        if not held:  # expired or released meanwhile
            del self._releasing[owner]
            return 0
        part = parts[0]
        released = self._release_part(owner, held, part, RELEASE_SLICE)
        if part.done:
            parts.pop(0)
        if not parts or owner not in self._by_owner:
            del self._releasing[owner]
        return released

    def _finish_release(self, owner: Owner) -> None:
        """Run every pending part of ``owner``'s release in slices now, in order."""
        parts, _asked = self._releasing.pop(owner)
        for part in parts:
            held = self._by_owner.get(owner)
            if not held:
                return
            self._release_part(owner, held, part, len(held) if part.keys is None else len(part.keys))

    def _release_part(self, owner: Owner, held: dict[ObjectKey, L1Object], part: _Release, budget: int) -> int:
        """Walk up to ``budget`` objects of ``part`` (``held``: ``owner``'s held map), releasing
        ``owner``'s counts on those the part selects; ``part.done`` says whether it is over."""
        if part.keys is None:  # everything the owner holds
            if len(held) <= budget:
                del self._by_owner[owner]
                part.done = True
                return self._release_held(owner, held, part.reason)
            batch = dict(itertools.islice(held.items(), budget))
            for key in batch:
                del held[key]
            return self._release_held(owner, batch, part.reason)
        keys, start = part.keys, part.pos
        stop = min(len(keys), start + budget)
        part.pos = stop
        part.done = stop == len(keys)
        wanted, ranks, expiry = part.chunks, part.ranks, part.expiry
        released = 0
        seq = self._use_seq
        for i in range(start, stop):
            key = keys[i]
            obj = held.get(key)
            if obj is None:  # released meanwhile
                continue
            if wanted is not None and (key.chunk_hash not in wanted or key.kv_rank >= ranks):
                continue
            readers = obj.readers
            if expiry is not None and readers[owner][1] != expiry:
                continue  # refreshed since: a later expiry entry covers it
            del held[key]
            released += readers.pop(owner)[0]
            if not readers and obj.writer is None:  # ``_mark_evictable`` inlined
                lru = obj.lru = obj.account.lru
                lru[key] = obj
                seq += 1
                obj.used = seq
        self._end_release(owner, held, released, part.reason, seq)
        return released

    def release_owner(self, owner: Owner, reason: ReleaseReason, now: float) -> int:
        """Release every count ``owner`` holds, on every object (in the order it leased them);
        a release in slices of it pending finishes first, with its own reason."""
        self.expire(now)
        if self._releasing and owner in self._releasing:
            self._finish_release(owner)
        held = self._by_owner.pop(owner, None)
        if not held:
            return 0
        return self._release_held(owner, held, reason)

    def _release_held(self, owner: Owner, held: dict[ObjectKey, L1Object], reason: ReleaseReason) -> int:
        """Release ``owner``'s counts on ``held`` (taken out of its held map already)."""
        released = 0
        seq = self._use_seq
        for key, obj in held.items():
            readers = obj.readers
            released += readers.pop(owner)[0]
            if not readers:
                # evictable again, the most recently used (a leased object is never WRITING
                # and never in its LRU set: ``_mark_evictable`` inlined)
                lru = obj.lru = obj.account.lru
                lru[key] = obj
                seq += 1
                obj.used = seq
        self._use_seq = seq
        self._leases_held -= released
        self._leases_released[reason] += released
        return released

    def touch(self, key: ObjectKey) -> None:
        """Mark a READY object most recently used."""
        obj = self._objects.get(key)
        if obj is not None and key in obj.lru:
            lru = obj.account.lru
            if obj.lru is lru:
                lru.move_to_end(key)
            else:  # in a forgotten tenant's orphan run: into the common set, the most recent
                del obj.lru[key]
                lru[key] = obj
                obj.lru = lru
            self._use_seq += 1
            obj.used = self._use_seq

    # ----------------------------------------------------------------------------- time, capacity

    def expire(self, now: float) -> None:
        """Release every lease and drop every write reservation whose expiry is ``<= now``."""
        pop = self._expiries.pop_due_entry
        budget = RELEASE_SLICE  # leases released at once; the batches past it go in slices
        while (entry := pop(now)) is not None:
            expiry, timer = entry
            if isinstance(timer, WritesExpire):
                if timer.batch not in self._writing:
                    continue  # every write of the batch finished or went: a stale entry
                for key in timer.keys:
                    obj = self._objects.get(key)
                    if obj is not None and obj.writer is not None and obj.write_expiry == expiry:
                        self._write_expirations += 1
                        self._drop(obj)
                continue
            assert isinstance(timer, LeasesExpire)
            owner, keys = timer.owner, timer.keys
            held = self._by_owner.get(owner)
            if held is None:
                continue  # released already: a stale entry
            if len(keys) > budget:  # a big lookup's leases expire a slice per loop turn
                self._queue(owner, _Release(ReleaseReason.TTL, keys, expiry=expiry), now, run=False)
                budget = 0
                continue
            budget -= len(keys)
            self._expire_leases(held, keys, owner, expiry)

    def _expire_leases(self, held: dict[ObjectKey, L1Object], keys: tuple[ObjectKey, ...], owner: Owner,
                       expiry: float) -> None:
        """``owner``'s leases on ``keys`` (its held map ``held``) that still end at ``expiry``
        are released (TTL): ``_release`` per key, inlined over the batch."""
        released = 0
        seq = self._use_seq
        for key in keys:
            obj = held.get(key)
            if obj is None:
                continue
            readers = obj.readers
            lease = readers[owner]
            if lease[1] != expiry:
                continue  # refreshed since: a later entry covers it
            del readers[owner]
            del held[key]
            released += lease[0]
            if not readers and obj.writer is None:  # ``_mark_evictable`` inlined
                lru = obj.lru = obj.account.lru
                lru[key] = obj
                seq += 1
                obj.used = seq
        self._end_release(owner, held, released, ReleaseReason.TTL, seq)

    def _end_release(self, owner: Owner, held: dict[ObjectKey, L1Object], released: int, reason: ReleaseReason,
                     seq: int) -> None:
        """The bookkeeping after a batch of ``owner``'s leases went (``held``: what it still holds;
        ``seq``: the use sequence the batch advanced to)."""
        self._use_seq = seq
        if not held:
            del self._by_owner[owner]
        self._leases_held -= released
        self._leases_released[reason] += released

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

    def can_recarve(self, num_slots: int, slot_bytes: int, *, drop_ready: bool) -> bool:
        """Whether ``recarve(num_slots, slot_bytes)`` would cut L1 now -- after ``clear(False)``
        when ``drop_ready`` (which drops the ready, unleased objects and keeps what is being
        written or leased). Changes nothing: a registration's refusal is decided by it before
        anything is dropped or cut (core_sm/server_instances.py)."""
        if num_slots < 0 or slot_bytes < 1 or self._pinned or self._quarantined:
            return False
        if not drop_ready:
            return not self._objects
        return all(obj.writer is None and not obj.readers for obj in self._objects.values())

    def recarve(self, num_slots: int, slot_bytes: int) -> bool:
        """Cut L1 into ``num_slots`` slots of ``slot_bytes`` (core_sm.l1_slots decides the size):
        only while the index holds nothing (no object, no pinned or quarantined slot), since
        every slot id changes meaning. Returns whether it did."""
        if num_slots < 0 or slot_bytes < 1:
            return False
        if self._objects or self._pinned or self._quarantined:
            return False
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._free_slots = list(range(num_slots))
        return True

    def _evict_one(self, requester: Tenant | None = None) -> bool:
        """Drop the object the quota chooses for ``requester``; False: nothing may go."""
        victim = self.quota.victim(requester)
        if victim is None:
            return False
        self._drop(victim)
        self.quota.evicted(victim, requester)
        return True

    def _evict_to_watermark(self, requester: Tenant | None = None) -> int:
        """Past the high watermark, evict (for ``requester``) down to the low one; returns how many."""
        if self.num_slots == 0 or self.used_slots <= self.high_watermark * self.num_slots:
            return 0
        evicted = 0
        while self.used_slots > self.low_watermark * self.num_slots and self._evict_one(requester):
            evicted += 1
        return evicted

    def pin_slot(self, slot: int) -> None:
        """An effect that reads or writes ``slot`` is in flight: if its object is dropped
        meanwhile, the slot is quarantined, not freed, until every pin is removed."""
        self._pinned[slot] = self._pinned.get(slot, 0) + 1

    def pin_slots(self, slots: Sequence[int]) -> None:
        """``pin_slot`` for each of ``slots``."""
        pinned = self._pinned
        fresh = dict.fromkeys(slots, 1)
        if len(fresh) == len(slots) and pinned.keys().isdisjoint(fresh):
            pinned.update(fresh)  # none pinned yet, each once (a batch just reserved): in C
            return
        for slot in slots:
            pinned[slot] = pinned.get(slot, 0) + 1

    def unpin_slots(self, slots: Iterable[int]) -> None:
        """``unpin_slot`` for each of ``slots``."""
        pinned, quarantined = self._pinned, self._quarantined
        for slot in slots:
            n = pinned.get(slot, 0) - 1
            if n > 0:
                pinned[slot] = n
                continue
            pinned.pop(slot, None)
            if quarantined and slot in quarantined:
                quarantined.discard(slot)
                heapq.heappush(self._free_slots, slot)

    def unpin_slot(self, slot: int) -> None:
        """One in-flight effect on ``slot`` ended; a quarantined slot with no pin left is free."""
        n = self._pinned.get(slot, 0) - 1
        if n > 0:
            self._pinned[slot] = n
            return
        self._pinned.pop(slot, None)
        if slot in self._quarantined:
            self._quarantined.discard(slot)
            heapq.heappush(self._free_slots, slot)

    # ----------------------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (cheap enough per event).

        The simulator runs this after every server event that may change the index, so the
        objects are walked once for the slots and bytes and once for their writes and leases,
        and the free list made a set once; the assertions are made in the invariants' order --
        the same assertions as one walk per invariant, the same one failing first on a broken
        state (the lease walk raises nothing itself: what it finds is raised at the place of
        its assertion, after the writes per batch)."""
        objects = self._objects
        objs = tuple(objects.values())
        assert self._bytes == sum(o.nbytes for o in objs), "bytes accounting"
        slots = {o.slot for o in objs}
        free = set(self._free_slots)
        quarantined = self._quarantined
        assert len(slots) == len(objects), "two objects share a slot"
        assert not slots & free, "a used slot is on the free list"
        assert not slots & quarantined, "a used slot is quarantined"
        assert not quarantined & free, "a quarantined slot is free"
        assert quarantined <= self._pinned.keys(), "a quarantined slot with no pin"
        assert len(slots) + len(self._free_slots) + len(quarantined) == self.num_slots, "slots lost"
        assert {ObjectKey(h, r): o for r, by_hash in self._readable.items() for h, o in by_hash.items()} == {
            k: o for k, o in objects.items() if o.writer is None}, "readable map"
        assert all(self._readable.values()), "an empty rank map"
        held = 0
        pending = {(k, t.owner if isinstance(t, LeasesExpire) else None, t.expiry) for t in self._expiry_timers()
                   for k in t.keys}
        for o, (parts, _asked) in self._releasing.items():
            assert parts and all(not p.done for p in parts), "a finished release part left queued"
            for p in parts:
                if p.expiry is not None and p.keys is not None:
                    pending.update((k, o, p.expiry) for k in p.keys[p.pos:])
        batches: dict[int, int] = {}
        by_owner = self._by_owner
        wrong: Exception | None = None  # what the first object whose write or leases are wrong raises
        for obj in objs:
            writer = obj.writer
            if writer is not None:
                batches[obj.batch] = batches.get(obj.batch, 0) + 1
            if wrong is not None:
                continue
            key = obj.key
            if writer is not None and (key, None, obj.write_expiry) not in pending:
                wrong = AssertionError("a write that would never expire")
                continue
            for owner, (count, expiry) in obj.readers.items():
                if count <= 0:
                    wrong = AssertionError("non-positive lease count")
                elif owner not in by_owner:  # (the owner map's lookup raises)
                    wrong = KeyError(owner)
                elif key not in by_owner[owner]:
                    wrong = AssertionError("owner map misses a lease")
                elif (key, owner, expiry) not in pending:
                    wrong = AssertionError("a lease that would never expire")
                else:
                    held += count
                    continue
                break
            else:
                if (writer is None and not obj.readers) != (key in obj.lru):
                    wrong = AssertionError("LRU set out of sync")
                elif writer is not None and obj.readers:
                    wrong = AssertionError("read lease on a writing object")
        assert batches == self._writing, "writes per reservation batch"
        if wrong is not None:
            raise wrong
        for owner, keys in by_owner.items():
            assert keys, "empty owner entry"
            for k in keys:
                assert owner in objects[k].readers, "owner map has a stale lease"
        assert held == self._leases_held, "held lease counter"
        self.quota.check(objs)
        released = sum(self._leases_released.values())
        assert self._leases_taken == held + released, "a lease was neither held nor released once"

    def state_parts(self) -> tuple[Any, ...]:
        """The index and the parts it is made of (its quota, its expiry timers), each with its
        ``STATE_FIELDS``: what the server's ``state_parts`` lists for it."""
        return (self, self.quota, self._expiries)

    # ----------------------------------------------------------------------------- internals

    def _expiry_timers(self) -> list[LeasesExpire | WritesExpire]:
        """Every expiry entry's timer, live or stale (the heap holds only these two kinds)."""
        return cast("list[LeasesExpire | WritesExpire]", self._expiries.timers())

    def _expiry_live(self, timer: Timer) -> bool:
        """Whether an expiry entry still has something to end. Released leases leave their
        entries behind until they come due (a TTL later); the heap drops the stale ones, which
        keeps it proportional to what is held."""
        if isinstance(timer, WritesExpire):
            return timer.batch in self._writing  # live while one of the batch's writes is
        assert isinstance(timer, LeasesExpire)
        owner, expiry = timer.owner, timer.expiry
        objects = self._objects
        if owner not in self._by_owner:
            return False  # the owner holds nothing any more
        for key in timer.keys:
            obj = objects.get(key)
            lease = None if obj is None else obj.readers.get(owner)
            if lease is not None and lease[1] == expiry:
                return True
        return False

    def _release(self, key: ObjectKey, owner: Owner, count: int | None, reason: ReleaseReason) -> int:
        obj = self._objects.get(key)
        if obj is None:
            return 0
        lease = obj.readers.get(owner)
        if lease is None:
            return 0
        held = lease[0]
        n = held if count is None else max(0, min(count, held))
        self._leases_held -= n
        self._leases_released[reason] += n
        if n < held:
            obj.readers[owner] = (held - n, lease[1])
        else:
            del obj.readers[owner]
            keys = self._by_owner[owner]
            del keys[key]
            if not keys:
                del self._by_owner[owner]
            if not obj.readers and obj.writer is None:
                self._mark_evictable(obj)  # released objects are the most recently used
        return n

    def _drop(self, obj: L1Object) -> None:
        for owner in tuple(obj.readers):
            self._release(obj.key, owner, None, ReleaseReason.CLEAR)
        key = obj.key
        del self._objects[key]
        if obj.writer is None:
            readable = self._readable[key.kv_rank]
            del readable[key.chunk_hash]
            if not readable:
                del self._readable[key.kv_rank]
        else:
            self._written(obj.batch)
        if self.dropped is not None:
            self.dropped.append(obj.key)
        obj.lru.pop(obj.key, None)
        self.quota.uncharge(obj.tenant)
        self._bytes -= obj.nbytes
        if obj.slot in self._pinned:
            self._quarantined.add(obj.slot)
        else:
            heapq.heappush(self._free_slots, obj.slot)

    def _written(self, batch: int) -> None:
        """One write of reservation batch ``batch`` finished or went."""
        n = self._writing[batch] - 1
        if n:
            self._writing[batch] = n
        else:
            del self._writing[batch]

    def _mark_evictable(self, obj: L1Object) -> None:
        lru = obj.lru = obj.account.lru
        lru[obj.key] = obj
        lru.move_to_end(obj.key)
        self._use_seq += 1
        obj.used = self._use_seq

    def objects(self) -> Iterable[ObjectKey]:
        return tuple(self._objects)
