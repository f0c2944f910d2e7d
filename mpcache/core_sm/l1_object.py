"""The L1 index's record of one object, and the charge account it points to.

``L1Index`` (``mpcache.core_sm.l1_index``) keeps these records -- one per object that holds a slot
-- and the ``TenantQuota`` it owns (``mpcache.core_sm.l1_quota``) keeps the LRU sets they wait in
while evictable and reads their charges and recency to choose eviction victims; both import the
record from here, so neither imports the other's.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import attrs

from mpcache.core_sm.chunks import ObjectKey

Owner = Hashable  # who holds a lease or a write reservation (a request, a transfer, an L2 read)
Tenant = Hashable  # an instance id; None: no tenant
# READY unleased objects by key, least recently used first (a set that hands out its objects)
LruSet = OrderedDict[ObjectKey, "L1Object"]
# A read lease: (count, expiry). A tuple, replaced on change: the lookup path takes one per object.
Lease = tuple[int, float]


@attrs.define(eq=False)
class Account:
    """What the objects charged to one tenant share (identity: one per tenant while it lasts).
    ``tenant``: whose charge they are (None once forgotten); ``lru``: the LRU set an object of
    theirs enters when it becomes evictable (the common set of no tenant once forgotten)."""

    tenant: Tenant | None
    lru: LruSet


@attrs.define(eq=False)  # identity: the batch paths search lists of objects for None
class L1Object:
    """One object in L1: its slot and size, its writer while WRITING, its readers' leases, whose
    charge it is and where it stands in recency."""

    key: ObjectKey
    slot: int
    nbytes: int
    writer: Owner | None  # not None while WRITING
    write_expiry: float
    account: Account  # whose charge it is (shared by the tenant's objects: l1_quota)
    # the LRU set it last entered (it is in it while READY and unleased): its account's, or an
    # orphan run of a forgotten tenant it was in when forgotten
    lru: LruSet
    used: int = 0  # recency: the index's use sequence when it last became or was made MRU
    readers: dict[Owner, Lease] = attrs.Factory(dict)
    batch: int = 0  # while WRITING: the seq of the expiry entry of its reservation

    @property
    def tenant(self) -> Tenant | None:
        return self.account.tenant
