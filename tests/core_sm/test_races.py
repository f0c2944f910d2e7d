"""The three copy races the simulator found (tests/sim/findings/), pinned at the machine level.

* late STORE after abandon: a STORE the worker gave up on must not copy blocks vLLM reused --
  the STORE carries ``not_after``, the server refuses it later, the worker frees the blocks
  only once ``not_after`` (plus the copy grace) has passed.
* duplicate STORE answered early: a STORE whose chunks another in-flight store is writing is
  answered only when that write ends.
* late effect into a reused slot: a slot an in-flight L2 read / L2 write / copy / plan uses is
  quarantined, never given to another object, until that effect's completion event.
"""
from __future__ import annotations

import attrs

from mpcache.core_sm.effects import ErrorReply
from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.messages import (
    Clear,
    CommitTransfer,
    EngineFinished,
    L2ReadFinished,
    L2WriteFinished,
    Lookup,
    PrepareStore,
    Retrieve,
    RetrieveResult,
    ServerHealth,
    Store,
    StoreResult,
    TransferFinished,
    TransferPlan,
)
from mpcache.core_sm.transfer_client import TransferClient, TransferClientConfig
from sm_helpers import C, ServerHarness, key, tokens
from sm_pair import Pair

TOKS = tokens(2)
BLOCKS = (10, 11, 12, 13)


# ----------------------------------------------------------------------------- late STORE


def test_store_carries_not_after_and_is_refused_after_it() -> None:
    h = ServerHarness()
    h.register()
    h.now = 6.0
    rt = h.send(Store(key("r", TOKS, worker_id=0), 1, BLOCKS, not_after=5.0))
    assert h.error_kind(rt) is ErrorKind.TIMEOUT
    assert not h.transfers  # no copy
    stats = h.server.stats()
    assert stats["writing"] == 0 and stats["objects"] == 0 and stats["late_transfers_refused"] == 1
    rt = h.send(PrepareStore(key("p", TOKS, worker_id=0), 1, not_after=5.9))
    assert h.error_kind(rt) is ErrorKind.TIMEOUT and h.server.stats()["writing"] == 0
    rt = h.send(Store(key("q", TOKS, worker_id=0), 1, BLOCKS, not_after=6.0))  # on time
    assert len(h.transfers) == 1 and h.reply(rt) is None
    assert next(iter(h.transfers.values())).not_after == 6.0


def test_store_given_up_frees_its_blocks_only_after_not_after() -> None:
    c = TransferClient(TransferClientConfig(instance_id=1, model_name="m", chunk_size=C,
                                            object_bytes=10, transfer_timeout=10.0, copy_grace=0.5))
    (sent,) = c.handle(SubmitStoreEvent(), 2.0)
    assert isinstance(sent.request, Store) and sent.request.not_after == 12.0
    c.handle(EngineFinished(("r",)), 2.0)
    c.handle(ServerHealth(0, False), 3.0)  # gives up; the STORE may still be on its way
    assert c.finished() == (frozenset(), frozenset())
    assert c.next_deadline() == 12.5
    c.handle(ServerHealth(0, True), 12.4)
    assert c.finished() == (frozenset(), frozenset())
    c.handle(ServerHealth(0, True), 12.5)
    assert c.finished() == (frozenset({"r"}), frozenset())
    c.check_invariants()
    assert c.stats()["requests"] == 0 and c.stats()["fenced_requests"] == 0


def test_a_synchronous_load_given_up_is_still_loading_until_its_fence_ends() -> None:
    """A server-driven synchronous RETRIEVE given up on (its server lost, or its op timed out)
    may still be copied until not_after + copy_grace: the worker's wait for the step's loads
    (``loading``) holds until then, and its blocks are in ``load_errors()`` when it ends. Ending
    the wait when the op was dropped let vLLM read blocks no copy wrote as loaded (F10, profile
    no-reregister seed 56)."""
    from mpcache.core_sm.messages import SubmitRetrieve

    c = TransferClient(TransferClientConfig(instance_id=1, model_name="m", chunk_size=C,
                                            object_bytes=10, transfer_timeout=10.0, copy_grace=0.5))
    (sent,) = c.handle(SubmitRetrieve("r", TOKS, 0, 2 * C, BLOCKS, synchronous=True), 2.0)
    assert isinstance(sent.request, Retrieve) and sent.request.not_after == 12.0
    c.handle(ServerHealth(0, False), 3.0)  # gives up; the RETRIEVE may still be copying
    assert c.ops_of("r") == ()
    assert c.loading(("r",)) and c.load_errors() == frozenset()
    c.handle(ServerHealth(0, True), 12.4)
    assert c.loading(("r",))
    c.handle(ServerHealth(0, True), 12.5)
    assert not c.loading(("r",)) and c.load_errors() == frozenset(BLOCKS)
    assert c.finished() == (frozenset(), frozenset())  # synchronous: never in recving


def test_store_answered_by_the_server_needs_no_fence() -> None:
    c = TransferClient(TransferClientConfig(instance_id=1, model_name="m", chunk_size=C,
                                            object_bytes=10, transfer_timeout=10.0))
    (sent,) = c.handle(SubmitStoreEvent(), 0.0)
    c.handle(EngineFinished(("r",)), 0.0)
    from mpcache.core_sm.messages import ReplyReceived

    c.handle(ReplyReceived(0, sent.correlation, StoreResult(False)), 1.0)
    assert c.finished() == (frozenset({"r"}), frozenset())


def test_store_failed_timeout_stays_fenced_until_not_after() -> None:
    """A TIMEOUT error is the transport's own request timeout (the STORE, or its resend after
    not_registered, may still be copying) or the server's refusal of a late STORE: they look
    alike, so the blocks stay the request's until not_after + copy_grace either way."""
    from mpcache.core_sm.errors import ProtocolError
    from mpcache.core_sm.messages import RequestFailed

    c = TransferClient(TransferClientConfig(instance_id=1, model_name="m", chunk_size=C,
                                            object_bytes=10, transfer_timeout=10.0, copy_grace=0.5))
    (sent,) = c.handle(SubmitStoreEvent(), 2.0)
    c.handle(EngineFinished(("r",)), 2.0)
    c.handle(RequestFailed(0, sent.correlation, ProtocolError(ErrorKind.TIMEOUT, "no reply")), 11.0)
    assert c.finished() == (frozenset(), frozenset()) and c.next_deadline() == 12.5
    c.handle(ServerHealth(0, True), 12.5)
    assert c.finished() == (frozenset({"r"}), frozenset())
    assert c.stats()["stores_failed"] == 1 and c.stats()["store_fences"] == 1


def test_a_store_the_transport_would_not_take_needs_no_fence() -> None:
    """NOT_SENT (the link's SendFailed: no connection, the frame never left) cannot be copied by
    any server, so its blocks go back to vLLM at once; an UNHEALTHY failure (the frame may be on
    its way) of the same store stays fenced until not_after + copy_grace."""
    from mpcache.core_sm.errors import ProtocolError
    from mpcache.core_sm.messages import RequestFailed

    for kind, freed_at in ((ErrorKind.NOT_SENT, 2.0), (ErrorKind.UNHEALTHY, 12.5)):
        c = TransferClient(TransferClientConfig(instance_id=1, model_name="m", chunk_size=C,
                                                object_bytes=10, transfer_timeout=10.0, copy_grace=0.5))
        (sent,) = c.handle(SubmitStoreEvent(), 2.0)
        c.handle(EngineFinished(("r",)), 2.0)
        c.handle(RequestFailed(0, sent.correlation, ProtocolError(kind, "server not connected")), 2.0)
        if freed_at > 2.0:
            assert c.finished() == (frozenset(), frozenset()) and c.next_deadline() == freed_at
            c.handle(ServerHealth(0, True), freed_at)
        assert c.finished() == (frozenset({"r"}), frozenset()), kind
        assert c.stats()["store_fences"] == (kind is ErrorKind.UNHEALTHY)
        c.check_invariants()


def test_pair_late_store_after_abandon_never_reads_reused_blocks() -> None:
    """The finding's sequence: STORE held in the network, the worker's server turns unhealthy,
    the STORE arrives later. Either the blocks are still the request's (before the fence), or
    the server refuses the STORE (after not_after)."""
    for arrive_at, expect_copy, expect_freed_at in ((4.0, True, None), (30.5, False, None),
                                                    (31.5, False, 31.0)):
        p = Pair()
        p.workers[0] = w = TransferClient(TransferClientConfig(
            instance_id=1, model_name="m", chunk_size=C, object_bytes=10, transfer_timeout=30.0))
        p.client("w0", ServerHealth(0, False))
        p.client("w0", ServerHealth(0, True))
        p.run()
        p.client("w0", SubmitStoreEvent())
        p.client("w0", EngineFinished(("r",)))
        held = p.up.pop()
        assert isinstance(held.request, Store)
        p.now = 1.0
        p.client("w0", ServerHealth(0, False))
        freed_at = None
        while p.now < arrive_at:
            p.now = round(p.now + 0.5, 6)
            p.client("w0", ServerHealth(0, True) if p.now > 2 else ServerHealth(0, False))
            p.run()
            if freed_at is None and "r" in w.finished()[0]:
                freed_at = p.now
        p.up.append(held)
        p.to_server(len(p.up) - 1)
        copying = bool([e for e in p.internal if isinstance(e[1], TransferFinished)])
        assert freed_at == expect_freed_at and copying is expect_copy
        assert not (copying and freed_at is not None)  # a copy never reads freed blocks
        if not copying:
            refused = p.down[-1].reply
            assert isinstance(refused, ErrorReply) and refused.error.kind is ErrorKind.TIMEOUT


def SubmitStoreEvent() -> object:
    from mpcache.core_sm.messages import SubmitStore

    return SubmitStore("r", TOKS, 0, 2 * C, BLOCKS)


# ----------------------------------------------------------------------------- duplicate STORE


def test_duplicate_store_is_answered_when_the_original_write_ends() -> None:
    for ok in (True, False):
        h = ServerHarness()
        h.register()
        store = Store(key("r", TOKS, worker_id=0), 1, BLOCKS)
        first = h.send(store)
        (tid,) = h.transfers
        dup = h.send(store)
        assert h.reply(dup) is None  # the original copy still reads the blocks
        assert len(h.transfers) == 1 and h.server.stats()["store_waits"] == 1
        h.finish_all_transfers(ok)
        assert h.result(first) == StoreResult(ok, 2 if ok else 0, 0 if ok else 2)
        assert h.result(dup) == StoreResult(ok, 0, 2)
        assert h.server.stats()["store_waits"] == 0


def test_store_overlapping_a_running_store_waits_for_both_copies() -> None:
    h = ServerHarness()
    h.register()
    a = h.send(Store(key("a", TOKS, 0, C, worker_id=0), 1, BLOCKS[:2]))
    (ta,) = h.transfers
    b = h.send(Store(key("b", TOKS, worker_id=0), 1, BLOCKS))  # chunk 0 is a's, chunk 1 its own
    (tb,) = set(h.transfers) - {ta}
    h.feed(TransferFinished(tb, True))
    assert h.reply(b) is None  # a's copy of chunk 0 has not landed
    h.feed(TransferFinished(ta, True))
    assert h.result(a) == StoreResult(True, 1, 0) and h.result(b) == StoreResult(True, 1, 1)


def test_duplicate_store_expiring_original_reports_failure() -> None:
    h = ServerHarness(lease_ttl=2.0)
    h.register()
    store = Store(key("r", TOKS, worker_id=0), 1, BLOCKS)
    first, dup = h.send(store), h.send(store)
    h.advance(2.0)
    assert h.result(first) == StoreResult(False, 0, 2) and h.result(dup) == StoreResult(False, 0, 2)


# ----------------------------------------------------------------------------- reused slots


def test_late_l2_read_slot_is_quarantined_until_it_lands() -> None:
    h = ServerHarness(l2_enabled=True, lease_ttl=2.0, num_slots=2)
    h.register()
    h.send(Lookup(key("r", tokens(1, seed=1))))
    (read,) = h.reads.values()
    ((_k, slot),) = read.items
    h.advance(3.0)  # the read's reservation expired; the read itself is still running
    assert h.server.stats()["quarantined_slots"] == 1 and h.server.stats()["objects"] == 0
    rt = h.send(Store(key("w", tokens(2, seed=2), worker_id=0), 1, BLOCKS))
    (t,) = h.transfers.values()
    assert slot not in {s for _c, s in t.placements}  # the other slot only; one chunk skipped
    h.finish_all_transfers()
    assert h.result(rt) == StoreResult(True, 1, 1)
    h.feed(L2ReadFinished(read.read_id, (True,)))  # lands in a slot nobody else was given
    stats = h.server.stats()
    assert stats["quarantined_slots"] == 0 and stats["free_slots"] == 1 and stats["pinned_slots"] == 0


def test_expired_copy_and_forced_clear_keep_slots_until_completion() -> None:
    h = ServerHarness(lease_ttl=2.0, num_slots=2)
    h.register()
    h.store(TOKS, rid="w")  # both slots ready
    rt = h.send(Retrieve(key("r", TOKS, worker_id=0), 1, BLOCKS))
    (t,) = h.transfers.values()
    h.advance(2.5)  # the retrieve is failed on schedule; its copy has not reported
    assert h.result(rt).ok is False  # type: ignore[attr-defined]
    h.send(Clear(True, admin=True))
    stats = h.server.stats()
    assert stats["objects"] == 0 and stats["quarantined_slots"] == 2 and stats["free_slots"] == 0
    other = h.send(Store(key("o", tokens(2, seed=5), worker_id=0), 1, BLOCKS))
    assert h.result(other) == StoreResult(True, 0, 2) and len(h.transfers) == 1  # no slot
    h.feed(TransferFinished(t.transfer_id, True))
    assert h.server.stats()["free_slots"] == 2 and h.server.stats()["stale_events"] == 1


def test_l2_write_slot_waits_for_its_completion() -> None:
    h = ServerHarness(lease_ttl=2.0, num_slots=1, write_behind=True)
    h.register()
    h.store(tokens(1), rid="w")
    (write,) = h.writes.values()
    h.advance(2.5)  # the write's lease expired
    h.send(Clear(True, admin=True))
    assert h.server.stats()["quarantined_slots"] == 1
    h.feed(L2WriteFinished(write.write_id, True))
    assert h.server.stats()["free_slots"] == 1


def test_expired_plan_slots_quarantined_for_one_more_lease_ttl() -> None:
    h = ServerHarness(lease_ttl=2.0, num_slots=2)
    h.register(engine_driven=True)
    rt = h.send(PrepareStore(key("r", TOKS, worker_id=0), 1))
    plan = h.result(rt)
    assert isinstance(plan, TransferPlan) and len(plan.placements) == 2
    h.advance(2.0)  # uncommitted: the plan expires, its engine may still be copying
    assert h.server.stats()["quarantined_slots"] == 2
    assert h.server.next_deadline() == 4.0
    h.advance(2.0)
    assert h.server.stats()["quarantined_slots"] == 0 and h.server.stats()["free_slots"] == 2
    # A commit arriving inside the quarantine ends it at once.
    rt = h.send(PrepareStore(key("q", TOKS, worker_id=0), 1))
    plan = h.result(rt)
    assert isinstance(plan, TransferPlan)
    h.advance(2.5)
    late = h.send(CommitTransfer(plan.transfer_id, True))
    assert h.error_kind(late) is ErrorKind.UNKNOWN_TRANSFER
    assert h.server.stats()["quarantined_slots"] == 0 and h.server.stats()["free_slots"] == 2


def test_no_effect_ever_targets_a_slot_given_to_another_object() -> None:
    """Reads that outlive their reservation, under slot pressure: until a read's completion
    arrives, its slots hold its key or nothing."""
    h = ServerHarness(l2_enabled=True, lease_ttl=1.0, num_slots=3)
    h.register()
    target: dict[int, object] = {}
    for i in range(6):
        h.send(Lookup(key(f"r{i}", tokens(2, seed=i))))
        for read in h.reads.values():
            for k, slot in read.items:
                target.setdefault(slot, k)
        h.advance(1.5)
        for slot, k in target.items():
            holders = [o for o in h.server.index.objects() if h.server.index.slot_of(o) == slot]
            assert holders in ([], [k]), (slot, holders, k)
    assert len(target) == 3 and h.server.stats()["quarantined_slots"] == 3
    for read in list(h.reads.values()):
        h.feed(L2ReadFinished(read.read_id, (False,) * len(read.items)))
    assert h.server.stats()["free_slots"] == 3


def test_retrieve_given_up_reports_recving_and_errors_only_after_not_after() -> None:
    """The same fence for RETRIEVE: a late copy would write blocks vLLM recomputes or reused."""
    c = TransferClient(TransferClientConfig(instance_id=1, model_name="m", chunk_size=C,
                                            object_bytes=10, op_timeout=4.0, copy_grace=0.5))
    from mpcache.core_sm.messages import SubmitRetrieve

    (sent,) = c.handle(SubmitRetrieve("r", TOKS, 0, 2 * C, BLOCKS), 1.0)
    assert isinstance(sent.request, Retrieve) and sent.request.not_after == 5.0
    c.handle(ServerHealth(0, False), 2.0)
    assert c.finished() == (frozenset(), frozenset()) and c.load_errors() == frozenset()
    c.handle(ServerHealth(0, False), 5.5)
    assert c.finished() == (frozenset(), frozenset({"r"})) and c.load_errors() == frozenset(BLOCKS)
    h = ServerHarness()
    h.register()
    h.store(TOKS, rid="w")
    h.now = 5.5
    rt = h.send(attrs.evolve(sent.request, instance_id=1))
    assert h.error_kind(rt) is ErrorKind.TIMEOUT and not h.transfers
    assert h.server.leases_by_owner() == {}


def test_duplicate_retrieve_never_starts_a_second_copy() -> None:
    h = ServerHarness()
    h.register()
    h.store(TOKS, rid="w")
    retrieve = Retrieve(key("r", TOKS, worker_id=0), 1, BLOCKS, not_after=10.0)
    first, dup = h.send(retrieve), h.send(retrieve)
    assert len(h.transfers) == 1 and h.reply(dup) is None  # shares the running copy
    h.finish_all_transfers()
    assert h.result(first) == h.result(dup) == RetrieveResult(True, 2)
    late = h.send(retrieve)  # after the copy, before not_after: answered, no new copy
    assert h.result(late) == RetrieveResult(True, 2) and not h.transfers
    h.now = 10.5
    assert h.error_kind(h.send(retrieve)) is ErrorKind.TIMEOUT and not h.transfers
    assert h.server.stats()["duplicate_transfers"] == 2


def test_duplicate_store_after_an_answer_gets_that_answer_and_no_copy() -> None:
    """The network may deliver a STORE again after it was answered (an error, or success and
    the chunks evicted since): the worker may have freed the blocks, so no copy may start."""
    h = ServerHarness(num_slots=2)
    store = Store(key("r", TOKS, worker_id=0), 1, BLOCKS, not_after=10.0)
    first = h.send(store)
    assert h.error_kind(first) is ErrorKind.NOT_REGISTERED
    h.register()
    again = h.send(store)
    assert h.error_kind(again) is ErrorKind.NOT_REGISTERED and not h.transfers
    other = Store(key("s", tokens(2, seed=3), worker_id=0), 1, BLOCKS, not_after=10.0)
    ok = h.send(other)
    h.finish_all_transfers()
    assert h.result(ok) == StoreResult(True, 2, 0)
    h.send(Clear(True, admin=True))  # the chunks are gone from L1
    dup = h.send(other)
    assert h.result(dup) == StoreResult(True, 2, 0) and not h.transfers
    h.now = 10.5  # after not_after: refused
    assert h.error_kind(h.send(other)) is ErrorKind.TIMEOUT and not h.transfers


def test_a_duplicate_is_answered_until_its_own_not_after_not_an_older_ops() -> None:
    """Found by the simulator (default profile, seed 177, once its transport was core_sm's
    ServerLink): pruning the kept answers rebound the new op's keep-until to the oldest kept
    answer's, so a STORE answered at 1.18 with not_after 4.18 was kept only until 1.19; the
    network's duplicate at 1.20 started a second copy of blocks vLLM had freed (F10)."""
    h = ServerHarness()
    h.register()
    h.store(TOKS, rid="w")
    early = Retrieve(key("early", TOKS, worker_id=0), 1, BLOCKS, not_after=2.0)
    h.send(early)
    h.finish_all_transfers()
    h.now = 1.0
    late = Retrieve(key("late", TOKS, worker_id=0), 1, BLOCKS, not_after=10.0)
    h.send(late)  # kept answers are pruned here, the early one (until 2.0) first in line
    h.finish_all_transfers()
    h.now = 3.0  # past the early op's not_after, long before the late one's
    assert h.result(h.send(late)) == RetrieveResult(True, 2) and not h.transfers


def test_a_synchronous_load_is_settled_by_the_time_the_machine_names() -> None:
    """``settled_by`` is the machine's own bound on a load's wait (its op timeout, then the
    late-copy fence): None exactly when nothing is loading, and once that time has come and a
    timer fired, nothing is. The worker's wait asks it instead of keeping a bound of its own."""
    import random

    from mpcache.core_sm.messages import SubmitRetrieve, TimerFired

    for seed in range(200):
        rng = random.Random(seed)
        engine_driven = rng.random() < 0.3
        c = TransferClient(TransferClientConfig(
            instance_id=1, model_name="m", chunk_size=C, object_bytes=10, engine_driven=engine_driven,
            transfer_timeout=rng.choice([None, 1.0, 10.0]), op_timeout=rng.choice([2.0, 5.0]),
            copy_grace=rng.choice([0.0, 0.5])))
        now = rng.uniform(0.0, 3.0)
        c.handle(SubmitRetrieve("r", TOKS, 0, 2 * C, BLOCKS, synchronous=True), now)
        if rng.random() < 0.5:  # the server is lost while the load is in flight
            now += rng.uniform(0.0, 3.0)
            c.handle(ServerHealth(0, False), now)
        bound = c.settled_by(("r",))
        assert (bound is None) == (not c.loading(("r",)))
        assert c.settled_by(("other",)) is None
        if bound is None:  # settled already (an engine-driven load failed at once)
            assert c.load_errors() == frozenset(BLOCKS)
            continue
        # nothing answers: the machine's own timers settle it by the bound (or at once, by the
        # timers due now, when the bound has passed already: a fence that ended before the loss)
        settle_at = max(now, bound)
        for _ in range(8):
            if not c.loading(("r",)):
                break
            due = c.next_deadline()
            assert due is not None and due <= settle_at, (seed, due, bound, now)
            now = max(now, due)
            c.handle(TimerFired(), now)
        assert not c.loading(("r",)) and now <= settle_at and c.settled_by(("r",)) is None
        assert c.load_errors() == frozenset(BLOCKS)
