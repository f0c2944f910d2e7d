"""Forgetting a gone tenant (``L1Index.quota.forget_tenant``, mpcache.core_sm.l1_quota) touches none
of the index's objects -- a client repeating register, store, unregister must not cost the loop
O(objects) each time -- and keeps one recency order over every object of no tenant."""
from __future__ import annotations

from typing import Any, ClassVar

import pytest

from mpcache.core_sm import l1_index
from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.l1_index import L1Index, ReleaseReason
from mpcache.core_sm.l1_object import L1Object


class CountingObject(L1Object):
    """The index's record of an object, noting every record any code reads while ``counting``."""

    __slots__ = ()
    counting: ClassVar[bool] = False
    touched: ClassVar[set[int]] = set()

    def __getattribute__(self, name: str) -> Any:
        if CountingObject.counting:
            CountingObject.touched.add(id(self))
        return super().__getattribute__(name)


def _key(i: int) -> ObjectKey:
    return ObjectKey(i.to_bytes(16, "little"), 0)


def _store(idx: L1Index, first: int, n: int, tenant: object) -> list[ObjectKey]:
    keys = [_key(i) for i in range(first, first + n)]
    for k in keys:
        assert idx.reserve_write(k, "w", 1, 0.0, tenant=tenant) is not None
        assert idx.finish_write(k, "w", 0.0)
    return keys


def _objects_touched_forgetting(others: int) -> int:
    idx = L1Index(num_slots=2 * others + 16, slot_bytes=1)
    idx.quota.tenant_share = others
    _store(idx, 0, others, tenant="earlier")
    assert idx.quota.forget_tenant("earlier") == others  # nobody's now: the common LRU is full
    _store(idx, others, others, tenant="bystander")
    gone = _store(idx, 2 * others, 8, tenant="gone")
    CountingObject.touched.clear()
    CountingObject.counting = True
    try:
        assert idx.tenant_of(gone[0]) == "gone"  # the count sees a read: one record
        assert len(CountingObject.touched) == 1
        CountingObject.touched.clear()
        assert idx.quota.forget_tenant("gone") == 8
    finally:
        CountingObject.counting = False
    touched = len(CountingObject.touched)
    idx.check_invariants()
    return touched


def test_forgetting_a_tenant_touches_at_most_its_own_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(l1_index, "L1Object", CountingObject)  # every record the index makes counts
    # with 4,096 objects of others (nobody's and a live tenant's), 8 of its own
    assert _objects_touched_forgetting(4096) <= 8
    assert _objects_touched_forgetting(64) <= 8


def test_objects_of_no_tenant_are_evicted_in_one_recency_order() -> None:
    """Three tenants' objects interleaved in time; two are forgotten (one of them before the
    other stored its last); evictions for a new tenant take every object of no tenant oldest
    first, wherever it came from, before any of the live tenant's."""
    idx = L1Index(num_slots=13, slot_bytes=1)
    idx.quota.tenant_share = 20  # nobody reaches its share: only objects of no tenant may go
    order: list[ObjectKey] = []
    for i in range(9):
        order += _store(idx, i, 1, tenant=("a", "b", "c")[i % 3])
    idx.quota.forget_tenant("a")
    order += _store(idx, 9, 1, tenant="b")
    idx.quota.forget_tenant("b")
    idx.touch(order[1])  # b's first: now the most recently used of no tenant
    nobody = [k for k in order if idx.tenant_of(k) is None]
    expected = [k for k in nobody if k != order[1]] + [order[1]]
    idx.check_invariants()
    _store(idx, 100, 3, tenant="new")  # fills the free slots
    evicted = []
    for i in range(len(nobody)):
        before = set(idx.objects())
        _store(idx, 200 + i, 1, tenant="new")
        idx.check_invariants()
        evicted += [k for k in before if k not in set(idx.objects())]
    assert evicted == expected
    assert all(idx.tenant_of(k) == "c" for k in order if idx.is_readable(k))


def test_repeated_forgetting_leaves_no_empty_runs_behind() -> None:
    """Register, store, lease, unregister, over and over: each forgotten tenant's run empties
    when its object is leased; the runs do not pile up past the heap's compaction."""
    idx = L1Index(num_slots=64, slot_bytes=1)
    idx.quota.tenant_share = 64
    for i in range(5000):
        (k,) = _store(idx, i, 1, tenant=("t", i))
        assert idx.quota.forget_tenant(("t", i)) == 1
        assert idx.lease_read(k, "reader", 1, 0.0)
        assert idx.release_owner("reader", ReleaseReason.FREE, 0.0) == 1
        if i % 500 == 0:
            idx.check_invariants()
        if idx.used_slots > 48:
            idx.clear(force=False)
    assert idx.quota.orphan_runs <= 2048
