"""A free of a big request and the TTL expiry of big lease batches go the way an end session does
(mpcache.core_sm.l1_index's release slices): no call walks more than ``RELEASE_SLICE`` objects,
the reply does not wait, and messages that arrive between two slices -- a lookup, a retrieve, a
store or an end session naming the same objects -- leave every count released exactly once,
under its own reason, with nothing leaked."""
from __future__ import annotations

import pytest

from mpcache.core_sm import l1_index, server_jobs
from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.l1_index import L1Index, ReleaseReason
from mpcache.core_sm.messages import EndSession, FreeLookupLocks, Lookup, QueryPrefetchStatus

try:
    from .sm_helpers import ServerHarness, key, tokens
except ImportError:
    from sm_helpers import ServerHarness, key, tokens  # type: ignore[no-redef]

SLICE = 16


@pytest.fixture(autouse=True)
def _small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(l1_index, "RELEASE_SLICE", SLICE)


class _CountingDict(dict):  # type: ignore[type-arg]
    """A held map that counts the lookups a release makes in it (objects walked)."""

    walked = 0

    def get(self, k, default=None):  # type: ignore[no-untyped-def, override]
        _CountingDict.walked += 1
        return super().get(k, default)


def _index(n: int, ttl: float = 300.0) -> tuple[L1Index, list[ObjectKey]]:
    idx = L1Index(num_slots=n + 8, slot_bytes=1, lease_ttl=ttl)
    keys = [ObjectKey(i.to_bytes(16, "little"), i % 4) for i in range(n)]
    for k in keys:
        assert idx.reserve_write(k, "w", 1, 0.0) is not None and idx.finish_write(k, "w", 0.0)
    return idx, keys


def _drain(idx: L1Index) -> int:
    calls = 0
    while idx.releasing:
        idx.release_slice()
        idx.check_invariants()
        calls += 1
    return calls


# ------------------------------------------------------------------------------ the index


def test_a_free_walks_a_slice_per_call_and_releases_only_its_range() -> None:
    idx, keys = _index(128)
    assert idx.lease_reads(keys, "r", 2, 0.0) == 128
    wanted = [k.chunk_hash for k in keys[:100]]
    idx.release_chunks_in_slices("r", wanted, 2, ReleaseReason.FREE, 1.0)  # ranks 0 and 1 only
    held = [idx.leases_by_owner()["r"]]
    assert idx.releasing and held[0] == 2 * 128  # queued: the slices walk it
    while idx.releasing:
        idx.release_slice()
        idx.check_invariants()
        held.append(idx.leases_by_owner().get("r", 0))
    freed = [k for k in keys[:100] if k.kv_rank < 2]
    assert held[-1] == 2 * (128 - len(freed))
    assert idx.released_by(ReleaseReason.FREE) == 2 * len(freed)
    assert set(idx.keys_leased_by("r")) == set(keys) - set(freed)
    assert len(held) == 1 + 128 // SLICE  # 8 slices of 16 of the 128 held


def test_a_slice_walks_at_most_release_slice_objects() -> None:
    idx, keys = _index(128)
    idx.lease_reads(keys, "r", 1, 0.0)
    idx._by_owner["r"] = _CountingDict(idx._by_owner["r"])
    _CountingDict.walked = 0
    idx.release_chunks_in_slices("r", [k.chunk_hash for k in keys], 4, ReleaseReason.FREE, 1.0)
    assert _CountingDict.walked <= SLICE
    _CountingDict.walked = 0
    idx.release_slice()
    assert _CountingDict.walked <= SLICE


def test_a_big_lease_batch_expires_a_slice_per_call() -> None:
    idx, keys = _index(100, ttl=10.0)
    idx.lease_reads(keys, "r", 3, 0.0)
    idx.expire(10.0)
    assert idx.releasing and idx.leases_by_owner()["r"] == 300  # queued, nothing walked at once
    held = [300]
    while idx.releasing:
        idx.release_slice()
        idx.check_invariants()
        held.append(idx.leases_by_owner().get("r", 0))
    assert [a - b for a, b in zip(held, held[1:])] == [3 * SLICE] * 6 + [3 * 4]
    assert idx.released_by(ReleaseReason.TTL) == 300 and not idx.holds("r")


def test_one_expiry_step_releases_at_most_a_slice_of_many_small_batches() -> None:
    idx, keys = _index(100, ttl=10.0)
    for i in range(0, 100, 10):  # ten batches of 10, one expiry
        idx.lease_reads(keys[i:i + 10], "r", 1, 0.0)
    idx.expire(10.0)
    assert idx.leases_by_owner()["r"] == 90  # the first batch at once, the next past the budget
    assert _drain(idx) <= 9
    assert idx.released_by(ReleaseReason.TTL) == 100 and not idx.holds("r")


def test_a_lease_renewed_between_slices_of_its_expiry_stays() -> None:
    idx, keys = _index(100, ttl=10.0)
    idx.lease_reads(keys, "r", 1, 0.0)
    idx.lease_reads(keys, "other", 1, 0.0)
    idx.expire(10.0)
    idx.release_slice()
    # the same owner leases again: its expired leases go first (TTL), then it holds anew
    assert idx.lease_reads(keys[:10], "r", 1, 10.0) == 10
    assert not any(o == "r" for o in idx._releasing)
    assert idx.leases_by_owner()["r"] == 10
    _drain(idx)
    assert idx.leases_by_owner() == {"r": 10}
    assert idx.released_by(ReleaseReason.TTL) == 200
    idx.check_invariants()


def test_an_end_session_between_slices_of_a_free_queues_behind_it() -> None:
    idx, keys = _index(100)
    idx.lease_reads(keys, "r", 1, 0.0)
    idx.release_chunks_in_slices("r", [k.chunk_hash for k in keys[:50]], 4, ReleaseReason.FREE, 1.0)
    idx.release_read(keys[60], "r", None, ReleaseReason.RETRIEVE, 1.0)  # a retrieve in between
    idx.release_read(keys[40], "r", None, ReleaseReason.RETRIEVE, 1.0)
    idx.release_owner_in_slices("r", ReleaseReason.END_SESSION, 1.0)
    _drain(idx)
    assert idx.released_by(ReleaseReason.FREE) == 49
    assert idx.released_by(ReleaseReason.RETRIEVE) == 2
    assert idx.released_by(ReleaseReason.END_SESSION) == 49
    assert not idx.holds("r")
    idx.check_invariants()


# ------------------------------------------------------------------------------ the server

RANKS, CHUNKS = 4, 64  # 256 objects; C = 4 tokens (sm_helpers)


def _looked_up(**config: object) -> tuple[ServerHarness, tuple[int, ...]]:
    h = ServerHarness(num_slots=1024, **config)  # type: ignore[arg-type]
    h.register(1, world_size=RANKS)
    toks = tokens(CHUNKS, seed=5)
    for r in range(RANKS):
        h.store(toks, worker_id=r, world_size=RANKS)
    h.send(Lookup(key("r", toks, world_size=RANKS)))
    while h.server.deferred_work:
        h.advance(0.0)
    assert h.server.leases_of("r") == CHUNKS * RANKS
    return h, toks


def test_the_server_answers_a_big_free_at_once_and_releases_on_its_turns() -> None:
    h, toks = _looked_up()
    rt = h.send(FreeLookupLocks(key("r", toks, world_size=RANKS)))
    assert h.result(rt) is None  # answered at once, the release to come
    assert h.server.leases_of("r") == 256 and h.server.deferred_work
    turns = 0
    while h.server.deferred_work:
        deadline = h.server.next_deadline()
        assert deadline is not None and deadline <= h.now
        h.advance(0.0)
        turns += 1
        assert h.server.leases_of("r") == 256 - SLICE * turns
    assert turns == 256 // SLICE and h.server.leases_of("r") == 0
    assert h.server.index.released_by(ReleaseReason.FREE) == 256
    h.server.check_invariants()


def test_a_lookup_of_the_same_request_between_turns_of_a_free_is_leased_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_jobs, "LEASE_SLICE_OBJECTS", 1 << 20)
    h, toks = _looked_up()
    assert h.result(h.send(QueryPrefetchStatus("r"))) == CHUNKS
    h.send(FreeLookupLocks(key("r", toks, world_size=RANKS)))
    h.send(Lookup(key("r", toks, world_size=RANKS)))  # between two turns: the free finishes first
    h.server.check_invariants()
    while h.server.deferred_work:
        h.advance(0.0)
        h.server.check_invariants()
    assert h.server.leases_of("r") == 256  # the new lookup's leases, untouched by the old free
    assert h.server.index.released_by(ReleaseReason.FREE) == 256
    h.send(EndSession("r"))
    while h.server.deferred_work:
        h.advance(0.0)
    stats = h.server.stats()
    assert stats["leases_held"] == 0 and stats["leases_taken"] == 512


def test_lease_ttl_expiry_of_a_big_lookup_goes_in_turns_and_a_store_between_them_keeps_the_objects() -> None:
    h, toks = _looked_up(lease_ttl=50.0)
    taken = h.server.stats()["leases_taken"]
    assert h.result(h.send(QueryPrefetchStatus("r"))) == CHUNKS
    h.advance(50.0)  # the leases are due: queued, a slice per turn from here
    assert h.server.deferred_work and h.server.next_deadline() == h.now
    h.advance(0.0)
    assert 0 < h.server.leases_of("r") < 256
    # a store of the same chunks between two turns: present already, nothing reserved twice
    h.store(toks, worker_id=0, world_size=RANKS)
    # another request looks the same keys up between two turns
    h.send(Lookup(key("r2", toks, world_size=RANKS)))
    h.server.check_invariants()
    while h.server.deferred_work:
        h.advance(0.0)
        h.server.check_invariants()
    assert h.server.leases_of("r") == 0 and h.server.leases_of("r2") == 256
    stats = h.server.stats()
    assert stats["leases_released_ttl"] == 256 and stats["leases_taken"] == taken + 256
    assert stats["leases_held"] == 256 and stats["objects"] == 256
