"""LookupServer: every request type, its replies and its lease accounting."""
from __future__ import annotations

import pytest

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import ErrorReply, Reply
from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.l1_index import ReleaseReason
from mpcache.core_sm.messages import (
    CacheKey,
    Clear,
    CommitTransfer,
    EndSession,
    FreeLookupLocks,
    GetChunkSize,
    L2ReadFinished,
    L2WriteFinished,
    Lookup,
    Ping,
    PrepareRetrieve,
    PrepareStore,
    QueryPrefetchStatus,
    RegisterInstance,
    Retrieve,
    RetrieveResult,
    Store,
    StoreResult,
    TimerFired,
    TransferFinished,
    TransferKind,
    TransferPlan,
    UnregisterInstance,
    WaitPrefetchStatus,
)
from mpcache.core_sm.server import JobState, LookupServer, ServerConfig, TransferState
from mpcache.core_sm.server_core import L2WriteOwner
from sm_helpers import C, MODEL, ServerHarness, key, tokens


def lookup(h: ServerHarness, rid: str, toks: tuple[int, ...], readers: int = 1, ws: int = 1) -> int | None:
    assert h.call(Lookup(key(rid, toks, world_size=ws), readers)) is None
    r = h.call(QueryPrefetchStatus(rid))
    assert r is None or isinstance(r, int)
    return r


def held(h: ServerHarness, owner: object) -> int:
    """Read counts of ``owner``: a request id (of the harness's peer, None) or an effect owner."""
    return h.server.leases_of(owner) if isinstance(owner, str) else h.server.leases_by_owner().get(owner, 0)


def test_ping_and_chunk_size() -> None:
    h = ServerHarness()
    assert h.call(Ping()) is True
    assert h.call(GetChunkSize()) == C


def test_lookup_miss_then_hit_leases_prefix_for_request() -> None:
    h = ServerHarness()
    h.register()
    toks = tokens(4, extra=2)
    assert lookup(h, "a", toks) == 0
    h.store(toks, end=2 * C)  # first two chunks only
    assert lookup(h, "b", toks) == 2
    assert held(h, "b") == 2
    assert h.server.stats()["hit_chunks"] == 2
    # a prefix gap: chunk 3 stored but not chunk 2 -> still 2
    h.store(toks, start=3 * C, end=4 * C)
    assert lookup(h, "c", toks) == 2


def test_unknown_status_is_zero_and_answers_repeat_from_tombstone() -> None:
    h = ServerHarness()
    h.register()
    toks = tokens(3)
    h.store(toks)
    assert h.call(QueryPrefetchStatus("never")) == 0
    assert lookup(h, "r", toks) == 3
    assert h.server.job_state("r") is JobState.ANSWERED
    for _ in range(3):
        assert h.call(QueryPrefetchStatus("r")) == 3
    h.advance(61.0)
    assert h.server.job_state("r") is JobState.ABSENT
    assert h.call(QueryPrefetchStatus("r")) == 0


def test_tombstone_cap() -> None:
    h = ServerHarness(tombstone_cap=3)
    for i in range(5):
        lookup(h, f"r{i}", tokens(1))
    assert h.server.stats()["tombstones"] == 3
    assert h.server.tombstone("r0") is None and h.server.tombstone("r4") == 0


def test_duplicate_lookup_takes_no_second_lease() -> None:
    h = ServerHarness(l2_enabled=True)
    h.register()
    toks = tokens(2)
    h.store(toks, end=C)
    h.call(Lookup(key("r", toks), 1))  # pending: chunk 1 is read from L2
    assert h.server.job_state("r") is JobState.PENDING
    assert h.call(Lookup(key("r", toks), 1)) is None
    assert held(h, "r") == 1
    assert h.server.stats()["duplicate_lookups"] == 1
    assert len(h.reads) == 1


def test_relookup_after_answer_tops_up_never_doubles() -> None:
    h = ServerHarness()
    h.register()
    toks = tokens(2)
    h.store(toks)
    assert lookup(h, "r", toks, readers=2) == 2
    assert held(h, "r") == 4
    assert lookup(h, "r", toks, readers=2) == 2
    assert held(h, "r") == 4


def test_mla_readers_each_retrieve_releases_one() -> None:
    h = ServerHarness()
    h.register()
    toks = tokens(2)
    h.store(toks)
    assert lookup(h, "r", toks, readers=2) == 2
    for _ in range(2):
        rt = h.send(Retrieve(key("r", toks, worker_id=0), 1))
        h.finish_all_transfers()
        assert h.result(rt) == RetrieveResult(True, 2)
    assert held(h, "r") == 0
    assert h.server.index.released_by(ReleaseReason.RETRIEVE) == 4


def test_free_releases_only_own_leases_and_is_idempotent() -> None:
    h = ServerHarness()
    h.register()
    toks = tokens(3)
    h.store(toks)
    lookup(h, "a", toks)
    lookup(h, "b", toks)
    assert h.call(FreeLookupLocks(key("a", toks, 0, 2 * C + 1))) is None  # floors to chunk 2
    assert held(h, "a") == 1 and held(h, "b") == 3
    assert h.call(FreeLookupLocks(key("a", toks, 0, 3 * C))) is None
    assert h.call(FreeLookupLocks(key("a", toks, 0, 3 * C))) is None
    assert held(h, "a") == 0 and held(h, "b") == 3
    # a request that never looked anything up releases nothing (F9)
    assert h.call(FreeLookupLocks(key("stranger", toks, 0, 3 * C))) is None
    assert held(h, "b") == 3


@pytest.mark.parametrize("start,end", [(8, 4), (0, 100), (-4, 4)])
def test_free_of_a_range_outside_the_tokens_is_a_validation_error(start: int, end: int) -> None:
    h = ServerHarness()
    rt = h.send(FreeLookupLocks(CacheKey(MODEL, 1, None, tokens(2), start, end, "r")))
    assert h.error_kind(rt) is ErrorKind.VALIDATION


def test_end_session_releases_everything_and_forgets() -> None:
    h = ServerHarness()
    h.register()
    toks = tokens(2)
    h.store(toks)
    lookup(h, "r", toks)
    assert h.call(EndSession("r")) is None
    assert held(h, "r") == 0 and h.server.job_state("r") is JobState.ABSENT
    assert h.call(QueryPrefetchStatus("r")) == 0
    assert h.server.index.released_by(ReleaseReason.END_SESSION) == 2
    assert h.call(EndSession("r")) is None  # idempotent


def test_abandoned_job_is_reaped_with_its_leases() -> None:
    h = ServerHarness(abandoned_job_ttl=60.0)
    h.register()
    toks = tokens(2)
    h.store(toks)
    h.call(Lookup(key("r", toks)))
    assert h.server.next_deadline() is not None
    h.advance(59.0)
    assert held(h, "r") == 2
    h.advance(1.0)
    assert held(h, "r") == 0 and h.server.stats()["reaped_jobs"] == 1
    assert h.server.index.released_by(ReleaseReason.REAP) == 2
    assert h.call(QueryPrefetchStatus("r")) == 0


def test_lease_ttl_releases_answered_but_never_retrieved_leases() -> None:
    h = ServerHarness(lease_ttl=300.0)
    h.register()
    toks = tokens(1)
    h.store(toks)
    lookup(h, "r", toks)
    h.advance(299.0)
    assert held(h, "r") == 1
    h.advance(1.0)
    assert held(h, "r") == 0 and h.server.index.released_by(ReleaseReason.TTL) == 1


def test_wait_answered_on_completion_timeout_and_end() -> None:
    h = ServerHarness(l2_enabled=True)
    toks = tokens(2)
    h.call(Lookup(key("r", toks)))
    (read,) = h.reads.values()
    w1 = h.send(WaitPrefetchStatus("r", 5.0))
    w2 = h.send(WaitPrefetchStatus("r", 1.0))
    assert h.reply(w1) is None and h.server.stats()["waiters"] == 2
    h.advance(1.0)
    assert h.result(w2) is None  # timed out
    h.feed(L2ReadFinished(read.read_id, (True, True)))
    assert h.result(w1) == 2
    assert h.call(QueryPrefetchStatus("r")) == 2  # tombstone
    # a waiter whose request ends gets 0
    h.call(Lookup(key("s", tokens(2, seed=1))))
    w3 = h.send(WaitPrefetchStatus("s", 5.0))
    h.call(EndSession("s"))
    assert h.result(w3) == 0
    # an unknown id and a zero timeout answer at once
    assert h.call(WaitPrefetchStatus("nope", 1.0)) == 0


def test_wait_refuses_nan_and_too_many_waiters() -> None:
    h = ServerHarness(l2_enabled=True, max_waiters=1)
    h.call(Lookup(key("r", tokens(1))))
    assert h.error_kind(h.send(WaitPrefetchStatus("r", float("nan")))) is ErrorKind.VALIDATION
    h.send(WaitPrefetchStatus("r", 5.0))
    assert h.error_kind(h.send(WaitPrefetchStatus("r", 5.0))) is ErrorKind.TOO_LARGE


def test_l2_prefetch_is_prefix_only() -> None:
    h = ServerHarness(l2_enabled=True)
    h.register()
    toks = tokens(4)
    h.store(toks, end=C)
    h.call(Lookup(key("r", toks)))
    (read,) = h.reads.values()
    assert len(read.items) == 3  # chunks 1..3
    assert h.call(QueryPrefetchStatus("r")) is None
    # chunk 2 fails: hits = 1 (L1) + 1 (chunk 1); chunk 3 lands but past the gap: unleased
    h.feed(L2ReadFinished(read.read_id, (True, False, True)))
    assert h.call(QueryPrefetchStatus("r")) == 2
    assert held(h, "r") == 2
    k3 = read.items[2][0]
    assert h.server.index.is_readable(k3) and h.server.index.read_count(k3, "r") == 0
    assert not h.server.index.is_readable(read.items[1][0])


def test_l2_read_timeout_resolves_with_l1_prefix_and_late_load_lands() -> None:
    h = ServerHarness(l2_enabled=True, l2_read_timeout=30.0)
    toks = tokens(2)
    h.call(Lookup(key("r", toks)))
    (read,) = h.reads.values()
    h.advance(30.0)
    assert h.call(QueryPrefetchStatus("r")) == 0
    h.feed(L2ReadFinished(read.read_id, (True, True)))
    assert h.server.stats()["objects"] == 2 and held(h, "r") == 0
    assert h.call(QueryPrefetchStatus("r")) == 0  # the answer never changes


def test_stale_internal_events_are_counted_not_raised() -> None:
    h = ServerHarness()
    assert h.feed(TransferFinished(999, True)) == []
    assert h.feed(L2ReadFinished(999, ())) == []
    assert h.feed(L2WriteFinished(999, True)) == []
    assert h.server.stats()["stale_events"] == 3


def test_store_skips_present_and_reports() -> None:
    h = ServerHarness()
    h.register()
    toks = tokens(3)
    assert h.store(toks, end=C) == StoreResult(True, 1, 0)
    assert h.store(toks) == StoreResult(True, 2, 1)
    assert h.store(toks) == StoreResult(True, 0, 3)
    assert h.server.stats()["bytes"] == 30


def test_store_failure_frees_slots() -> None:
    h = ServerHarness()
    h.register()
    assert h.store(tokens(2), ok=False) == StoreResult(False, 0, 2)
    assert h.server.stats()["objects"] == 0 and h.server.stats()["transfers_failed"] == 1


def test_store_out_of_slots_skips() -> None:
    h = ServerHarness(num_slots=1)
    h.register()
    toks = tokens(2)
    rt = h.send(Store(key("w", toks, worker_id=0), 1))
    (t,) = h.transfers.values()
    assert len(t.placements) == 1
    h.finish_all_transfers()
    assert h.result(rt) == StoreResult(True, 1, 1)


@pytest.mark.parametrize(
    "mutate,kind",
    [
        (dict(instance=2), ErrorKind.NOT_REGISTERED),
        (dict(start=1), ErrorKind.VALIDATION),
        (dict(end=C + 1), ErrorKind.VALIDATION),
        (dict(worker_id=1), ErrorKind.VALIDATION),
        (dict(worker_id=None), ErrorKind.VALIDATION),
        (dict(salt="a/b"), ErrorKind.VALIDATION),
        (dict(salt="x" * 129), ErrorKind.VALIDATION),
        (dict(model="other"), ErrorKind.VALIDATION),
        (dict(toks=(-1,) * 8), ErrorKind.VALIDATION),
    ],
)
@pytest.mark.parametrize("op", [Store, Retrieve, PrepareStore, PrepareRetrieve])
def test_bad_transfer_requests_get_typed_errors(op: type, mutate: dict, kind: ErrorKind) -> None:
    h = ServerHarness()
    h.register()
    toks = mutate.get("toks", tokens(2))
    k = CacheKey(mutate.get("model", MODEL), 1, mutate.get("worker_id", 0), toks,
                 mutate.get("start", 0), mutate.get("end", 2 * C), "r", mutate.get("salt", ""))
    rt = h.send(op(k, mutate.get("instance", 1)))
    assert h.error_kind(rt) is kind
    assert h.transfers == {}


@pytest.mark.parametrize(
    "k",
    [
        CacheKey(MODEL, 1, 0, tokens(1), 0, C, "r"),  # worker_id set on a scheduler key
        CacheKey(MODEL, 1, None, tokens(1), C, C, "r"),  # start != 0
        CacheKey(MODEL, 1, None, tokens(2), 0, C + 1, "r"),  # not aligned
        CacheKey(MODEL, 0, None, tokens(1), 0, C, "r"),  # world size 0
        CacheKey(MODEL, 1, None, tokens(1), 0, C, "r", "bad@salt"),
    ],
)
def test_bad_lookup_gets_validation_error(k: CacheKey) -> None:
    h = ServerHarness()
    assert h.error_kind(h.send(Lookup(k))) is ErrorKind.VALIDATION
    assert h.server.job_state("r") is JobState.ABSENT


def test_retrieve_all_or_nothing() -> None:
    h = ServerHarness()
    h.register()
    toks = tokens(3)
    h.store(toks, end=2 * C)
    assert h.call(Retrieve(key("r", toks, worker_id=0), 1)) == RetrieveResult(False, 3)
    assert h.transfers == {} and h.server.stats()["retrieve_misses"] == 1
    rt = h.send(Retrieve(key("r", toks, 0, 2 * C, worker_id=0), 1, (7, 8), skip_first_n_tokens=2))
    (t,) = h.transfers.values()
    assert t.kind is TransferKind.RETRIEVE and t.block_ids == (7, 8) and t.skip_first_n_tokens == 2
    assert [c for c, _ in t.placements] == [0, 1]
    # the transfer holds the objects: a forced clear still leaves the reply coming
    h.finish_all_transfers()
    assert h.result(rt) == RetrieveResult(True, 2)


def test_retrieve_in_flight_protects_objects_from_eviction() -> None:
    h = ServerHarness(num_slots=2)
    h.register()
    toks = tokens(2)
    h.store(toks)
    h.send(Retrieve(key("r", toks, worker_id=0), 1))
    rt = h.send(Store(key("w", tokens(1, seed=9), worker_id=0), 1))
    assert h.result(rt) == StoreResult(True, 0, 1)  # nothing evictable: skipped
    assert h.server.stats()["evictions"] == 0


def test_unknown_instance_and_registration() -> None:
    h = ServerHarness()
    rt = h.send(RegisterInstance(1, MODEL, 1, 101))
    assert h.error_kind(rt) is ErrorKind.TOO_LARGE
    h.register()
    h.register()  # idempotent
    assert h.call(UnregisterInstance(1)) is None
    assert h.call(UnregisterInstance(1)) is None
    assert h.server.stats()["instances"] == 0


def test_engine_driven_store_and_retrieve() -> None:
    h = ServerHarness()
    h.register(engine_driven=True)
    toks = tokens(2)
    plan = h.call(PrepareStore(key("w", toks, worker_id=0), 1))
    assert isinstance(plan, TransferPlan) and plan.ok and len(plan.placements) == 2
    assert h.server.transfer_state(plan.transfer_id) is TransferState.PREPARED
    assert h.call(CommitTransfer(plan.transfer_id, True)) == StoreResult(True, 2, 0)
    assert h.error_kind(h.send(CommitTransfer(plan.transfer_id, True))) is ErrorKind.UNKNOWN_TRANSFER
    lookup(h, "r", toks)
    plan = h.call(PrepareRetrieve(key("r", toks, worker_id=0), 1))
    assert isinstance(plan, TransferPlan) and plan.kind is TransferKind.RETRIEVE
    assert h.call(CommitTransfer(plan.transfer_id, True)) == RetrieveResult(True, 2)
    assert held(h, "r") == 0
    miss = h.call(PrepareRetrieve(key("r", tokens(2, seed=5), worker_id=0), 1))
    assert miss == TransferPlan(-1, (), False, TransferKind.RETRIEVE, 0)


def test_uncommitted_plan_expires_without_reply() -> None:
    h = ServerHarness(lease_ttl=10.0)
    h.register(engine_driven=True)
    plan = h.call(PrepareStore(key("w", tokens(1), worker_id=0), 1))
    assert isinstance(plan, TransferPlan)
    h.advance(10.0)
    assert h.server.transfer_state(plan.transfer_id) is TransferState.ABSENT
    assert h.server.stats()["objects"] == 0 and h.server.stats()["expired_plans"] == 1
    assert h.error_kind(h.send(CommitTransfer(plan.transfer_id, True))) is ErrorKind.UNKNOWN_TRANSFER


def test_write_behind_holds_a_lease_until_l2_write_finished() -> None:
    h = ServerHarness(write_behind=True)
    h.register()
    toks = tokens(2)
    h.store(toks)
    (w,) = h.writes.values()
    assert len(w.items) == 2 and held(h, L2WriteOwner(w.write_id)) == 2
    assert h.call(Clear(False, admin=True)) is None
    assert h.server.stats()["objects"] == 2  # leased: not cleared
    h.feed(L2WriteFinished(w.write_id, True))
    assert held(h, L2WriteOwner(w.write_id)) == 0
    h.call(Clear(False, admin=True))
    assert h.server.stats()["objects"] == 0


def test_clear_force_drops_leased_objects() -> None:
    h = ServerHarness()
    h.register()
    toks = tokens(2)
    h.store(toks)
    lookup(h, "r", toks)
    h.call(Clear(True, admin=True))
    assert h.server.stats()["objects"] == 0 and h.server.stats()["bytes"] == 0
    assert h.server.index.released_by(ReleaseReason.CLEAR) == 2
    assert h.call(Retrieve(key("r", toks, worker_id=0), 1)) == RetrieveResult(False, 2)


def test_world_size_two_counts_only_chunks_all_ranks_have() -> None:
    h = ServerHarness()
    h.register(world_size=2)
    toks = tokens(2)
    h.store(toks, worker_id=0, world_size=2)
    h.store(toks, worker_id=1, world_size=2, end=C)
    assert lookup(h, "r", toks, ws=2) == 1
    assert held(h, "r") == 2  # chunk 0, both ranks


def test_next_deadline_covers_every_timer_and_timer_is_harmless() -> None:
    s = LookupServer(ServerConfig(chunk_size=C))
    assert s.next_deadline() is None
    assert s.handle(TimerFired(), 5.0) == []
    s.handle(Lookup(key("r", tokens(1)), reply_to=1), 0.0)
    assert s.next_deadline() == pytest.approx(60.0)  # tombstone-less: reap timer


def test_handle_never_raises_on_garbage() -> None:
    h = ServerHarness()
    weird = [
        Lookup(CacheKey(MODEL, 1, None, ("x",) * 4, 0, 4, "r")),  # type: ignore[arg-type]
        Lookup(CacheKey(5, "2", None, (), 0, 0, 7)),  # type: ignore[arg-type]
        Store(CacheKey(MODEL, 1, 0, (), 0, 0, "r"), 1),
        FreeLookupLocks(CacheKey(MODEL, 1, None, (), 0, 0, "r", None)),  # type: ignore[arg-type]
        RegisterInstance(1, MODEL, "x", 1),  # type: ignore[arg-type]
    ]
    for ev in weird:
        rt = h.send(ev)
        assert isinstance(h.reply(rt), (Reply, ErrorReply))
    assert h.outstanding == set()
    rt = ("x", 1)
    out = h.server.handle(object(), 0.0)  # type: ignore[arg-type]
    assert out == [] and h.server.stats()["stale_events"] >= 1
    del rt


def test_same_events_same_effects() -> None:
    def run() -> list[object]:
        h = ServerHarness(l2_enabled=True, write_behind=True)
        h.register()
        toks = tokens(3)
        h.store(toks, end=C)
        lookup(h, "r", toks)
        for read in list(h.reads.values()):
            h.feed(L2ReadFinished(read.read_id, (True,) * len(read.items)))
        h.call(QueryPrefetchStatus("r"))
        h.advance(100.0)
        return list(h.log)

    assert run() == run()


def test_stats_keys_for_oracles() -> None:
    st = LookupServer().stats()
    for k in ("leases_held", "objects", "bytes", "jobs", "tombstones", "waiters", "evictions",
              "hit_chunks", "transfers", "l2_reads_in_flight", "unknown_status"):
        assert k in st
    assert ObjectKey(b"", 0).kv_rank == 0


def test_forced_clear_spares_objects_in_flight_copies_use() -> None:
    h = ServerHarness()
    h.register()
    toks = tokens(2)
    h.store(toks, end=C)
    lookup(h, "r", toks)  # leases chunk 0 for r
    rt = h.send(Retrieve(key("r", toks, 0, C, worker_id=0), 1))  # copying chunk 0 now
    st = h.send(Store(key("w", toks, C, 2 * C, worker_id=0), 1))  # writing chunk 1 now
    h.call(Clear(True, admin=True))
    assert h.server.stats()["objects"] == 2  # neither slot may be handed out mid-copy
    assert held(h, "r") == 1  # a spared object keeps its leases
    h.finish_all_transfers()
    assert h.result(rt) == RetrieveResult(True, 1)
    assert held(h, "r") == 0
    assert h.result(st) == StoreResult(True, 1, 0)
    h.call(Clear(True, admin=True))
    assert h.server.stats()["objects"] == 0


def test_a_completion_the_runtime_never_reports_still_answers_the_request() -> None:
    h = ServerHarness(lease_ttl=100.0)
    h.register()
    toks = tokens(2)
    rt = h.send(Store(key("w", toks, worker_id=0), 1))
    (t,) = h.transfers.values()
    h.advance(99.0)
    assert h.reply(rt) is None
    h.advance(1.0)
    assert h.result(rt) == StoreResult(False, 0, 2)
    assert h.server.stats()["expired_transfers"] == 1 and h.server.stats()["objects"] == 0
    h.feed(TransferFinished(t.transfer_id, True))  # too late: stale
    assert h.server.stats()["stale_events"] == 1


def test_l2_read_and_write_never_answered_are_bounded() -> None:
    h = ServerHarness(l2_enabled=True, write_behind=True, lease_ttl=100.0, l2_read_timeout=1000.0,
                      abandoned_job_ttl=1000.0)
    h.register()
    h.store(tokens(1, seed=3))
    assert len(h.writes) == 1
    h.call(Lookup(key("r", tokens(2))))
    assert h.server.job_state("r") is JobState.PENDING
    h.advance(100.0)
    st = h.server.stats()
    assert st["l2_reads_in_flight"] == 0 and st["l2_writes_in_flight"] == 0
    assert st["l2_reads_expired"] == 1 and st["l2_writes_expired"] == 1
    assert h.call(QueryPrefetchStatus("r")) == 0
    assert h.server.leases_by_owner() == {}


def test_l2_probe_reserves_nothing_on_a_miss_and_reads_only_the_present_prefix() -> None:
    from mpcache.core_sm.messages import L2ProbeFinished

    h = ServerHarness(num_slots=4, l2_enabled=True, l2_probe=True)
    h.register()
    for seed in range(4):  # L1 full of ready, unleased objects
        h.store(tokens(1, seed=10 + seed))
    toks = tokens(3)
    h.call(Lookup(key("miss", toks)))
    (probe,) = h.probes.values()
    assert len(probe.keys) == 3 and h.reads == {}
    assert h.call(QueryPrefetchStatus("miss")) is None
    h.feed(L2ProbeFinished(probe.probe_id, (False, False, False)))
    assert h.call(QueryPrefetchStatus("miss")) == 0
    assert h.server.stats()["evictions"] == 0 and h.reads == {}
    # L2 has chunks 0 and 2: only chunk 0 is read (prefix only), evicting one object for it
    h.call(Lookup(key("hit", toks)))
    probe = h.probes[max(h.probes)]
    h.feed(L2ProbeFinished(probe.probe_id, (True, False, True)))
    (read,) = h.reads.values()
    assert [k for k, _ in read.items] == [probe.keys[0]]
    h.feed(L2ReadFinished(read.read_id, (True,)))
    assert h.call(QueryPrefetchStatus("hit")) == 1
    assert held(h, "hit") == 1 and h.server.stats()["evictions"] == 1


def test_l2_probe_stale_and_expired() -> None:
    from mpcache.core_sm.messages import L2ProbeFinished

    h = ServerHarness(l2_enabled=True, l2_probe=True, lease_ttl=50.0, l2_read_timeout=100.0,
                      abandoned_job_ttl=100.0)
    h.feed(L2ProbeFinished(12345, (True,)))
    assert h.server.stats()["stale_events"] == 1
    h.call(Lookup(key("r", tokens(2))))
    h.advance(50.0)  # the probe is never answered
    assert h.server.stats()["l2_probes_expired"] == 1 and h.server.stats()["l2_probes_in_flight"] == 0
    assert h.call(QueryPrefetchStatus("r")) == 0


# ------------------------------------------------------------------- ranks per server


def test_lookup_ranks_count_lease_and_free_only_those_ranks() -> None:
    h = ServerHarness()
    h.register(world_size=2)
    toks = tokens(3)
    h.store(toks, worker_id=1, world_size=2)  # this server holds rank 1 only (3 chunks)
    h.store(toks, worker_id=0, world_size=2, end=C)
    assert lookup(h, "all", toks, ws=2) == 1  # every rank: only chunk 0 has both
    assert h.call(Lookup(key("r1", toks, world_size=2), 1, (1,))) is None
    assert h.call(QueryPrefetchStatus("r1")) == 3
    assert held(h, "r1") == 3  # rank 1's objects only
    assert all(k.kv_rank == 1 for k in h.server.index.keys_leased_by("r1"))
    assert h.call(Lookup(key("r0", toks, world_size=2), 1, (0,))) is None
    assert h.call(QueryPrefetchStatus("r0")) == 1 and held(h, "r0") == 1
    # FREE of the tail releases what r1 leased there, nothing of anyone else's
    assert h.call(FreeLookupLocks(key("r1", toks, C, 3 * C, world_size=2))) is None
    assert held(h, "r1") == 1 and held(h, "r0") == 1 and held(h, "all") == 2


@pytest.mark.parametrize("ranks", [(), (2,), (-1,), (0, 0), (True,)])
def test_lookup_with_bad_ranks_is_a_validation_error(ranks: tuple[int, ...]) -> None:
    h = ServerHarness()
    h.register(world_size=2)
    rt = h.send(Lookup(key("r", tokens(1), world_size=2), 1, ranks))
    assert h.error_kind(rt) is ErrorKind.VALIDATION
    assert h.server.job_state("r") is JobState.ABSENT


def test_l2_prefetch_reads_only_the_lookups_ranks() -> None:
    h = ServerHarness(l2_enabled=True)
    h.register(world_size=2)
    toks = tokens(2)
    h.call(Lookup(key("r", toks, world_size=2), 1, (1,)))
    (read,) = h.reads.values()
    assert [k.kv_rank for k, _slot in read.items] == [1, 1]
    h.feed(L2ReadFinished(read.read_id, (True, True)))
    assert h.call(QueryPrefetchStatus("r")) == 2 and held(h, "r") == 2


# ------------------------------------------------------------------------------ dead instances


def test_a_silent_heartbeating_instance_is_reaped_and_its_plans_fail() -> None:
    from mpcache.core_sm.effects import InstanceReaped
    from mpcache.core_sm.server import InstanceState

    h = ServerHarness(instance_ttl=60.0, lease_ttl=300.0, plan_ttl=300.0)
    h.register(engine_driven=True)
    assert h.call(Ping(1)) is True  # the first heartbeat: watched from now on
    plan = h.call(PrepareStore(key("w", tokens(2), worker_id=0), 1))
    assert isinstance(plan, TransferPlan) and plan.ok
    h.now = 59.0
    assert h.call(Ping(1)) is True  # alive, idle
    fx = h.advance(59.0 + 1.0 - h.now + 58.0)  # t = 118: 59 s since the last sign of life
    assert not any(isinstance(e, InstanceReaped) for e in fx)
    assert h.server.instance_state(1) is InstanceState.REGISTERED
    fx = h.advance(1.0)  # t = 119 = 59 + 60
    assert [e for e in fx if isinstance(e, InstanceReaped)] == [InstanceReaped(1)]
    st = h.server.stats()
    assert st["instances_reaped"] == 1 and st["instances"] == 0 and st["plans_of_reaped_instances"] == 1
    assert h.server.transfer_state(plan.transfer_id) is TransferState.ABSENT
    assert st["objects"] == 0  # the plan's reservations are dropped
    # anything naming it now: not_registered, and the client registers again
    assert h.error_kind(h.send(Ping(1))) is ErrorKind.NOT_REGISTERED
    assert h.error_kind(h.send(Store(key("w", tokens(2), worker_id=0), 1))) is ErrorKind.NOT_REGISTERED
    h.register(engine_driven=True)
    assert h.server.instance_state(1) is InstanceState.REGISTERED


def test_a_live_idle_instance_is_never_reaped_and_traffic_counts_as_life() -> None:
    h = ServerHarness(instance_ttl=60.0, lease_ttl=10_000.0, abandoned_job_ttl=10_000.0)
    h.register()
    h.call(Ping(1))
    for _ in range(100):  # 100 heartbeats 30 s apart, no traffic at all
        h.advance(30.0)
        assert h.call(Ping(1)) is True
    h.register(instance_id=2)
    h.call(Ping(2))
    for _ in range(10):  # instance 2 only stores, 50 s apart
        h.advance(50.0)
        h.call(Ping(1))
        rt = h.send(Store(key(f"s{len(h.log)}", tokens(1, seed=len(h.log)), worker_id=0), 2))
        h.finish_all_transfers()
        assert h.result(rt) == StoreResult(True, 1, 0)
    st = h.server.stats()
    assert st["instances_reaped"] == 0 and st["instances"] == 2 and st["heartbeats"] >= 111
    assert st["timers"] < 50  # heartbeats move a time stamp, not a heap entry each


def test_an_instance_that_never_heartbeats_is_not_reaped_and_plain_ping_still_answers() -> None:
    h = ServerHarness(instance_ttl=1.0)
    h.register()
    h.advance(1000.0)
    assert h.server.stats()["instances"] == 1 and h.call(Ping()) is True
    off = ServerHarness(instance_ttl=None)
    off.register()
    off.call(Ping(1))
    off.advance(10**6)
    assert off.server.stats()["instances"] == 1
