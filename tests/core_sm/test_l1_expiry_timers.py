"""The L1 index's lease and write-reservation expiries on core_sm's ``TimerHeap``
(``mpcache.core_sm.timers``): two timer kinds, a write batch's id the ``seq`` of its entry, and
an expiry step that judges every due entry itself -- a stale one included."""
from __future__ import annotations

import pytest

from mpcache.core_sm import l1_index
from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.l1_index import L1Index, LeasesExpire, ReleaseReason, WritesExpire
from mpcache.core_sm.timers import TimerHeap

KEYS = [ObjectKey(bytes([i]) * 4, 0) for i in range(6)]


def _ready(idx: L1Index, keys: list[ObjectKey], now: float) -> None:
    assert None not in idx.reserve_writes(keys, "w", 8, now)
    assert idx.finish_writes(keys, "w", now) == keys


def test_one_entry_per_call_and_a_batch_id_is_its_entrys_seq() -> None:
    idx = L1Index(8, 8, lease_ttl=10.0)
    heap = idx._expiries
    assert isinstance(heap, TimerHeap)
    assert idx.reserve_write(KEYS[0], "w", 8, 0.0) is not None  # seq 1
    idx.finish_write(KEYS[0], "w", 0.0)
    assert idx.lease_reads([KEYS[0]], "r", 1, 1.0) == 1  # seq 2: a lease entry takes a seq too
    assert idx.reserve_writes(KEYS[1:4], "w", 8, 2.0) == [1, 2, 3]  # seq 3, one entry for three
    assert heap.seq == 3 and len(heap) == 3
    assert {idx._objects[k].batch for k in KEYS[1:4]} == {3} and idx._writing == {3: 3}
    assert heap.timers() == [WritesExpire(1, (KEYS[0],), 10.0), LeasesExpire("r", (KEYS[0],), 11.0),
                             WritesExpire(3, tuple(KEYS[1:4]), 12.0)]
    # the first batch's one write finished: its entry is stale, dropped when it reaches the top
    assert idx.next_expiry() == 11.0 and len(heap) == 2
    idx.expire(12.0)  # the lease's TTL, then the three writes
    assert idx.released_by(ReleaseReason.TTL) == 1 and idx.stats()["write_expirations"] == 3
    assert len(heap) == 0 and idx.next_expiry() is None
    idx.check_invariants()


def test_a_refreshed_lease_entry_still_counts_against_the_expiry_steps_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The expiry step pops due entries live or stale (``pop_due_entry``): an owner's entry whose
    leases were all refreshed releases nothing, but while the owner holds something its keys
    count against the step's ``RELEASE_SLICE`` budget, so a later due batch goes in slices."""
    monkeypatch.setattr(l1_index, "RELEASE_SLICE", 2)
    idx = L1Index(8, 8, lease_ttl=10.0)
    _ready(idx, KEYS[:3], 0.0)
    assert idx.lease_reads(KEYS[:2], "a", 1, 0.0) == 2  # due at 10
    assert idx.lease_reads([KEYS[2]], "b", 1, 0.5) == 1  # due at 10.5
    assert idx.lease_reads(KEYS[:2], "a", 1, 1.0, top_up=True, refresh=True) == 2  # a's now due at 11
    idx.expire(10.6)
    assert idx.read_count(KEYS[0], "a") == 1 and idx.lease_expiry(KEYS[0], "a") == 11.0
    assert idx.holds("b") and idx.releasing  # b's expiry waits for a slice: a's stale entry took the budget
    idx.check_invariants()
    assert idx.release_slice() == 1 and not idx.holds("b") and not idx.releasing
    assert idx.released_by(ReleaseReason.TTL) == 1
    idx.expire(11.0)
    assert not idx.holds("a") and idx.released_by(ReleaseReason.TTL) == 3


def test_the_heap_is_rebuilt_past_twice_its_live_entries_and_never_below_the_floor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``slack=0, floor=_MIN_COMPACT``: with the floor at 4, five entries of released leases
    are rebuilt away at the fifth push, leaving the one live entry."""
    monkeypatch.setattr(l1_index, "_MIN_COMPACT", 4)
    idx = L1Index(8, 8, lease_ttl=10.0)
    _ready(idx, KEYS[:2], 0.0)  # entry 1: the writes' (stale once finished)
    heap = idx._expiries
    idx.lease_read(KEYS[0], "kept", 1, 0.0)  # entry 2, live
    for i in range(2):  # entries 3 and 4, stale at once
        idx.lease_read(KEYS[1], f"r{i}", 1, 0.0)
        idx.release_owner(f"r{i}", ReleaseReason.END_SESSION, 0.0)
    assert len(heap) == 4 and heap.compactions == 0  # at the floor, not past it
    idx.lease_read(KEYS[1], "r2", 1, 0.0)  # entry 5: past the floor
    assert heap.compactions == 1 and heap.timers() == [LeasesExpire("kept", (KEYS[0],), 10.0),
                                                       LeasesExpire("r2", (KEYS[1],), 10.0)]
    idx.check_invariants()
