from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from core_sm.chunks import ObjectKey
from core_sm.l1_index import OPERATIONS, TRANSITIONS, L1Index, ObjectState, ReleaseReason

K = ObjectKey(b"k", 0)
OTHER = ObjectKey(b"o", 0)


def _index_in(state: ObjectState) -> L1Index:
    idx = L1Index(num_slots=1, slot_bytes=10, lease_ttl=10.0)
    if state is not ObjectState.ABSENT:
        assert idx.reserve_write(K, "w", 5, 0.0) == 0
    if state in (ObjectState.READY, ObjectState.READ_LEASED):
        assert idx.finish_write(K, "w", 0.0)
    if state is ObjectState.READ_LEASED:
        assert idx.lease_read(K, "r", 1, 0.0)
    assert idx.state(K) is state
    return idx


def _apply(idx: L1Index, op: str) -> object:
    if op == "reserve_write":
        return idx.reserve_write(K, "w2", 5, 1.0)
    if op == "finish_write":
        return idx.finish_write(K, "w", 1.0)
    if op == "abort_write":
        return idx.abort_write(K, "w", 1.0)
    if op == "lease_read":
        return idx.lease_read(K, "r2", 1, 1.0)
    if op == "release_read":
        return idx.release_read(K, "r", 1, ReleaseReason.FREE, 1.0)
    if op == "expire":
        idx.expire(100.0)
        return None
    if op == "evict":  # a reservation for another key in a full index evicts the LRU object
        return idx.reserve_write(OTHER, "x", 5, 1.0)
    if op == "clear":
        return idx.clear(False)
    if op == "clear_force":
        return idx.clear(True)
    raise AssertionError(op)


@pytest.mark.parametrize("state", list(ObjectState))
@pytest.mark.parametrize("op", OPERATIONS)
def test_every_state_times_every_operation(state: ObjectState, op: str) -> None:
    """A listed (state, op) lands in an allowed next state; an unlisted one changes nothing."""
    idx = _index_in(state)
    _apply(idx, op)
    after = idx.state(K)
    allowed = TRANSITIONS.get((state, op))
    if allowed is None:
        assert after is state, f"{op} on {state} is not in the table but changed it to {after}"
    else:
        assert after in allowed
    idx.check_invariants()


def test_table_mentions_only_known_operations() -> None:
    assert {op for _s, op in TRANSITIONS} <= set(OPERATIONS)


def test_owned_release_is_exact() -> None:
    idx = L1Index(4, 10)
    idx.reserve_write(K, "w", 10, 0)
    idx.finish_write(K, "w", 0)
    idx.lease_read(K, "a", 2, 0)
    idx.lease_read(K, "b", 1, 0)
    assert idx.release_read(K, "c", None, ReleaseReason.FREE, 0) == 0
    assert idx.release_read(K, "a", None, ReleaseReason.FREE, 0) == 2
    assert idx.read_count(K, "b") == 1 and idx.state(K) is ObjectState.READ_LEASED
    assert idx.release_owner("b", ReleaseReason.END_SESSION, 0) == 1
    assert idx.state(K) is ObjectState.READY
    assert idx.released_by(ReleaseReason.FREE) == 2 and idx.released_by(ReleaseReason.END_SESSION) == 1
    idx.check_invariants()


def test_lease_ttl_counts_as_released_and_refreshes() -> None:
    idx = L1Index(4, 10, lease_ttl=300)
    idx.reserve_write(K, "w", 1, 0)
    idx.finish_write(K, "w", 0)
    idx.lease_read(K, "a", 1, 0)
    idx.lease_read(K, "a", 1, 200)  # refresh: expiry 500
    assert idx.next_expiry() is not None
    idx.expire(400)
    assert idx.read_count(K, "a") == 2
    idx.expire(500)
    assert idx.read_count(K, "a") == 0 and idx.released_by(ReleaseReason.TTL) == 2
    assert idx.state(K) is ObjectState.READY
    idx.check_invariants()


def test_write_reservation_expires() -> None:
    idx = L1Index(1, 10, lease_ttl=5)
    assert idx.reserve_write(K, "w", 1, 0) == 0
    idx.expire(5)
    assert idx.state(K) is ObjectState.ABSENT and not idx.finish_write(K, "w", 6)
    assert idx.stats()["write_expirations"] == 1 and idx.stats()["free_slots"] == 1


def test_lru_evicts_only_ready_unleased_oldest_first() -> None:
    idx = L1Index(3, 10)
    keys = [ObjectKey(bytes([i]), 0) for i in range(4)]
    for k in keys[:3]:
        idx.reserve_write(k, "w", 10, 0)
        idx.finish_write(k, "w", 0)
    idx.lease_read(keys[0], "r", 1, 0)  # oldest but leased
    idx.touch(keys[1])  # now 2 is the least recently used unleased
    assert idx.reserve_write(keys[3], "w", 10, 0) is not None
    assert idx.state(keys[2]) is ObjectState.ABSENT
    assert idx.state(keys[0]) is ObjectState.READ_LEASED and idx.state(keys[1]) is ObjectState.READY
    # everything leased or writing: no slot, no eviction
    idx.lease_read(keys[1], "r", 1, 0)
    assert idx.reserve_write(ObjectKey(b"z", 0), "w", 10, 0) is None
    assert idx.stats()["evictions"] == 1
    idx.check_invariants()


def test_watermark_evicts_down_to_low() -> None:
    idx = L1Index(10, 1, high_watermark=0.8, low_watermark=0.5)
    for i in range(9):
        k = ObjectKey(bytes([i]), 0)
        idx.reserve_write(k, "w", 1, 0)
        idx.finish_write(k, "w", 0)
    # the 9th reservation crossed 8 used: evicted down to 5 (only ready ones could go)
    assert idx.used_slots <= 9
    k = ObjectKey(b"x", 0)
    idx.reserve_write(k, "w", 1, 0)
    assert idx.used_slots <= 5 + 1
    idx.check_invariants()


def test_clear() -> None:
    idx = _index_in(ObjectState.READ_LEASED)
    assert idx.clear(False) == 0
    assert idx.clear(True) == 1
    assert idx.released_by(ReleaseReason.CLEAR) == 1 and idx.bytes_used == 0
    idx.check_invariants()


def test_object_larger_than_slot_refused() -> None:
    assert L1Index(1, 10).reserve_write(K, "w", 11, 0) is None


def _ready_index(keys: list[ObjectKey], ttl: float = 300.0) -> L1Index:
    idx = L1Index(len(keys) + 2, 10, lease_ttl=ttl)
    for k in keys:
        assert idx.reserve_write(k, "w", 1, 0) is not None
        assert idx.finish_write(k, "w", 0)
    return idx


def test_readable_prefix_stops_at_the_first_chunk_missing_a_rank() -> None:
    hashes = [b"a", b"b", b"c", b"d"]
    present = [ObjectKey(h, r) for h in hashes[:3] for r in range(2)]
    present.remove(ObjectKey(b"c", 1))
    idx = _ready_index(present + [ObjectKey(b"d", 0), ObjectKey(b"d", 1)])
    assert idx.reserve_write(ObjectKey(b"c", 1), "w2", 1, 0) is not None  # being written: not readable
    chunks, keys = idx.readable_prefix(hashes, range(2))
    assert chunks == 2
    assert keys == [ObjectKey(b"a", 0), ObjectKey(b"a", 1), ObjectKey(b"b", 0), ObjectKey(b"b", 1)]
    assert idx.readable_prefix(hashes, (0,)) == (4, [ObjectKey(h, 0) for h in hashes])
    assert idx.readable_prefix([], range(2)) == (0, [])


def test_lease_reads_tops_up_and_refreshes_only_what_it_adds() -> None:
    keys = [ObjectKey(bytes([i]), 0) for i in range(3)]
    idx = _ready_index(keys, ttl=100)
    assert idx.lease_read(keys[0], "r", 2, 0)
    assert idx.lease_read(keys[1], "r", 1, 0)
    missing = ObjectKey(b"x", 0)
    assert idx.lease_reads([*keys, missing], "r", 2, 50, top_up=True) == 3
    assert [idx.read_count(k, "r") for k in keys] == [2, 2, 2]
    assert idx.stats()["leases_taken"] == 3 + 1 + 2
    idx.expire(100)  # keys[0] was already at 2: not refreshed, so it expires with its first lease
    assert [idx.read_count(k, "r") for k in keys] == [0, 2, 2]
    idx.expire(150)
    assert idx.stats()["leases_held"] == 0 and idx.released_by(ReleaseReason.TTL) == 6
    idx.check_invariants()


def test_lease_reads_adds_like_lease_read_per_key() -> None:
    keys = [ObjectKey(bytes([i]), r) for i in range(3) for r in range(2)]
    batch, single = _ready_index(keys), _ready_index(keys)
    order = [keys[0], keys[3], keys[0], keys[5]]
    assert batch.lease_reads(order, "o", 2, 1.0) == 4
    for k in order:
        assert single.lease_read(k, "o", 2, 1.0)
    for k in keys:
        assert batch.read_count(k, "o") == single.read_count(k, "o")
        assert batch.state(k) is single.state(k)
    assert batch.stats() == single.stats()
    assert batch.lease_reads(order, "o", 0, 1.0) == 0  # a count below 1 leases nothing
    batch.check_invariants()


def test_release_reads_and_release_owner_are_exact() -> None:
    keys = [ObjectKey(bytes([i]), 0) for i in range(4)]
    idx = _ready_index(keys)
    idx.lease_reads(keys, "a", 2, 0)
    idx.lease_reads(keys[:2], "b", 1, 0)
    assert idx.release_reads(keys[:3], "a", 1, ReleaseReason.RETRIEVE, 0) == 3
    assert idx.release_reads(keys, "c", None, ReleaseReason.FREE, 0) == 0
    assert [idx.read_count(k, "a") for k in keys] == [1, 1, 1, 2]
    assert idx.release_owner("a", ReleaseReason.END_SESSION, 0) == 5
    assert idx.release_owner("a", ReleaseReason.END_SESSION, 0) == 0
    assert [idx.state(k) for k in keys] == [ObjectState.READ_LEASED] * 2 + [ObjectState.READY] * 2
    assert idx.keys_leased_by("b") == tuple(keys[:2])
    idx.check_invariants()


def test_released_leases_do_not_pile_up_in_the_expiry_heap() -> None:
    keys = [ObjectKey(bytes([i]), 0) for i in range(8)]
    idx = _ready_index(keys, ttl=300)
    idx.lease_read(keys[0], "kept", 1, 0)
    for i in range(5000):
        rid = f"r{i}"
        idx.lease_reads(keys, rid, 1, float(i) / 1000)
        idx.release_owner(rid, ReleaseReason.END_SESSION, float(i) / 1000)
    assert len(idx._expiries) <= 2 * 1024 + 1  # compacted, not 5000 entries
    idx.check_invariants()  # the kept lease still has its expiry entry
    idx.expire(300)
    assert idx.read_count(keys[0], "kept") == 0 and idx.released_by(ReleaseReason.TTL) == 1


KEYS = [ObjectKey(bytes([i]), r) for i in range(4) for r in range(2)]
OWNERS = ["a", "b", ("transfer", 1)]


class L1Machine(RuleBasedStateMachine):
    """Random operations; a model tracks every lease count per (key, owner)."""

    @initialize(slots=st.integers(1, 6), ttl=st.sampled_from([5.0, 50.0]))
    def setup(self, slots: int, ttl: float) -> None:
        self.idx = L1Index(slots, 8, lease_ttl=ttl, high_watermark=1.0, low_watermark=1.0)
        self.now = 0.0
        self.model: dict[tuple[ObjectKey, object], tuple[int, float]] = {}  # count, expiry
        self.taken = 0

    def _expire_model(self) -> None:
        for k, (_c, exp) in list(self.model.items()):
            if exp <= self.now:
                del self.model[k]

    @rule(dt=st.sampled_from([0.0, 1.0, 4.0, 30.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.idx.expire(self.now)
        self._expire_model()

    @rule(key=st.sampled_from(KEYS), nbytes=st.integers(0, 8))
    def reserve_and_finish(self, key: ObjectKey, nbytes: int) -> None:
        before = {k: self.idx.state(k) for k in KEYS}
        slot = self.idx.reserve_write(key, "w", nbytes, self.now)
        if slot is not None:
            assert before[key] is ObjectState.ABSENT
            for k, s in before.items():  # eviction never touches leased or writing objects
                if s in (ObjectState.READ_LEASED, ObjectState.WRITING):
                    assert self.idx.state(k) is s
            assert self.idx.finish_write(key, "w", self.now)

    @rule(key=st.sampled_from(KEYS))
    def reserve_and_abort(self, key: ObjectKey) -> None:
        if self.idx.reserve_write(key, "w", 1, self.now) is not None:
            assert self.idx.abort_write(key, "w", self.now)
            assert self.idx.state(key) is ObjectState.ABSENT

    @rule(key=st.sampled_from(KEYS), owner=st.sampled_from(OWNERS), n=st.integers(1, 3))
    def lease(self, key: ObjectKey, owner: object, n: int) -> None:
        readable = self.idx.is_readable(key)
        ok = self.idx.lease_read(key, owner, n, self.now)
        assert ok == readable
        if ok:
            count, _ = self.model.get((key, owner), (0, 0.0))
            self.model[(key, owner)] = (count + n, self.now + self.idx.lease_ttl)
            # a refresh moves every lease of this owner on this key
            self.taken += n

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=6), owner=st.sampled_from(OWNERS),
          n=st.integers(1, 3), top_up=st.booleans())
    def lease_batch(self, keys: list[ObjectKey], owner: object, n: int, top_up: bool) -> None:
        readable = [k for k in keys if self.idx.is_readable(k)]
        assert self.idx.lease_reads(keys, owner, n, self.now, top_up=top_up) == len(readable)
        for key in readable:
            count, exp = self.model.get((key, owner), (0, 0.0))
            add = max(0, n - count) if top_up else n
            if add:
                self.model[(key, owner)] = (count + add, self.now + self.idx.lease_ttl)
                self.taken += add

    @rule(key=st.sampled_from(KEYS), owner=st.sampled_from(OWNERS), n=st.one_of(st.none(), st.integers(1, 3)))
    def release(self, key: ObjectKey, owner: object, n: int | None) -> None:
        got = self.idx.release_read(key, owner, n, ReleaseReason.FREE, self.now)
        assert got == self._release_model(key, owner, n)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=6), owner=st.sampled_from(OWNERS),
          n=st.one_of(st.none(), st.integers(1, 3)))
    def release_batch(self, keys: list[ObjectKey], owner: object, n: int | None) -> None:
        want = sum(self._release_model(k, owner, n) for k in keys)
        assert self.idx.release_reads(keys, owner, n, ReleaseReason.RETRIEVE, self.now) == want

    def _release_model(self, key: ObjectKey, owner: object, n: int | None) -> int:
        count, exp = self.model.get((key, owner), (0, 0.0))
        want = count if n is None else min(n, count)
        if count - want:
            self.model[(key, owner)] = (count - want, exp)
        else:
            self.model.pop((key, owner), None)
        return want

    @rule(owner=st.sampled_from(OWNERS))
    def release_owner(self, owner: object) -> None:
        want = sum(c for (k, o), (c, _e) in self.model.items() if o == owner)
        assert self.idx.release_owner(owner, ReleaseReason.END_SESSION, self.now) == want
        for k in [k for k in self.model if k[1] == owner]:
            del self.model[k]

    @rule(force=st.booleans())
    def clear(self, force: bool) -> None:
        self.idx.clear(force)
        if force:
            self.model.clear()

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "idx"):
            return
        self.idx.check_invariants()
        for (key, owner), (count, _exp) in self.model.items():
            assert self.idx.read_count(key, owner) == count
        assert self.idx.stats()["leases_held"] == sum(c for c, _ in self.model.values())
        for k in KEYS:
            assert self.idx.total_read_count(k) >= 0


L1Machine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestL1Machine = L1Machine.TestCase
