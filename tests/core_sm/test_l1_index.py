from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.l1_index import OPERATIONS, TRANSITIONS, L1Index, ObjectState, ReleaseReason

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


def _fill(idx: L1Index, tenant: object, n: int, tag: bytes, now: float = 0.0) -> list[ObjectKey]:
    keys = []
    for i in range(n):
        k = ObjectKey(tag + bytes([i]), 0)
        assert idx.reserve_write(k, "w", 1, now, tenant) is not None, (tenant, i)
        assert idx.finish_write(k, "w", now)
        keys.append(k)
    return keys


def test_a_tenant_over_its_share_evicts_its_own_lru_objects_never_a_tenant_within_its_share() -> None:
    idx = L1Index(num_slots=4, slot_bytes=8)
    idx.quota.tenant_share = 2
    victim = _fill(idx, 2, 2, b"v")  # within its share
    flood = _fill(idx, 1, 2, b"f")  # L1 is full now
    more = _fill(idx, 1, 5, b"g")  # every one of these evicts one of tenant 1's own
    assert all(idx.is_readable(k) for k in victim)
    assert [k for k in flood + more if idx.is_readable(k)] == more[-2:]  # its most recent
    assert idx.quota.charged(1) == 2 and idx.quota.charged(2) == 2
    assert idx.stats()["evictions"] == 5 and idx.stats()["evictions_for_others"] == 0
    idx.check_invariants()


def test_a_tenant_within_its_share_evicts_a_flooders_objects_first() -> None:
    idx = L1Index(num_slots=4, slot_bytes=8)
    idx.quota.tenant_share = 2
    flood = _fill(idx, 1, 4, b"f")  # free slots are anyone's: tenant 1 holds all four
    idx.touch(flood[0])  # flood[1] is now its least recently used
    mine = _fill(idx, 2, 2, b"m")
    assert all(idx.is_readable(k) for k in mine)
    assert [idx.is_readable(k) for k in flood] == [True, False, False, True]
    assert idx.stats()["evictions_for_others"] == 2
    # both at their share now: tenant 2 storing more evicts its own, tenant 1's stay
    third = _fill(idx, 2, 1, b"t")
    assert not idx.is_readable(mine[0]) and idx.is_readable(third[0]) and idx.quota.charged(1) == 2
    idx.check_invariants()


def test_a_reservation_that_may_evict_nothing_is_refused_and_changes_nothing() -> None:
    idx = L1Index(num_slots=4, slot_bytes=8)
    idx.quota.tenant_share = 3  # e.g. max_slots_per_instance: both tenants below their share
    a, b = _fill(idx, 1, 2, b"a"), _fill(idx, 2, 2, b"b")
    # an L2 read (no tenant) may not take an object of a tenant below its share
    assert idx.reserve_write(ObjectKey(b"l2", 0), "read", 1, 0.0) is None
    # a tenant with nothing evictable of its own (leased) cannot take the other's
    assert idx.lease_reads(a, "req", 1, 0.0) == 2
    assert idx.reserve_write(ObjectKey(b"a9", 0), "w", 1, 0.0, 1) is None
    assert all(idx.is_readable(k) for k in a + b) and idx.stats()["evictions"] == 0
    idx.check_invariants()


def test_an_l2_read_may_evict_from_tenants_at_their_share() -> None:
    # one engine that filled L1 (its share is all of it) still gets its L2 hits loaded
    idx = L1Index(num_slots=2, slot_bytes=8)
    idx.quota.tenant_share = 2
    a = _fill(idx, 1, 2, b"a")
    assert idx.reserve_write(ObjectKey(b"l2", 0), "read", 1, 0.0) is not None
    assert not idx.is_readable(a[0]) and idx.is_readable(a[1]) and idx.quota.charged(None) == 1
    idx.check_invariants()


def test_no_tenant_objects_and_a_gone_tenants_objects_are_the_first_to_go() -> None:
    idx = L1Index(num_slots=4, slot_bytes=8)
    idx.quota.tenant_share = 2
    l2 = _fill(idx, None, 1, b"c")  # loaded from L2 for a lookup: nobody's
    gone = _fill(idx, 3, 1, b"g")
    keep = _fill(idx, 1, 2, b"k")
    assert idx.quota.forget_tenant(3) == 1 and idx.tenant_of(gone[0]) is None and idx.quota.charged(None) == 2
    assert idx.is_readable(gone[0])  # still a hit until room is needed
    new = _fill(idx, 2, 2, b"n")
    assert not idx.is_readable(l2[0]) and not idx.is_readable(gone[0])  # LRU order among them
    assert all(idx.is_readable(k) for k in keep + new)
    assert idx.quota.forget_tenant(3) == 0
    idx.check_invariants()


def test_readers_are_not_charged_for_an_object_they_share() -> None:
    idx = L1Index(num_slots=3, slot_bytes=8)
    idx.quota.tenant_share = 1
    (shared,) = _fill(idx, 1, 1, b"s")
    assert idx.lease_read(shared, "tenant-2-request", 1, 0.0)
    assert idx.quota.charged(1) == 1 and idx.quota.charged(2) == 0 and idx.tenant_of(shared) == 1
    assert idx.release_read(shared, "tenant-2-request", None, ReleaseReason.RETRIEVE, 0.0) == 1
    # tenant 2 stores up to L1's size: tenant 1's object is within its share and stays
    two = _fill(idx, 2, 2, b"t")
    assert idx.reserve_write(ObjectKey(b"t9", 0), "w", 1, 0.0, 2) is not None
    assert idx.is_readable(shared) and not idx.is_readable(two[0])
    idx.check_invariants()


def test_without_a_share_eviction_is_one_global_lru() -> None:
    idx = L1Index(num_slots=2, slot_bytes=8)
    a = _fill(idx, 1, 1, b"a")
    b = _fill(idx, 2, 1, b"b")
    _fill(idx, 2, 1, b"c")
    assert not idx.is_readable(a[0]) and idx.is_readable(b[0])


KEYS = [ObjectKey(bytes([i]), r) for i in range(4) for r in range(2)]
OWNERS = ["a", "b", ("transfer", 1)]
TENANTS = [None, 1, 2]


class L1Machine(RuleBasedStateMachine):
    """Random operations; a model tracks every lease count per (key, owner)."""

    @initialize(slots=st.integers(1, 6), ttl=st.sampled_from([5.0, 50.0]),
                share=st.one_of(st.none(), st.integers(1, 3)))
    def setup(self, slots: int, ttl: float, share: int | None) -> None:
        self.idx = L1Index(slots, 8, lease_ttl=ttl, high_watermark=1.0, low_watermark=1.0)
        self.idx.quota.tenant_share = share
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

    @rule(key=st.sampled_from(KEYS), nbytes=st.integers(0, 8), tenant=st.sampled_from(TENANTS))
    def reserve_and_finish(self, key: ObjectKey, nbytes: int, tenant: object) -> None:
        idx = self.idx
        before = {k: idx.state(k) for k in KEYS}
        tenants = {k: idx.tenant_of(k) for k in KEYS}
        charged = {t: idx.quota.charged(t) for t in TENANTS}
        own_evictable = any(s is ObjectState.READY and tenants[k] == tenant for k, s in before.items())
        slot = idx.reserve_write(key, "w", nbytes, self.now, tenant)
        evicted = [k for k, s in before.items() if s is not ObjectState.ABSENT and idx.state(k) is ObjectState.ABSENT]
        share = idx.quota.tenant_share
        for k in evicted:
            t = tenants[k]
            # the quota: another tenant's object goes only when that tenant is over its share
            limit = None if share is None else share - 1 if tenant is None else share
            assert limit is None or t == tenant or t is None or charged[t] > limit, (k, t, tenant)
            if share is not None and tenant is not None and charged[tenant] >= share and own_evictable:
                assert t == tenant, "a tenant at its share evicts its own first"
        if slot is not None:
            assert before[key] is ObjectState.ABSENT and idx.tenant_of(key) == tenant
            for k, s in before.items():  # eviction never touches leased or writing objects
                if s in (ObjectState.READ_LEASED, ObjectState.WRITING):
                    assert idx.state(k) is s
            assert idx.finish_write(key, "w", self.now)

    @rule(tenant=st.sampled_from(TENANTS[1:]))
    def tenant_gone(self, tenant: object) -> None:
        n = self.idx.quota.charged(tenant)
        assert self.idx.quota.forget_tenant(tenant) == n and self.idx.quota.charged(tenant) == 0

    @rule(key=st.sampled_from(KEYS))
    def touch(self, key: ObjectKey) -> None:
        self.idx.touch(key)

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

    @rule(hashes=st.lists(st.sampled_from([bytes([i]) for i in range(5)]), max_size=5),
          ranks=st.sampled_from([(0,), (1,), (0, 1), (1, 0)]), owner=st.sampled_from(OWNERS),
          n=st.integers(0, 3))
    def lease_prefix(self, hashes: list[bytes], ranks: tuple[int, ...], owner: object, n: int) -> None:
        chunks = 0
        for h in hashes:
            if not all(self.idx.is_readable(ObjectKey(h, r)) for r in ranks):
                break
            chunks += 1
        assert self.idx.lease_prefix(hashes, ranks, owner, n, self.now) == chunks
        if n < 1:
            return
        for h in dict.fromkeys(hashes[:chunks]):
            for r in ranks:
                count, _exp = self.model.get((ObjectKey(h, r), owner), (0, 0.0))
                self.model[(ObjectKey(h, r), owner)] = (max(count, n), self.now + self.idx.lease_ttl)
                self.taken += max(0, n - count)

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
        for (key, owner), (count, exp) in self.model.items():
            assert self.idx.read_count(key, owner) == count
            assert self.idx.lease_expiry(key, owner) == exp
        assert self.idx.stats()["leases_held"] == sum(c for c, _ in self.model.values())
        for k in KEYS:
            assert self.idx.total_read_count(k) >= 0


L1Machine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestL1Machine = L1Machine.TestCase


def test_server_two_instances_one_floods_the_others_hits_survive() -> None:
    # LookupServer end to end: instance 2 stores a prompt; instance 1 then commits ten times L1
    # in stores; instance 2's prompt still hits in full, instance 1 keeps its share.
    from mpcache.core_sm.messages import Lookup, QueryPrefetchStatus, Store
    from sm_helpers import ServerHarness, key, tokens

    h = ServerHarness(num_slots=8)
    h.register(1)
    h.register(2)
    victim = tokens(3, seed=99)
    rt = h.send(Store(key("v", victim, worker_id=0), 2))
    h.finish_all_transfers()
    assert h.result(rt).stored == 3  # type: ignore[attr-defined]
    for i in range(40):
        rt = h.send(Store(key(f"f{i}", tokens(2, seed=i), worker_id=0), 1))
        h.finish_all_transfers()
        h.result(rt)
    idx = h.server.index
    assert idx.quota.charged(2) == 3 and idx.quota.charged(1) == 5  # all the room the victim does not use
    assert h.call(Lookup(key("probe", victim), 1)) is None
    assert h.call(QueryPrefetchStatus("probe")) == 3  # all 3 of its chunks hit
    # the victim unregisters: its objects are nobody's now (still hits), the flooder's share grows
    from mpcache.core_sm.messages import UnregisterInstance

    assert h.call(UnregisterInstance(2)) is None
    assert idx.quota.charged(2) == 0 and idx.quota.charged(None) == 3 and idx.quota.tenant_share == 8


def test_lease_reads_refresh_renews_held_leases_and_lease_expiry_reads_them() -> None:
    keys = [ObjectKey(bytes([i]), 0) for i in range(2)]
    idx = _ready_index(keys, ttl=100)
    assert idx.lease_read(keys[0], "r", 1, 0)
    assert idx.lease_expiry(keys[0], "r") == 100 and idx.lease_expiry(keys[1], "r") is None
    assert idx.lease_reads(keys, "r", 1, 60, top_up=True, refresh=True) == 2
    assert [idx.lease_expiry(k, "r") for k in keys] == [160, 160]
    assert [idx.read_count(k, "r") for k in keys] == [1, 1]  # renewed, not added
    idx.expire(100)
    assert [idx.read_count(k, "r") for k in keys] == [1, 1]
    idx.expire(160)
    assert idx.stats()["leases_held"] == 0
    idx.check_invariants()
