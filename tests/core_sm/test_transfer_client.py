"""TransferClient: ops keyed by (request, seq), exactly-once reporting, load errors, aborts."""
from __future__ import annotations

from typing import Any

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from mpcache.core_sm.effects import CopyBlocks, Effect, SendRequest
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.core_sm.messages import (
    Abort,
    CommitTransfer,
    CopyFinished,
    EngineFinished,
    PrepareRetrieve,
    PrepareStore,
    RegisterInstance,
    ReplyReceived,
    RequestFailed,
    Retrieve,
    RetrieveResult,
    ServerEpoch,
    ServerHealth,
    Store,
    StoreResult,
    SubmitRetrieve,
    SubmitStore,
    TimerFired,
    TransferKind,
    TransferPlan,
)
from mpcache.core_sm.transfer_client import (
    EVENTS,
    TABLES,
    LinkState,
    OpState,
    RequestRecord,
    TransferClient,
    TransferClientConfig,
    TransferOp,
)
from sm_helpers import C, Pick, every_choice, tokens

FAIL = ProtocolError(ErrorKind.NOT_READABLE, "x")
TOKS = tokens(2)
BLOCKS = (10, 11, 12, 13)  # 2 tokens per block for C=4


def tc(engine: bool = False, **kw: Any) -> TransferClient:
    return TransferClient(TransferClientConfig(instance_id=7, model_name="m", chunk_size=C,
                                               engine_driven=engine, object_bytes=10, **kw))


def only_send(effects: list[Effect]) -> SendRequest:
    (e,) = effects
    assert isinstance(e, SendRequest)
    return e


def store(c: TransferClient, rid: str = "r", now: float = 0.0) -> SendRequest:
    return only_send(c.handle(SubmitStore(rid, TOKS, 0, 2 * C, BLOCKS), now))


def retrieve(c: TransferClient, rid: str = "r", skip: int = 0) -> SendRequest:
    return only_send(c.handle(SubmitRetrieve(rid, TOKS, 0, 2 * C, BLOCKS, skip), 0.0))


def test_registration_on_healthy() -> None:
    c = tc()
    reg = only_send(c.handle(ServerHealth(0, True), 0.0))
    assert reg.request == RegisterInstance(7, "m", 1, 10, False)
    c.handle(ReplyReceived(0, reg.correlation, None), 0.0)
    assert c.handle(ServerHealth(0, True), 0.0) == []  # registered, still healthy: nothing
    c.handle(ServerHealth(0, False), 1.0)
    assert c.handle(ServerHealth(0, True), 2.0) == []  # registering again is its link's


def test_server_driven_store_and_retrieve_report_once() -> None:
    c = tc()
    s = store(c)
    assert isinstance(s.request, Store) and s.request.block_ids == BLOCKS
    assert s.request.key.worker_id == 0
    r = retrieve(c)
    assert isinstance(r.request, Retrieve)
    c.handle(ReplyReceived(0, r.correlation, RetrieveResult(True, 2)), 0.0)
    assert c.finished() == (frozenset(), frozenset({"r"}))
    assert c.finished() == (frozenset(), frozenset())
    c.handle(EngineFinished(("r",)), 0.0)
    assert c.finished() == (frozenset(), frozenset())  # the store is still in flight
    c.handle(ReplyReceived(0, s.correlation, StoreResult(True, 2, 0)), 0.0)
    assert c.finished() == (frozenset({"r"}), frozenset())
    c.handle(EngineFinished(("r",)), 0.0)  # reported already: never twice
    assert c.finished() == (frozenset(), frozenset()) and c.stats()["duplicate_finishes"] == 1
    assert c.stats()["requests"] == 0 and c.stats()["ops_in_flight"] == 0


def test_a_synchronous_load_is_waited_for_and_never_reported_in_recving() -> None:
    """vLLM's forward reads a synchronous load in the step that scheduled it, never waiting on
    recving: the worker waits while ``loading`` names it, and a recving report of it would be a
    second completion (vLLM asserts on it). Its load errors are still reported."""
    c = tc()
    r = only_send(c.handle(SubmitRetrieve("r", TOKS, 0, 2 * C, BLOCKS, synchronous=True), 0.0))
    a = retrieve(c, "a")  # an asynchronous one beside it
    assert c.loading(("r",)) and c.loading(("r", "a")) and not c.loading(("x",))
    c.handle(ReplyReceived(0, r.correlation, RetrieveResult(False, 2)), 0.0)
    assert not c.loading(("r",)) and c.loading(("a",))
    assert c.finished() == (frozenset(), frozenset()) and c.load_errors() == frozenset(BLOCKS)
    c.handle(ReplyReceived(0, a.correlation, RetrieveResult(True, 2)), 0.0)
    assert c.finished() == (frozenset(), frozenset({"a"}))
    # the request's next retrieve (after a preemption, say) is asynchronous: reported again
    r2 = retrieve(c, "r")
    c.handle(ReplyReceived(0, r2.correlation, RetrieveResult(True, 2)), 0.0)
    assert c.finished() == (frozenset(), frozenset({"r"}))


def test_later_op_never_overwrites_earlier() -> None:
    c = tc()
    a, b = store(c), store(c)
    ops = c.ops_of("r")
    assert len(ops) == 2 and ops[0] != ops[1]
    c.handle(EngineFinished(("r",)), 0.0)
    c.handle(ReplyReceived(0, b.correlation, StoreResult(True)), 0.0)
    assert c.finished() == (frozenset(), frozenset())  # the first store still reads the blocks
    c.handle(ReplyReceived(0, a.correlation, StoreResult(True)), 0.0)
    assert c.finished() == (frozenset({"r"}), frozenset())


def test_failed_retrieve_gives_load_errors_and_one_report() -> None:
    c = tc()
    r = retrieve(c, skip=2)  # the first block is vLLM's own: not an error
    c.handle(ReplyReceived(0, r.correlation, RetrieveResult(False, 2)), 0.0)
    assert c.finished() == (frozenset(), frozenset({"r"}))
    assert c.load_errors() == frozenset({11, 12, 13})
    assert c.load_errors() == frozenset()
    r = retrieve(c, "e")
    c.handle(RequestFailed(0, r.correlation, FAIL), 0.0)
    assert c.finished()[1] == {"e"} and c.load_errors() == frozenset(BLOCKS)


def test_abort_mid_retrieve_holds_blocks_and_reports_once() -> None:
    c = tc()
    r = retrieve(c)
    c.handle(Abort("r"), 0.0)
    assert c.finished() == (frozenset(), frozenset())  # blocks held: the copy may still run
    c.handle(ReplyReceived(0, r.correlation, RetrieveResult(False, 2)), 0.0)
    sending, recving = c.finished()
    assert sending == {"r"} and recving == frozenset()  # never both (F16)
    assert c.load_errors() == frozenset()  # the request is gone: nothing to recompute


def test_engine_finished_without_ops_reported_once() -> None:
    c = tc()
    c.handle(EngineFinished(("x", "y", "x")), 0.0)
    assert c.finished() == (frozenset({"x", "y"}), frozenset())


def test_unhealthy_drains_waiting_ops_and_refuses_new() -> None:
    c = tc()
    s = store(c, "s")
    retrieve(c, "r")
    c.handle(ServerHealth(0, False), 0.0)
    # The RETRIEVE may still reach the server: reported at its not_after (30 s) + copy grace.
    assert c.finished() == (frozenset(), frozenset()) and c.load_errors() == frozenset()
    assert c.next_deadline() == 31.0
    c.handle(TimerFired(), 31.0)
    assert c.finished() == (frozenset(), frozenset({"r"}))
    assert c.load_errors() == frozenset(BLOCKS)
    assert c.handle(SubmitRetrieve("q", TOKS, 0, 2 * C, BLOCKS), 31.0) == []
    assert c.finished()[1] == {"q"} and c.load_errors() == frozenset(BLOCKS)
    assert c.handle(SubmitStore("q2", TOKS, 0, 2 * C, BLOCKS), 31.0) == []
    c.handle(ReplyReceived(0, s.correlation, StoreResult(True)), 31.0)  # late: stale
    assert c.stats()["stale_replies"] == 1


def test_op_timeout() -> None:
    c = tc(op_timeout=5.0)
    retrieve(c)
    assert c.next_deadline() == 5.0
    c.handle(TimerFired(), 5.0)
    assert c.finished()[1] == frozenset() and c.stats()["timeouts"] == 1
    assert c.next_deadline() == 6.0  # not_after (sent + op_timeout) + copy grace
    c.handle(TimerFired(), 6.0)
    assert c.finished()[1] == {"r"}


def test_engine_driven_flow() -> None:
    c = tc(engine=True)
    p = store(c)
    assert isinstance(p.request, PrepareStore)
    (copy,) = c.handle(ReplyReceived(0, p.correlation, TransferPlan(5, ((0, 3), (1, 4)))), 0.0)
    assert isinstance(copy, CopyBlocks) and copy.direction is TransferKind.STORE
    assert copy.placements == ((0, 3), (1, 4)) and copy.block_ids == BLOCKS
    assert c.op_state(copy.op) is OpState.COPYING
    commit = only_send(c.handle(CopyFinished(copy.op, True), 0.0))
    assert commit.request == CommitTransfer(5, True)
    c.handle(EngineFinished(("r",)), 0.0)
    c.handle(ReplyReceived(0, commit.correlation, StoreResult(True, 2)), 0.0)
    assert c.finished() == (frozenset({"r"}), frozenset())


def test_engine_driven_retrieve_failures() -> None:
    c = tc(engine=True)
    p = retrieve(c)
    assert isinstance(p.request, PrepareRetrieve)
    c.handle(ReplyReceived(0, p.correlation, TransferPlan(-1, (), False, TransferKind.RETRIEVE)), 0.0)
    assert c.finished()[1] == {"r"} and c.load_errors() == frozenset(BLOCKS)
    # copy failed: commit says so, retrieve is an error even if the server acks
    p = retrieve(c, "s")
    (copy,) = c.handle(ReplyReceived(0, p.correlation, TransferPlan(6, ((0, 1), (1, 2)), True,
                                                                     TransferKind.RETRIEVE)), 0.0)
    commit = only_send(c.handle(CopyFinished(copy.op, False), 0.0))
    assert commit.request == CommitTransfer(6, False)
    c.handle(ReplyReceived(0, commit.correlation, RetrieveResult(False, 2)), 0.0)
    assert c.finished()[1] == {"s"} and c.load_errors() == frozenset(BLOCKS)


def test_engine_driven_abort_waits_for_copy_then_commits() -> None:
    c = tc(engine=True)
    p = retrieve(c)
    (copy,) = c.handle(ReplyReceived(0, p.correlation, TransferPlan(6, ((0, 1),), True,
                                                                     TransferKind.RETRIEVE)), 0.0)
    c.handle(Abort("r"), 0.0)
    c.handle(ServerHealth(0, False), 0.0)
    assert c.finished() == (frozenset(), frozenset())  # the engine copy still runs
    c.handle(CopyFinished(copy.op, True), 0.0)
    assert c.finished() == (frozenset({"r"}), frozenset())


@pytest.mark.parametrize("end", [Abort("r"), EngineFinished(("r",))], ids=["abort", "finished"])
def test_retrieve_plan_arriving_after_the_end_is_released_without_copy(end: Abort | EngineFinished) -> None:
    c = tc(engine=True)
    p = retrieve(c)
    c.handle(end, 0.0)
    commit = only_send(c.handle(ReplyReceived(0, p.correlation, TransferPlan(5, ((0, 1),), True,
                                                                             TransferKind.RETRIEVE)), 0.0))
    assert commit.request == CommitTransfer(5, False)
    assert c.stats()["retrieves_skipped_finished"] == 1
    assert c.finished() == (frozenset(), frozenset())
    c.handle(ReplyReceived(0, commit.correlation, RetrieveResult(False, 0)), 0.0)
    assert c.finished() == (frozenset({"r"}), frozenset())
    assert c.load_errors() == frozenset()  # the request is gone from vLLM: nothing to recompute


@pytest.mark.parametrize("end", [Abort("r"), EngineFinished(("r",))], ids=["abort", "finished"])
def test_store_plan_arriving_after_the_end_is_copied_then_committed(end: Abort | EngineFinished) -> None:
    # vLLM holds the finished (or aborted) request's blocks until `sending` names it, so the copy
    # still reads the request's own KV: the store goes ahead and `sending` waits for the commit.
    c = tc(engine=True)
    p = store(c)
    c.handle(end, 0.0)
    assert c.finished() == (frozenset(), frozenset())
    (copy,) = c.handle(ReplyReceived(0, p.correlation, TransferPlan(5, ((0, 3), (1, 4)))), 0.0)
    assert isinstance(copy, CopyBlocks) and copy.direction is TransferKind.STORE
    assert copy.block_ids == BLOCKS and copy.placements == ((0, 3), (1, 4))
    assert c.finished() == (frozenset(), frozenset())  # the copy reads the blocks now
    commit = only_send(c.handle(CopyFinished(copy.op, True), 0.0))
    assert commit.request == CommitTransfer(5, True)
    assert c.finished() == (frozenset(), frozenset())  # not before the commit is answered
    c.handle(ReplyReceived(0, commit.correlation, StoreResult(True, 2)), 0.0)
    assert c.finished() == (frozenset({"r"}), frozenset())
    c.handle(TimerFired(), 1.0)
    assert c.finished() == (frozenset(), frozenset())  # reported once
    assert c.stats()["stores_failed"] == 0 and c.stats()["retrieves_skipped_finished"] == 0


def test_store_plan_after_the_end_reports_sending_once_when_the_commit_fails() -> None:
    c = tc(engine=True, op_timeout=5.0)
    p = store(c)
    c.handle(EngineFinished(("r",)), 0.0)
    (copy,) = c.handle(ReplyReceived(0, p.correlation, TransferPlan(5, ((0, 3),))), 1.0)
    commit = only_send(c.handle(CopyFinished(copy.op, True), 1.0))
    c.handle(RequestFailed(0, commit.correlation, FAIL), 2.0)
    assert c.finished() == (frozenset({"r"}), frozenset()) and c.stats()["stores_failed"] == 1
    # a commit that is never answered times out, then the request is reported
    p = store(c, "s", 3.0)
    c.handle(EngineFinished(("s",)), 3.0)
    (copy,) = c.handle(ReplyReceived(0, p.correlation, TransferPlan(6, ((0, 3),))), 3.0)
    only_send(c.handle(CopyFinished(copy.op, True), 3.0))
    c.handle(TimerFired(), 7.9)
    assert c.finished() == (frozenset(), frozenset())
    c.handle(TimerFired(), 8.0)
    assert c.finished() == (frozenset({"s"}), frozenset())
    c.handle(TimerFired(), 9.0)
    assert c.finished() == (frozenset(), frozenset())


def test_stale_copy_and_bad_reply() -> None:
    c = tc()
    c.handle(CopyFinished(("x", 1), True), 0.0)
    r = retrieve(c)
    c.handle(ReplyReceived(0, r.correlation, StoreResult(True)), 0.0)  # wrong type
    assert c.stats()["stale_copies"] == 1 and c.stats()["bad_replies"] == 1
    assert c.load_errors() == frozenset(BLOCKS)


class LegacyOpKey(TransferClient):
    def _op_key(self, record: RequestRecord) -> tuple[str, int]:
        return (record.request_id, 0)


class LegacyDoubleReport(TransferClient):
    def _report_recving_after_finish(self, record: RequestRecord) -> bool:
        return True


class LegacyNoErrors(TransferClient):
    def _errors_for_failed_retrieve(self, op: TransferOp) -> tuple[int, ...]:
        return ()


def test_legacy_hooks_show_the_old_bugs() -> None:
    cfg = TransferClientConfig(chunk_size=C)
    c1 = LegacyOpKey(cfg)
    store(c1)
    store(c1)
    assert len(c1.ops_of("r")) == 1  # F15: the first op was overwritten
    c2 = LegacyDoubleReport(cfg)
    r = retrieve(c2)
    c2.handle(Abort("r"), 0.0)
    c2.handle(ReplyReceived(0, r.correlation, RetrieveResult(True)), 0.0)
    assert c2.finished() == (frozenset({"r"}), frozenset({"r"}))  # F16
    c3 = LegacyNoErrors(cfg)
    r = retrieve(c3)
    c3.handle(ReplyReceived(0, r.correlation, RetrieveResult(False)), 0.0)
    assert c3.load_errors() == frozenset()  # F10


# ------------------------------------------------------------------- all states x all inputs


UNHEALTHY = ProtocolError(ErrorKind.UNHEALTHY, "transport gave up")
NOT_REGISTERED = ProtocolError(ErrorKind.NOT_REGISTERED, "unknown instance 7")
# the client's one registration before the op: not sent, in flight, acked, refused
LINKS = ("fresh", "sent", "acked", "refused")


def client_with_op(state: OpState, kind: str, engine: bool = False, aborted: bool = False,
                   link: str = "fresh", reported: bool = False,
                   fenced: bool = False) -> tuple[TransferClient, tuple[str, int], list[int]]:
    """A client whose op of request "r" is in ``state``; its server link in ``link`` (before
    the op was sent: ``LINKS``); ``reported``: "r" was reported in sending before; ``fenced``: a store of
    "r" sent at -2 s was given up on (UNHEALTHY), so "r" is fenced until 4 s."""
    c = tc(engine=engine or state in (OpState.COPYING, OpState.COMMITTING), op_timeout=5.0)
    if link != "fresh":
        reg = only_send(c.handle(ServerHealth(0, True), 0.0))
        if link == "acked":
            c.handle(ReplyReceived(0, reg.correlation, None), 0.0)
        elif link == "refused":
            c.handle(RequestFailed(0, reg.correlation, FAIL), 0.0)
    assert c.link_state() is LinkState.UP
    if reported:
        c.handle(Abort("r"), 0.0)
        assert c.finished()[0] == {"r"}
    corrs = []
    if fenced and not c.config.engine_driven:
        first = store(c, now=-2.0)
        c.handle(RequestFailed(0, first.correlation, UNHEALTHY), -2.0)
        corrs.append(first.correlation)
    if state is OpState.ABSENT:
        return c, ("r", 999), corrs + [999]
    s = store(c) if kind == "store" else retrieve(c)
    (op,) = c.ops_of("r")
    corrs.append(s.correlation)
    if state in (OpState.COPYING, OpState.COMMITTING):
        k = TransferKind.STORE if kind == "store" else TransferKind.RETRIEVE
        c.handle(ReplyReceived(0, s.correlation, TransferPlan(3, ((0, 1),), True, k)), 0.0)
    if state is OpState.COMMITTING:
        corrs.append(only_send(c.handle(CopyFinished(op, True), 0.0)).correlation)
    if aborted:
        c.handle(Abort("r"), 0.0)
    assert c.op_state(op) is state
    return c, op, corrs


def test_every_event_goes_to_one_table() -> None:
    for table in TABLES.values():
        for (state, event_type), row in table.rows.items():
            assert callable(getattr(TransferClient, row.handler.__name__)), (state, event_type)
    named = {e for table in TABLES.values() for e in table.events()}
    # Abort / EngineFinished arrive as RequestEnded; TimerFired only runs the due timers.
    assert set(EVENTS) - named == {Abort, EngineFinished, TimerFired}


Transition = tuple[Any, type, Any]


def _walk_one(state: OpState, kind: str, event_type: type, pick: Pick[Any]) -> set[Transition]:
    """One external event; returns every table row it executed (timers included)."""
    engine = state is OpState.SENT and pick([False, True])
    c, op, corrs = client_with_op(state, kind, engine, aborted=state is not OpState.ABSENT and pick([False, True]),
                                  link=pick(LINKS), reported=pick([False, True]),
                                  fenced=not engine and state is not OpState.COPYING and pick([False, True]))
    if state is OpState.COPYING and pick([False, True]):
        c.handle(ServerHealth(0, False), 0.0)  # the engine copy outlives the server's health
    if c._registration_correlation is not None and pick([False, True]):
        c.handle(ReplyReceived(0, c._registration_correlation, None), 0.0)  # acked after the op went
    dispatchers = (c._link, c._request_d, c._op_d)
    for d in dispatchers:
        d.trace = []
    now = 0.0
    ev: Any
    if event_type in (SubmitStore, SubmitRetrieve):
        if not pick([True, False]):
            c.handle(ServerHealth(0, False), 0.0)
        ev = (SubmitStore("r", TOKS, 0, 2 * C, BLOCKS) if event_type is SubmitStore
              else SubmitRetrieve("r", TOKS, 0, 2 * C, BLOCKS))
    elif event_type in (ReplyReceived, RequestFailed):
        corr = pick(corrs + [1, 12345])  # 1: the registration's
        if event_type is RequestFailed:
            ev = RequestFailed(0, corr, pick([FAIL, UNHEALTHY, NOT_REGISTERED]))
        else:
            ev = ReplyReceived(0, corr, pick([
                None, StoreResult(True), StoreResult(False), RetrieveResult(True), RetrieveResult(False),
                TransferPlan(4, ((0, 2),)), TransferPlan(-1, (), False)]))
    elif event_type is CopyFinished:
        ev = CopyFinished(pick([op, ("r", 4242)]), pick([True, False]))
    elif event_type is ServerHealth:
        server = pick([0, 1])
        if pick([False, True]):
            c.handle(ServerHealth(server, False), 0.0)  # already down
        ev = ServerHealth(server, pick([True, False]))
    elif event_type is ServerEpoch:
        server = pick([0, 1])
        if pick([False, True]):
            c.handle(ServerHealth(server, False), 0.0)
        if pick([True, False]):
            c.handle(ServerEpoch(server, 1), 0.0)  # the first epoch is only noted (or registers again)
            if c._registration_correlation is not None and pick([False, True]):
                c.handle(ReplyReceived(0, c._registration_correlation, None), 0.0)
        ev = ServerEpoch(server, pick([1, 2]))
    elif event_type is TimerFired:
        now = pick([0.0, 0.5, 4.9, 5.0, 10.0, 31.0, 50.0])  # 4.9: a fence ends, ops still wait
        ev = TimerFired()
    elif event_type is Abort:
        ev = Abort("r")
    else:
        ev = EngineFinished(("r",))
    c.finished()  # what the steps before reported
    effects = c.handle(ev, now)
    stats = c.stats()
    assert stats["table_violations"] == 0 and stats["internal_errors"] == 0
    assert stats["stale_events"] == 0, "a row missing for an event that happens"
    assert all(isinstance(e, (SendRequest, CopyBlocks)) for e in effects)
    c.check_invariants()
    sending, recving = c.finished()
    assert not (sending & recving), "one request reported both ways in one call"
    trace = {t for d in dispatchers for t in (d.trace or ())}
    for d in dispatchers:
        d.trace = None
    return trace


@settings(max_examples=400, deadline=None)
@given(state=st.sampled_from(list(OpState)), kind=st.sampled_from(["store", "retrieve"]),
       event_type=st.sampled_from(EVENTS), data=st.data())
def test_every_state_times_every_input(state: OpState, kind: str, event_type: type,
                                       data: st.DataObject) -> None:
    _walk_one(state, kind, event_type, lambda opts: data.draw(st.sampled_from(opts)))


def test_every_listed_transition_happens() -> None:
    """h2 style: every (state, input, next state) the three tables list is seen executed, and
    nothing else is (the dispatcher counts a row leaving an unlisted state in table_violations)."""
    seen: set[Transition] = set()
    for state in OpState:
        for kind in ("store", "retrieve"):
            for event_type in EVENTS:
                every_choice(lambda pick: seen.update(_walk_one(state, kind, event_type, pick)))
    listed = {(s, e, nxt) for table in TABLES.values() for (s, e), row in table.rows.items()
              for nxt in row.next_states}
    assert listed - seen == set(), "listed but never seen"
    assert seen - listed == set(), "seen but not listed"


# ------------------------------------------------------------------- restart detection (F13)

NOT_REG = ProtocolError(ErrorKind.NOT_REGISTERED, "unknown instance 7")


def registered(engine: bool = False, **kw: Any) -> TransferClient:
    c = tc(engine=engine, **kw)
    reg = only_send(c.handle(ServerHealth(0, True), 0.0))
    c.handle(ReplyReceived(0, reg.correlation, None), 0.0)
    assert c.next_deadline() is None and c.stats()["registrations"] == 1
    return c


def registrations(effects: list[Effect]) -> list[SendRequest]:
    return [e for e in effects if isinstance(e, SendRequest) and isinstance(e.request, RegisterInstance)]


def test_the_instance_is_introduced_once_and_the_link_registers_again() -> None:
    """The first ServerHealth(True) sends the one RegisterInstance; a recovery, a failure of
    that registration or a second healthy report sends none (its ServerLink decides those)."""
    c = tc()
    (reg,) = registrations(c.handle(ServerHealth(0, True), 0.0))
    assert reg.request == c.registration_request()
    assert c.handle(ServerHealth(0, True), 0.1) == []
    c.handle(RequestFailed(0, reg.correlation, FAIL), 0.2)
    assert c.next_deadline() is None and c.stats()["registration_failures"] == 1
    c.handle(ServerHealth(0, False), 1.0)
    assert c.handle(ServerHealth(0, True), 2.0) == [] and c.stats()["registrations"] == 1


def test_not_registered_fails_the_op_and_registers_nothing() -> None:
    c = registered()
    s1, r, s2 = store(c, "s1"), retrieve(c, "r"), store(c, "s2")
    for op in (s1, r, s2):  # the link's verdict after its one resend (or its failed registration)
        assert c.handle(RequestFailed(0, op.correlation, NOT_REG), 1.0) == []
    assert c.finished() == (frozenset(), frozenset({"r"})) and c.load_errors() == frozenset(BLOCKS)
    assert c.stats()["not_registered"] == 3 and c.stats()["stores_failed"] == 2
    c.handle(EngineFinished(("s1", "s2", "r")), 1.0)
    assert c.finished() == (frozenset({"s1", "s2", "r"}), frozenset())  # each once, no fence
    s3 = store(c, "s3", now=2.0)  # the next store goes out as usual
    c.handle(ReplyReceived(0, s3.correlation, StoreResult(True, 2)), 2.0)
    assert c.stats()["stores_failed"] == 2 and c.stats()["registrations"] == 1


def test_new_epoch_is_a_restart() -> None:
    c = registered()
    assert c.handle(ServerEpoch(0, "a"), 0.0) == []  # the first epoch is only remembered
    assert c.handle(ServerEpoch(0, "a"), 0.5) == []
    assert c.handle(ServerEpoch(1, "z"), 0.5) == []  # another server's
    s, r = store(c, "s"), retrieve(c, "r")
    assert c.handle(ServerEpoch(0, "b"), 1.0) == []  # no registration: the link's
    assert c.stats()["server_restarts"] == 1 and c.link_state() is LinkState.UP
    assert c.finished() == (frozenset(), frozenset())  # fenced: they may reach the new server
    # the old server's answers, if any arrive, are stale: no completion from them
    c.handle(ReplyReceived(0, s.correlation, StoreResult(True)), 1.0)
    c.handle(ReplyReceived(0, r.correlation, RetrieveResult(True)), 1.0)
    assert c.stats()["stale_replies"] == 2 and c.finished() == (frozenset(), frozenset())
    c.handle(TimerFired(), 31.0)  # not_after (sent at 0 + 30 s) + copy grace
    assert c.finished() == (frozenset(), frozenset({"r"})) and c.load_errors() == frozenset(BLOCKS)
    assert c.failed_retrieves() == {"r"}
    assert c.finished() == (frozenset(), frozenset())


def test_new_epoch_while_unhealthy_only_noted() -> None:
    c = registered()
    c.handle(ServerEpoch(0, 1), 0.0)
    c.handle(ServerHealth(0, False), 1.0)
    assert c.handle(ServerEpoch(0, 2), 2.0) == [] and c.link_state() is LinkState.DOWN
    assert c.handle(ServerHealth(0, True), 3.0) == [] and c.stats()["server_restarts"] == 1


def test_engine_copy_outliving_a_restart_is_never_committed() -> None:
    for lose in ("epoch", "flap"):
        c = registered(engine=True)
        c.handle(ServerEpoch(0, 1), 0.0)
        p = retrieve(c)
        (copy,) = c.handle(ReplyReceived(0, p.correlation, TransferPlan(6, ((0, 1),), True,
                                                                         TransferKind.RETRIEVE)), 0.0)
        if lose == "epoch":
            c.handle(ServerEpoch(0, 2), 1.0)
        else:
            c.handle(ServerHealth(0, False), 1.0)
            c.handle(ServerHealth(0, True), 1.5)
        assert c.finished() == (frozenset(), frozenset())  # the engine copy still runs
        # transfer 6 may be another client's on the restarted server: no CommitTransfer
        assert c.handle(CopyFinished(copy.op, True), 2.0) == []
        assert c.finished() == (frozenset(), frozenset({"r"})) and c.load_errors() == frozenset(BLOCKS)


def test_failed_retrieves_are_reported_once_alongside_load_errors() -> None:
    c = tc()
    ok, bad = retrieve(c, "ok"), retrieve(c, "bad")
    c.handle(ReplyReceived(0, ok.correlation, RetrieveResult(True, 2)), 0.0)
    c.handle(ReplyReceived(0, bad.correlation, RetrieveResult(False, 2)), 0.0)
    assert c.finished() == (frozenset(), frozenset({"ok", "bad"}))
    assert c.failed_retrieves() == {"bad"} and c.load_errors() == frozenset(BLOCKS)
    assert c.failed_retrieves() == frozenset()
    # two retrieves of one request, one fails: reported once, when both are done
    a, b = retrieve(c, "two"), retrieve(c, "two")
    c.handle(RequestFailed(0, a.correlation, FAIL), 0.0)
    assert c.failed_retrieves() == frozenset()
    c.handle(ReplyReceived(0, b.correlation, RetrieveResult(True, 2)), 0.0)
    assert c.failed_retrieves() == {"two"} and c.stats()["failed_retrieves_pending"] == 0
    # aborted before being reported: gone, as from recving
    r = retrieve(c, "gone")
    c.handle(ReplyReceived(0, r.correlation, RetrieveResult(False, 2)), 0.0)
    c.handle(Abort("gone"), 0.0)
    assert c.failed_retrieves() == frozenset()


def test_failed_retrieves_memory_is_bounded() -> None:
    c = tc(reported_cap=3)
    c.handle(ServerHealth(0, False), 0.0)
    for i in range(5):
        c.handle(SubmitRetrieve(f"r{i}", TOKS, 0, 2 * C, BLOCKS), 0.0)
        c.check_invariants()
    assert c.failed_retrieves() == {"r2", "r3", "r4"}
