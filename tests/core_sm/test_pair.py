"""Seed bugs replayed on the pair harness (sm_pair.Pair: clients <-> servers, no runtime), and a
Hypothesis network schedule checking liveness and lease cleanup."""
from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from mpcache.core_sm.lookup_client import LookupClient, PendingLookup, ServerLeg
from mpcache.core_sm.messages import (
    Cleanup,
    Clear,
    EndRequest,
    EngineFinished,
    FreeUnusedLeases,
    Lookup,
    QueryPrefetchStatus,
    RegisterInstance,
    ServerEpoch,
    ServerHealth,
    SubmitLookup,
    SubmitRetrieve,
    SubmitStore,
)
from mpcache.core_sm.server import LookupServer
from mpcache.core_sm.transfer_client import TransferClient
from sm_helpers import C, tokens
from sm_pair import Msg, Pair


def test_full_request_lifecycle_leaves_nothing_behind() -> None:
    p = Pair()
    toks = tokens(3)
    p.store(toks)
    p.client("lookup", SubmitLookup("r", toks))
    p.settle()
    assert p.lookup.check("r") == 3 * C
    p.client("lookup", Cleanup("r"))
    p.client("w0", SubmitRetrieve("r", toks, 0, 3 * C, (0, 1, 2, 3, 4, 5)))
    p.run()
    assert p.workers[0].finished() == (frozenset(), frozenset({"r"}))
    assert p.leases("r") == 0
    p.client("lookup", EndRequest("r"))
    p.client("w0", EngineFinished(("r", "writer")))
    p.run()
    assert p.workers[0].finished() == (frozenset({"r", "writer"}), frozenset())
    st_ = p.servers[0].stats()
    assert st_["leases_held"] == 0 and st_["jobs"] == 0 and st_["tombstones"] == 0


def test_requery_after_the_job_was_consumed_answers_the_same() -> None:
    """#2733 / F1: the server consumed the job; asking again must not turn into None."""
    p = Pair()
    toks = tokens(2)
    p.store(toks)
    p.client("lookup", SubmitLookup("r", toks))
    p.settle()
    assert p.lookup.check("r") == 2 * C
    assert p.lookup.check("r") == 2 * C  # client cache
    # and a raw re-query reaches the server: the tombstone repeats the count
    p.up.append(Msg("lookup", 0, 10_000, request=QueryPrefetchStatus("r")))
    p.to_server()
    assert p.down[-1].reply.result == 2
    p.down.clear()


def test_query_of_an_unknown_id_is_zero() -> None:
    """#2996: an id the server never saw (or lost in a restart) answers 0, never None."""
    p = Pair()
    p.up.append(Msg("lookup", 0, 10_000, request=QueryPrefetchStatus("ghost")))
    p.to_server()
    assert p.down.pop().reply.result == 0


def test_duplicated_and_reordered_status_queries() -> None:
    p = Pair(l2_enabled=True)
    toks = tokens(2)
    p.store(toks)
    p.client("lookup", SubmitLookup("r", toks))
    p.to_server()  # lookup
    p.to_client()  # ack -> status query
    (q,) = p.up
    p.to_server(0, duplicate=True)  # the network duplicates the query
    p.to_server(0)
    a, b = p.down
    assert a.reply.result == b.reply.result == 2  # both copies answer the same count
    p.to_client(1)  # delivered out of order: the second copy first
    p.to_client(0)  # the first copy is now stale, ignored and counted
    assert p.lookup.check("r") == 2 * C and p.lookup.stats()["stale_replies"] == 1


def test_server_restart_mid_lookup_resolves_to_zero() -> None:
    p = Pair(l2_enabled=True)
    toks = tokens(2)
    p.client("lookup", SubmitLookup("r", toks))
    p.to_server()
    p.to_client()  # acked; the status query is queued
    p.servers[0] = LookupServer(p.cfg)  # crash + restart: everything is gone
    p.internal.clear()
    p.settle()
    assert p.lookup.check("r") == 0


def test_abort_before_allocation_releases_leases() -> None:
    """F8: the request is aborted while its lookup is still pending."""
    p = Pair(l2_enabled=True)
    toks = tokens(3)
    p.store(toks, end=C)
    p.l2_has = set()
    p.client("lookup", SubmitLookup("r", toks))
    p.to_server()  # lookup: 1 chunk leased, L2 read in flight
    assert p.leases("r") == 1
    p.client("lookup", Cleanup("r"))
    p.client("lookup", EndRequest("r"))
    p.settle()
    assert p.leases("r") == 0 and p.servers[0].stats()["jobs"] == 0
    assert p.lookup.stats()["correlations"] == 0


def test_free_only_releases_own_leases() -> None:
    """F9: A frees the shared prefix; B's retrieve of it still works."""
    p = Pair()
    shared = tokens(2)
    p.store(shared)
    for rid in ("a", "b"):
        p.client("lookup", SubmitLookup(rid, shared))
    p.settle()
    assert p.leases("a") == 2 and p.leases("b") == 2
    p.client("lookup", FreeUnusedLeases("a", shared, 0, 2 * C))
    p.run()
    assert p.leases("a") == 0 and p.leases("b") == 2
    p.client("w0", SubmitRetrieve("b", shared, 0, 2 * C, (0, 1, 2, 3)))
    p.run()
    assert p.workers[0].finished()[1] == {"b"} and p.workers[0].load_errors() == frozenset()
    assert p.leases("b") == 0


def test_two_servers_min_and_tail_free() -> None:
    p = Pair(num_servers=2)
    toks = tokens(3)
    p.client("w0", SubmitStore("w", toks, 0, 3 * C, tuple(range(6))))
    p.client("w1", SubmitStore("w", toks, 0, C, tuple(range(2))))
    p.run()
    p.client("lookup", SubmitLookup("r", toks))
    p.settle()
    assert p.lookup.check("r") == C
    assert p.leases("r") == 2  # one chunk on each server: the tail on server 0 was freed


class LegacyServer(LookupServer):
    """LMCache between #2733 and #2996: unknown -> None, exactly-once pop."""

    def _status_for_unknown(self, request_id: str) -> int | None:
        return None

    def _keeps_tombstones(self) -> bool:
        return False


class ResendingClient(LookupClient):
    """A client that abandons an unanswered query after one poll interval (F2)."""

    def _should_resend_status(self, pending: PendingLookup, leg: ServerLeg, now: float) -> bool:
        return True


def test_legacy_profile_reproduces_f2_hang_and_the_fix_does_not() -> None:
    for server_cls, expect in ((LegacyServer, None), (LookupServer, 2 * C)):
        p = Pair(server_cls=server_cls, lookup_cls=ResendingClient)
        toks = tokens(2)
        p.store(toks)
        p.client("lookup", SubmitLookup("r", toks))
        p.to_server()
        p.to_client()  # ack -> q1
        p.tick(0.02)  # q1 unanswered: the legacy client abandons it and sends q2
        assert len(p.up) == 2
        p.to_server()  # q1 consumes the job; its answer is stale at the client
        p.to_server()  # q2
        p.run()
        # legacy: q2 got None for the consumed id -> pending; every retry None until the timeout
        p.tick(0.02)
        p.run()
        assert p.lookup.check("r") == expect


class NoAckClient(LookupClient):
    def _wait_for_ack(self, pending: PendingLookup, server: int) -> bool:
        return False


def test_reordered_lookup_and_query_never_leak_past_the_reaper() -> None:
    """#4935 / F5: the status query overtakes the LOOKUP (only a client that skips the ack)."""
    p = Pair(lookup_cls=NoAckClient, abandoned_job_ttl=60.0)
    toks = tokens(2)
    p.store(toks)
    p.client("lookup", SubmitLookup("r", toks))
    assert [type(m.request) for m in p.up] == [Lookup, QueryPrefetchStatus]
    p.to_server(1)  # the query first: unknown -> 0, a final miss
    p.to_server(0)  # then the lookup leases the prefix
    p.run()
    assert p.lookup.check("r") == 0
    p.tick(61.0)  # the job was never queried: the reaper frees its leases
    assert p.leases("r") == 0
    # the fixed client waits for the ack, so the reorder cannot happen
    q = Pair()
    q.client("lookup", SubmitLookup("r", toks))
    assert [type(m.request) for m in q.up] == [Lookup]


@settings(max_examples=60, deadline=None)
@given(schedule=st.lists(st.tuples(st.sampled_from(["up", "down", "dup_up", "dup_down", "drop_up",
                                                     "drop_down", "tick", "internal"]),
                                   st.integers(0, 5)), max_size=60),
       n_servers=st.integers(1, 2), l2=st.booleans(), probe=st.booleans(), n_requests=st.integers(1, 3))
def test_any_schedule_every_lookup_resolves_and_leases_are_released(
        schedule: list[tuple[str, int]], n_servers: int, l2: bool, probe: bool, n_requests: int) -> None:
    p = Pair(num_servers=n_servers, l2_enabled=l2, l2_probe=probe, write_behind=l2)
    base = tokens(3)
    p.store(base, end=2 * C)
    rids = [f"r{i}" for i in range(n_requests)]
    for i, rid in enumerate(rids):
        p.client("lookup", SubmitLookup(rid, base[: (i + 1) * C + 1]))
    for action, i in schedule:
        queue = p.up if action.endswith("up") else p.down
        if action == "tick":
            p.tick(0.5 * (i + 1))
        elif action == "internal":
            p.complete()
        elif not queue:
            continue
        elif action in ("up", "down"):
            (p.to_server if action == "up" else p.to_client)(i % len(queue))
        elif action.startswith("dup"):
            (p.to_server if action == "dup_up" else p.to_client)(i % len(queue), duplicate=True)
        else:
            queue.pop(i % len(queue))
    # Liveness: within the lookup timeout every lookup has an int answer.
    for _ in range(12):
        p.tick(0.5)
        p.run()
    for rid in rids:
        answer = p.lookup.check(rid)
        assert isinstance(answer, int) and answer % C == 0 and answer <= 2 * C
    # Cleanup: once the requests end (and the reaper / TTL have had time), no lease remains.
    for rid in rids:
        p.client("lookup", Cleanup(rid))
        p.client("lookup", EndRequest(rid))
    p.run()
    p.tick(400.0)
    p.run()
    for srv in p.servers:
        assert srv.stats()["leases_held"] == 0
        assert srv.stats()["jobs"] == 0


def test_l2_round_trip_with_probe_after_l1_is_cleared() -> None:
    p = Pair(l2_enabled=True, l2_probe=True, write_behind=True)
    toks = tokens(3)
    p.store(toks)  # write-behind copies every chunk to L2
    p.up.append(Msg("lookup", 0, 10_000, request=Clear(True, admin=True)))
    p.run()
    assert p.servers[0].stats()["objects"] == 0
    p.client("lookup", SubmitLookup("r", toks))
    p.settle()
    assert p.lookup.check("r") == 3 * C
    st_ = p.servers[0].stats()
    assert st_["l2_probes"] == 1 and st_["l2_reads"] == 1 and p.leases("r") == 3


# ------------------------------------------------------------------- restart detection (F13)


def test_restart_between_heartbeats_not_registered_then_registers_again() -> None:
    """The server restarts between two heartbeats: the next store is refused NOT_REGISTERED and
    fails cleanly, the worker sends no registration of its own; once its link registered again
    the store after that is cached."""
    p = Pair()
    toks = tokens(2)
    p.store(toks, rid="before")
    p.restart_server()
    assert p.servers[0].stats()["instances"] == 0
    p.store(toks, rid="refused")
    w = p.workers[0]
    assert w.stats()["stores_failed"] == 1 and w.stats()["not_registered"] == 1
    assert w.stats()["registrations"] == 1 and p.servers[0].stats()["instances"] == 0
    p.reregister()
    p.run()
    assert p.servers[0].stats()["instances"] == 1
    p.store(toks, rid="after")
    assert w.stats()["stores_failed"] == 1 and p.servers[0].stats()["objects"] == 2
    p.client("w0", EngineFinished(("before", "refused", "after")))
    assert w.finished() == (frozenset({"before", "refused", "after"}), frozenset())
    p.client("lookup", SubmitLookup("r", toks))
    p.settle()
    assert p.lookup.check("r") == 2 * C  # cached again


def test_many_refused_ops_fail_cleanly_and_register_nothing() -> None:
    p = Pair()
    toks = tokens(2)
    p.restart_server()
    for i in range(4):
        p.client("w0", SubmitStore(f"s{i}", toks, 0, 2 * C, (0, 1, 2, 3)))
        p.client("w0", SubmitRetrieve(f"r{i}", toks, 0, 2 * C, (4, 5, 6, 7)))
    p.run()
    w = p.workers[0]
    assert w.stats()["not_registered"] == 8 and w.stats()["registrations"] == 1
    assert p.servers[0].stats()["instances"] == 0
    assert w.finished()[1] == {f"r{i}" for i in range(4)} and w.load_errors() == {4, 5, 6, 7}
    assert w.failed_retrieves() == {f"r{i}" for i in range(4)}


def test_new_epoch_mid_lookup_resolves_to_zero_and_worker_registers_again() -> None:
    p = Pair(num_servers=2)
    toks = tokens(2)
    p.store(toks)
    for s in range(2):
        p.client("lookup", ServerEpoch(s, 1))
        p.client(f"w{s}", ServerEpoch(s, 1))
    p.client("lookup", SubmitLookup("r", toks))
    p.to_server()
    p.to_server()
    p.to_client()
    p.to_client()  # both acked; the status queries are queued
    p.client("w1", SubmitRetrieve("r", toks, 0, 2 * C, (0, 1, 2, 3)))
    p.restart_server(1)
    p.client("lookup", ServerEpoch(1, 2))
    p.client("w1", ServerEpoch(1, 2))
    p.reregister(1)  # w1's link registers again on the new epoch
    assert p.lookup.check("r") == 0
    w1 = p.workers[1]
    # The RETRIEVE may still reach the new server: its blocks are fenced until not_after + grace.
    assert w1.finished() == (frozenset(), frozenset()) and w1.load_errors() == frozenset()
    p.settle()
    assert p.lookup.check("r") == 0 and p.lookup.stats()["resolved"] == 1
    assert p.servers[1].stats()["instances"] == 1
    p.tick(31.0)
    assert w1.finished() == (frozenset(), frozenset({"r"})) and w1.load_errors() == {0, 1, 2, 3}
    assert w1.finished() == (frozenset(), frozenset())  # no second completion
    assert p.leases("r") == 0  # server 0's leases were freed through the normal path


def test_tensor_parallel_ranks_spread_over_servers_hit() -> None:
    """TP=2, rank 0's KV on server 0 and rank 1's on server 1: a lookup naming each server's
    ranks hits; one asking every server for every rank cannot."""
    toks = tokens(3)
    cases: list[tuple[tuple[tuple[int, ...], ...] | None, int]] = [(((0,), (1,)), 3 * C), (None, 0)]
    for rps, expect in cases:
        p = Pair(num_servers=2, world_size=2, ranks_per_server=rps)
        if rps is None:  # the same placement, stored by workers of ranks 0 and 1
            p.workers[1] = TransferClient(attrs.evolve(p.workers[1].config, worker_id=1))
            p.client("w1", ServerHealth(1, True))
        p.store(toks)
        assert [srv.stats()["objects"] for srv in p.servers] == [3, 3]
        p.client("lookup", SubmitLookup("r", toks))
        p.settle()
        assert p.lookup.check("r") == expect
        if expect:
            assert p.leases("r") == 6  # 3 chunks x the one rank each server holds
            for s in range(2):
                p.client(f"w{s}", SubmitRetrieve("r", toks, 0, 3 * C, tuple(range(6))))
            p.run()
            assert all(w.finished()[1] == {"r"} and not w.load_errors() for w in p.workers)
            assert p.leases("r") == 0
