"""L1's tenant quota and eviction: whose charge each object is, and which object an eviction drops.

A base of ``L1Index`` (``mpcache.core_sm.l1_index``): the index keeps the objects, slots and
leases; this module decides, for a reservation that needs room or a used-slot count over the
high watermark, which READY unleased object goes, and keeps the charges that decision reads.

**L1 is shared by quota.** Every object is charged to one *tenant* (the instance that stored it;
``None``: no tenant, e.g. loaded from L2 for a lookup, or its instance is gone). With
``tenant_share`` set (the server sets it to each instance's fair share of the slots), the
victim of an eviction a reservation needs is chosen by who asked:

* a tenant at or over its share evicts its **own** least recently used object first;
* otherwise (or when it has none evictable) the least recently used object among those of no
  tenant and of tenants **over** their share;
* a tenant within its share evicts its own objects only when nothing else may go;
* an object of a tenant within its share (charged objects <= share) is never evicted for
  another tenant, so a tenant that floods L1 with committed objects pushes out its own;
* a reservation of no tenant (an L2 read for a lookup: the scheduler asking is no registered
  instance, so the server cannot tell whose it is) may also evict from tenants exactly at their
  share -- else one engine that fills L1 would never get an L2 hit loaded -- never from a
  tenant below its share.

Free slots are used by anyone (a tenant may hold more than its share while L1 has room).
An object read by several tenants stays charged to the one that stored it (one charge per
object, never double-counted; readers pay nothing): a tenant cannot move its objects onto
another's quota by reading them, and the object's eviction follows its storer's share.
``forget_tenant`` re-charges a gone tenant's objects to no tenant. ``tenant_share`` None:
one global LRU, as before.

**Forgetting a tenant costs O(log tenants forgotten), not O(objects)** (a client may repeat
register, store, unregister). Objects do not name their tenant: they share one ``Account`` per
tenant (the tenant and the LRU set its objects enter when they become evictable), so forgetting
sets the account's tenant to None and points it at the common LRU set of no tenant, touching no
object. The tenant's LRU set at that moment, already in recency order, becomes an *orphan run*:
objects of no tenant that entered no common set; it only shrinks (a released, touched or
finished object enters the common set, as the most recently used), and the oldest object of no
tenant is the older of the common set's head and the heads of the orphan runs, which a heap keyed
by each run's head recency yields (a run's key is a lower bound of its head's recency, put right
when it reaches the top; empty runs leave the heap there).

Invariants it keeps (``L1Index.check_invariants`` asserts them, through ``_check_quota``):

* every object is charged to exactly one tenant; ``charged(t)`` is the number of objects (any
  state) whose tenant is ``t``, and a tenant with none has no entry;
* a READY unleased object is in its own tenant's LRU set and in no other; WRITING and leased
  objects are in none; each set is in recency order (``L1Object.used`` ascending);
* a tenant's LRU set exists while the tenant has objects and goes with its last one (the set
  of no tenant, ``None``, always exists), so a gone instance leaves nothing behind; a READY
  unleased object of no tenant is in the common set or in one orphan run, each run in recency
  order and on the orphan heap under a key no later than its head's recency;
* only a READY unleased object is ever evicted, so a lease or an in-flight write is never lost
  to an eviction.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.l1_object import Account, L1Object, LruSet, Tenant

_MIN_COMPACT = 1024  # the orphan heap drops its empty runs when it doubles past this


class TenantQuota:
    """The quota part of ``L1Index``: charges per tenant, the victim rules, the evictions."""

    # the index's state these methods read (``L1Index.__init__`` sets it)
    num_slots: int
    high_watermark: float
    low_watermark: float
    _objects: dict[ObjectKey, L1Object]

    if TYPE_CHECKING:  # and the index's members they call: L1Index defines them
        @property
        def used_slots(self) -> int: ...

        def _drop(self, obj: L1Object) -> None: ...

    def _init_quota(self) -> None:
        # READY, unleased objects per tenant, least recently used first (``L1Object.lru``)
        common: LruSet = OrderedDict()
        self._lru: dict[Tenant | None, LruSet] = {None: common}
        self._accounts: dict[Tenant | None, Account] = {None: Account(None, common)}
        self._charged: dict[Tenant | None, int] = {}  # objects (any state) charged per tenant
        # Forgotten tenants' LRU sets (module doc): a heap of (key, seq, run), the key a lower
        # bound of the run's head's ``used``.
        self._orphans: list[tuple[int, int, LruSet]] = []
        self._orphan_seq = 0
        self._orphans_compact_at = _MIN_COMPACT
        # Slots each tenant may hold while L1 is full (None: no quotas, one global LRU).
        self.tenant_share: int | None = None
        self._evictions = 0
        self._evictions_for_others = 0  # the victim was charged to another tenant (or to none)

    def tenant_of(self, key: ObjectKey) -> Tenant | None:
        obj = self._objects.get(key)
        return None if obj is None else obj.tenant

    def charged(self, tenant: Tenant | None) -> int:
        """Objects (any state) charged to ``tenant``."""
        return self._charged.get(tenant, 0)

    def forget_tenant(self, tenant: Tenant) -> int:
        """``tenant`` is gone (its instance unregistered or reaped): its objects are charged to no
        tenant from now on (still readable, the first to go when room is needed). Returns how
        many. Their recency is kept. Touches none of them (module doc): O(log orphan runs)."""
        if tenant is None or tenant not in self._charged:
            return 0
        account = self._accounts.pop(tenant)
        run = self._lru.pop(tenant)
        moved = self._charged.pop(tenant)
        account.tenant = None
        account.lru = self._lru[None]
        self._charged[None] = self._charged.get(None, 0) + moved
        if run:
            self._orphan_seq += 1
            heapq.heappush(self._orphans, (self._objects[next(iter(run))].used, self._orphan_seq, run))
            if len(self._orphans) > self._orphans_compact_at:
                live = [entry for entry in self._orphans if entry[2]]
                heapq.heapify(live)
                self._orphans = live
                self._orphans_compact_at = max(_MIN_COMPACT, 2 * len(live))
        return moved

    def _oldest_orphan(self) -> L1Object | None:
        """The least recently used object of the orphan runs (the heap's top, put right)."""
        heap = self._orphans
        objects = self._objects
        while heap:
            used, seq, run = heap[0]
            if not run:
                heapq.heappop(heap)
                continue
            head = objects[next(iter(run))]
            if head.used != used:  # its head left or was touched since: a later one now
                heapq.heapreplace(heap, (head.used, seq, run))
                continue
            return head
        return None

    def _check_quota(self) -> None:
        """The module doc's invariants on charges and LRU sets (``L1Index.check_invariants``
        checks each object's own LRU membership)."""
        charged: dict[Tenant | None, int] = {}
        for obj in self._objects.values():
            charged[obj.tenant] = charged.get(obj.tenant, 0) + 1
        assert charged == self._charged, "tenant charges"
        assert self._lru.keys() == self._charged.keys() | {None}, "LRU sets are not the charged tenants'"
        assert self._accounts.keys() == self._lru.keys(), "accounts are not the charged tenants'"
        for tenant, account in self._accounts.items():
            assert account.tenant == tenant and account.lru is self._lru[tenant], f"tenant {tenant!r}'s account"
        runs = [run for _used, _seq, run in self._orphans if run]
        assert len({id(run) for run in runs}) == len(runs), "an orphan run twice on the heap"
        for used, _seq, run in self._orphans:
            if run:
                assert used <= self._objects[next(iter(run))].used, "an orphan run's key after its head"
                uses = [self._objects[k].used for k in run]
                assert uses == sorted(uses), "an orphan run out of recency order"
                assert all(self._objects[k].tenant is None for k in run), "a charged object in an orphan run"
        assert sum(len(lru) for lru in self._lru.values()) + sum(len(run) for run in runs) == sum(
            1 for o in self._objects.values() if o.writer is None and not o.readers), "LRU sizes"
        for tenant, lru in self._lru.items():
            uses = [self._objects[k].used for k in lru]
            assert uses == sorted(uses), f"tenant {tenant!r}'s LRU out of recency order"

    def _charge(self, tenant: Tenant | None) -> Account:
        """One more object is charged to ``tenant``; returns the tenant's account (made, with
        its LRU set, if this is its first)."""
        account = self._accounts.get(tenant)
        if account is None:
            lru: LruSet = OrderedDict()
            self._lru[tenant] = lru
            account = self._accounts[tenant] = Account(tenant, lru)
        self._charged[tenant] = self._charged.get(tenant, 0) + 1
        return account

    def _uncharge(self, tenant: Tenant | None) -> None:
        n = self._charged[tenant] - 1
        if n:
            self._charged[tenant] = n
        else:
            del self._charged[tenant]
            if tenant is not None:
                self._lru.pop(tenant, None)  # empty: its objects are gone
                self._accounts.pop(tenant, None)

    def _oldest(self, lrus: Iterable[tuple[Tenant | None, LruSet]]) -> L1Object | None:
        """The least recently used head of the ``(tenant, LRU set)`` pairs; the pair of no
        tenant also stands for the orphan runs."""
        best: L1Object | None = None
        for tenant, lru in lrus:
            if lru:
                obj = self._objects[next(iter(lru))]
                if best is None or obj.used < best.used:
                    best = obj
            if tenant is None and self._orphans:
                obj_ = self._oldest_orphan()
                if obj_ is not None and (best is None or obj_.used < best.used):
                    best = obj_
        return best

    def _victim(self, requester: Tenant | None) -> L1Object | None:
        """The object an eviction for ``requester`` drops (the module doc's quota rules)."""
        share = self.tenant_share
        if share is None:
            return self._oldest(self._lru.items())
        charged = self._charged
        own = self._lru.get(requester) if requester is not None else None
        if own and charged.get(requester, 0) >= share:
            return self._objects[next(iter(own))]
        # Nobody's reservation (an L2 read for a lookup: the server cannot tell which instance
        # the scheduler asking serves) may also take from tenants exactly at their share, so a
        # single engine that fills L1 still gets its L2 hits loaded; never from one below it.
        limit = share - 1 if requester is None else share
        victim = self._oldest((tenant, lru) for tenant, lru in self._lru.items() if tenant != requester
                              and (tenant is None or charged.get(tenant, 0) > limit))
        if victim is None and own:
            victim = self._objects[next(iter(own))]
        return victim

    def _evict_one(self, requester: Tenant | None = None) -> bool:
        victim = self._victim(requester)
        if victim is None:
            return False
        self._drop(victim)
        self._evictions += 1
        if victim.tenant != requester:
            self._evictions_for_others += 1
        return True

    def _evict_to_watermark(self, requester: Tenant | None = None) -> int:
        if self.num_slots == 0 or self.used_slots <= self.high_watermark * self.num_slots:
            return 0
        evicted = 0
        while self.used_slots > self.low_watermark * self.num_slots and self._evict_one(requester):
            evicted += 1
        return evicted
