"""A random walk over a client/server pair on a lossy, reordering network.

Invariants: a lookup's answer never changes once given (until the request is cleaned up);
`check` is None only for a lookup in flight; both machines stay consistent; a worker reports an
engine-finished request in `sending` once, never in the same report as `recving`; at the end,
with every request ended and time passed, no lease, job or correlation survives, and every
worker is registered with its server again, however often the servers restarted (told by a new
epoch or not)."""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mpcache.core_sm.lookup_client import LookupState
from mpcache.core_sm.messages import (
    Cleanup,
    EndRequest,
    EngineFinished,
    FreeUnusedLeases,
    ServerEpoch,
    SubmitLookup,
    SubmitRetrieve,
    SubmitStore,
)
from sm_helpers import C, tokens
from sm_pair import Pair

RIDS = ["a", "b", "c"]
BASE = tokens(3)


class PairMachine(RuleBasedStateMachine):
    @initialize(servers=st.integers(1, 2), l2=st.booleans(), in_ack=st.booleans())
    def setup(self, servers: int, l2: bool, in_ack: bool) -> None:
        # in_ack: the lookup asks for its count in the ack (one round trip for an L1 hit)
        self.p = Pair(num_servers=servers, l2_enabled=l2, answer_in_ack=in_ack)
        self.p.store(BASE, end=2 * C)
        self.answers: dict[str, int] = {}
        self.submitted: set[str] = set()
        self.epochs = [0] * servers
        self.told = [-1] * servers
        for s in range(servers):
            self.tell_epoch(s)
        self.sent: list[set[str]] = [set() for _ in range(servers)]

    def tell_epoch(self, s: int) -> None:
        self.p.client("lookup", ServerEpoch(s, self.epochs[s]))
        self.p.client(f"w{s}", ServerEpoch(s, self.epochs[s]))
        if self.told[s] != self.epochs[s]:
            self.told[s] = self.epochs[s]
            self.p.reregister(s)  # the worker's link registers again on a first or new epoch

    @rule(s=st.integers(0, 1), tell=st.booleans())
    def restart(self, s: int, tell: bool) -> None:
        s %= len(self.p.servers)
        self.p.restart_server(s)
        self.epochs[s] += 1
        if tell:  # the heartbeat saw the new epoch; else only a NOT_REGISTERED can show it
            self.tell_epoch(s)

    @rule(rid=st.sampled_from(RIDS))
    def store(self, rid: str) -> None:
        for s in range(len(self.p.workers)):
            self.p.client(f"w{s}", SubmitStore(rid, BASE, 0, 2 * C, (0, 1, 2, 3)))

    @rule(rid=st.sampled_from(RIDS))
    def engine_finished(self, rid: str) -> None:
        for s in range(len(self.p.workers)):
            self.p.client(f"w{s}", EngineFinished((rid,)))

    @rule(rid=st.sampled_from(RIDS), n=st.integers(0, 3))
    def submit(self, rid: str, n: int) -> None:
        self.p.client("lookup", SubmitLookup(rid, BASE[: n * C + 1]))
        self.submitted.add(rid)

    @precondition(lambda self: bool(self.p.up))
    @rule(i=st.integers(0, 10), how=st.sampled_from(["deliver", "dup", "drop"]))
    def up(self, i: int, how: str) -> None:
        i %= len(self.p.up)
        if how == "drop":
            self.p.up.pop(i)
        else:
            self.p.to_server(i, duplicate=how == "dup")

    @precondition(lambda self: bool(self.p.down))
    @rule(i=st.integers(0, 10), how=st.sampled_from(["deliver", "dup", "drop"]))
    def down(self, i: int, how: str) -> None:
        i %= len(self.p.down)
        if how == "drop":
            self.p.down.pop(i)
        else:
            self.p.to_client(i, duplicate=how == "dup")

    @rule()
    def complete(self) -> None:
        self.p.complete()

    @rule(dt=st.sampled_from([0.005, 0.5, 3.0, 70.0]))
    def tick(self, dt: float) -> None:
        self.p.tick(dt)

    @rule(rid=st.sampled_from(RIDS))
    def cleanup(self, rid: str) -> None:
        self.p.client("lookup", Cleanup(rid))
        self.answers.pop(rid, None)
        self.submitted.discard(rid)

    @rule(rid=st.sampled_from(RIDS))
    def end(self, rid: str) -> None:
        self.p.client("lookup", EndRequest(rid))
        self.answers.pop(rid, None)
        self.submitted.discard(rid)

    @rule(rid=st.sampled_from(RIDS), a=st.integers(0, 2), b=st.integers(0, 2))
    def free(self, rid: str, a: int, b: int) -> None:
        start, end = sorted((a * C, b * C))
        self.p.client("lookup", FreeUnusedLeases(rid, BASE, start, end))

    @rule(rid=st.sampled_from(RIDS), n=st.integers(1, 3))
    def retrieve(self, rid: str, n: int) -> None:
        for s in range(len(self.p.workers)):
            self.p.client(f"w{s}", SubmitRetrieve(rid, BASE, 0, n * C, tuple(range(2 * n))))

    @invariant()
    def answers_are_stable(self) -> None:
        for rid in RIDS:
            got = self.p.lookup.check(rid)
            state = self.p.lookup.state(rid)
            assert (got is None) == (state in (LookupState.AWAITING_ACK, LookupState.QUERYING))
            if got is None:
                continue
            if rid in self.answers:
                assert got == self.answers[rid], f"{rid}: answer changed {self.answers[rid]} -> {got}"
            elif state is LookupState.DONE:
                self.answers[rid] = got
            assert got % C == 0 and got <= 2 * C
        self.p.lookup.check_invariants()
        for srv in self.p.servers:
            srv.check_invariants()
        for s, w in enumerate(self.p.workers):
            w.check_invariants()
            sending, recving = w.finished()
            assert not (sending & recving), "one request reported both ways"
            assert not (sending & self.sent[s]), f"{sending & self.sent[s]} reported sending twice"
            self.sent[s] |= sending

    def teardown(self) -> None:
        p = self.p
        for _ in range(12):  # liveness: everything resolves within the lookup timeout
            p.tick(0.5)
            p.run()
        for rid in RIDS:
            assert p.lookup.check(rid) is not None
            p.client("lookup", Cleanup(rid))
            p.client("lookup", EndRequest(rid))
        p.run()
        for s in range(len(p.servers)):
            self.tell_epoch(s)  # the next heartbeat after a silent restart
        p.run()
        p.tick(400.0)
        p.run()
        for s in range(len(p.servers)):
            p.reregister(s)  # the link's retry of a registration the network lost
        p.run()
        for w in p.workers:
            assert w.next_deadline() is None
        for srv in p.servers:
            assert srv.stats()["instances"] == 1
            s = srv.stats()
            assert s["leases_held"] == 0 and s["jobs"] == 0 and s["waiters"] == 0
            assert s["transfers"] == 0 and s["internal_errors"] == 0
        assert p.lookup.stats()["correlations"] == 0 and p.lookup.stats()["active"] == 0


PairMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestPairMachine = PairMachine.TestCase
