"""``L1Index.check_invariants`` catches broken quota bookkeeping (mpcache.core_sm.l1_quota): a
wrong charge, an LRU set left behind by a gone tenant, an LRU set out of recency order."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import pytest

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.l1_index import L1Index


def _filled() -> L1Index:
    idx = L1Index(num_slots=4, slot_bytes=8)
    idx.tenant_share = 2
    for i, tenant in enumerate((1, 1, 2)):
        key = ObjectKey(bytes([i]) * 16, 0)
        assert idx.reserve_write(key, "w", 8, 0.0, tenant=tenant) is not None
        assert idx.finish_write(key, "w", 0.0)
    idx.check_invariants()
    return idx


def _wrong_charge(idx: L1Index) -> None:
    idx._charged[1] += 1


def _gone_tenants_lru(idx: L1Index) -> None:
    idx._lru[3] = OrderedDict()


def _out_of_order(idx: L1Index) -> None:
    idx._lru[1].move_to_end(next(iter(idx._lru[1])))


@pytest.mark.parametrize("corrupt", [_wrong_charge, _gone_tenants_lru, _out_of_order],
                         ids=lambda f: f.__name__)
def test_quota_corruption_is_caught(corrupt: Callable[[L1Index], None]) -> None:
    idx = _filled()
    corrupt(idx)
    with pytest.raises(AssertionError):
        idx.check_invariants()


def test_a_forgotten_tenant_leaves_no_lru_set() -> None:
    idx = _filled()
    assert idx.forget_tenant(2) == 1
    idx.check_invariants()
    assert 2 not in idx._lru and idx.charged(2) == 0
