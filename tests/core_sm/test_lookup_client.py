"""LookupClient: submit, ack, one in-flight status query per server, min over servers."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpcache.core_sm.chunks import MAX_CACHE_SALT_LEN
from mpcache.core_sm.effects import Effect, SendRequest
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.core_sm.lookup_client import (
    EVENTS,
    LOOKUP_TABLE,
    SERVER_VIEW_TABLE,
    LookupClient,
    LookupClientConfig,
    LookupState,
    PendingLookup,
    ServerLeg,
)
from mpcache.core_sm.messages import (
    Cleanup,
    EndRequest,
    EndSession,
    FreeLookupLocks,
    FreeUnusedLeases,
    Lookup,
    QueryPrefetchStatus,
    ReplyReceived,
    RequestFailed,
    ServerEpoch,
    ServerHealth,
    SubmitLookup,
    TimerFired,
    WaitPrefetchStatus,
)
from sm_helpers import C, Pick, every_choice, tokens

FAIL = ProtocolError(ErrorKind.TIMEOUT, "x")


def client(n: int = 1, **kw: Any) -> LookupClient:
    return LookupClient(LookupClientConfig(num_servers=n, model_name="m", chunk_size=C, **kw))


def sends(effects: list[Effect], typ: type | None = None) -> list[SendRequest]:
    out = [e for e in effects if isinstance(e, SendRequest)]
    assert len(out) == len(effects)
    return [e for e in out if typ is None or isinstance(e.request, typ)]


def ack_all(c: LookupClient, effects: list[Effect], now: float = 0.0) -> list[Effect]:
    out: list[Effect] = []
    for e in sends(effects, Lookup):
        out += c.handle(ReplyReceived(e.server, e.correlation, None), now)
    return out


def test_submit_ack_query_result() -> None:
    c = client()
    fx = c.handle(SubmitLookup("r", tokens(3, extra=1)), 0.0)
    (lk,) = sends(fx, Lookup)
    assert lk.request.key.end == 3 * C and lk.request.key.worker_id is None
    assert c.check("r") is None and c.state("r") is LookupState.AWAITING_ACK
    assert c.handle(SubmitLookup("r", tokens(3)), 0.0) == []  # duplicate guard
    (q,) = sends(ack_all(c, fx), QueryPrefetchStatus)
    assert c.state("r") is LookupState.QUERYING
    assert c.handle(ReplyReceived(0, q.correlation, 2), 0.0) == []
    assert c.check("r") == 2 * C and c.state("r") is LookupState.DONE
    assert c.check("r") == 2 * C  # answered from the cache, no new query
    assert c.stats()["status_queries_sent"] == 1 and c.stats()["duplicate_submits"] == 1


def test_never_queries_before_ack_and_never_resends_in_flight() -> None:
    c = client(poll_interval=0.01)
    fx = c.handle(SubmitLookup("r", tokens(1)), 0.0)
    for t in (0.01, 0.02, 5.0):
        assert c.handle(TimerFired(), t) == []  # no ack yet: nothing sent
    (q,) = sends(ack_all(c, fx, 5.0), QueryPrefetchStatus)
    for t in (5.01, 5.02, 6.0):
        assert c.handle(TimerFired(), t) == []  # query in flight: never resent (F2)
    assert c.handle(ReplyReceived(0, q.correlation, None), 6.0) == []
    assert c.next_deadline() == pytest.approx(6.01)
    (q2,) = sends(c.handle(TimerFired(), 6.01), QueryPrefetchStatus)
    assert q2.correlation != q.correlation
    c.handle(ReplyReceived(0, q2.correlation, 1), 6.02)
    assert c.check("r") == C


def test_min_over_servers_frees_tails() -> None:
    c = client(3)
    fx = c.handle(SubmitLookup("r", tokens(4)), 0.0)
    qs = sends(ack_all(c, fx), QueryPrefetchStatus)
    assert len(qs) == 3
    c.handle(ReplyReceived(0, qs[0].correlation, 4), 0.0)
    c.handle(ReplyReceived(1, qs[1].correlation, 2), 0.0)
    out = sends(c.handle(ReplyReceived(2, qs[2].correlation, 3), 0.0), FreeLookupLocks)
    assert c.check("r") == 2 * C
    assert {(e.server, e.request.key.start, e.request.key.end) for e in out} == {
        (0, 2 * C, 4 * C), (2, 2 * C, 3 * C)}


def test_a_zero_resolves_at_once_and_frees_the_others() -> None:
    c = client(2)
    fx = c.handle(SubmitLookup("r", tokens(2)), 0.0)
    qs = sends(ack_all(c, fx), QueryPrefetchStatus)
    out = sends(c.handle(ReplyReceived(0, qs[0].correlation, 0), 0.0), FreeLookupLocks)
    assert c.check("r") == 0
    assert [(e.server, e.request.key.start, e.request.key.end) for e in out] == [(1, 0, 2 * C)]
    c.handle(ReplyReceived(1, qs[1].correlation, 2), 0.0)  # late: stale
    assert c.stats()["stale_replies"] == 1 and c.check("r") == 0


def test_failures_unhealthy_and_timeouts_resolve_to_zero() -> None:
    c = client(lookup_timeout=10.0)
    fx = c.handle(SubmitLookup("f", tokens(1)), 0.0)
    (lk,) = sends(fx)
    c.handle(RequestFailed(0, lk.correlation, FAIL), 0.0)
    assert c.check("f") == 0
    fx = c.handle(SubmitLookup("t", tokens(1)), 0.0)
    assert c.next_deadline() == pytest.approx(10.0)
    c.handle(TimerFired(), 10.0)
    assert c.check("t") == 0 and c.stats()["timeouts"] == 1
    fx = c.handle(SubmitLookup("u", tokens(1)), 20.0)
    ack_all(c, fx, 20.0)
    c.handle(ServerHealth(0, False), 20.0)
    assert c.check("u") == 0
    assert c.handle(SubmitLookup("v", tokens(1)), 21.0) == []  # unhealthy: no sends
    assert c.check("v") == 0
    c.handle(ServerHealth(0, True), 22.0)
    assert sends(c.handle(SubmitLookup("w", tokens(1)), 22.0), Lookup)


def test_no_full_chunk_is_zero_without_sending() -> None:
    c = client()
    assert c.handle(SubmitLookup("r", tokens(0, extra=C - 1)), 0.0) == []
    assert c.check("r") == 0


@pytest.mark.parametrize("toks,salt", [(tokens(1), "bad/salt"), ((-1,) * C, ""), (("x",) * C, ""),
                                       ((2**32,) * C, "")])
def test_invalid_submit_resolves_zero_without_raising(toks: tuple[Any, ...], salt: str) -> None:
    c = client()
    assert c.handle(SubmitLookup("r", toks, salt), 0.0) == []
    assert c.check("r") == 0 and c.stats()["invalid_submits"] == 1


def test_unknown_is_zero_cleanup_forgets_result_ttl_expires() -> None:
    c = client(result_ttl=100.0)
    assert c.check("nope") == 0
    fx = c.handle(SubmitLookup("r", tokens(1)), 0.0)
    (q,) = sends(ack_all(c, fx), QueryPrefetchStatus)
    c.handle(ReplyReceived(0, q.correlation, 1), 0.0)
    assert c.check("r") == C
    c.handle(TimerFired(), 100.0)
    assert c.check("r") == 0 and c.stats()["expired_results"] == 1
    fx = c.handle(SubmitLookup("s", tokens(1)), 0.0)
    assert c.handle(Cleanup("s"), 0.0) and c.state("s") is LookupState.ABSENT


def test_cleanup_of_a_pending_lookup_frees_its_range() -> None:
    c = client(2)
    c.handle(SubmitLookup("r", tokens(2)), 0.0)
    out = sends(c.handle(Cleanup("r"), 0.0), FreeLookupLocks)
    assert sorted(e.server for e in out) == [0, 1]
    assert all(e.request.key.end == 2 * C for e in out)
    assert c.stats()["correlations"] == 0


def test_free_unused_and_end_request_fire_and_forget() -> None:
    c = client(2)
    out = sends(c.handle(FreeUnusedLeases("r", tokens(2), 0, 2 * C), 0.0), FreeLookupLocks)
    assert len(out) == 2
    assert c.handle(FreeUnusedLeases("r", tokens(2), C, C), 0.0) == []
    ends = sends(c.handle(EndRequest("r"), 0.0), EndSession)
    assert len(ends) == 2
    for e in out + ends:
        c.handle(ReplyReceived(e.server, e.correlation, None), 0.0)
    assert c.stats()["stale_replies"] == 0 and c.stats()["fire_and_forget_replies"] == 4


def test_use_wait_sends_wait_prefetch_status() -> None:
    c = client(use_wait=True, wait_timeout=2.0)
    fx = c.handle(SubmitLookup("r", tokens(1)), 0.0)
    (w,) = sends(ack_all(c, fx), WaitPrefetchStatus)
    assert w.request.timeout == 2.0


def test_bad_result_type_resolves_zero() -> None:
    c = client()
    fx = c.handle(SubmitLookup("r", tokens(1)), 0.0)
    (q,) = sends(ack_all(c, fx))
    c.handle(ReplyReceived(0, q.correlation, "garbage"), 0.0)
    assert c.check("r") == 0 and c.stats()["bad_replies"] == 1


class NoAckWait(LookupClient):
    def _wait_for_ack(self, pending: PendingLookup, server: int) -> bool:
        return False


class Resender(LookupClient):
    def _should_resend_status(self, pending: PendingLookup, leg: ServerLeg, now: float) -> bool:
        return True


def test_legacy_hooks() -> None:
    c = NoAckWait(LookupClientConfig(chunk_size=C))
    fx = c.handle(SubmitLookup("r", tokens(1)), 0.0)
    assert len(sends(fx, Lookup)) == 1 and len(sends(fx, QueryPrefetchStatus)) == 1
    r = Resender(LookupClientConfig(chunk_size=C, poll_interval=0.01))
    fx = r.handle(SubmitLookup("r", tokens(1)), 0.0)
    (q,) = sends(ack_all(r, fx))
    (q2,) = sends(r.handle(TimerFired(), 0.01), QueryPrefetchStatus)
    r.handle(ReplyReceived(0, q.correlation, 1), 0.02)  # the abandoned answer is stale
    assert r.check("r") is None and r.stats()["stale_replies"] == 1


# ------------------------------------------------------------------- all states x all inputs

RID = "r"


class NoAckResending(LookupClient):
    """Both legacy query hooks: queries before the ack, and abandons unanswered ones (F5, F2):
    the only client whose lookups have a re-query before every ack, or a StatusResend."""

    def _wait_for_ack(self, pending: PendingLookup, server: int) -> bool:
        return False

    def _should_resend_status(self, pending: PendingLookup, leg: ServerLeg, now: float) -> bool:
        return True


def client_in(state: LookupState, n: int, acked: int, cls: type[LookupClient] = LookupClient,
              none_first: bool = False) -> tuple[LookupClient, list[SendRequest]]:
    """A client whose lookup RID is in ``state`` (``none_first``: its first status query was
    answered None, so a re-query is armed)."""
    c = cls(LookupClientConfig(num_servers=n, model_name="m", chunk_size=C, poll_interval=0.01,
                               lookup_timeout=10.0, result_ttl=100.0))
    sent: list[SendRequest] = []
    if state is LookupState.ABSENT:
        return c, sent
    sent += sends(c.handle(SubmitLookup(RID, tokens(2)), 0.0))
    if state is LookupState.AWAITING_ACK:
        for e in [e for e in sent if isinstance(e.request, Lookup)][: min(acked, n - 1)]:
            sent += sends(c.handle(ReplyReceived(e.server, e.correlation, None), 0.0))
    else:
        sent += sends(ack_all(c, list(sent)))
    queries = [e for e in sent if isinstance(e.request, QueryPrefetchStatus)]
    if state is LookupState.DONE:
        for e in queries:
            sent += sends(c.handle(ReplyReceived(e.server, e.correlation, 1), 0.0))
    elif none_first and queries:
        sent += sends(c.handle(ReplyReceived(queries[0].server, queries[0].correlation, None), 0.0))
    assert c.state(RID) is state, (c.state(RID), state)
    return c, sent


def test_every_event_goes_to_one_table() -> None:
    for event_type in EVENTS:
        owners = [t for t in (LOOKUP_TABLE, SERVER_VIEW_TABLE) if event_type in t.events()]
        assert len(owners) == (0 if event_type is TimerFired else 1), event_type
    for table in (LOOKUP_TABLE, SERVER_VIEW_TABLE):
        for (state, event_type), row in table.rows.items():
            assert callable(getattr(LookupClient, row.handler.__name__)), (state, event_type)


Transition = tuple[Any, type, Any]


def _walk_one(state: LookupState, event_type: type, n: int, acked: int, pick: Pick[Any]) -> set[Transition]:
    """One external event in ``state``; returns every table row it executed (timers included)."""
    cls = pick([LookupClient, NoAckResending])
    c, sent = client_in(state, n, acked, cls, none_first=pick([False, True]))
    c._lookups.trace, c._servers.trace = [], []
    now = 0.0
    ev: Any
    if event_type in (ReplyReceived, RequestFailed):
        corr = pick([e.correlation for e in sent] + [999])
        server = pick(list(range(n)))
        if event_type is ReplyReceived:
            ev = ReplyReceived(server, corr, pick([None, 0, 1, 2, -1, "x", True]))
        else:
            ev = RequestFailed(server, corr, FAIL)
    elif event_type is SubmitLookup:
        # a salt over MAX_CACHE_SALT_LEN: an invalid submit, resolved to 0 at once
        ev = SubmitLookup(RID, tokens(pick([0, 1, 3])), cache_salt=pick(["", "s" * (MAX_CACHE_SALT_LEN + 1)]))
    elif event_type is ServerHealth:
        server = pick(list(range(n + 1)))
        if pick([False, True]):
            c.handle(ServerHealth(server, False), 0.0)  # already down
        ev = ServerHealth(server, pick([True, False]))
    elif event_type is ServerEpoch:
        server = pick(list(range(n + 1)))
        if pick([False, True]):
            c.handle(ServerHealth(server, False), 0.0)
        if pick([True, False]):
            assert c.handle(ServerEpoch(server, "a"), 0.0) == []  # the first epoch is only noted
        ev = ServerEpoch(server, pick(["a", "b"]))
    elif event_type is TimerFired:
        now = pick([0.0, 0.01, 9.99, 10.0, 100.0, 200.0])
        ev = TimerFired()
    elif event_type is FreeUnusedLeases:
        ev = FreeUnusedLeases(RID, tokens(2), 0, pick([0, C, 2 * C]))
    else:
        ev = event_type(RID)
    before = c.state(RID)
    effects = c.handle(ev, now)
    after = c.state(RID)
    stats = c.stats()
    assert stats["table_violations"] == 0 and stats["internal_errors"] == 0
    assert stats["stale_events"] == 0, "a row missing for an event that happens"
    if hasattr(ev, "request_id") and (before, event_type) in LOOKUP_TABLE.rows and event_type is not SubmitLookup:
        assert after in LOOKUP_TABLE.rows[(before, event_type)].next_states
    assert all(isinstance(e, SendRequest) for e in effects)
    c.check_invariants()
    answer = c.check(RID)
    if cls is LookupClient:
        assert (answer is None) == (after in (LookupState.AWAITING_ACK, LookupState.QUERYING))
        if state is LookupState.DONE and after is LookupState.DONE:
            assert answer == C, "a finished lookup's answer changed"
    trace = set(c._lookups.trace) | set(c._servers.trace)
    c._lookups.trace = c._servers.trace = None
    return trace


@settings(max_examples=400, deadline=None)
@given(state=st.sampled_from(list(LookupState)), event_type=st.sampled_from(EVENTS),
       n=st.integers(1, 3), acked=st.integers(0, 2), data=st.data())
def test_every_state_times_every_input(state: LookupState, event_type: type, n: int, acked: int,
                                       data: st.DataObject) -> None:
    _walk_one(state, event_type, n, acked, lambda opts: data.draw(st.sampled_from(opts)))


def test_every_listed_transition_happens() -> None:
    """h2 style: every (state, input, next state) the tables list is seen executed, and nothing
    else is (the dispatcher counts a row leaving an unlisted state in table_violations)."""
    seen: set[Transition] = set()
    for state in LookupState:
        for event_type in EVENTS:
            for n, acked in ((1, 0), (2, 0), (2, 1)):
                every_choice(lambda pick: seen.update(_walk_one(state, event_type, n, acked, pick)))
    listed = {(s, e, nxt) for table in (LOOKUP_TABLE, SERVER_VIEW_TABLE)
              for (s, e), row in table.rows.items() for nxt in row.next_states}
    assert listed - seen == set(), "listed but never seen"
    assert seen - listed == set(), "seen but not listed"


# ------------------------------------------------------------------- restart detection, ranks


def test_new_epoch_mid_lookup_resolves_to_zero_once() -> None:
    c = client(2)
    c.handle(ServerEpoch(0, 1), 0.0)
    c.handle(ServerEpoch(1, 1), 0.0)
    fx = c.handle(SubmitLookup("r", tokens(2)), 0.0)
    queries = sends(ack_all(c, fx))
    assert c.check("r") is None
    fx = c.handle(ServerEpoch(1, 2), 0.5)  # server 1 restarted: its job is gone
    assert c.check("r") == 0 and c.stats()["server_restarts"] == 1
    # server 0 may hold leases for the request: freed through the normal path
    assert [(e.server, type(e.request)) for e in sends(fx)] == [(0, FreeLookupLocks)]
    for q in queries:  # late answers change nothing
        c.handle(ReplyReceived(q.server, q.correlation, 2), 0.6)
    assert c.check("r") == 0 and c.stats()["resolved"] == 1 and c.stats()["stale_replies"] == 2
    c.check_invariants()


def test_first_or_same_epoch_changes_nothing() -> None:
    c = client(1)
    fx = c.handle(SubmitLookup("r", tokens(2)), 0.0)
    ack_all(c, fx)
    assert c.handle(ServerEpoch(0, "x"), 0.1) == [] and c.handle(ServerEpoch(0, "x"), 0.2) == []
    assert c.check("r") is None
    assert c.handle(ServerEpoch(5, "y"), 0.2) == [] and c.stats()["bad_replies"] == 1


def test_a_server_holding_no_rank_is_not_asked() -> None:
    """More servers than ranks (core_sm.client_config.ranks_per_server): the lookup asks only the
    servers holding a rank, and resolves on their answers alone."""
    c = client(3, world_size=2, ranks_per_server=((0,), (1,), ()))
    fx = c.handle(SubmitLookup("r", tokens(2)), 0.0)
    assert sorted(e.server for e in sends(fx, Lookup)) == [0, 1]
    for q in sends(ack_all(c, fx), QueryPrefetchStatus):
        c.handle(ReplyReceived(q.server, q.correlation, 2), 0.0)
    assert c.check("r") == 2 * C  # both holding servers answered: resolved
    c.handle(ServerHealth(2, False), 0.0)  # the idle server's health does not decide the lookup
    assert sends(c.handle(SubmitLookup("r2", tokens(2)), 0.0), Lookup)


def test_lookups_name_each_servers_ranks() -> None:
    c = client(2, world_size=4, ranks_per_server=((0, 1), (2, 3)))
    fx = sends(c.handle(SubmitLookup("r", tokens(1)), 0.0), Lookup)
    assert [(e.server, e.request.ranks) for e in fx if isinstance(e.request, Lookup)] == [(0, (0, 1)), (1, (2, 3))]
    plain = sends(client(2).handle(SubmitLookup("r", tokens(1)), 0.0), Lookup)
    assert all(isinstance(e.request, Lookup) and e.request.ranks is None for e in plain)


@pytest.mark.parametrize("rps", [((0,),), ((0,), (5,)), ((), ()), ((0, 0), (1,))])
def test_bad_ranks_per_server_is_refused_at_construction(rps: tuple[tuple[int, ...], ...]) -> None:
    with pytest.raises(ValueError):
        LookupClientConfig(num_servers=2, world_size=2, ranks_per_server=rps)
