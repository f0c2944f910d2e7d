"""An end session or a reap of a request holding more than ``RELEASE_SLICE`` objects releases
them a slice per loop turn (mpcache.core_sm.l1_index): the reply does not wait, the counts stay
held (and the objects unevictable) until their slice, every count is released exactly once, and a
request id used again before its release is done gets its new leases whole."""
from __future__ import annotations

import pytest

from mpcache.core_sm import l1_index
from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.l1_index import L1Index, ReleaseReason

SLICE = 16


@pytest.fixture(autouse=True)
def _small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(l1_index, "RELEASE_SLICE", SLICE)


def _leased(n: int) -> tuple[L1Index, list[ObjectKey]]:
    idx = L1Index(num_slots=n, slot_bytes=1)
    keys = [ObjectKey(i.to_bytes(16, "little"), 0) for i in range(n)]
    for k in keys:
        assert idx.reserve_write(k, "w", 1, 0.0) is not None and idx.finish_write(k, "w", 0.0)
    assert idx.lease_reads(keys, "r", 2, 0.0) == n
    return idx, keys


def test_a_big_release_goes_a_slice_per_call_each_count_once() -> None:
    idx, keys = _leased(100)
    idx.release_owner_in_slices("r", ReleaseReason.END_SESSION, 1.0)
    held = [idx.leases_by_owner().get("r", 0)]
    assert held == [2 * (100 - SLICE)] and idx.releasing and idx.next_release() == 1.0
    while idx.releasing:
        idx.release_slice()
        idx.check_invariants()
        held.append(idx.leases_by_owner().get("r", 0))
    assert [a - b for a, b in zip(held, held[1:])] == [2 * SLICE] * 5 + [2 * 4]
    assert idx.released_by(ReleaseReason.END_SESSION) == 200 and not idx.holds("r")
    # every object is evictable again
    assert idx.reserve_write(ObjectKey(b"\xff" * 16, 0), "w", 1, 2.0) is not None


def test_a_small_release_is_done_at_once() -> None:
    idx, _keys = _leased(SLICE)
    idx.release_owner_in_slices("r", ReleaseReason.REAP, 1.0)
    assert not idx.releasing and not idx.holds("r") and idx.released_by(ReleaseReason.REAP) == 2 * SLICE


def test_the_same_owner_leasing_again_finishes_its_old_release_first() -> None:
    idx, keys = _leased(100)
    idx.release_owner_in_slices("r", ReleaseReason.END_SESSION, 1.0)
    assert idx.lease_prefix([k.chunk_hash for k in keys[:10]], [0], "r", 1, 2.0) == 10
    assert not idx.releasing
    while idx.releasing:
        idx.release_slice()
    idx.check_invariants()
    assert idx.leases_by_owner() == {"r": 10}  # the new lookup's leases, whole
    assert idx.released_by(ReleaseReason.END_SESSION) == 200


def test_the_server_answers_end_session_at_once_and_releases_on_its_turns() -> None:
    from mpcache.core_sm.messages import EndSession, Lookup

    try:
        from .sm_helpers import ServerHarness, key, tokens
    except ImportError:
        from sm_helpers import ServerHarness, key, tokens  # type: ignore[no-redef]

    h = ServerHarness(num_slots=1024)
    h.register(1, world_size=4)
    toks = tokens(64, seed=5)
    for r in range(4):
        h.store(toks, worker_id=r, world_size=4)
    h.send(Lookup(key("r", toks, world_size=4)))
    assert h.server.leases_of("r") == 256
    rt = h.send(EndSession("r"))
    assert h.result(rt) is None
    assert 0 < h.server.leases_of("r") < 256 and h.server.deferred_work
    turns = 0
    while h.server.deferred_work:
        deadline = h.server.next_deadline()
        assert deadline is not None and deadline <= h.now
        h.advance(0.0)
        turns += 1
    assert turns == 256 // SLICE - 1 and h.server.leases_of("r") == 0
    assert h.server.index.released_by(ReleaseReason.END_SESSION) == 256
