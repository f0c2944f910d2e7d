"""``L1Index.lease_prefix`` (a lookup's L1 prefix and its leases in one walk) and the batched
``release_owner``: the same result as the per-key forms, at every edge."""
from __future__ import annotations

import pytest

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.l1_index import L1Index, ObjectState, ReleaseReason
from mpcache.core_sm.messages import EndSession, Lookup, QueryPrefetchStatus
from sm_helpers import ServerHarness, key, tokens

HASHES = [bytes([i]) * 16 for i in range(6)]


def _index(keys: list[ObjectKey], ttl: float = 100.0, slots: int | None = None) -> L1Index:
    idx = L1Index(len(keys) + 2 if slots is None else slots, 10, lease_ttl=ttl)
    for k in keys:
        assert idx.reserve_write(k, "w", 1, 0) is not None
        assert idx.finish_write(k, "w", 0)
    return idx


def _per_key(idx: L1Index, hashes: list[bytes], ranks: tuple[int, ...], owner: object, n: int, now: float) -> int:
    """What the lookup path did before ``lease_prefix``: the prefix, then a top-up batch."""
    idx.expire(now)
    chunks, keys = idx.readable_prefix(hashes, ranks)
    if n > 0 and keys:
        idx.lease_reads(keys, owner, n, now, top_up=True, refresh=True)
    return chunks


def _same(a: L1Index, b: L1Index, keys: list[ObjectKey], owners: list[object]) -> None:
    a.check_invariants()
    b.check_invariants()
    assert a.stats() == b.stats()
    for k in keys:
        assert a.state(k) is b.state(k)
        for o in owners:
            assert a.read_count(k, o) == b.read_count(k, o)
            assert a.lease_expiry(k, o) == b.lease_expiry(k, o)
    for o in owners:
        assert a.keys_leased_by(o) == b.keys_leased_by(o)
    assert a.next_expiry() == b.next_expiry()


def _mixed() -> tuple[list[ObjectKey], list[ObjectKey]]:
    """Chunks 0-2 have both ranks; chunk 3 lacks rank 1; chunk 4 has both; chunk 5 none."""
    present = [ObjectKey(h, r) for h in HASHES[:5] for r in range(2)]
    present.remove(ObjectKey(HASHES[3], 1))
    return present, [ObjectKey(h, r) for h in HASHES for r in range(2)]


@pytest.mark.parametrize("ranks", [(0,), (1,), (0, 1), (1, 0)])
@pytest.mark.parametrize("n", [0, 1, 3])
def test_lease_prefix_is_readable_prefix_then_a_top_up(ranks: tuple[int, ...], n: int) -> None:
    present, every = _mixed()
    fast, slow = _index(present), _index(present)
    want = {(0,): 5, (1,): 3, (0, 1): 3, (1, 0): 3}[ranks]
    assert fast.lease_prefix(HASHES, ranks, "r", n, 1.0) == want
    assert _per_key(slow, HASHES, ranks, "r", n, 1.0) == want
    _same(fast, slow, every, ["r"])
    # a repeat lookup of the same owner renews what it holds and tops up to n, no more
    assert fast.lease_prefix(HASHES, ranks, "r", n + 1, 20.0) == want
    assert _per_key(slow, HASHES, ranks, "r", n + 1, 20.0) == want
    _same(fast, slow, every, ["r"])
    # the same count again: nothing to add, every lease it holds renewed
    assert fast.lease_prefix(HASHES, ranks, "r", n + 1, 25.0) == want
    assert _per_key(slow, HASHES, ranks, "r", n + 1, 25.0) == want
    _same(fast, slow, every, ["r"])
    if n:
        assert fast.lease_expiry(ObjectKey(HASHES[0], ranks[0]), "r") == 125.0
    assert fast.release_owner("r", ReleaseReason.END_SESSION, 30.0) == slow.release_owner(
        "r", ReleaseReason.END_SESSION, 30.0) == (n + 1) * want * len(ranks)
    _same(fast, slow, every, ["r"])


def test_a_prefix_stops_at_an_object_being_written_and_at_the_first_missing_chunk() -> None:
    keys = [ObjectKey(h, 0) for h in HASHES[:4]]
    idx = _index([keys[0], keys[1], keys[3]])
    assert idx.reserve_write(keys[2], "w2", 1, 0) is not None  # WRITING: not readable
    assert idx.lease_prefix(HASHES, (0,), "r", 1, 1.0) == 2
    assert [idx.read_count(k, "r") for k in keys] == [1, 1, 0, 0]
    assert idx.state(keys[2]) is ObjectState.WRITING
    assert idx.finish_write(keys[2], "w2", 2.0)
    assert idx.lease_prefix(HASHES, (0,), "s", 1, 2.0) == 4  # readable now, up to chunk 4's gap
    assert idx.lease_prefix([], (0,), "t", 1, 2.0) == 0
    assert idx.lease_prefix(HASHES, (), "t", 1, 2.0) == len(HASHES)  # no rank asked: as readable_prefix
    assert idx.lease_prefix(HASHES, (7,), "t", 1, 2.0) == 0  # a rank nothing was stored for
    assert not idx.holds("t")
    idx.check_invariants()


def test_an_expired_write_reservation_ends_the_prefix() -> None:
    keys = [ObjectKey(h, 0) for h in HASHES[:3]]
    idx = _index([keys[0], keys[2]], ttl=10.0)
    assert idx.reserve_write(keys[1], "w2", 1, 0) is not None
    assert idx.lease_prefix(HASHES, (0,), "r", 1, 10.0) == 1  # the reservation expired: absent
    assert idx.state(keys[1]) is ObjectState.ABSENT
    idx.check_invariants()


def test_a_repeated_hash_is_leased_once() -> None:
    keys = [ObjectKey(h, 0) for h in HASHES[:2]]
    idx = _index(keys)
    hashes = [HASHES[0], HASHES[0], HASHES[1]]
    assert idx.lease_prefix(hashes, (0,), "r", 2, 1.0) == 3
    assert [idx.read_count(k, "r") for k in keys] == [2, 2]
    assert idx.stats()["leases_held"] == 4
    assert idx.release_owner("r", ReleaseReason.END_SESSION, 1.0) == 4
    idx.check_invariants()


def test_leases_of_other_owners_are_left_alone_and_released_objects_are_most_recent() -> None:
    keys = [ObjectKey(h, 0) for h in HASHES[:4]]
    idx = _index(keys, slots=4)
    assert idx.lease_read(keys[1], "other", 1, 0.0)
    assert idx.lease_prefix(HASHES[:4], (0,), "r", 1, 1.0) == 4
    assert idx.read_count(keys[1], "other") == 1
    assert idx.release_owner("r", ReleaseReason.END_SESSION, 1.0) == 4
    assert idx.state(keys[1]) is ObjectState.READ_LEASED and idx.owners_of(keys[1]) == ("other",)
    # keys 0, 2, 3 are evictable again, in lease order; keys[1] is still leased
    for i, expect_gone in enumerate([keys[0], keys[2], keys[3]]):
        assert idx.reserve_write(ObjectKey(b"new%d" % i, 0), "w", 1, 2.0) is not None
        assert idx.state(expect_gone) is ObjectState.ABSENT
    assert idx.reserve_write(ObjectKey(b"full", 0), "w", 1, 2.0) is None  # only the leased one left
    idx.check_invariants()


def test_a_forced_clear_between_lookup_and_end_leaves_nothing_to_release() -> None:
    keys = [ObjectKey(h, 0) for h in HASHES[:3]]
    idx = _index(keys)
    assert idx.lease_prefix(HASHES, (0,), "r", 1, 1.0) == 3
    assert idx.clear(force=True) == 3
    assert not idx.holds("r") and idx.released_by(ReleaseReason.CLEAR) == 3
    assert idx.release_owner("r", ReleaseReason.END_SESSION, 2.0) == 0
    assert idx.lease_prefix(HASHES, (0,), "r", 1, 2.0) == 0
    for k in keys:  # stored again: the same owner leases them afresh
        assert idx.reserve_write(k, "w", 1, 3.0) is not None and idx.finish_write(k, "w", 3.0)
    assert idx.lease_prefix(HASHES, (0,), "r", 1, 3.0) == 3
    assert idx.next_expiry() == 103.0
    idx.check_invariants()


def test_leases_expire_by_ttl_after_a_batch_and_stale_entries_are_skipped() -> None:
    keys = [ObjectKey(h, 0) for h in HASHES[:3]]
    idx = _index(keys, ttl=10.0)
    assert idx.lease_prefix(HASHES, (0,), "a", 1, 0.0) == 3
    assert idx.lease_prefix(HASHES, (0,), "b", 1, 1.0) == 3
    assert idx.release_owner("a", ReleaseReason.END_SESSION, 2.0) == 3
    assert idx.next_expiry() == 11.0  # a's entry is stale: skipped
    idx.expire(11.0)
    assert idx.released_by(ReleaseReason.TTL) == 3 and not idx.holds("b")
    assert all(idx.state(k) is ObjectState.READY for k in keys)
    idx.check_invariants()


# -------------------------------------------------------------------------- through the server

def _stored(**config: int) -> tuple[ServerHarness, tuple[int, ...]]:
    """A server holding one stored 3-chunk prompt (instance 1), and the prompt."""
    h = ServerHarness(**config)
    h.register(1)
    toks = tokens(3)
    h.store(toks)
    return h, toks


def test_a_lookup_at_the_per_request_cap_takes_no_lease() -> None:
    h, toks = _stored(max_lookups_per_request=2)
    idx = h.server.index
    for _ in range(2):
        assert h.call(Lookup(key("r", toks), 2)) is None
        assert h.call(QueryPrefetchStatus("r")) == 3
    held = idx.stats()["leases_held"]
    taken = idx.stats()["leases_taken"]
    assert h.error_kind(h.send(Lookup(key("r", toks), 5))) is ErrorKind.TOO_LARGE
    assert idx.stats()["leases_held"] == held and idx.stats()["leases_taken"] == taken
    assert h.call(EndSession("r")) is None
    assert idx.stats()["leases_held"] == 0
    idx.check_invariants()


def test_a_chunk_evicted_between_lookup_and_status() -> None:
    # without reader counts a lookup leases nothing, so its chunks may go before the status
    h, toks = _stored(num_slots=3)
    assert h.call(Lookup(key("r", toks), 0)) is None
    for i in range(3):  # three other chunks push the prompt's out
        h.store(tokens(1, seed=50 + i), rid=f"f{i}")
    assert h.call(QueryPrefetchStatus("r")) == 3  # the answer of the lookup itself
    assert h.call(Lookup(key("r2", toks), 1)) is None
    assert h.call(QueryPrefetchStatus("r2")) == 0  # gone now: a new lookup sees it
    assert h.call(EndSession("r")) is None and h.call(EndSession("r2")) is None
    assert h.server.index.stats()["leases_held"] == 0
    h.server.index.check_invariants()
