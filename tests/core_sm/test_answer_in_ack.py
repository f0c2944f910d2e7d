"""One round trip for a hit: ``Lookup.answer_in_ack``.

The server (``JobMachine.ack_answer``) puts the hit count in the LOOKUP's ack when it is final as
the lookup is handled -- the prefix leased from L1, no L2 step needed or possible -- and answers
the job as a status query would; anything else gets the nil ack of today. The client
(``LookupClientConfig.answer_in_ack``) goes AWAITING_ACK -> DONE on an ack with a count, and
takes a nil ack exactly as today (an L2 step left, or a server that ignores the request)."""
from __future__ import annotations

from typing import Any

import pytest

from mpcache.core_sm.effects import Effect, LookupWorkFailed, ReadL2, SendRequest
from mpcache.core_sm.lookup_client import LookupClient, LookupClientConfig, LookupState
from mpcache.core_sm.messages import (
    EndSession,
    FreeLookupLocks,
    L2ReadFinished,
    Lookup,
    QueryPrefetchStatus,
    ReplyReceived,
    ServerEpoch,
    SubmitLookup,
    WaitPrefetchStatus,
)
from mpcache.core_sm.server import JobState, LookupServer, ServerConfig
from sm_helpers import C, ServerHarness, key, tokens


def harness(**kw: Any) -> ServerHarness:
    return ServerHarness(ack_first=True, **kw)  # as runtime_zmq and the simulator run it


def in_ack(rid: str, toks: tuple[int, ...], **kw: Any) -> Lookup:
    return Lookup(key(rid, toks), 1, answer_in_ack=True, **kw)


# ------------------------------------------------------------------------------------- server


@pytest.mark.parametrize("ack_first", [True, False])
def test_an_l1_hit_is_answered_in_its_ack(ack_first: bool) -> None:
    h = ServerHarness(ack_first=ack_first)
    h.register()
    toks = tokens(3)
    h.store(toks)
    assert h.call(in_ack("a", toks)) == 3
    s = h.server
    assert not s.deferred_work  # nothing left to run after the ack
    assert s.job_state("a") is JobState.ANSWERED  # answered as a status query answers it
    assert s.leases_of("a") == 3  # held until the retrieve / free / end session, as today
    assert s.stats()["lookups_answered_in_ack"] == 1
    # a status query that comes anyway (a client that asks regardless) answers the same count
    assert h.call(QueryPrefetchStatus("a")) == 3
    assert h.call(WaitPrefetchStatus("a", 1.0)) == 3


def test_without_the_field_the_ack_is_nil_as_today() -> None:
    h = harness()
    h.register()
    toks = tokens(3)
    h.store(toks)
    assert h.call(Lookup(key("a", toks), 1)) is None
    assert h.server.stats()["lookups_answered_in_ack"] == 0
    assert h.call(QueryPrefetchStatus("a")) == 3


def test_a_miss_without_l2_is_final_and_answered_zero() -> None:
    h = harness()
    assert h.call(in_ack("a", tokens(2))) == 0
    assert h.server.job_state("a") is JobState.ANSWERED
    assert h.call(QueryPrefetchStatus("a")) == 0


def test_a_lookup_that_reads_l2_gets_the_nil_ack_and_its_status_later() -> None:
    h = harness(l2_enabled=True)
    h.register()
    toks = tokens(3)
    h.store(toks[: C])  # chunk 0 in L1, the rest to read from L2
    rt = h.send(in_ack("a", toks))
    assert h.result(rt) is None
    assert h.server.job_state("a") is JobState.PENDING and len(h.reads) == 1
    (read,) = h.reads.values()
    h.feed(L2ReadFinished(read.read_id, (True,) * len(read.items)))
    assert h.call(QueryPrefetchStatus("a")) == 3
    assert h.server.stats()["lookups_answered_in_ack"] == 0


def test_with_l2_a_whole_l1_hit_is_still_answered_in_the_ack() -> None:
    h = harness(l2_enabled=True)
    h.register()
    toks = tokens(2)
    h.store(toks)
    assert h.call(in_ack("a", toks)) == 2
    assert not [e for e in h.log if isinstance(e, ReadL2)]


def test_a_duplicate_gets_the_same_answer_and_no_second_set_of_leases() -> None:
    h = harness()
    h.register()
    toks = tokens(3)
    h.store(toks)
    first = h.call(in_ack("a", toks))
    again = h.call(in_ack("a", toks))  # a network duplicate after the answer: a lookup of an answered id
    assert first == again == 3
    assert h.server.leases_of("a") == 3  # topped up, never doubled
    assert h.call(QueryPrefetchStatus("a")) == 3


def test_a_duplicate_of_a_pending_lookup_is_acked_nil_as_its_original() -> None:
    h = harness(l2_enabled=True)
    h.register()
    toks = tokens(2)
    assert h.call(in_ack("a", toks)) is None  # reads L2
    assert h.call(in_ack("a", toks)) is None  # the live job's duplicate: no new leases
    assert h.server.stats()["duplicate_lookups"] == 1


def test_end_session_and_free_after_an_answer_in_the_ack_work_as_today() -> None:
    h = harness()
    h.register()
    toks = tokens(3)
    h.store(toks)
    assert h.call(in_ack("a", toks)) == 3
    assert h.call(FreeLookupLocks(key("a", toks, 2 * C, 3 * C))) is None
    assert h.server.leases_of("a") == 2
    assert h.call(EndSession("a")) is None
    assert h.server.leases_of("a") == 0 and h.server.job_state("a") is JobState.ABSENT
    assert h.call(QueryPrefetchStatus("a")) == 0


class FailingLeases(LookupServer):
    def _lease_prefix_for_lookup(self, *args: Any) -> int:
        raise MemoryError("no room for the leases")


def test_work_failing_is_answered_zero_in_the_ack() -> None:
    h = ServerHarness(server=FailingLeases(ServerConfig(chunk_size=C, num_slots=64, slot_bytes=100, ack_first=True)))
    h.register()
    toks = tokens(2)
    h.store(toks)
    rt = h.send(in_ack("a", toks))
    assert h.result(rt) == 0
    assert any(isinstance(e, LookupWorkFailed) for e in h.log)
    assert h.server.leases_of("a") == 0 and h.call(QueryPrefetchStatus("a")) == 0


# ------------------------------------------------------------------------------------- client


def client(n: int = 1, **kw: Any) -> LookupClient:
    return LookupClient(LookupClientConfig(num_servers=n, model_name="m", chunk_size=C, answer_in_ack=True, **kw))


def sends(effects: list[Effect], typ: type) -> list[SendRequest]:
    return [e for e in effects if isinstance(e, SendRequest) and isinstance(e.request, typ)]


def test_client_asks_for_the_answer_in_the_ack_only_when_configured() -> None:
    (lk,) = sends(client().handle(SubmitLookup("r", tokens(3)), 0.0), Lookup)
    assert lk.request.answer_in_ack is True
    plain = LookupClient(LookupClientConfig(model_name="m", chunk_size=C))
    (lk,) = sends(plain.handle(SubmitLookup("r", tokens(3)), 0.0), Lookup)
    assert lk.request.answer_in_ack is False


def test_client_an_ack_with_a_count_resolves_without_a_status_query() -> None:
    c = client()
    (lk,) = sends(c.handle(SubmitLookup("r", tokens(3)), 0.0), Lookup)
    assert c.state("r") is LookupState.AWAITING_ACK
    assert c.handle(ReplyReceived(0, lk.correlation, 3), 0.001) == []  # no query, no free
    assert c.state("r") is LookupState.DONE and c.check("r") == 3 * C
    stats = c.stats()
    assert stats["status_queries_sent"] == 0 and stats["answered_in_ack"] == 1
    c.check_invariants()


@pytest.mark.parametrize("use_wait", [True, False])
def test_client_a_nil_ack_is_taken_as_today(use_wait: bool) -> None:
    """An old server (or a lookup that reads L2) acks nil: the status query follows."""
    c = client(use_wait=use_wait)
    (lk,) = sends(c.handle(SubmitLookup("r", tokens(3)), 0.0), Lookup)
    fx = c.handle(ReplyReceived(0, lk.correlation, None), 0.001)
    (q,) = sends(fx, WaitPrefetchStatus if use_wait else QueryPrefetchStatus)
    assert c.state("r") is LookupState.QUERYING
    c.handle(ReplyReceived(0, q.correlation, 2), 0.002)
    assert c.check("r") == 2 * C and c.stats()["answered_in_ack"] == 0


def test_client_min_over_servers_whose_acks_may_or_may_not_carry_a_count() -> None:
    c = client(n=2, use_wait=True)
    lks = sends(c.handle(SubmitLookup("r", tokens(3)), 0.0), Lookup)
    by_server = {e.server: e for e in lks}
    assert c.handle(ReplyReceived(0, by_server[0].correlation, 3), 0.0) == []  # server 0: in its ack
    assert c.state("r") is LookupState.AWAITING_ACK
    (q,) = sends(c.handle(ReplyReceived(1, by_server[1].correlation, None), 0.0), WaitPrefetchStatus)
    assert q.server == 1 and c.state("r") is LookupState.QUERYING
    fx = c.handle(ReplyReceived(1, q.correlation, 2), 0.0)
    assert c.check("r") == 2 * C
    (free,) = sends(fx, FreeLookupLocks)  # server 0 holds a chunk beyond the result
    assert free.server == 0 and (free.request.key.start, free.request.key.end) == (2 * C, 3 * C)
    c.check_invariants()


def test_client_a_zero_in_one_ack_resolves_at_once_and_frees_the_others() -> None:
    c = client(n=2)
    lks = {e.server: e for e in sends(c.handle(SubmitLookup("r", tokens(3)), 0.0), Lookup)}
    fx = c.handle(ReplyReceived(1, lks[1].correlation, 0), 0.0)
    assert c.check("r") == 0
    (free,) = sends(fx, FreeLookupLocks)  # server 0's lookup is in flight: whatever it leases goes
    assert free.server == 0
    # its ack (with a count or not) comes later and is stale
    assert c.handle(ReplyReceived(0, lks[0].correlation, 3), 0.0) == []
    assert c.stats()["stale_replies"] == 1


def test_client_a_bad_count_in_an_ack_is_a_bad_reply_taken_as_zero() -> None:
    c = client()
    (lk,) = sends(c.handle(SubmitLookup("r", tokens(3)), 0.0), Lookup)
    c.handle(ReplyReceived(0, lk.correlation, -1), 0.0)
    assert c.check("r") == 0 and c.stats()["bad_replies"] == 1


def test_client_a_restart_while_awaiting_the_ack_resolves_zero() -> None:
    c = client()
    c.handle(ServerEpoch(0, "e1"), 0.0)
    (lk,) = sends(c.handle(SubmitLookup("r", tokens(3)), 0.0), Lookup)
    c.handle(ServerEpoch(0, "e2"), 0.0)
    assert c.check("r") == 0
    assert c.handle(ReplyReceived(0, lk.correlation, 3), 0.0) == []  # the old server's answer: stale
    assert c.check("r") == 0


def test_pair_an_l1_hit_takes_one_round_trip_a_miss_with_l2_two() -> None:
    """Client and server back to back: an L1 hit is DONE after the LOOKUP's reply alone."""
    h = harness(l2_enabled=True)
    h.register()
    hit, part = tokens(3), tokens(3, seed=1)
    h.store(hit)
    h.store(part[: C])
    c = client()
    for rid, toks, trips in (("hit", hit, 1), ("l2", part, 2)):
        fx = c.handle(SubmitLookup(rid, toks), h.now)
        n = 0
        while c.state(rid) is not LookupState.DONE:
            (req,) = [e for e in fx if isinstance(e, SendRequest)]
            n += 1
            rt = h.send(req.request)
            for read in list(h.reads.values()):  # the L2 read lands before the status query
                del h.reads[read.read_id]
                h.feed(L2ReadFinished(read.read_id, (True,) * len(read.items)))
            fx = c.handle(ReplyReceived(0, req.correlation, h.result(rt)), h.now)
        assert n == trips, rid
        assert c.check(rid) == 3 * C
