"""A random walk over LookupServer with its invariants checked after every step."""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mpcache.core_sm.effects import ErrorReply, Reply
from mpcache.core_sm.messages import (
    Clear,
    CommitTransfer,
    EndSession,
    FreeLookupLocks,
    L2ProbeFinished,
    L2ReadFinished,
    L2WriteFinished,
    Lookup,
    PrepareRetrieve,
    PrepareStore,
    QueryPrefetchStatus,
    Retrieve,
    Store,
    TransferFinished,
    TransferPlan,
    WaitPrefetchStatus,
)
from mpcache.core_sm.server import JobState, ServerConfig
from sm_helpers import C, ServerHarness, key, tokens

RIDS = ["a", "b", "c"]
BASE = tokens(4)
# Sequences sharing 0..4 leading chunks with BASE, so requests contend for the same objects.
SEQS = [BASE[: k * C] + tokens(4 - k, seed=k + 1) for k in range(5)]


class ServerMachine(RuleBasedStateMachine):
    @initialize(
        slots=st.integers(2, 24),
        l2=st.booleans(),
        write_behind=st.booleans(),
        engine=st.booleans(),
        probe=st.booleans(),
    )
    def setup(self, slots: int, l2: bool, write_behind: bool, engine: bool, probe: bool) -> None:
        cfg = ServerConfig(chunk_size=C, num_slots=slots, slot_bytes=100, lease_ttl=300.0,
                           tombstone_ttl=60.0, abandoned_job_ttl=60.0, l2_enabled=l2, l2_probe=probe,
                           l2_read_timeout=30.0, write_behind=write_behind, tombstone_cap=1000)
        self.h = ServerHarness(cfg)
        self.h.register(engine_driven=engine)
        self.answered: dict[str, tuple[int, float]] = {}  # rid -> (answer, valid until)
        self.plans: list[int] = []

    # ---- helpers
    def _status_reply(self, rid: str, result: object) -> None:
        if result is None:
            assert self.h.server.job_state(rid) is JobState.PENDING, "None for a non-pending id"
            return
        assert isinstance(result, int) and result >= 0
        prev = self.answered.get(rid)
        if prev is not None and self.h.now < prev[1]:
            assert result == prev[0], f"answer for {rid} changed {prev[0]} -> {result}"
        elif self.h.server.job_state(rid) is JobState.ANSWERED:
            self.answered[rid] = (result, self.h.now + 60.0)

    def _on_deferred(self) -> None:
        # waiters answered later go through the same check
        pass

    # ---- rules
    @rule(rid=st.sampled_from(RIDS), seq=st.integers(0, 4), readers=st.integers(1, 2))
    def lookup(self, rid: str, seq: int, readers: int) -> None:
        if self.h.server.job_state(rid) is JobState.ANSWERED:
            self.answered.pop(rid, None)  # a new lookup starts a new job
        held_before = self.h.server.leases_of(rid)
        live = self.h.server.job_state(rid) in (JobState.PENDING, JobState.DONE)
        assert self.h.call(Lookup(key(rid, SEQS[seq]), readers)) is None
        if live:  # duplicate: no new leases
            assert self.h.server.leases_of(rid) == held_before

    @rule(rid=st.sampled_from(RIDS + ["never"]))
    def query(self, rid: str) -> None:
        self._status_reply(rid, self.h.call(QueryPrefetchStatus(rid)))

    @rule(rid=st.sampled_from(RIDS), timeout=st.sampled_from([0.0, 1.0, 50.0]))
    def wait(self, rid: str, timeout: float) -> None:
        rt = self.h.send(WaitPrefetchStatus(rid, timeout))
        r = self.h.reply(rt)
        if r is not None:
            assert isinstance(r, Reply)
            self._status_reply(rid, r.result)

    @rule(rid=st.sampled_from(RIDS), seq=st.integers(0, 4), a=st.integers(0, 4), b=st.integers(0, 4))
    def free(self, rid: str, seq: int, a: int, b: int) -> None:
        start, end = sorted((a * C, b * C))
        before = dict(self.h.server.leases_by_owner())
        assert self.h.call(FreeLookupLocks(key(rid, SEQS[seq], start, end))) is None
        after = self.h.server.leases_by_owner()
        for owner, n in before.items():
            if owner != (None, rid):
                assert after.get(owner, 0) == n, "FREE touched another owner's leases"

    @rule(rid=st.sampled_from(RIDS))
    def end_session(self, rid: str) -> None:
        assert self.h.call(EndSession(rid)) is None
        self.answered.pop(rid, None)
        assert self.h.server.leases_of(rid) == 0
        assert self.h.server.job_state(rid) is JobState.ABSENT

    @rule(seq=st.integers(0, 4), a=st.integers(0, 4), b=st.integers(0, 4), engine=st.booleans())
    def store(self, seq: int, a: int, b: int, engine: bool) -> None:
        start, end = sorted((a * C, b * C))
        k = key("w", SEQS[seq], start, end, worker_id=0)
        if engine:
            r = self.h.call(PrepareStore(k, 1))
            assert isinstance(r, TransferPlan) and r.ok
            self.plans.append(r.transfer_id)
        else:
            self.h.send(Store(k, 1))

    @rule(rid=st.sampled_from(RIDS), seq=st.integers(0, 4), a=st.integers(0, 4), b=st.integers(0, 4),
          engine=st.booleans())
    def retrieve(self, rid: str, seq: int, a: int, b: int, engine: bool) -> None:
        start, end = sorted((a * C, b * C))
        k = key(rid, SEQS[seq], start, end, worker_id=0)
        if engine:
            r = self.h.call(PrepareRetrieve(k, 1))
            assert isinstance(r, TransferPlan)
            if r.ok:
                self.plans.append(r.transfer_id)
        else:
            self.h.send(Retrieve(k, 1))

    @precondition(lambda self: hasattr(self, "h") and bool(self.h.transfers))
    @rule(data=st.data(), ok=st.booleans())
    def finish_transfer(self, data: st.DataObject, ok: bool) -> None:
        tid = data.draw(st.sampled_from(sorted(self.h.transfers)))
        del self.h.transfers[tid]
        self.h.feed(TransferFinished(tid, ok))

    @precondition(lambda self: hasattr(self, "h") and bool(self.plans))
    @rule(data=st.data(), ok=st.booleans())
    def commit(self, data: st.DataObject, ok: bool) -> None:
        from mpcache.core_sm.errors import ErrorKind
        from mpcache.core_sm.server import TransferState

        tid = data.draw(st.sampled_from(self.plans))
        self.plans.remove(tid)
        expired = self.h.server.transfer_state(tid) is TransferState.ABSENT
        rt = self.h.send(CommitTransfer(tid, ok))
        if expired:
            assert self.h.error_kind(rt) is ErrorKind.UNKNOWN_TRANSFER
            self.h.log.remove(self.h.reply(rt))
        else:
            assert isinstance(self.h.reply(rt), Reply)

    @precondition(lambda self: hasattr(self, "h") and bool(self.h.reads))
    @rule(data=st.data())
    def finish_read(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.h.reads)))
        read = self.h.reads.pop(rid)
        loaded = data.draw(st.lists(st.booleans(), min_size=len(read.items), max_size=len(read.items)))
        self.h.feed(L2ReadFinished(rid, tuple(loaded)))

    @precondition(lambda self: hasattr(self, "h") and bool(self.h.probes))
    @rule(data=st.data())
    def finish_probe(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(self.h.probes)))
        probe = self.h.probes.pop(pid)
        present = data.draw(st.lists(st.booleans(), min_size=len(probe.keys), max_size=len(probe.keys)))
        self.h.feed(L2ProbeFinished(pid, tuple(present)))

    @precondition(lambda self: hasattr(self, "h") and bool(self.h.writes))
    @rule(data=st.data(), ok=st.booleans())
    def finish_write(self, data: st.DataObject, ok: bool) -> None:
        wid = data.draw(st.sampled_from(sorted(self.h.writes)))
        del self.h.writes[wid]
        self.h.feed(L2WriteFinished(wid, ok))

    @rule(dt=st.sampled_from([0.5, 5.0, 29.0, 61.0, 301.0]))
    def tick(self, dt: float) -> None:
        self.h.advance(dt)
        for rid, (_v, until) in list(self.answered.items()):
            if self.h.now >= until:
                del self.answered[rid]
        for rid in list(self.answered):
            if self.h.server.job_state(rid) is not JobState.ANSWERED:
                del self.answered[rid]

    @rule(force=st.booleans())
    def clear(self, force: bool) -> None:
        assert self.h.call(Clear(force, admin=True)) is None

    # ---- invariants
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "h"):
            return
        s = self.h.server
        s.check_invariants()  # includes the lease ledger: taken == held + released once each
        st_ = s.stats()
        assert st_["internal_errors"] == 0
        assert all(n > 0 for n in s.leases_by_owner().values())
        assert st_["leases_held"] >= 0 and st_["bytes"] == st_["objects"] * 10
        for e in self.h.log:
            if isinstance(e, ErrorReply):
                raise AssertionError(f"valid input refused: {e}")

    def teardown(self) -> None:
        if not hasattr(self, "h"):
            return
        # Drive every pending piece of work home: then every request has had its one reply.
        for tid in list(self.plans):
            self.h.send(CommitTransfer(tid, True))  # expired ones get UNKNOWN_TRANSFER: still one reply
        self.h.finish_all_transfers()
        for pid, probe in list(self.h.probes.items()):
            self.h.feed(L2ProbeFinished(pid, (True,) * len(probe.keys)))
        for rid, read in list(self.h.reads.items()):
            self.h.feed(L2ReadFinished(rid, (True,) * len(read.items)))
        for wid in list(self.h.writes):
            self.h.feed(L2WriteFinished(wid, True))
        self.h.advance(10_000.0)
        assert self.h.outstanding == set(), f"unanswered requests {self.h.outstanding}"
        s = self.h.server.stats()
        assert s["leases_held"] == 0 and s["jobs"] == 0 and s["waiters"] == 0
        assert s["transfers"] == 0 and s["tombstones"] == 0


ServerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=35, deadline=None)
TestServerMachine = ServerMachine.TestCase
