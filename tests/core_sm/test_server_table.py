"""hyper-h2 style: every job/transfer state x every input lands in a state the table allows,
or is refused with a clean typed error and no state change. The tables are the ones ``handle``
executes (mpcache.core_sm.table): the walks record every row that ran, so a row that never runs, or a
transition no row lists, fails."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from hypothesis import given, settings
from hypothesis import strategies as st

from mpcache.core_sm.effects import ErrorReply, ReadL2, Reply, StartTransfer
from mpcache.core_sm.messages import (
    CacheKey,
    Clear,
    CommitTransfer,
    EndSession,
    FreeLookupLocks,
    L2ProbeFinished,
    L2ReadFinished,
    Lookup,
    PrepareRetrieve,
    PrepareStore,
    QueryPrefetchStatus,
    Retrieve,
    Store,
    TimerFired,
    TransferFinished,
    TransferPlan,
    WaitPrefetchStatus,
)
from mpcache.core_sm.server import SERVER_TABLE, TRANSFER_CREATORS, JobState, LookupServer, TransferState
from mpcache.core_sm import server_jobs as sj
from mpcache.core_sm.server_jobs import JOB_TABLE, JOB_TIMERS
from mpcache.core_sm.server_transfers import TRANSFER_TABLE, TRANSFER_TIMERS
from mpcache.core_sm.table import Dispatcher
from sm_helpers import C, MODEL, Pick, ServerHarness, every_choice, key, tokens

RID = "r"
TOKS = tokens(3)
# The inputs a walk feeds: requests addressing the job, and what reaches it indirectly (its L2
# work's completions, time passing, a clear of L1).
JOB_EVENTS = (Lookup, QueryPrefetchStatus, WaitPrefetchStatus, FreeLookupLocks, EndSession,
              L2ReadFinished, L2ProbeFinished, TimerFired, Clear)
TRANSFER_EVENTS = (TransferFinished, CommitTransfer, TimerFired, Clear)
Seen = set[tuple[Any, type, Any]]


def record(dispatcher: Dispatcher[Any], seen: Seen) -> None:
    """Record (state, event type, next state) of every row ``dispatcher`` runs."""
    run, address, state_of = dispatcher.run, dispatcher._address, dispatcher._state_of

    def recording(event: Any, now: float, out: list[Any]) -> bool:
        entity = address(event)
        before = state_of(entity)
        ran = run(event, now, out)
        if ran:
            seen.add((before, type(event), state_of(entity)))
        return ran

    dispatcher.run = recording  # type: ignore[method-assign]


def record_jobs(server: LookupServer) -> list[tuple[Any, type, Any]]:
    """The job table's rows as the server runs them: (state, the specific event a guard
    classified the input into, the state it assigned), in order (``Dispatcher.trace``)."""
    trace: list[tuple[Any, type, Any]] = []
    server.jobs.dispatch.trace = trace
    return trace


def test_every_server_event_is_routed_and_every_table_row_is_a_method() -> None:
    from mpcache.core_sm.messages import (
        SERVER_REQUEST_TYPES,
        InstanceAttached,
        InstanceFailed,
        L2WriteFinished,
        PeerGone,
    )

    routed = set(SERVER_TABLE.events())
    assert set(SERVER_REQUEST_TYPES) | {TransferFinished, InstanceFailed, InstanceAttached, PeerGone, L2ReadFinished,
                                        L2ProbeFinished, L2WriteFinished, TimerFired} == routed
    s = LookupServer()
    for table, machine in ((JOB_TABLE, s.jobs), (TRANSFER_TABLE, s.transfers)):
        for row in table.rows.values():
            assert callable(getattr(machine, row.handler.__name__))


def harness_with_job(state: JobState, stored: int, readers: int, waiter: bool = False,
                     probe: bool = False, l2_timeout: float = 30.0) -> ServerHarness:
    h = ServerHarness(l2_enabled=True, l2_probe=probe, abandoned_job_ttl=60.0, tombstone_ttl=60.0,
                      lease_ttl=300.0, l2_read_timeout=l2_timeout)
    h.register()
    if stored:
        h.store(TOKS, end=stored * C)
    if state is JobState.ABSENT:
        return h
    if state is JobState.PENDING and stored == 3:
        h.call(Clear(False, admin=True))  # make sure something is missing so an L2 read is planned
    h.call(Lookup(key(RID, TOKS), readers))
    if state is not JobState.PENDING:
        for pr in list(h.probes.values()):
            h.probes.pop(pr.probe_id)
            h.feed(L2ProbeFinished(pr.probe_id, (True,) * len(pr.keys)))
        for read in list(h.reads.values()):
            h.reads.pop(read.read_id)
            h.feed(L2ReadFinished(read.read_id, (True,) * len(read.items)))
    elif waiter:
        h.send(WaitPrefetchStatus(RID, 45.0))
    if state is JobState.ANSWERED:
        h.call(QueryPrefetchStatus(RID))
    assert h.server.job_state(RID) is state
    return h


JobInput = Callable[[ServerHarness, Pick[Any]], Any]


def _lookup(h: ServerHarness, pick: Pick[Any]) -> Any:
    return Lookup(key(RID, TOKS, salt=pick(["", "ok", "bad/salt"])), pick([0, 1, 3]),
                  answer_in_ack=pick([False, True]))


def _free(h: ServerHarness, pick: Pick[Any]) -> Any:
    start = pick([-1, 0, C, 2 * C + 1, 3 * C])
    end = pick([-1, 0, C, 3 * C, 3 * C + 2])
    return FreeLookupLocks(CacheKey(MODEL, 1, None, TOKS, start, end, RID))


def _l2_finished(h: ServerHarness, pick: Pick[Any]) -> Any:
    job = h.server.job(RID)
    if job is not None and job.read_id is not None and pick([True, False]):
        read = h.reads[job.read_id]
        n = len(read.items)
        pattern = pick(["all", "none", "first", "alternate"])
        loaded = [pattern == "all" or (pattern == "first" and i == 0) or
                  (pattern == "alternate" and i % 2 == 0) for i in range(n)]
        return L2ReadFinished(read.read_id, tuple(loaded))
    return L2ReadFinished(10_000 + pick([0, 5]), (True,))


def _l2_probe_finished(h: ServerHarness, pick: Pick[Any]) -> Any:
    job = h.server.job(RID)
    if job is not None and job.probe_id is not None and pick([True, False]):
        n = len(h.probes[job.probe_id].keys)
        pattern = pick(["all", "none", "first", "alternate"])
        present = [pattern == "all" or (pattern == "first" and i == 0) or
                   (pattern == "alternate" and i % 2 == 0) for i in range(n)]
        return L2ProbeFinished(job.probe_id, tuple(present))
    return L2ProbeFinished(20_000 + pick([0, 5]), (True,))


def _timer(h: ServerHarness, pick: Pick[Any]) -> Any:
    h.now += pick([0.0, 1.0, 30.0, 45.0, 60.0, 400.0])
    return TimerFired()


JOB_INPUTS: dict[type, JobInput] = {
    Lookup: _lookup,
    QueryPrefetchStatus: lambda h, pick: QueryPrefetchStatus(RID),
    WaitPrefetchStatus: lambda h, pick: WaitPrefetchStatus(RID, pick([0.0, 1.0, 100.0, float("nan"), -1.0])),
    FreeLookupLocks: _free,
    EndSession: lambda h, pick: EndSession(RID),
    L2ReadFinished: _l2_finished,
    L2ProbeFinished: _l2_probe_finished,
    TimerFired: _timer,
    Clear: lambda h, pick: Clear(pick([True, False]), admin=True),
}


# What the job table's guards classify each raw input into, and the rows of a lookup's outcome.
CLASSIFIED = {
    Lookup: {sj.RefusedLookup, sj.DuplicateLookup, sj.OverwritingLookup, sj.AcceptedLookup, sj.StartedLookup},
    QueryPrefetchStatus: {QueryPrefetchStatus, sj.ForgettingQuery},
    WaitPrefetchStatus: {WaitPrefetchStatus, sj.RefusedWait, sj.ForgettingWait},
    FreeLookupLocks: {sj.AdmittedFree, sj.RefusedFree},
    sj.ReapJob: {sj.ReapJob, sj.KeptAbandonedJob},
    sj.L2Timeout: {sj.L2Timeout, sj.L2TimeoutForWaiters, sj.L2TimeoutForgotten},
    sj.JobResolved: {sj.JobResolved, sj.ResolvedForWaiters, sj.ResolvedForgotten},
    sj.AckDue: {sj.AckDue, sj.AnswerInAck, sj.AnswerInAckForgotten},
}


def test_job_inputs_cover_the_table() -> None:
    assert set(JOB_INPUTS) == set(JOB_EVENTS)
    assert set(JOB_TABLE.guards) == set(CLASSIFIED)
    requests = {e for e in JOB_EVENTS if hasattr(e, "__annotations__") and "reply_to" in e.__annotations__
                and e is not Clear}
    assert requests == {Lookup, QueryPrefetchStatus, WaitPrefetchStatus, FreeLookupLocks, EndSession}
    for state in JobState:
        for ev in requests:
            # every job request is legal anywhere: a row of its own, or every row it is classified into
            kinds = CLASSIFIED.get(ev, {ev})
            assert any((state, k) in JOB_TABLE.rows for k in kinds), (state, ev)
            for refused in (sj.RefusedLookup, sj.RefusedWait, sj.RefusedFree):
                if refused in kinds:
                    assert JOB_TABLE.rows[(state, refused)].next_state is state, (state, refused)
    specific = set().union(*CLASSIFIED.values())
    assert set(JOB_TABLE.events()) == specific | {EndSession, sj.WaiterDeadline, sj.ForgetRequestId,
                                                  sj.TombstoneExpired, sj.TombstoneDropped}
    assert set(JOB_TIMERS) <= set(JOB_TABLE.events())


def _check_outcome(h: ServerHarness, before: Any, after: Any, event: Any, effects: list[Any],
                   rt: Any) -> bool:
    allowed = JOB_TABLE.allowed(before, type(event))
    errors = [e for e in effects if isinstance(e, ErrorReply) and e.reply_to == rt]
    if errors:
        assert after == before, "a refused input changed the state"
        assert len(errors) == 1
    elif allowed is not None:
        assert after in allowed, f"{before} --{type(event).__name__}--> {after}, allowed {allowed}"
    elif isinstance(event, Clear):
        assert after == before, "a clear of L1 changed a job"
    # any other input reaches the job through rows of its own (timers) or of its L2 work; the
    # harness asserts no row ran outside its next states
    replies = [e for e in effects if isinstance(e, (Reply, ErrorReply)) and e.reply_to == rt]
    if rt is not None:
        # every request is answered at once, except a wait on a pending job
        deferred = (isinstance(event, WaitPrefetchStatus) and after is JobState.PENDING
                    and event.timeout > 0 and not errors)
        assert len(replies) == (0 if deferred else 1)
        if deferred:
            assert h.server.stats()["waiters"] >= 1
    return bool(errors)


def _walk_one(state: JobState, event_type: type, stored: int, readers: int, waiter: bool,
              pick: Pick[Any], probe: bool = False, seen: Seen | None = None,
              l2_timeout: float = 30.0) -> tuple[JobState, bool]:
    """One step of the walk; returns (next state, refused)."""
    h = harness_with_job(state, stored, readers, waiter, probe, l2_timeout)
    trace = record_jobs(h.server)
    event = JOB_INPUTS[event_type](h, pick)
    rt = ("walk", 1) if hasattr(event, "reply_to") else None
    if rt is not None:
        event = attrs.evolve(event, reply_to=rt)
        h.outstanding.add(rt)
    effects = h.feed(event)
    after = h.server.job_state(RID)
    refused = _check_outcome(h, state, after, event, effects, rt)
    # the rows that ran for the job chain from its state before to its state after (time may
    # first drop its tombstone), each in the state the one before assigned
    if trace:
        assert trace[0][0] is state or (state, trace[0][0]) == (JobState.ANSWERED, JobState.ABSENT), trace
        for (_s, _e, assigned), (nxt, _e2, _a2) in zip(trace, trace[1:]):
            assert assigned is nxt, trace
        assert trace[-1][2] is after, (trace, after)
        for s_, e_, a_ in trace:
            assert JOB_TABLE.rows[(s_, e_)].next_state is a_
    if seen is not None:
        seen.update(trace)
    if isinstance(event, QueryPrefetchStatus):
        (reply,) = [e for e in effects if getattr(e, "reply_to", None) == rt]
        assert isinstance(reply, Reply)
        assert reply.result is not None or after is JobState.PENDING, "None for a non-pending id"
    return after, refused


@settings(max_examples=400, deadline=None)
@given(state=st.sampled_from(list(JobState)), event_type=st.sampled_from(JOB_EVENTS),
       stored=st.integers(0, 3), readers=st.integers(1, 2), waiter=st.booleans(), probe=st.booleans(),
       data=st.data())
def test_every_job_state_times_every_input(state: JobState, event_type: type, stored: int,
                                           readers: int, waiter: bool, probe: bool,
                                           data: st.DataObject) -> None:
    _walk_one(state, event_type, stored, readers, waiter, lambda opts: data.draw(st.sampled_from(opts)),
              probe)


def test_every_listed_job_transition_happens() -> None:
    """Exhaustive over a small grid: the table lists no transition that cannot happen (but the
    rows of a legacy server's flaws, and a few other tests drive)."""
    seen: Seen = set()
    refused: Seen = set()
    for state in JobState:
        for event_type in JOB_EVENTS:
            for stored in (0, 1, 3):
                for waiter in ((False, True) if state is JobState.PENDING else (False,)):
                    for probe in ((False, True) if state is JobState.PENDING else (False,)):
                        for l2_timeout in ((30.0, 100.0) if state is JobState.PENDING else (30.0,)):
                            def run(pick: Pick[Any]) -> None:
                                rows: Seen = set()
                                after, was_refused = _walk_one(state, event_type, stored, 1, waiter,
                                                               pick, probe, rows, l2_timeout)
                                seen.update(rows)  # a refusal is a row of its own
                                refused.update(rows if was_refused else ())

                            every_choice(run)
    listed = {(s, e, row.next_state) for (s, e), row in JOB_TABLE.rows.items()}
    # the rows of a legacy server's flaws (test_server_jobs_rows walks them): no reaper, a
    # duplicate overwriting its job (and the ack it then answers to an ANSWERED or ABSENT job),
    # no tombstones
    legacy = {sj.KeptAbandonedJob, sj.OverwritingLookup, sj.ResolvedForgotten, sj.L2TimeoutForgotten,
              sj.AnswerInAckForgotten, sj.ForgettingQuery, sj.ForgettingWait}
    legacy_only = {(s, e, n) for s, e, n in listed if e in legacy} | {
        (JobState.ABSENT, sj.AckDue, JobState.ABSENT), (JobState.ANSWERED, sj.AckDue, JobState.ANSWERED)}
    # leases outliving their tombstone: test_server_ownership drives that row; ack_first's
    # acceptance: test_ack_first; a lookup past the job or repeat caps: test_server_ownership
    # the tombstone cap: test_server_jobs_rows
    elsewhere = {(JobState.ABSENT, sj.ForgetRequestId, JobState.ABSENT),
                 (JobState.ANSWERED, sj.TombstoneDropped, JobState.ABSENT),
                 (JobState.ABSENT, sj.AcceptedLookup, JobState.PENDING),
                 (JobState.ANSWERED, sj.AcceptedLookup, JobState.PENDING)}
    assert listed - seen - legacy_only - elsewhere == set(), "listed but never seen"
    # a refused request ran its refusal's row, and nothing else
    assert {e for _s, e, _n in refused} == {sj.RefusedLookup, sj.RefusedWait, sj.RefusedFree}
    assert seen <= listed


# ------------------------------------------------------------------------------- transfers


def harness_with_transfer(state: TransferState, kind: str) -> tuple[ServerHarness, int]:
    h = ServerHarness(lease_ttl=300.0)
    h.register(engine_driven=True)
    h.store(TOKS)
    if state is TransferState.ABSENT:
        return h, 999
    if state is TransferState.RUNNING:
        req: Any = Store(key("w", tokens(2, seed=4), worker_id=0), 1) if kind == "store" else \
            Retrieve(key(RID, TOKS, worker_id=0), 1)
        h.send(req)
        (t,) = h.transfers.values()
        h.transfers.clear()
        return h, t.transfer_id
    req = PrepareStore(key("w", tokens(2, seed=4), worker_id=0), 1) if kind == "store" else \
        PrepareRetrieve(key(RID, TOKS, worker_id=0), 1)
    plan = h.call(req)
    assert isinstance(plan, TransferPlan) and plan.ok
    return h, plan.transfer_id


def test_transfer_table_is_complete() -> None:
    from mpcache.core_sm import server_transfers as st_

    for ev in TRANSFER_CREATORS:  # a creating request is always classified first
        assert TRANSFER_TABLE.guards[ev] is st_.TransferMachine._classify_request
    classified = {st_.AdmittedStore, st_.AdmittedRetrieve, st_.LateTransfer, st_.DuplicateTransfer,
                  st_.StaleResend, st_.RefusedTransfer, st_.ForeignCommit}
    internal = {st_.CopyBegins, st_.PlanBegins, st_.PlanOfGoneInstance}
    assert set(TRANSFER_TABLE.events()) == classified | internal | {TransferFinished, CommitTransfer} | \
        set(TRANSFER_TIMERS)


@settings(max_examples=200, deadline=None)
@given(state=st.sampled_from(list(TransferState)), kind=st.sampled_from(["store", "retrieve"]),
       event_type=st.sampled_from(TRANSFER_EVENTS), ok=st.booleans(),
       dt=st.sampled_from([0.0, 299.0, 300.0, 1000.0]))
def test_every_transfer_state_times_every_input(state: TransferState, kind: str, event_type: type,
                                                ok: bool, dt: float) -> None:
    import attrs

    h, tid = harness_with_transfer(state, kind)
    event: Any
    if event_type is TransferFinished:
        event = TransferFinished(tid, ok)
    elif event_type is CommitTransfer:
        event = CommitTransfer(tid, ok)
    elif event_type is TimerFired:
        h.now += dt
        event = TimerFired()
    else:
        event = Clear(ok, admin=True)
    rt = ("walk", 1) if hasattr(event, "reply_to") else None
    if rt is not None:
        event = attrs.evolve(event, reply_to=rt)
        h.outstanding.add(rt)
    effects = h.feed(event)
    after = h.server.transfer_state(tid)
    errors = [e for e in effects if isinstance(e, ErrorReply) and e.reply_to == rt]
    allowed = TRANSFER_TABLE.allowed(state, event_type)
    if errors:
        assert after is state or (state, event_type) == (TransferState.ABSENT, CommitTransfer)
    elif allowed is not None:
        assert after in allowed, (state, event_type, after)
    elif event_type is TransferFinished:
        assert after is state and h.server.stats()["stale_events"] == 1  # a plan's completion
    else:
        assert event_type in (TimerFired, Clear)
        assert after is state or event_type is TimerFired
    if rt is not None:
        assert len([e for e in effects if getattr(e, "reply_to", None) == rt]) == 1


@settings(max_examples=150, deadline=None)
@given(creator=st.sampled_from(TRANSFER_CREATORS), engine_driven=st.booleans(),
       stored=st.integers(0, 3), start=st.sampled_from([0, C, 1]), end=st.sampled_from([0, C, 3 * C, 3 * C + 1]),
       worker=st.sampled_from([0, 1, None]), instance=st.sampled_from([1, 2]))
def test_transfer_creators(creator: type, engine_driven: bool, stored: int, start: int, end: int,
                           worker: int | None, instance: int) -> None:
    h = ServerHarness()
    h.register(engine_driven=engine_driven)
    if stored:
        h.store(TOKS, end=stored * C)
    before = h.server.stats()["transfers"]
    rt = h.send(creator(CacheKey(MODEL, 1, worker, TOKS, start, end, RID), instance))
    reply = h.reply(rt)
    started = [e for e in h.log if isinstance(e, StartTransfer) and e.reply_to == rt]
    new = h.server.stats()["transfers"] - before
    if isinstance(reply, ErrorReply):
        assert new == 0 and not started
        return
    if started:
        assert reply is None and new == 1
        # the copy began by its own row (CopyBegins: ABSENT -> RUNNING)
        assert h.server.transfer_state(started[0].transfer_id) is TransferState.RUNNING
        h.finish_all_transfers()
        assert h.reply(rt) is not None
    elif isinstance(reply, Reply) and isinstance(reply.result, TransferPlan) and reply.result.ok:
        assert new == 1
        assert h.server.transfer_state(reply.result.transfer_id) is TransferState.PREPARED
    else:
        assert reply is not None and new == 0
    assert not any(isinstance(e, ReadL2) for e in h.log)


# ------------------------------------------------------------------------- instances, L2 work


def _recording(server: LookupServer, machine: Any, seen: Seen) -> None:
    run = machine.dispatch.run
    record(machine.dispatch, seen)
    for event_type, handler in list(server._rows.items()):
        if handler == run:
            server._rows[event_type] = machine.dispatch.run


def test_every_instance_row_runs_and_only_listed_transitions_happen() -> None:
    from mpcache.core_sm.messages import Ping, RegisterInstance, UnregisterInstance
    from mpcache.core_sm.server_instances import INSTANCE_TABLE, InstanceState

    h = ServerHarness(instance_ttl=10.0)
    trace: list[tuple[Any, type, Any]] = []
    h.server.instances.dispatch.trace = trace  # the specific event a guard chose, the state assigned
    h.call(UnregisterInstance(1))  # ABSENT
    assert h.error_kind(h.send(Ping(1))) is not None  # ABSENT, named: not registered
    h.register()  # ABSENT -> REGISTERED
    h.register()  # again
    h.call(Ping(1))  # heartbeat: watched
    h.advance(5.0)
    h.call(Ping(1))
    h.advance(6.0)  # deadline at 10: seen at 5, checked again
    h.advance(10.0)  # silent: reaped
    h.register(instance_id=2)
    h.call(UnregisterInstance(2))
    from mpcache.core_sm.messages import InstanceFailed

    h.register(instance_id=3)
    h.feed(InstanceFailed(3))  # REGISTERED -> ABSENT (the runtime failed it)
    h.feed(InstanceFailed(3))  # ABSENT: stale
    h.register(instance_id=3)
    h.feed(InstanceFailed(3, failed_at=h.now - 1.0))  # REGISTERED, registered after the failure: stays
    from mpcache.core_sm.errors import ErrorKind
    from mpcache.core_sm.messages import InstanceAttached

    h.attach_error = "cannot open the IPC handles"
    rt = h.send(RegisterInstance(4, "m", 1, 10))  # the transfer engine refuses: REGISTERED -> ABSENT
    assert h.error_kind(rt) is ErrorKind.VALIDATION and h.server.instances.registration(4) is None
    h.attach_error = None
    h.outstanding.add(("late", 1))
    h.feed(InstanceAttached(4, 12345, None, reply_to=("late", 1)))  # ABSENT: stale, still answered
    assert h.error_kind(("late", 1)) is ErrorKind.NOT_REGISTERED
    from mpcache.core_sm.messages import PeerGone

    h.register(instance_id=5)
    h.feed(PeerGone(None))  # REGISTERED -> ABSENT: its peer's connection is gone for good
    # the guards' rows: refusals keep the state the instance was in
    assert h.error_kind(h.send(RegisterInstance(6, "m", 0, 10))) is ErrorKind.VALIDATION  # ABSENT
    assert h.error_kind(h.send(RegisterInstance(6, "m", 1, 200))) is ErrorKind.TOO_LARGE  # ABSENT: > a slot
    h.register(instance_id=6)
    assert h.error_kind(h.send(RegisterInstance(6, "m", 1, 200))) is ErrorKind.TOO_LARGE  # REGISTERED
    assert h.error_kind(h.send(RegisterInstance(6, "m", 1, 10, peer="other"))) is ErrorKind.FORBIDDEN
    assert h.error_kind(h.send(UnregisterInstance(6, peer="other"))) is ErrorKind.FORBIDDEN
    assert h.error_kind(h.send(Ping(6, peer="other"))) is ErrorKind.FORBIDDEN
    h.outstanding.add(("late", 2))
    h.feed(InstanceAttached(6, 12345, None, reply_to=("late", 2)))  # REGISTERED, another registration's
    assert h.error_kind(("late", 2)) is ErrorKind.NOT_REGISTERED
    assert h.server.instance_state(6) is InstanceState.REGISTERED
    seen = set(trace)
    listed = {(s, e, n) for (s, e), row in INSTANCE_TABLE.rows.items() for n in row.next_states}
    assert seen <= listed and listed - seen == set()


def test_every_l2_row_runs_and_only_listed_transitions_happen() -> None:
    from mpcache.core_sm.messages import L2WriteFinished
    from mpcache.core_sm.server_l2 import L2_TABLE

    seen: Seen = set()
    for probe in (False, True):
        h = ServerHarness(l2_enabled=True, l2_probe=probe, write_behind=True, lease_ttl=10.0,
                          abandoned_job_ttl=100.0, l2_read_timeout=100.0, plan_ttl=100.0)
        _recording(h.server, h.server.l2, seen)
        h.register()
        h.store(TOKS)  # write-behind
        for w in list(h.writes.values()):
            h.feed(L2WriteFinished(w.write_id, True))
            h.feed(L2WriteFinished(w.write_id, True))  # stale
        h.call(Clear(True, admin=True))
        h.call(Lookup(key("a", TOKS), 1))  # probe or read
        for pr in list(h.probes.values()):
            h.feed(L2ProbeFinished(pr.probe_id, (True,) * len(pr.keys)))
            h.feed(L2ProbeFinished(pr.probe_id, (True,)))  # stale
        for rd in list(h.reads.values()):
            h.feed(L2ReadFinished(rd.read_id, (True,) * len(rd.items)))
            h.feed(L2ReadFinished(rd.read_id, (True,)))  # stale
        h.reads.clear()
        h.probes.clear()
        h.call(Clear(True, admin=True))
        h.store(tokens(2, seed=9), rid="w2")  # a write nobody answers
        h.call(Lookup(key("b", tokens(3, seed=7)), 1))  # misses: an L2 step nobody answers
        h.advance(11.0)  # all deadlines
    listed = {(s, e, n) for (s, e), row in L2_TABLE.rows.items() for n in row.next_states}
    assert seen <= listed and listed - seen == set()


def test_every_transfer_row_runs_and_only_listed_transitions_happen() -> None:
    h = ServerHarness(lease_ttl=10.0, plan_ttl=5.0)
    trace: list[tuple[Any, type, Any]] = []
    h.server.transfers.dispatch.trace = trace  # the specific event a guard chose, the state assigned
    h.register(engine_driven=True)
    h.store(TOKS)  # Store: RUNNING, then TransferFinished
    h.feed(TransferFinished(424242, True))  # ABSENT: stale
    h.store(TOKS)  # nothing to write: no transfer (ABSENT -> ABSENT)
    rt = h.send(Retrieve(key("r", TOKS, worker_id=0), 1))
    h.finish_all_transfers()
    assert h.reply(rt) is not None
    h.send(Retrieve(key("m", tokens(2, seed=3), worker_id=0), 1))  # a miss: no transfer
    plan = h.call(PrepareStore(key("p", tokens(2, seed=4), worker_id=0), 1))
    assert isinstance(plan, TransferPlan)
    h.call(CommitTransfer(plan.transfer_id, True))  # PREPARED -> ABSENT
    h.send(CommitTransfer(plan.transfer_id, True))  # ABSENT: unknown
    h.call(PrepareRetrieve(key("q", TOKS, worker_id=0), 1))  # a plan nobody commits
    h.call(PrepareRetrieve(key("q2", tokens(2, seed=8), worker_id=0), 1))  # a miss: no plan
    h.send(Store(key("s", tokens(2, seed=5), worker_id=0), 1))  # a copy nobody reports
    h.transfers.clear()
    h.advance(5.0)  # the plan expires (quarantined)
    h.advance(5.0)  # the copy expires
    h.advance(10.0)  # the quarantine ends
    # the guards' rows: refused before any work, a duplicate answered like the first copy
    from mpcache.core_sm.errors import ErrorKind
    from mpcache.core_sm.messages import InstanceFailed

    late = Store(key("l", TOKS, worker_id=0), 1, not_after=h.now - 1.0)
    assert h.error_kind(h.send(late)) is ErrorKind.TIMEOUT
    first = Store(key("d", tokens(2, seed=9), worker_id=0), 1, not_after=h.now + 5.0)
    h.send(first)
    h.send(first)  # the network's duplicate: waits for the first copy's answer
    h.finish_all_transfers()
    resend = Store(key("d", tokens(2, seed=9), worker_id=0), 1, registration=424242)
    assert h.error_kind(h.send(resend)) is ErrorKind.NOT_REGISTERED
    assert h.error_kind(h.send(Store(key("u", TOKS, worker_id=0), 77))) is ErrorKind.NOT_REGISTERED
    plan = h.call(PrepareRetrieve(key("q", TOKS, worker_id=0), 1))
    assert isinstance(plan, TransferPlan) and plan.ok
    assert h.error_kind(h.send(CommitTransfer(plan.transfer_id, True, peer="other"))) is ErrorKind.FORBIDDEN
    h.feed(InstanceFailed(1))  # its plan fails with it (PREPARED -> ABSENT)
    assert h.server.transfer_state(plan.transfer_id) is TransferState.ABSENT
    seen = set(trace)
    listed = {(s, e, n) for (s, e), row in TRANSFER_TABLE.rows.items() for n in row.next_states}
    assert seen <= listed and listed - seen == set()
