"""The server's jobs table (``JOB_TABLE``, core_sm/server_jobs.py) over seeded random input
sequences, in the production server and every legacy profile's server subclass: every row the
dispatcher runs leaves the job in one of the states its row names, named per row (not only the
``table_violations`` count), and the walk reaches every row of the table and the next states the
multi-state rows exist for.

``JOB_TABLE`` still checks (its handlers set the state; docs/core_sm.md says why). The states each
row was seen to reach are what a conversion to an assigning table must classify into rows of their
own; this test is the harness that conversion is measured against."""
from __future__ import annotations

import random
from typing import Any

import pytest

from mpcache.core_sm.effects import ProbeL2, ReadL2
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
from mpcache.core_sm.job_table import JobState
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

Seen = set[tuple[str, str, str]]  # (state, event type, state after)

# The legacy profiles whose server leaves a job where no row of the table says (the flaws they
# reproduce): a server that keeps no tombstone forgets an answered job (ABSENT, not ANSWERED: after
# a status query, and after an L2 timeout that answers a waiter, which this walk reaches rarely), and
# one that overwrites a live job on a duplicate Lookup restarts or settles it. An assigning jobs
# table has to give these their own rows (or their hooks a classification) before it can assign.
DEPARTURES: dict[type[LookupServer], Seen] = {
    server_type: {("DONE", "QueryPrefetchStatus", "ABSENT"), ("DONE", "WaitPrefetchStatus", "ABSENT")}
    for server_type in (profiles.UnknownNoneServer, profiles.PopOnceServer)}
RARE = {("PENDING", "L2Timeout", "ABSENT")}  # a departure allowed (where any is), not required
DEPARTURES[profiles.OverwriteDupServer] = {("DONE", "Lookup", "PENDING"), ("DONE", "Lookup", "ANSWERED"),
                                           ("PENDING", "Lookup", "DONE"), ("PENDING", "Lookup", "ANSWERED")}


def _config(r: random.Random) -> ServerConfig:
    return ServerConfig(
        chunk_size=C, num_slots=r.choice([3, 12]), slot_bytes=64, lease_ttl=r.choice([8.0, 30.0]),
        l2_enabled=r.random() < 0.6, l2_probe=r.random() < 0.3, l2_read_timeout=r.choice([2.0, 30.0]),
        tombstone_ttl=r.choice([3.0, 60.0]), tombstone_cap=r.choice([1, 100]),
        abandoned_job_ttl=r.choice([4.0, 60.0]), ack_first=r.random() < 0.3, instance_ttl=None,
        l1_bytes=0, slot_align=16)


def _walk(server_type: type[LookupServer], seed: int, steps: int, departures: Seen | None = None) -> Seen:
    r = random.Random(seed)
    server = server_type(_config(r))
    failures: list[str] = []
    trace: list[Any] = []
    server.jobs.dispatch.trace = trace
    reads: list[int] = []
    probes: list[int] = []
    now = 0.0

    def key(worker: bool) -> CacheKey:
        a, b = sorted((r.randint(0, 4) * C, r.randint(1, 4) * C))
        return CacheKey("m", 1, 0 if worker else None, r.choice(SEQS), a if worker else 0, b,
                        r.choice(RIDS), "")

    for n in range(steps):
        rt, peer, pick = ("r", n), r.choice(PEERS), r.randrange(12)
        ev: Any
        if pick <= 2:
            ev = Lookup(key(False), 1, answer_in_ack=r.random() < 0.3, reply_to=rt, peer=peer)
        elif pick == 3:
            ev = Store(key(True), 0, (1, 2, 3, 4), reply_to=rt, peer=peer)
        elif pick == 4:
            ev = QueryPrefetchStatus(r.choice(RIDS), reply_to=rt, peer=peer)
        elif pick == 5:
            ev = WaitPrefetchStatus(r.choice(RIDS), r.choice([0.5, 5.0, 40.0]), reply_to=rt, peer=peer)
        elif pick == 6:
            ev = FreeLookupLocks(key(True), reply_to=rt, peer=peer)
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
        effects = server.handle(ev, now) + server.run_deferred()
        for state, event_type, after in trace[mark:]:
            nexts = JOB_TABLE.allowed(state, event_type)
            assert nexts is not None
            if after not in nexts:
                if departures and (state.name, event_type.__name__, after.name) in departures | RARE:
                    continue
                failures.append(f"{state.name} x {event_type.__name__} left the job {after.name}, "
                                f"the row names {sorted(s.name for s in nexts)}")
        for e in effects:
            if isinstance(e, ReadL2):
                reads.append(e.read_id)
            elif isinstance(e, ProbeL2):
                probes.append(e.probe_id)
        server.check_invariants()
        assert server.stats()["internal_errors"] == 0, (server_type.__name__, seed, n, ev)
        assert not failures, (server_type.__name__, seed, n, ev, failures)
    if not departures:
        assert server.stats()["table_violations"] == 0, (server_type.__name__, seed)
    return {(s.name, e.__name__, a.name) for s, e, a in trace}


def _seen(seeds: range, steps: int) -> Seen:
    seen: Seen = set()
    for server_type in SERVERS:
        for seed in seeds:
            seen |= _walk(server_type, seed, steps, DEPARTURES.get(server_type))
    return seen


# Every next state of the multi-state rows: a new Lookup (from ABSENT or ANSWERED) that is done at
# once, waits on L2, is answered in its ack, or is refused; a reap that drops its job and one a
# profile's hook keeps (NoReaper); an L2 timeout with and without a waiter to answer.
MULTI = {(state, "Lookup", after) for state in ("ABSENT", "ANSWERED")
         for after in ("PENDING", "DONE", "ANSWERED", "ABSENT" if state == "ABSENT" else "ANSWERED")} | {
    ("PENDING", "ReapJob", "ABSENT"), ("PENDING", "ReapJob", "PENDING"), ("DONE", "ReapJob", "ABSENT"),
    ("DONE", "ReapJob", "DONE"), ("PENDING", "L2Timeout", "DONE"), ("PENDING", "L2Timeout", "ANSWERED")}


def test_every_jobs_row_leaves_a_state_it_names_and_every_row_runs() -> None:
    seen = _seen(range(60), 80)
    rows = {(s.name, e.__name__) for s, e in JOB_TABLE.rows}
    ran = {(s, e) for s, e, _a in seen}
    assert rows <= ran, sorted(rows - ran)
    assert MULTI <= seen, sorted(MULTI - seen)


def test_the_legacy_departures_are_still_reached() -> None:
    """Each departure listed above is one its profile still makes (the list cannot go stale)."""
    for server_type, departures in DEPARTURES.items():
        reached: Seen = set()
        for seed in range(200):
            reached |= _departures_of(server_type, seed, 80) & departures
            if reached == departures:
                break
        assert reached == departures, (server_type.__name__, sorted(departures - reached))


def _departures_of(server_type: type[LookupServer], seed: int, steps: int) -> Seen:
    every = {(s.name, e.__name__, a.name) for s in JobState for (_s, e) in JOB_TABLE.rows for a in JobState}
    return _walk(server_type, seed, steps, every) - {
        (s.name, e.__name__, a.name) for (s, e), t in JOB_TABLE.rows.items() for a in t.next_states}


@pytest.mark.parametrize("row,dropped", [
    ((JobState.ABSENT, Lookup), JobState.PENDING),
    ((JobState.ABSENT, Lookup), JobState.DONE),
    ((JobState.PENDING, EndSession), None),
    ((JobState.DONE, QueryPrefetchStatus), None),
    ((JobState.PENDING, WaitPrefetchStatus), None),
])
def test_the_walk_fails_when_a_rows_next_states_are_edited(row: Any, dropped: JobState | None,
                                                           monkeypatch: Any) -> None:
    """A row edited to name a wrong next state (a state dropped from a set, or a one-state row
    pointed elsewhere) shows as a job left in a state its row does not name."""
    transition = JOB_TABLE.rows[row]
    if dropped is None:
        (only,) = transition.next_states
        wrong = frozenset({JobState.ANSWERED if only is not JobState.ANSWERED else JobState.DONE})
    else:
        wrong = transition.next_states - {dropped}
    monkeypatch.setitem(JOB_TABLE.rows, row, type(transition)(transition.handler, wrong))
    with pytest.raises(AssertionError, match="left the job"):
        _seen(range(60), 80)
