"""ServerConfig.ack_first: a lookup is acknowledged before its work (hashes, leases, L2 start).

What it must never change: every later message sees exactly what it would have seen had the
lookup's work run with its ack -- whether the runtime calls ``run_deferred`` right after the ack
or never (then the next ``handle`` runs it first)."""
from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.effects import Effect, ErrorReply, LookupWorkFailed, ProbeL2, ReadL2, Reply, StartTransfer, WriteL2
from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.messages import (
    Clear,
    EndSession,
    FreeLookupLocks,
    L2ProbeFinished,
    L2ReadFinished,
    L2WriteFinished,
    Lookup,
    QueryPrefetchStatus,
    RegisterInstance,
    Retrieve,
    Store,
    TimerFired,
    TransferFinished,
    WaitPrefetchStatus,
)
from mpcache.core_sm.server import JobState, LookupServer, ServerConfig
from sm_helpers import C, MODEL, ServerHarness, key, tokens


def harness(**kw: Any) -> ServerHarness:
    return ServerHarness(ack_first=True, **kw)


def test_ack_comes_before_any_lease_and_the_work_runs_on_run_deferred() -> None:
    h = harness()
    h.register()
    toks = tokens(3)
    h.store(toks)
    rt = h.send(Lookup(key("a", toks), 1))
    assert h.result(rt) is None  # acknowledged
    s = h.server
    assert s.deferred_work
    job = s.job("a")
    assert job is not None and job.accepted and s.job_state("a") is JobState.PENDING
    assert s.leases_of("a") == 0 and s.stats()["lookup_chunks"] == 0  # nothing hashed or leased yet
    assert s.run_deferred() == []  # an L1-only hit: nothing to start
    assert not s.deferred_work and s.run_deferred() == []
    assert s.leases_of("a") == 3 and s.job("a").hits == 3  # type: ignore[union-attr]
    assert h.call(QueryPrefetchStatus("a")) == 3


def test_a_runtime_that_never_calls_run_deferred_sees_todays_answers() -> None:
    h = harness()
    h.register()
    toks = tokens(2)
    h.store(toks)
    h.send(Lookup(key("a", toks), 1))
    assert h.server.deferred_work
    assert h.call(QueryPrefetchStatus("a")) == 2  # the query ran the work first
    assert h.server.leases_of("a") == 2 and not h.server.deferred_work


@pytest.mark.parametrize("later", ["lookup", "end_session", "free", "clear", "reap", "status", "wait"])
def test_events_arriving_before_run_deferred(later: str) -> None:
    """Each event that can follow the ack, handled with the work still waiting: the result is
    what the same event gets after a lookup done all at once."""
    outcomes = []
    for ack_first in (False, True):
        h = ServerHarness(ack_first=ack_first)
        h.register()
        toks = tokens(3)
        h.store(toks)
        h.send(Lookup(key("a", toks), 2))
        if later == "lookup":  # a duplicate: acknowledged, no second set of leases
            got: object = h.call(Lookup(key("a", toks), 2))
        elif later == "end_session":
            got = h.call(EndSession("a"))
        elif later == "free":
            got = h.call(FreeLookupLocks(key("a", toks, 0, 2 * C)))
        elif later == "clear":
            got = h.call(Clear(True, admin=True))
        elif later == "reap":
            got = [type(e).__name__ for e in h.advance(h.server.config.abandoned_job_ttl + 1)]
        elif later == "status":
            got = h.call(QueryPrefetchStatus("a"))
        else:
            got = h.call(WaitPrefetchStatus("a", 1.0))
        s = h.server
        stats = s.stats()
        outcomes.append((got, s.leases_of("a"), s.job_state("a"), stats["duplicate_lookups"],
                         stats["reaped_jobs"], stats["hit_chunks"], h.call(QueryPrefetchStatus("a"))))
        assert not s.deferred_work
    assert outcomes[0] == outcomes[1]


def test_every_refusal_happens_before_the_ack() -> None:
    """What can fail fails with the ack's place taken by the error: no job, nothing deferred."""
    h = harness(max_jobs_per_peer=1, max_lookups_per_request=2)
    toks = tokens(2)
    bad = [
        Lookup(key("v", toks, start=C), 1),  # not from token 0
        Lookup(key("v", toks, salt="bad@"), 1),
        Lookup(key("v", toks, end=C + 1), 1),  # unaligned
        Lookup(key("v", toks), 1, (0, 0)),  # repeated rank
        Lookup(key("v", (2**33,) + toks[1:]), 1),  # not a uint32 token
    ]
    for ev in bad:
        assert h.error_kind(h.send(ev)) is ErrorKind.VALIDATION
        assert not h.server.deferred_work and h.server.job("v") is None
    assert h.call(Lookup(key("a", toks), 1)) is None
    assert h.error_kind(h.send(Lookup(key("b", toks), 1))) is ErrorKind.TOO_LARGE  # per-peer cap
    assert not h.server.deferred_work  # the cap check ran a's work first, then refused b
    assert h.call(QueryPrefetchStatus("a")) == 0
    assert h.call(Lookup(key("a", toks), 1)) is None  # a repeat of an answered request
    assert h.error_kind(h.send(Lookup(key("a", toks), 1))) is ErrorKind.TOO_LARGE  # repeat cap


def test_the_uint32_refusal_is_todays() -> None:
    toks = (2**33,) + tokens(1)[1:]
    msgs = []
    for ack_first in (False, True):
        h = ServerHarness(ack_first=ack_first)
        r = h.reply(h.send(Lookup(key("v", toks), 1)))
        assert isinstance(r, ErrorReply)
        msgs.append(r.error.message)
    assert msgs[0] == msgs[1] and msgs[0].startswith("token ids must be uint32")


class FailingLeases(LookupServer):
    def _lease_prefix_for_lookup(self, *args: Any) -> int:
        raise MemoryError("no room for the leases")


class FailingAfterLeases(LookupServer):
    """The work fails after the L1 prefix was leased: those leases must go."""

    def _lease_prefix_for_lookup(self, *args: Any) -> int:
        super()._lease_prefix_for_lookup(*args)
        raise RuntimeError("a bug after leasing")


@pytest.mark.parametrize("cls", [FailingLeases, FailingAfterLeases])
@pytest.mark.parametrize("via", ["run_deferred", "next_event"])
def test_work_failing_after_the_ack_resolves_as_zero_hits(cls: type[LookupServer], via: str) -> None:
    h = ServerHarness(server=cls(ServerConfig(chunk_size=C, num_slots=64, slot_bytes=100, ack_first=True)))
    h.register()
    toks = tokens(2)
    h.store(toks)
    assert h.call(Lookup(key("a", toks), 1)) is None
    if via == "run_deferred":
        effects = h.server.run_deferred()
    else:
        effects = h.feed(TimerFired())
    failed = [e for e in effects if isinstance(e, LookupWorkFailed)]
    assert len(failed) == 1 and failed[0].request_id == "a" and "Error" in failed[0].reason
    s = h.server
    s.check_invariants()
    assert s.stats()["lookup_work_failures"] == 1 and s.stats()["internal_errors"] == 0
    assert s.leases_of("a") == 0
    assert h.call(QueryPrefetchStatus("a")) == 0  # answered, never pending forever
    assert h.call(QueryPrefetchStatus("a")) == 0  # and its tombstone repeats it


def test_hash_failure_after_the_ack(monkeypatch: pytest.MonkeyPatch) -> None:
    h = harness()
    toks = tokens(2)
    assert h.call(Lookup(key("a", toks), 1)) is None
    monkeypatch.setattr(h.server.ctx, "hashes", lambda k, n: ((), "token ids must be uint32: injected"))
    w = h.send(WaitPrefetchStatus("a", 5.0))
    assert h.result(w) == 0
    assert h.server.stats()["lookup_work_failures"] == 1


def test_l2_read_starts_in_the_deferred_work() -> None:
    h = harness(l2_enabled=True)
    toks = tokens(2)
    assert h.call(Lookup(key("a", toks), 1)) is None
    assert not h.reads
    effects = h.server.run_deferred()
    h._absorb(effects)
    assert [type(e) for e in effects] == [ReadL2]
    (read,) = h.reads.values()
    h.feed(L2ReadFinished(read.read_id, (True, True)))
    assert h.call(QueryPrefetchStatus("a")) == 2


# ---------------------------------------------------------------------------------------------
# Differential: the same events into a server that does each lookup at once, one that runs the
# deferred work after each ack, and one whose runtime never calls run_deferred.

rids = st.sampled_from(["a", "b", "c"])
prompts = [tokens(3, seed=0), tokens(3, seed=0)[: 2 * C] + tokens(1, seed=7), tokens(2, seed=1)]
cache_keys = st.builds(lambda p, n, rid: key(rid, prompts[p], 0, min(n, len(prompts[p]) // C) * C),
                       st.integers(0, 2), st.integers(0, 3), rids)
requests = st.one_of(
    st.builds(Lookup, cache_keys, st.integers(0, 2)),
    st.builds(Lookup, cache_keys, st.integers(0, 2)),
    st.builds(QueryPrefetchStatus, rids),
    st.builds(WaitPrefetchStatus, rids, st.sampled_from([0.0, 1.0, 50.0])),
    st.builds(FreeLookupLocks, cache_keys),
    st.builds(EndSession, rids),
    st.builds(lambda: Clear(True, admin=True)),
    st.builds(lambda k: Store(attrs.evolve(k, worker_id=0, request_id="w"), 1, (0,)), cache_keys),
    st.builds(lambda k: Store(attrs.evolve(k, worker_id=0, request_id="w"), 1, (0,)), cache_keys),
    st.builds(lambda k: Retrieve(attrs.evolve(k, worker_id=0), 1, (0,), k.end), cache_keys),
    st.just("complete"),  # the runtime reports the oldest pending copy or L2 step done
    st.just("complete"),
    st.just("fail"),  # ... or failed
)
steps = st.lists(st.tuples(requests, st.sampled_from([0.0, 0.0, 0.5, 10.0, 100.0])), min_size=6, max_size=30)


def _norm(effects: list[Effect]) -> list[object]:
    return [(type(e), e.reply_to, e.error.kind, e.error.message) if isinstance(e, ErrorReply) else e
            for e in effects]


def _view(s: LookupServer) -> object:
    return (s.stats(), s.leases_by_owner(), {k: (j.hits, j.serial) for k, j in s.jobs.jobs.items()},
            dict(s.jobs.tombstones))


def _completion(effect: Effect, ok: bool) -> object:
    if isinstance(effect, StartTransfer):
        return TransferFinished(effect.transfer_id, ok)
    if isinstance(effect, ReadL2):
        return L2ReadFinished(effect.read_id, tuple(ok for _ in effect.items))
    if isinstance(effect, ProbeL2):
        return L2ProbeFinished(effect.probe_id, tuple(ok for _ in effect.keys))
    assert isinstance(effect, WriteL2)
    return L2WriteFinished(effect.write_id, ok)


@settings(max_examples=120, deadline=None)
@given(steps, st.booleans(), st.booleans())
def test_ack_first_changes_nothing_any_later_event_sees(events: list[tuple[Any, float]], l2: bool,
                                                        probe: bool) -> None:
    def make(ack_first: bool) -> LookupServer:
        return LookupServer(ServerConfig(chunk_size=C, num_slots=8, slot_bytes=64, l2_enabled=l2,
                                         l2_probe=l2 and probe, write_behind=l2, ack_first=ack_first))

    ref, eager, lazy = make(False), make(True), make(True)
    register = RegisterInstance(1, MODEL, 1, 10, reply_to=("setup",))
    for s in (ref, eager, lazy):
        s.handle(register, 0.0)
    ref_stream: list[Effect] = []
    lazy_stream: list[Effect] = []
    pending: list[Effect] = []  # copies and L2 steps the reference started, oldest first
    now = 0.0
    for i, (req, dt) in enumerate(events):
        now += dt
        if isinstance(req, str):
            if not pending:
                continue
            ev: Any = _completion(pending.pop(0), req == "complete")
        else:
            ev = attrs.evolve(req, reply_to=("r", i))
        got = ref.handle(ev, now)
        ref_stream += got
        pending += [e for e in got if isinstance(e, (StartTransfer, ReadL2, ProbeL2, WriteL2))]
        # run_deferred right after the ack: each event's effects and the state after are today's
        assert _norm(eager.handle(ev, now) + eager.run_deferred()) == _norm(got)
        assert _view(eager) == _view(ref)
        eager.check_invariants()
        # never run_deferred: the same effects in the same order, the work's coming one event
        # later; the state after any event but a lookup (whose work waits) is today's
        lazy_stream += lazy.handle(ev, now)
        lazy.check_invariants()
        if not lazy.deferred_work:
            assert _view(lazy) == _view(ref)
            assert _norm(lazy_stream) == _norm(ref_stream)
    lazy_stream += lazy.run_deferred()
    assert _norm(lazy_stream) == _norm(ref_stream)
    assert ref.stats()["internal_errors"] == 0
