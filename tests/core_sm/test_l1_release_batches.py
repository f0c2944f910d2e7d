"""The batch release paths of ``L1Index`` (a lock release over a whole range, leases expiring
together) do exactly what releasing key by key does: same counts, same objects evictable, same
recency order, same invariants."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.l1_index import L1Index, ReleaseReason

HASHES = [bytes([i]) * 4 for i in range(6)]


def _index(leases: list[tuple[int, int, str, int]]) -> L1Index:
    idx = L1Index(num_slots=64, slot_bytes=1, lease_ttl=10.0)
    for h in HASHES:
        for r in range(3):
            k = ObjectKey(h, r)
            assert idx.reserve_write(k, "w", 1, 0.0) is not None and idx.finish_write(k, "w", 0.0)
    for t, (h, r, owner, n) in enumerate(leases):
        assert idx.lease_read(ObjectKey(HASHES[h], r), owner, n, float(t % 3))
    return idx


def _view(idx: L1Index) -> tuple[object, ...]:
    idx.check_invariants()
    keys = [ObjectKey(h, r) for h in HASHES for r in range(3)]
    lru_order = sorted((k for k in keys if idx.total_read_count(k) == 0), key=lambda k: idx._objects[k].used)
    return (idx.leases_by_owner(), [idx.read_count(k, o) for k in keys for o in "ab"], lru_order,
            idx.stats())


LEASES = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2), st.sampled_from("ab"), st.integers(1, 3)),
                  max_size=20)


@settings(max_examples=200, deadline=None)
@given(leases=LEASES, chunks=st.lists(st.integers(0, 5), max_size=6), ranks=st.integers(0, 3))
def test_release_chunks_is_release_reads_of_those_keys(leases: list[tuple[int, int, str, int]],
                                                        chunks: list[int], ranks: int) -> None:
    by_key, batch = _index(leases), _index(leases)
    hashes = [HASHES[c] for c in chunks]
    # key by key, in the order the owner leased them (release_chunks' order)
    held = [k for k in by_key.keys_leased_by("a") if k.chunk_hash in set(hashes) and k.kv_rank < ranks]
    expected = by_key.release_reads(held, "a", None, ReleaseReason.FREE, 3.0)
    assert batch.release_chunks("a", hashes, ranks, ReleaseReason.FREE, 3.0) == expected
    assert _view(batch) == _view(by_key)


@settings(max_examples=200, deadline=None)
@given(leases=LEASES, at=st.sampled_from([5.0, 10.0, 11.0, 12.5, 40.0]))
def test_expiry_in_batches_is_release_key_by_key(leases: list[tuple[int, int, str, int]], at: float) -> None:
    idx = _index(leases)
    model = {(k, o): idx.read_count(k, o) for k in idx.objects() for o in "ab" if idx.read_count(k, o)}
    expiring = {ko for ko in model if (e := idx.lease_expiry(*ko)) is not None and e <= at}
    idx.expire(at)
    idx.check_invariants()
    for (k, o), n in model.items():
        assert idx.read_count(k, o) == (0 if (k, o) in expiring else n)
    assert idx.released_by(ReleaseReason.TTL) == sum(model[ko] for ko in expiring)
