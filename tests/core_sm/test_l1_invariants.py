"""``L1Index.check_invariants`` catches broken quota bookkeeping (``index.quota``,
mpcache.core_sm.l1_quota): a wrong charge, an LRU set left behind by a gone tenant, an LRU set out
of recency order, an LRU entry that is not its key's object."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import pytest

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.l1_index import L1Index


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
