"""The server's jobs table (``JOB_TABLE``, core_sm/server_jobs.py) over seeded random input
sequences, in the production server and every legacy profile's server subclass.

``JOB_TABLE`` assigns: every row names one next state, and ``JobMachine._set_state`` makes the job
that state after the row's handler (ABSENT: its job and tombstone forgotten; any other: it asserts
the records its handler filed or kept are that state, so a row naming a state its handler does
not leave shows as an internal error here). The walk checks, after every event: no internal
error, the server's invariants, and that every request's state changed only by a row that
addressed it (a tombstone's expiry and the tombstone cap too), to the state the last such row
assigned. It reaches every row of the table; the rows a legacy server's flaw
classifies into (no tombstones: F1/F2, a duplicate lookup overwriting its job: F4, no reaper:
F12) are reached by their profile's server, and by the production server only where its
configuration asks the same (``tombstone_cap`` 0 keeps no tombstone). ``EXPECTED`` pins the
table, row by row."""
from __future__ import annotations

import random
from typing import Any

import pytest

from mpcache.core_sm.effects import ProbeL2, ReadL2
from mpcache.core_sm.job_table import JobState
from mpcache.core_sm.messages import (
    CacheKey,
    EndSession,
    FreeLookupLocks,
    L2ProbeFinished,
    L2ReadFinished,
    Lookup,
    QueryPrefetchStatus,
    Store,
    TimerFired,
    WaitPrefetchStatus,
)
from mpcache.core_sm.server import LookupServer, ServerConfig
from mpcache.core_sm.server_core import RequestKey
from mpcache.core_sm import server_jobs as sj
from mpcache.core_sm.server_jobs import JOB_TABLE
from mpcache.sim import profiles

C = 4
PEERS: list[Any] = [None, "p1"]
RIDS = ["a", "b", "c"]
SEQS = [tuple(range(16)), tuple(range(8)) + tuple(range(100, 108))]
SERVERS: list[type[LookupServer]] = [LookupServer, profiles.UnknownNoneServer, profiles.PopOnceServer,
                                     profiles.OverwriteDupServer, profiles.ReleaseAllServer,
                                     profiles.SilentErrorsServer, profiles.NoReaperServer,
                                     profiles.TrustAllServer]

A, P, D, N = JobState.ABSENT, JobState.PENDING, JobState.DONE, JobState.ANSWERED
# The table as the protocol says it (state x the specific event a guard classifies into -> the
# one next state). A new lookup is refused (nothing changes), accepted or started (PENDING: its
# work runs right after, its outcome a JobResolved row), a duplicate of a live job acknowledged
# (or, F4, overwritten: PENDING again); a pending job resolves DONE, or ANSWERED at once to its
# waiters; answering a DONE job (a status, a wait, the ack of answer_in_ack) leaves its tombstone
# (ANSWERED) -- or nothing (ABSENT) on a server that keeps none; an end session forgets all; a
# reap forgets the job (or, F12, keeps it); a tombstone goes when its TTL passes or the cap needs
# its room.
EXPECTED: dict[tuple[JobState, type], JobState] = {
    **{(s, sj.RefusedLookup): s for s in JobState},
    **{(s, t): P for s in (A, N) for t in (sj.AcceptedLookup, sj.StartedLookup)},
    **{(s, sj.DuplicateLookup): s for s in (P, D)},
    **{(s, sj.OverwritingLookup): P for s in (P, D)},
    (P, sj.JobResolved): D, (P, sj.ResolvedForWaiters): N, (P, sj.ResolvedForgotten): A,
    (P, sj.L2Timeout): D, (P, sj.L2TimeoutForWaiters): N, (P, sj.L2TimeoutForgotten): A,
    **{(s, sj.AckDue): s for s in (A, P, N)},
    (D, sj.AnswerInAck): N, (D, sj.AnswerInAckForgotten): A,
    **{(s, QueryPrefetchStatus): s for s in (A, P, N)}, (D, QueryPrefetchStatus): N, (D, sj.ForgettingQuery): A,
    **{(s, WaitPrefetchStatus): s for s in (A, P, N)}, (D, WaitPrefetchStatus): N, (D, sj.ForgettingWait): A,
    **{(s, t): s for s in JobState for t in (sj.RefusedWait, sj.AdmittedFree, sj.RefusedFree)},
    **{(s, EndSession): A for s in JobState},
    (P, sj.ReapJob): A, (D, sj.ReapJob): A, (P, sj.KeptAbandonedJob): P, (D, sj.KeptAbandonedJob): D,
    (P, sj.WaiterDeadline): P, (A, sj.ForgetRequestId): A,
    (N, sj.TombstoneExpired): A, (N, sj.TombstoneDropped): A,
}
# The rows only a server keeping no tombstone runs (UnknownNone, PopOnce; production with a
# tombstone cap of 0), only OverwriteDup, only NoReaper.
NO_TOMBSTONE = {sj.ResolvedForgotten, sj.L2TimeoutForgotten, sj.AnswerInAckForgotten, sj.ForgettingQuery,
                sj.ForgettingWait}
# (A lookup answered in its ack meets an ANSWERED or ABSENT job only when it overwrote a job whose
# waiters its work then answered.)
LEGACY = {profiles.OverwriteDupServer: {"PENDING x OverwritingLookup", "DONE x OverwritingLookup",
                                        "ANSWERED x AckDue", "ABSENT x AckDue"},
          profiles.NoReaperServer: {"PENDING x KeptAbandonedJob", "DONE x KeptAbandonedJob"}}

Seen = set[tuple[str, str, str]]  # (server type[/cap0], state x event, state after)


def _config(r: random.Random) -> ServerConfig:
    return ServerConfig(
        chunk_size=C, num_slots=r.choice([3, 12]), slot_bytes=64, lease_ttl=r.choice([8.0, 30.0]),
        l2_enabled=r.random() < 0.6, l2_probe=r.random() < 0.3, l2_read_timeout=r.choice([2.0, 30.0]),
        tombstone_ttl=r.choice([3.0, 60.0]), tombstone_cap=r.choice([0, 1, 100, 100]),
        abandoned_job_ttl=r.choice([4.0, 60.0]), ack_first=r.random() < 0.3, instance_ttl=None,
        l1_bytes=0, slot_align=16, max_waiters=r.choice([1, 100]), max_jobs=r.choice([2, 100]),
        max_lookups_per_request=r.choice([2, 64]))


def _states(server: LookupServer) -> dict[RequestKey, JobState]:
    return {RequestKey(p, rid): server.job_state(rid, p) for p in PEERS for rid in RIDS}


def _walk(server_type: type[LookupServer], seed: int, steps: int) -> Seen:
    r = random.Random(seed)
    config = _config(r)
    server = server_type(config)
    label = server_type.__name__ + ("/cap0" if config.tombstone_cap == 0 else "")
    trace: list[Any] = []
    server.jobs.dispatch.trace = trace
    reads: list[int] = []
    probes: list[int] = []
    now = 0.0
    seen: Seen = set()

    def key(worker: bool) -> CacheKey:
        a, b = sorted((r.randint(0, 4) * C, r.randint(1, 4) * C))
        return CacheKey("m", 1, 0 if worker else None, r.choice(SEQS), a if worker else 0, b,
                        r.choice(RIDS), "")

    assignments: list[tuple[Any, JobState]] = []
    assign = server.jobs.dispatch._set_state
    assert assign is not None

    def recording(key: Any, state: JobState) -> None:
        assignments.append((key, state))
        assign(key, state)

    server.jobs.dispatch._set_state = recording
    # a lookup's work fails (the server's own fault: it resolves as 0 hits) where the walk says
    fail = [False]
    lease_prefix = server._lease_prefix_for_lookup

    def failing(*args: Any) -> int:
        if fail[0]:
            fail[0] = False
            raise MemoryError("the walk's")
        return lease_prefix(*args)

    server._lease_prefix_for_lookup = failing  # type: ignore[method-assign]
    before = _states(server)
    for n in range(steps):
        rt, peer, pick = ("r", n), r.choice(PEERS), r.randrange(13)
        ev: Any
        if pick <= 2:
            in_ack = r.random() < 0.3
            ev = Lookup(key(False), 1, (1,) if r.random() < 0.05 else None, answer_in_ack=in_ack, reply_to=rt,
                        peer=peer)
            # a work that raises is caught where the lookup answers in its ack
            fail[0] = in_ack and r.random() < 0.25
        elif pick == 3:
            ev = Store(key(True), 0, (1, 2, 3, 4), reply_to=rt, peer=peer)
        elif pick == 4:
            ev = QueryPrefetchStatus(r.choice(RIDS), reply_to=rt, peer=peer)
        elif pick == 5:
            ev = WaitPrefetchStatus(r.choice(RIDS), r.choice([0.5, 5.0, 40.0, "x"]), reply_to=rt, peer=peer)
        elif pick == 6:
            k = key(r.random() < 0.1)  # a worker's key: refused
            ev = FreeLookupLocks(CacheKey("m", 1, k.worker_id, k.token_ids, r.randint(0, 3) * C, k.end,
                                          k.request_id, ""), reply_to=rt, peer=peer)
        elif pick == 7:
            ev = EndSession(r.choice(RIDS), reply_to=rt, peer=peer)
        elif pick == 8 and reads:
            ev = L2ReadFinished(reads.pop(r.randrange(len(reads))), (r.random() < 0.7,) * 8)
        elif pick == 8 and probes:
            ev = L2ProbeFinished(probes.pop(r.randrange(len(probes))), (r.random() < 0.7,) * 8)
        else:
            ev = TimerFired()
        now += r.choice([0.0, 0.5, 1.0, 3.0, 7.0])
        mark = len(trace)
        assignments.clear()
        effects = server.handle(ev, now) + server.run_deferred()
        fail[0] = False
        assert server.stats()["internal_errors"] == 0, (label, seed, n, ev)
        server.check_invariants()
        after = _states(server)
        for state, event_type, state_after in trace[mark:]:
            seen.add((label, f"{state.name} x {event_type.__name__}", state_after.name))
        last = dict(assignments)  # the state the last row addressing each request assigned
        for k in before:
            assert after[k] is last.get(k, before[k]), (label, seed, n, ev, k, before[k], last.get(k), after[k])
        for e in effects:
            if isinstance(e, ReadL2):
                reads.append(e.read_id)
            elif isinstance(e, ProbeL2):
                probes.append(e.probe_id)
        before = after
    return seen


def _overwritten_with_waiters(cap: int) -> Seen:
    """OverwriteDup's rarest rows, directed: a job waits on L2 with a waiter, and a duplicate
    lookup answered in its ack overwrites it and fails at once (0 hits, answered to the waiter
    first: the ack finds the job ANSWERED, or ABSENT where the tombstone cap is 0)."""
    server = profiles.OverwriteDupServer(ServerConfig(
        chunk_size=C, num_slots=12, slot_bytes=64, l2_enabled=True, tombstone_cap=cap, instance_ttl=None,
        l1_bytes=0, slot_align=16))
    trace: list[Any] = []
    server.jobs.dispatch.trace = trace
    key = CacheKey("m", 1, None, SEQS[0], 0, 2 * C, "a", "")
    server.handle(Lookup(key, 1, reply_to=1), 0.0)
    server.handle(WaitPrefetchStatus("a", 5.0, reply_to=2), 0.0)

    def failing(*args: Any) -> int:
        raise MemoryError("the walk's")

    server._lease_prefix_for_lookup = failing  # type: ignore[method-assign]
    effects = server.handle(Lookup(key, 1, answer_in_ack=True, reply_to=3), 0.0)
    assert [e.result for e in effects if getattr(e, "reply_to", None) in (2, 3)] == [0, None]
    server.check_invariants()
    return {("OverwriteDupServer" + ("/cap0" if cap == 0 else ""), f"{s.name} x {e.__name__}", a.name)
            for s, e, a in trace}


def _timed_out_with_waiters(server_type: type[LookupServer]) -> Seen:
    """An L2 timeout under a waiter, directed: answered to it (ANSWERED, or ABSENT on a server
    that keeps no tombstone)."""
    server = server_type(ServerConfig(chunk_size=C, num_slots=12, slot_bytes=64, l2_enabled=True,
                                      l2_read_timeout=2.0, instance_ttl=None, l1_bytes=0, slot_align=16))
    trace: list[Any] = []
    server.jobs.dispatch.trace = trace
    server.handle(Lookup(CacheKey("m", 1, None, SEQS[0], 0, 2 * C, "a", ""), 1, reply_to=1), 0.0)
    server.handle(WaitPrefetchStatus("a", 40.0, reply_to=2), 0.0)
    effects = server.handle(TimerFired(), 3.0)
    assert [e.result for e in effects if getattr(e, "reply_to", None) == 2] == [0]
    server.check_invariants()
    return {(server_type.__name__, f"{s.name} x {e.__name__}", a.name) for s, e, a in trace}


def _seen(seeds: range, steps: int) -> Seen:
    seen: Seen = (_overwritten_with_waiters(100) | _overwritten_with_waiters(0)
                  | _timed_out_with_waiters(LookupServer) | _timed_out_with_waiters(profiles.PopOnceServer))
    for server_type in SERVERS:
        for seed in seeds:
            seen |= _walk(server_type, seed, steps)
    return seen


def test_the_table_assigns_one_next_state_per_row_and_is_the_expected_one() -> None:
    assert JOB_TABLE.assigns
    assert all(len(t.next_states) == 1 for t in JOB_TABLE.rows.values())
    table = {row: t.next_state for row, t in JOB_TABLE.rows.items()}
    assert table == EXPECTED, sorted((f"{s.name} x {e.__name__}", table.get((s, e)), EXPECTED.get((s, e)))
                                     for s, e in set(table) | set(EXPECTED) if table.get((s, e)) != EXPECTED.get((s, e)))


def test_every_jobs_row_runs_and_the_legacy_rows_only_where_their_flaw_is() -> None:
    seen = _seen(range(80), 100)
    rows = {f"{s.name} x {e.__name__}" for s, e in JOB_TABLE.rows}
    ran = {row for _label, row, _after in seen}
    assert rows <= ran, sorted(rows - ran)
    for label, row, after in seen:
        (state, event), = [k for k in JOB_TABLE.rows if f"{k[0].name} x {k[1].__name__}" == row]
        assert after == JOB_TABLE.rows[(state, event)].next_state.name, (label, row, after)
        server = label.split("/")[0]
        if event in NO_TOMBSTONE:
            assert server in ("UnknownNoneServer", "PopOnceServer") or label.endswith("/cap0"), (label, row)
        for legacy, legacy_rows in LEGACY.items():
            if row in legacy_rows:
                assert server == legacy.__name__, (label, row)
    for legacy, legacy_rows in LEGACY.items():
        reached = {row for label, row, _a in seen if label.split("/")[0] == legacy.__name__}
        assert legacy_rows <= reached, (legacy.__name__, sorted(legacy_rows - reached))
    for server in ("UnknownNoneServer", "PopOnceServer"):
        assert any(label == server and row == "DONE x ForgettingQuery" for label, row, _a in seen), server


@pytest.mark.parametrize("row,wrong", [
    ((JobState.ABSENT, sj.StartedLookup), JobState.DONE),
    ((JobState.ABSENT, sj.StartedLookup), JobState.ABSENT),
    ((JobState.PENDING, sj.JobResolved), JobState.ANSWERED),
    ((JobState.DONE, QueryPrefetchStatus), JobState.DONE),
    ((JobState.PENDING, WaitPrefetchStatus), JobState.ABSENT),
    ((JobState.ANSWERED, sj.AcceptedLookup), JobState.ANSWERED),
    ((JobState.PENDING, sj.L2Timeout), JobState.PENDING),
])
def test_the_walk_fails_when_a_rows_next_state_is_edited(row: Any, wrong: JobState, monkeypatch: Any) -> None:
    """A row edited to name a wrong next state shows in the walk itself (a state the handler
    did not leave, or records dropped under a live job), not only in ``EXPECTED``."""
    transition = JOB_TABLE.rows[row]
    monkeypatch.setitem(JOB_TABLE.rows, row, type(transition)(transition.handler, frozenset({wrong})))
    with pytest.raises(AssertionError):
        _seen(range(60), 80)
