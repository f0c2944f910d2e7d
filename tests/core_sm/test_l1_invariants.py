"""``L1Index.check_invariants`` catches broken quota bookkeeping (``index.quota``,
mpcache.core_sm.l1_quota): a wrong charge, an LRU set left behind by a gone tenant, an LRU set out
of recency order, an LRU entry that is not its key's object."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import pytest

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.l1_index import L1Index
from mpcache.core_sm.l1_object import Account, L1Object


def _filled() -> L1Index:
    idx = L1Index(num_slots=4, slot_bytes=8)
    idx.quota.tenant_share = 2
    for i, tenant in enumerate((1, 1, 2)):
        key = ObjectKey(bytes([i]) * 16, 0)
        assert idx.reserve_write(key, "w", 8, 0.0, tenant=tenant) is not None
        assert idx.finish_write(key, "w", 0.0)
    idx.check_invariants()
    return idx


def _wrong_charge(idx: L1Index) -> None:
    idx.quota.charge(1)  # a charge with no object behind it


def _gone_tenants_lru(idx: L1Index) -> None:
    idx.quota.lru_sets[3] = OrderedDict()


def _out_of_order(idx: L1Index) -> None:
    lru = idx.quota.lru_sets[1]
    lru.move_to_end(next(iter(lru)))


@pytest.mark.parametrize(("corrupt", "caught"), [
    pytest.param(_wrong_charge, "tenant charges", id="wrong_charge"),
    pytest.param(_gone_tenants_lru, "LRU sets are not the charged tenants'", id="gone_tenants_lru"),
    pytest.param(_out_of_order, "out of recency order", id="out_of_order"),
])
def test_quota_corruption_is_caught(corrupt: Callable[[L1Index], None], caught: str) -> None:
    idx = _filled()
    corrupt(idx)
    with pytest.raises(AssertionError, match=caught):
        idx.check_invariants()


def test_an_lru_entry_that_is_not_its_keys_object_is_caught() -> None:
    idx = _filled()
    lru = idx.quota.lru_sets[1]
    first, second = list(lru)
    lru[first] = lru[second]
    with pytest.raises(AssertionError, match="an LRU entry not its key's object"):
        idx.check_invariants()


def test_a_forgotten_tenant_leaves_no_lru_set() -> None:
    idx = _filled()
    assert idx.quota.forget_tenant(2) == 1
    idx.check_invariants()
    assert 2 not in idx.quota.lru_sets and idx.quota.charged(2) == 0


def _state() -> tuple[L1Index, ObjectKey, ObjectKey, ObjectKey]:
    """An index with a leased object (tenant 1), an unleased one (tenant 2) and a write in
    flight (tenant 1): the check walks each object's write, leases and LRU set once."""
    idx = L1Index(num_slots=8, slot_bytes=8)
    leased, idle, writing = (ObjectKey(bytes([i]) * 16, 0) for i in range(3))
    for key, tenant in ((leased, 1), (idle, 2)):
        assert idx.reserve_write(key, "w", 8, 0.0, tenant=tenant) is not None
        assert idx.finish_write(key, "w", 0.0)
    assert idx.lease_read(leased, "r", 2, 0.0)
    assert idx.reserve_write(writing, "w2", 8, 0.0, tenant=1) is not None
    idx.check_invariants()
    return idx, leased, idle, writing


def _obj(idx: L1Index, key: ObjectKey) -> L1Object:
    return idx._objects[key]  # noqa: SLF001 -- corrupting the records on purpose


def _zero_lease(idx: L1Index, leased: ObjectKey, idle: ObjectKey, writing: ObjectKey) -> None:
    _obj(idx, leased).readers["r"] = (0, _obj(idx, leased).readers["r"][1])


def _lease_of_unknown_owner(idx: L1Index, leased: ObjectKey, idle: ObjectKey, writing: ObjectKey) -> None:
    _obj(idx, idle).readers["ghost"] = (1, 5.0)


def _lease_missing_from_owner_map(idx: L1Index, leased: ObjectKey, idle: ObjectKey, writing: ObjectKey) -> None:
    _obj(idx, idle).readers["r"] = (1, 5.0)


def _lease_never_expiring(idx: L1Index, leased: ObjectKey, idle: ObjectKey, writing: ObjectKey) -> None:
    count, expiry = _obj(idx, leased).readers["r"]
    _obj(idx, leased).readers["r"] = (count, expiry + 1.0)


def _write_never_expiring(idx: L1Index, leased: ObjectKey, idle: ObjectKey, writing: ObjectKey) -> None:
    _obj(idx, writing).write_expiry += 1.0


def _unleased_not_in_lru(idx: L1Index, leased: ObjectKey, idle: ObjectKey, writing: ObjectKey) -> None:
    del _obj(idx, idle).lru[idle]


def _stale_account(idx: L1Index, leased: ObjectKey, idle: ObjectKey, writing: ObjectKey) -> None:
    obj = _obj(idx, idle)
    obj.account = Account(obj.account.tenant, obj.account.lru)


def _other_tenants_lru(idx: L1Index, leased: ObjectKey, idle: ObjectKey, writing: ObjectKey) -> None:
    _obj(idx, writing).lru = idx.quota.lru_sets[2]


def _lease_and_bad_batch(idx: L1Index, leased: ObjectKey, idle: ObjectKey, writing: ObjectKey) -> None:
    """Two things wrong: the writes per batch are asserted before any object's leases."""
    _zero_lease(idx, leased, idle, writing)
    _obj(idx, writing).batch += 1


@pytest.mark.parametrize(("corrupt", "caught"), [
    pytest.param(_zero_lease, "non-positive lease count", id="zero_lease"),
    pytest.param(_lease_missing_from_owner_map, "owner map misses a lease", id="owner_map"),
    pytest.param(_lease_never_expiring, "a lease that would never expire", id="lease_expiry"),
    pytest.param(_write_never_expiring, "a write that would never expire", id="write_expiry"),
    pytest.param(_unleased_not_in_lru, "LRU set out of sync", id="lru_sync"),
    pytest.param(_stale_account, "an object of a stale account", id="stale_account"),
    pytest.param(_other_tenants_lru, "an object in another tenant's LRU", id="other_lru"),
    pytest.param(_lease_and_bad_batch, "writes per reservation batch", id="first_in_order"),
])
def test_a_corrupted_object_is_caught_by_the_one_walk(
        corrupt: Callable[[L1Index, ObjectKey, ObjectKey, ObjectKey], None], caught: str) -> None:
    """The objects' writes, leases, accounts and LRU sets are checked in one walk each of the
    index and the quota; what the walk finds is still reported, and where two invariants are
    broken the one asserted first is the one reported."""
    idx, leased, idle, writing = _state()
    corrupt(idx, leased, idle, writing)
    with pytest.raises(AssertionError, match=caught):
        idx.check_invariants()


def test_a_lease_of_an_owner_the_owner_map_lacks_raises() -> None:
    idx, leased, idle, writing = _state()
    _lease_of_unknown_owner(idx, leased, idle, writing)
    with pytest.raises(KeyError):
        idx.check_invariants()
