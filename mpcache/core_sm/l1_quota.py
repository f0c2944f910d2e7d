"""L1's tenant quota: whose charge each object is, and which object an eviction drops.

``TenantQuota`` is an object ``L1Index`` (``mpcache.core_sm.l1_index``) owns, as ``index.quota``:
the index keeps the objects, slots, leases and recency; the quota keeps the charges per tenant,
the LRU sets the evictable objects wait in, and the eviction counts, and decides, for a
reservation that needs room or a used-slot count over the high watermark, which READY unleased
object goes. Neither reads the other's state; what passes between them:

* the index tells the quota what it charges: ``charge(tenant, n)`` when it reserves objects (the
  tenant's ``Account`` comes back: the new objects point to it), ``uncharge(tenant)`` when it
  drops one;
* the index asks ``victim(requester)``, drops that object itself, and tells the quota with
  ``evicted(victim, requester)`` (the eviction counts);
* both work on the shared records of ``mpcache.core_sm.l1_object``: the index moves an object
  into its account's LRU set (``obj.lru = obj.account.lru``) when it becomes evictable, out when
  leased or dropped, and to the end when used (``L1Object.used``, its recency); the quota makes
  those sets, re-points a forgotten tenant's account, and reads the sets' heads. An LRU set maps
  each key to its object, so the quota needs no map of the index's;
* ``check(objects)``: the index hands its objects to the quota's invariant check.

The server sets ``tenant_share`` and calls ``forget_tenant``; ``charged(tenant)``,
``evictions`` and ``evictions_for_others`` are its reads.

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

Invariants it keeps (``check``, which ``L1Index.check_invariants`` calls, asserts them):

* every object is charged to exactly one tenant; ``charged(t)`` is the number of objects (any
  state) whose tenant is ``t``, and a tenant with none has no entry;
* a READY unleased object is in its own tenant's LRU set and in no other; WRITING and leased
  objects are in none; each set is in recency order (``L1Object.used`` ascending) and maps
  each key to that key's object;
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

from mpcache.core_sm.l1_object import Account, L1Object, LruSet, Tenant

_MIN_COMPACT = 1024  # the orphan heap drops its empty runs when it doubles past this


def _head(lru: LruSet) -> L1Object:
    """The least recently used object of a non-empty LRU set."""
    return next(iter(lru.values()))


class TenantQuota:
    """Charges per tenant, the victim rules and the evictions' counts of one ``L1Index`` (the
    module doc: what the index tells it and asks of it)."""

    # What the server's ``state_values`` carries of this part, and the wiring it leaves out
    # (core_sm/values.py; tests/core_sm/test_state_values.py holds every attribute to one).
    STATE_FIELDS: tuple[str, ...] = ("_lru", "_accounts", "_charged", "_orphans", "_orphan_seq", "_orphans_compact_at",
                                     "tenant_share", "_evictions", "_evictions_for_others")  # the server sets the share
    WIRING_FIELDS: tuple[str, ...] = ()

    def __init__(self, tenant_share: int | None = None) -> None:
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
        self.tenant_share = tenant_share
        self._evictions = 0
        self._evictions_for_others = 0  # the victim was charged to another tenant (or to none)

    # ----------------------------------------------------------------------------- queries

    def charged(self, tenant: Tenant | None) -> int:
        """Objects (any state) charged to ``tenant``."""
        return self._charged.get(tenant, 0)

    @property
    def tenants(self) -> int:
        """How many tenants (not counting no tenant) have objects charged."""
        return len(self._charged) - (None in self._charged)

    @property
    def evictions(self) -> int:
        """Objects evicted (``evicted`` calls)."""
        return self._evictions

    @property
    def evictions_for_others(self) -> int:
        """Evictions whose victim was charged to another tenant than the one asking (or to none)."""
        return self._evictions_for_others

    @property
    def lru_sets(self) -> dict[Tenant | None, LruSet]:
        """The live LRU set of each charged tenant and of no tenant (the orphan runs aside): for
        invariant checks and the tests that break them, not to be changed otherwise."""
        return self._lru

    @property
    def orphan_runs(self) -> int:
        """Entries on the orphan heap (empty runs included until it is compacted or they reach
        its top): how much forgetting tenants left behind."""
        return len(self._orphans)

    # ----------------------------------------------------------------------------- what the index tells

    def charge(self, tenant: Tenant | None, n: int = 1) -> Account:
        """``n`` more objects are charged to ``tenant``; returns the tenant's account (made, with
        its LRU set, if these are its first)."""
        account = self._accounts.get(tenant)
        if account is None:
            lru: LruSet = OrderedDict()
            self._lru[tenant] = lru
            account = self._accounts[tenant] = Account(tenant, lru)
        self._charged[tenant] = self._charged.get(tenant, 0) + n
        return account

    def uncharge(self, tenant: Tenant | None) -> None:
        """One object charged to ``tenant`` is gone (out of its LRU set already); the tenant's
        account and LRU set go with its last."""
        n = self._charged[tenant] - 1
        if n:
            self._charged[tenant] = n
        else:
            del self._charged[tenant]
            if tenant is not None:
                self._lru.pop(tenant, None)  # empty: its objects are gone
                self._accounts.pop(tenant, None)

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
            heapq.heappush(self._orphans, (_head(run).used, self._orphan_seq, run))
            if len(self._orphans) > self._orphans_compact_at:
                live = [entry for entry in self._orphans if entry[2]]
                heapq.heapify(live)
                self._orphans = live
                self._orphans_compact_at = max(_MIN_COMPACT, 2 * len(live))
        return moved

    def evicted(self, victim: L1Object, requester: Tenant | None) -> None:
        """The index dropped ``victim``, the ``victim(requester)`` it was given."""
        self._evictions += 1
        if victim.tenant != requester:
            self._evictions_for_others += 1

    # ----------------------------------------------------------------------------- the victim rules

    def victim(self, requester: Tenant | None) -> L1Object | None:
        """The object an eviction for ``requester`` drops (the module doc's quota rules), or None
        when nothing may go; changes nothing."""
        share = self.tenant_share
        if share is None:
            return self._oldest(self._lru.items())
        charged = self._charged
        own = self._lru.get(requester) if requester is not None else None
        if own and charged.get(requester, 0) >= share:
            return _head(own)
        # Nobody's reservation (an L2 read for a lookup: the server cannot tell which instance
        # the scheduler asking serves) may also take from tenants exactly at their share, so a
        # single engine that fills L1 still gets its L2 hits loaded; never from one below it.
        limit = share - 1 if requester is None else share
        victim = self._oldest((tenant, lru) for tenant, lru in self._lru.items() if tenant != requester
                              and (tenant is None or charged.get(tenant, 0) > limit))
        if victim is None and own:
            victim = _head(own)
        return victim

    def _oldest(self, lrus: Iterable[tuple[Tenant | None, LruSet]]) -> L1Object | None:
        """The least recently used head of the ``(tenant, LRU set)`` pairs; the pair of no
        tenant also stands for the orphan runs."""
        best: L1Object | None = None
        for tenant, lru in lrus:
            if lru:
                obj = _head(lru)
                if best is None or obj.used < best.used:
                    best = obj
            if tenant is None and self._orphans:
                obj_ = self._oldest_orphan()
                if obj_ is not None and (best is None or obj_.used < best.used):
                    best = obj_
        return best

    def _oldest_orphan(self) -> L1Object | None:
        """The least recently used object of the orphan runs (the heap's top, put right)."""
        heap = self._orphans
        while heap:
            used, seq, run = heap[0]
            if not run:
                heapq.heappop(heap)
                continue
            head = _head(run)
            if head.used != used:  # its head left or was touched since: a later one now
                heapq.heapreplace(heap, (head.used, seq, run))
                continue
            return head
        return None

    # ----------------------------------------------------------------------------- invariants

    def check(self, objects: Iterable[L1Object]) -> None:
        """Assert the module doc's invariants over ``objects``, every object the index holds.

        The simulator runs this after every server event that may change the index, so the
        objects are walked once: each object's charge, whether it is READY unleased, and the
        first object whose account or LRU set is wrong are found in that one pass, and the
        assertions are then made in the invariants' order -- the same assertions as one walk
        per invariant, the same one failing first on a broken state (the object pass raises
        nothing itself: what it finds is raised at the place of its assertion)."""
        objs = tuple(objects)
        lrus, accounts = self._lru, self._accounts
        runs = [run for _used, _seq, run in self._orphans if run]
        orphan_runs = {id(run) for run in runs}
        common = lrus.get(None)
        charged: dict[Tenant | None, int] = {}
        ready = 0
        misplaced: str | None = None  # the first object's account or LRU set that is wrong
        for obj in objs:
            account = obj.account
            tenant = account.tenant
            charged[tenant] = charged.get(tenant, 0) + 1
            ready_unleased = obj.writer is None and not obj.readers
            if ready_unleased:
                ready += 1
            if misplaced is not None:
                continue
            if tenant is not None:
                # (once the charges and key sets below hold, ``tenant`` is a key of both maps)
                if account is not accounts.get(tenant):
                    misplaced = "an object of a stale account"
                elif obj.lru is not lrus.get(tenant):
                    misplaced = "an object in another tenant's LRU"
            elif ready_unleased and obj.lru is not common and id(obj.lru) not in orphan_runs:
                misplaced = "an object in no LRU set"
        assert charged == self._charged, "tenant charges"
        assert lrus.keys() == self._charged.keys() | {None}, "LRU sets are not the charged tenants'"
        assert accounts.keys() == lrus.keys(), "accounts are not the charged tenants'"
        for tenant, account in accounts.items():
            assert account.tenant == tenant and account.lru is lrus[tenant], f"tenant {tenant!r}'s account"
        assert len(orphan_runs) == len(runs), "an orphan run twice on the heap"
        held = set(map(id, objs))
        for used, _seq, run in self._orphans:
            if run:
                assert used <= _head(run).used, "an orphan run's key after its head"
                uses = [o.used for o in run.values()]
                assert uses == sorted(uses), "an orphan run out of recency order"
                assert all(o.account.tenant is None for o in run.values()), "a charged object in an orphan run"
        for tenant, lru in lrus.items():
            uses = [o.used for o in lru.values()]
            assert uses == sorted(uses), f"tenant {tenant!r}'s LRU out of recency order"
        for lru in (*lrus.values(), *runs):
            assert all(o.key == k and id(o) in held for k, o in lru.items()), "an LRU entry not its key's object"
        assert sum(len(lru) for lru in lrus.values()) + sum(len(run) for run in runs) == ready, "LRU sizes"
        assert misplaced is None, misplaced
