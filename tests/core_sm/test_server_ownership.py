"""Ownership and bounds on the server machines: what one peer creates, another cannot touch (a
request is (peer, request id): another peer naming the id names a request of its own); what one
client may hold or name is bounded; every refusal is one typed error, nothing changes."""
from __future__ import annotations

from typing import Any

import pytest

from mpcache.core_sm.effects import StartTransfer
from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.messages import (
    CacheKey,
    Clear,
    CommitTransfer,
    InstanceFailed,
    EndSession,
    FreeLookupLocks,
    Lookup,
    Ping,
    PrepareRetrieve,
    PrepareStore,
    QueryPrefetchStatus,
    RegisterInstance,
    Retrieve,
    Store,
    StoreResult,
    TransferPlan,
    UnregisterInstance,
    WaitPrefetchStatus,
)
from mpcache.core_sm.server import JobState, RequestKey, ServerConfig, TransferState
from sm_helpers import C, MODEL, ServerHarness, key, tokens

A, B = "peer-a", "peer-b"
TOKS = tokens(3)


def _call(h: ServerHarness, request: Any, peer: Any) -> Any:
    import attrs

    return h.send(attrs.evolve(request, peer=peer))


def _register(h: ServerHarness, iid: int, peer: Any, engine_driven: bool = False) -> None:
    assert isinstance(h.result(_call(h, RegisterInstance(iid, MODEL, 1, 10, engine_driven), peer)), int)


def _stored(h: ServerHarness, toks: tuple[int, ...], iid: int, peer: Any, rid: str = "w") -> Any:
    rt = _call(h, Store(key(rid, toks, worker_id=0), iid), peer)
    h.finish_all_transfers()
    return h.result(rt)


def test_two_peers_naming_one_request_id_are_two_requests() -> None:
    h = ServerHarness()
    _register(h, 1, A)
    _stored(h, TOKS, 1, A)
    assert h.result(_call(h, Lookup(key("r", TOKS), 1), A)) is None
    assert h.server.leases_of("r", A) == 3
    # B names A's id: every request of B's is about B's own request "r", none is refused
    assert h.result(_call(h, QueryPrefetchStatus("r"), B)) == 0  # B has no such request
    assert h.result(_call(h, WaitPrefetchStatus("r", 5.0), B)) == 0
    for request in (EndSession("r"), FreeLookupLocks(key("r", TOKS))):
        assert h.result(_call(h, request, B)) is None, request
    assert h.server.job_state("r", A) is JobState.DONE and h.server.leases_of("r", A) == 3
    assert h.result(_call(h, Lookup(key("r", TOKS), 2), B)) is None  # B's own job and leases
    assert h.server.job_state("r", B) is JobState.DONE and h.server.leases_of("r", B) == 6
    assert h.result(_call(h, EndSession("r"), B)) is None
    assert h.server.leases_of("r", B) == 0 and h.server.leases_of("r", A) == 3
    assert h.result(_call(h, QueryPrefetchStatus("r"), A)) == 3
    assert h.result(_call(h, QueryPrefetchStatus("r"), B)) == 0  # A's tombstone is A's
    assert h.result(_call(h, EndSession("r"), A)) is None
    assert h.server.leases_of("r", A) == 0 and h.server.stats()["errors"] == 0


def test_a_squatter_that_looks_up_an_id_first_denies_nothing() -> None:
    h = ServerHarness()
    _register(h, 1, A)
    _stored(h, TOKS, 1, A)
    # B guesses A's next id and looks it up first, over junk tokens and the same tokens
    assert h.result(_call(h, Lookup(key("cmpl-7", tokens(2, seed=9)), 1), B)) is None
    for _ in range(3):
        assert h.result(_call(h, Lookup(key("cmpl-8", TOKS), 1), B)) is None
    assert h.result(_call(h, Lookup(key("cmpl-7", TOKS), 1), A)) is None
    assert h.result(_call(h, QueryPrefetchStatus("cmpl-7"), A)) == 3  # A's lookup hit normally
    assert h.result(_call(h, FreeLookupLocks(key("cmpl-7", TOKS, 0, C)), A)) is None
    assert h.server.leases_of("cmpl-7", A) == 2
    assert h.result(_call(h, EndSession("cmpl-7"), A)) is None
    assert h.server.leases_of("cmpl-7", A) == 0
    assert h.server.job_state("cmpl-7", B) is JobState.DONE  # the squatter's own job is untouched
    assert h.result(_call(h, Lookup(key("cmpl-8", TOKS), 1), A)) is None  # B's repeats count for B
    assert h.result(_call(h, QueryPrefetchStatus("cmpl-8"), A)) == 3
    assert h.server.stats()["errors"] == 0


def test_leases_that_outlive_the_tombstone_stay_their_peers() -> None:
    h = ServerHarness(tombstone_ttl=10.0, lease_ttl=100.0, abandoned_job_ttl=1000.0, max_lookups_per_request=3)
    _register(h, 1, A)
    _stored(h, TOKS, 1, A)
    for _ in range(2):
        _call(h, Lookup(key("r", TOKS), 1), A)
        assert h.result(_call(h, QueryPrefetchStatus("r"), A)) == 3
    h.advance(50.0)  # tombstone gone, leases held
    assert h.server.job_state("r", A) is JobState.ABSENT and h.server.leases_of("r", A) == 3
    assert h.result(_call(h, FreeLookupLocks(key("r", TOKS)), B)) is None
    assert h.result(_call(h, EndSession("r"), B)) is None
    assert h.server.leases_of("r", A) == 3
    # the lookup count lives as long as the leases: the third lookup is A's last one
    assert h.result(_call(h, Lookup(key("r", TOKS), 1), A)) is None
    assert h.error_kind(_call(h, Lookup(key("r", TOKS), 1), A)) is ErrorKind.TOO_LARGE
    assert h.result(_call(h, Lookup(key("r", TOKS), 1), B)) is None  # B's count is B's
    assert h.result(_call(h, QueryPrefetchStatus("r"), A)) == 3
    h.advance(200.0)  # tombstone and leases gone: the count is forgotten
    assert h.server.leases_of("r", A) == 0 and RequestKey(A, "r") not in h.server.jobs.repeats
    assert h.result(_call(h, Lookup(key("r", TOKS), 1), A)) is None


def test_a_retrieve_releases_its_own_peers_lease_else_the_one_other_holders() -> None:
    W = "worker"  # an engine's scheduler (A) looks up, its worker (W) retrieves: two connections
    h = ServerHarness()
    _register(h, 1, W)
    _stored(h, TOKS, 1, W)
    _call(h, Lookup(key("r", TOKS), 1), A)
    assert h.result(_call(h, QueryPrefetchStatus("r"), A)) == 3
    rt = _call(h, Retrieve(key("r", TOKS, worker_id=0), 1), W)
    h.finish_all_transfers()
    assert h.result(rt).ok and h.server.leases_of("r", A) == 0  # A's count went with the copy
    # two peers' requests of one id hold the objects: a third peer's retrieve releases neither
    _call(h, Lookup(key("r", TOKS), 1), A)
    _call(h, Lookup(key("r", TOKS), 1), B)
    rt = _call(h, Retrieve(key("r", TOKS, worker_id=0), 1), W)
    h.finish_all_transfers()
    assert h.result(rt).ok and h.server.leases_of("r", A) == 3 and h.server.leases_of("r", B) == 3
    _call(h, Lookup(key("r", TOKS), 1), W)  # the retrieving peer's own request comes first
    rt = _call(h, Retrieve(key("r", TOKS, worker_id=0), 1), W)
    h.finish_all_transfers()
    assert h.result(rt).ok and h.server.leases_of("r", W) == 0
    assert h.server.leases_of("r", A) == 3 and h.server.leases_of("r", B) == 3


def test_a_plan_is_committed_only_by_its_peer_and_transfer_ids_are_unguessable() -> None:
    h = ServerHarness()
    _register(h, 1, A, engine_driven=True)
    plan = h.result(_call(h, PrepareStore(key("w", TOKS, worker_id=0), 1), A))
    assert isinstance(plan, TransferPlan) and plan.ok
    assert h.error_kind(_call(h, CommitTransfer(plan.transfer_id, True), B)) is ErrorKind.FORBIDDEN
    assert h.server.transfer_state(plan.transfer_id) is TransferState.PREPARED
    assert h.result(_call(h, CommitTransfer(plan.transfer_id, True), A)) == StoreResult(True, 3, 0)

    def ids(seed: int) -> list[int]:
        g = ServerHarness(ServerConfig(chunk_size=C, num_slots=64, slot_bytes=100, id_seed=seed))
        g.register(engine_driven=True)
        out = []
        for i in range(20):
            p = g.call(PrepareStore(key(f"w{i}", tokens(1, seed=i), worker_id=0), 1))
            assert isinstance(p, TransferPlan)
            out.append(p.transfer_id)
        return out

    a = ids(7)
    assert a == ids(7) and a != ids(8)  # deterministic per seed, different across seeds
    assert len(set(a)) == 20 and all(0 < t < 1 << 63 for t in a)
    assert sum(t > 1 << 40 for t in a) >= 18 and sorted(a) != a  # not a small counter


def test_an_instance_belongs_to_the_peer_that_registered_it() -> None:
    h = ServerHarness()
    _register(h, 1, A)
    for request in (RegisterInstance(1, MODEL, 1, 10), UnregisterInstance(1), Ping(1),
                    Store(key("w", TOKS, worker_id=0), 1), Retrieve(key("w", TOKS, worker_id=0), 1),
                    PrepareStore(key("w", TOKS, worker_id=0), 1)):
        assert h.error_kind(_call(h, request, B)) is ErrorKind.FORBIDDEN, request
    assert h.server.stats()["instances"] == 1 and h.server.stats()["transfers"] == 0
    assert _stored(h, TOKS, 1, A) == StoreResult(True, 3, 0)


def test_clear_needs_the_admin_flag() -> None:
    h = ServerHarness()
    h.register()
    h.store(TOKS)
    assert h.error_kind(h.send(Clear(True))) is ErrorKind.FORBIDDEN
    assert h.server.stats()["objects"] == 3 and h.server.stats()["clears_refused"] == 1
    assert h.call(Clear(True, admin=True)) is None and h.server.stats()["objects"] == 0


def test_jobs_are_bounded_in_total_and_per_peer() -> None:
    h = ServerHarness(max_jobs=5, max_jobs_per_peer=3)
    for i in range(3):
        assert h.result(_call(h, Lookup(key(f"a{i}", TOKS), 1), A)) is None
    assert h.error_kind(_call(h, Lookup(key("a3", TOKS), 1), A)) is ErrorKind.TOO_LARGE
    for i in range(2):
        assert h.result(_call(h, Lookup(key(f"b{i}", TOKS), 1), B)) is None
    assert h.error_kind(_call(h, Lookup(key("b2", TOKS), 1), B)) is ErrorKind.TOO_LARGE  # total
    assert h.result(_call(h, EndSession("a0"), A)) is None
    assert h.result(_call(h, Lookup(key("b2", TOKS), 1), B)) is None
    assert h.server.stats()["jobs"] == 5


def test_lookups_of_one_request_id_are_capped() -> None:
    h = ServerHarness(max_lookups_per_request=4)
    for _ in range(4):
        h.call(Lookup(key("r", TOKS), 1))
        h.call(QueryPrefetchStatus("r"))
    assert h.error_kind(h.send(Lookup(key("r", TOKS), 1))) is ErrorKind.TOO_LARGE
    h.call(EndSession("r"))
    assert h.call(Lookup(key("r", TOKS), 1)) is None  # a new session of the id


def test_transfers_per_instance_are_capped_and_plans_live_seconds() -> None:
    h = ServerHarness(max_transfers_per_instance=2, plan_ttl=5.0, lease_ttl=300.0)
    h.register(engine_driven=True)
    for i in range(2):
        assert isinstance(h.call(PrepareStore(key(f"w{i}", tokens(1, seed=i), worker_id=0), 1)), TransferPlan)
    assert h.error_kind(h.send(PrepareStore(key("w9", tokens(1, seed=9), worker_id=0), 1))) is ErrorKind.TOO_LARGE
    h.advance(5.0)
    assert h.server.stats()["transfers"] == 0 and h.server.stats()["expired_plans"] == 2
    assert isinstance(h.call(PrepareStore(key("w9", tokens(1, seed=9), worker_id=0), 1)), TransferPlan)


def test_an_instance_over_its_slot_quota_never_evicts_another_tenants_ready_objects() -> None:
    h = ServerHarness(num_slots=8)
    _register(h, 1, A, engine_driven=True)
    _register(h, 2, B)
    assert _stored(h, tokens(4, seed=1), 2, B, rid="b") == StoreResult(True, 4, 0)  # B: 4 ready
    # A's uncommitted plan may reserve its fair share (8 slots / 2 instances), no more
    plan = h.result(_call(h, PrepareStore(key("a", tokens(8, seed=2), worker_id=0), 1), A))
    assert isinstance(plan, TransferPlan) and len(plan.placements) == 4
    assert h.server.stats()["quota_skips"] == 4
    b_keys = [k for k in h.server.index.objects() if h.server.index.is_readable(k)]
    assert len(b_keys) == 4  # every one of B's objects is still there


def test_not_after_is_held_to_now_plus_sixty_seconds() -> None:
    h = ServerHarness()
    h.register()
    rt = h.send(Store(key("w", TOKS, worker_id=0), 1, not_after=1e15))
    (st,) = [e for e in h.log if isinstance(e, StartTransfer)]
    assert st.not_after == pytest.approx(h.now + 60.0)
    h.finish_all_transfers()
    assert h.result(rt) == StoreResult(True, 3, 0)
    h.advance(61.0)
    h.call(Lookup(key("other", TOKS), 1))  # any request: the kept answer expired
    assert len(h.server.transfers.ops_done) in (0, 1)
    h.send(Store(key("w2", tokens(1, seed=5), worker_id=0), 1, not_after=h.now + 1))
    assert all(until <= h.now + 60.0 for _ok, _a, until in h.server.transfers.ops_done.values())


@pytest.mark.parametrize("world_size,end_chunks", [(4097, 1), (4096, 65)])
def test_world_size_and_objects_per_request_are_bounded(world_size: int, end_chunks: int) -> None:
    h = ServerHarness(max_chunks_per_request=1 << 16)
    toks = tokens(end_chunks)
    assert h.error_kind(h.send(FreeLookupLocks(CacheKey(MODEL, world_size, None, toks, 0, end_chunks * C, "r")))) \
        is ErrorKind.VALIDATION
    assert h.error_kind(h.send(Lookup(CacheKey(MODEL, world_size, None, toks, 0, end_chunks * C, "r")))) \
        is ErrorKind.VALIDATION
    assert h.error_kind(h.send(RegisterInstance(5, MODEL, 4097, 10))) is ErrorKind.VALIDATION
    assert h.server.stats()["jobs"] == 0 and h.server.stats()["instances"] == 0



def test_an_op_is_its_senders_another_peer_repeating_it_neither_plants_nor_reads_an_answer() -> None:
    h = ServerHarness()
    _register(h, 1, A)
    store = Store(key("w", TOKS, worker_id=0), 1, not_after=h.now + 30.0)
    # B sends A's exact op first: refused (not its instance); the refusal is B's alone
    assert h.error_kind(_call(h, store, B)) is ErrorKind.FORBIDDEN
    rt = _call(h, store, A)  # A's own op runs: a copy starts
    assert [e for e in h.log if isinstance(e, StartTransfer)]
    h.finish_all_transfers()
    assert h.result(rt) == StoreResult(True, 3, 0)
    # B repeating it again gets its own refusal, not A's kept answer
    assert h.error_kind(_call(h, store, B)) is ErrorKind.FORBIDDEN
    assert h.server.stats()["duplicate_transfers"] == 1  # B's repeat of its own op


def test_l1_is_shared_by_peers_not_by_the_instances_one_peer_registers() -> None:
    h = ServerHarness(num_slots=8, max_instances_per_peer=16)
    _register(h, 1, A)
    victim = tokens(3, seed=99)
    assert _stored(h, victim, 1, A, rid="v").stored == 3
    for iid in range(100, 116):  # one connection, sixteen instances
        _register(h, iid, B)
    assert h.server.index.quota.tenant_share == 4  # two tenants: the instances of B count once
    for i in range(40):  # B floods L1 with committed stores from every instance
        _stored(h, tokens(2, seed=i), 100 + i % 16, B, rid=f"f{i}")
    assert h.result(_call(h, Lookup(key("probe", victim), 1), A)) is None
    assert h.result(_call(h, QueryPrefetchStatus("probe"), A)) == 3  # the victim's prompt hits in full
    # a seventeenth instance from that connection is refused, and changes nothing
    assert h.error_kind(_call(h, RegisterInstance(116, MODEL, 1, 10), B)) is ErrorKind.TOO_LARGE
    assert h.server.instances.registration(116) is None
    # when B's last instance goes, its objects are nobody's; not before
    for iid in range(100, 115):
        h.result(_call(h, UnregisterInstance(iid), B))
    assert h.server.index.quota.charged(("peer", B)) > 0
    h.result(_call(h, UnregisterInstance(115), B))
    assert h.server.index.quota.charged(("peer", B)) == 0


@pytest.mark.parametrize("gone", ["reaped", "failed"])
def test_a_reaped_or_failed_id_stays_its_owners_for_a_while(gone: str) -> None:
    """Hostile finding 4: after a reap, another peer registered the victim's id and locked the
    victim out. The id now stays the old owner's for reserved_id_ttl."""
    h = ServerHarness(instance_ttl=10.0, reserved_id_ttl=100.0)
    _register(h, 1, A)
    _register(h, 2, B)
    assert h.result(_call(h, Ping(1), A)) is True  # a heartbeating instance
    assert h.server.index.quota.tenant_share == 32  # two tenants
    if gone == "reaped":
        h.advance(11.0)
        assert h.server.stats()["instances_reaped"] == 1
    else:
        h.now += 11.0
        h.feed(InstanceFailed(1, "event never fired"))
    assert h.server.instances.registration(1) is None
    # the silent instance no longer counts: B is L1's only tenant
    assert h.server.index.quota.tenant_share == 64
    # another peer cannot take the id while it is kept; nothing changes
    assert h.error_kind(_call(h, RegisterInstance(1, MODEL, 1, 10), B)) is ErrorKind.FORBIDDEN
    assert h.server.instances.registration(1) is None and h.server.index.quota.tenant_share == 64
    # the owner can (its client registers again on NOT_REGISTERED)
    assert h.error_kind(_call(h, Store(key("w", TOKS, worker_id=0), 1), A)) is ErrorKind.NOT_REGISTERED
    _register(h, 1, A)
    assert _stored(h, TOKS, 1, A) == StoreResult(True, 3, 0)
    # an unregister frees the id at once, and a kept id is free after reserved_id_ttl
    assert h.result(_call(h, UnregisterInstance(1), A)) is None
    _register(h, 1, B)
    assert h.result(_call(h, Ping(1), B)) is True
    h.advance(11.0)
    assert h.error_kind(_call(h, RegisterInstance(1, MODEL, 1, 10), A)) is ErrorKind.FORBIDDEN
    h.now += 100.0
    _register(h, 1, A)


def test_reserved_ids_are_bounded() -> None:
    h = ServerHarness(instance_ttl=10.0, max_reserved_ids=3, max_instances_per_peer=8)
    for iid in range(1, 6):
        _register(h, iid, A)
        h.result(_call(h, Ping(iid), A))
    h.advance(11.0)
    assert h.server.stats()["instances_reaped"] == 5
    assert list(h.server.instances.reserved) == [3, 4, 5]  # the oldest went first
    _register(h, 1, B)
    assert h.error_kind(_call(h, RegisterInstance(5, MODEL, 1, 10), B)) is ErrorKind.FORBIDDEN


def test_an_engine_driven_store_plan_zeroes_its_slots_before_its_reply() -> None:
    """Hostile finding 8: a commit without writing served the slot's previous bytes. The plan's
    slots are scrubbed (ScrubSlots, the object's bytes) before the reply that hands them out."""
    from mpcache.core_sm.effects import Reply, ScrubSlots

    h = ServerHarness()
    _register(h, 1, A, engine_driven=True)
    effects = h.server.handle(PrepareStore(key("w", TOKS, worker_id=0), 1, peer=A, reply_to="p"), h.now)
    assert [type(e) for e in effects] == [ScrubSlots, Reply], effects
    plan = effects[1].result
    assert isinstance(plan, TransferPlan) and plan.ok and len(plan.placements) == 3
    assert effects[0] == ScrubSlots([slot for _c, slot in plan.placements], 10)
    h.server.handle(CommitTransfer(plan.transfer_id, True, peer=A, reply_to="c"), h.now)
    # a retrieve plan writes nothing into L1: nothing to scrub
    retrieve = h.server.handle(PrepareRetrieve(key("w", TOKS, worker_id=0), 1, peer=A, reply_to="r"), h.now)
    assert retrieve and not any(isinstance(e, ScrubSlots) for e in retrieve)


def test_a_gone_peers_instances_are_released_and_no_id_is_kept_for_it() -> None:
    """Hostile finding 13: a client without an explicit identity gets a new routing id when it
    reconnects, so it is a new peer: its old instance was forbidden to it until a reap (and a
    reaped id is now kept for the old peer). The runtime says PeerGone when such a connection
    closes: its instances go, and the client registers again by the NOT_REGISTERED path."""
    from mpcache.core_sm.effects import DetachInstance
    from mpcache.core_sm.messages import PeerGone

    h = ServerHarness(instance_ttl=10.0)
    _register(h, 1, A)
    _register(h, 2, A, engine_driven=True)
    _register(h, 3, A)
    _register(h, 7, B)
    assert h.result(_call(h, Ping(3), A)) is True
    h.advance(11.0)  # 3 is reaped: kept for A
    assert h.error_kind(_call(h, RegisterInstance(3, MODEL, 1, 10), B)) is ErrorKind.FORBIDDEN
    plan = h.result(_call(h, PrepareStore(key("w", TOKS, worker_id=0), 2), A))
    assert isinstance(plan, TransferPlan) and plan.ok
    effects = h.feed(PeerGone(A))
    assert [e for e in effects if isinstance(e, DetachInstance)] == [DetachInstance(1)]  # server-driven only
    assert h.server.instances.registration(1) is None and h.server.instances.registration(2) is None
    assert h.server.stats()["instances_of_gone_peers"] == 2
    assert h.error_kind(_call(h, CommitTransfer(plan.transfer_id, True), A)) is not None  # its plan went too
    assert h.server.index.quota.tenant_share == 64  # B alone
    # the client reconnected as C: it registers its ids (3 was kept for A, who can never come back)
    for iid in (1, 2, 3):
        _register(h, iid, "peer-c")
    assert h.server.instances.registration(7) is not None  # another peer's instance stays
    h.feed(PeerGone("peer-nobody"))  # a peer with nothing: nothing changes
    assert h.server.stats()["instances"] == 4
