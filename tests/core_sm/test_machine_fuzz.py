"""Wild input never escapes `handle` as an exception, and every server request is answered once.

Well-typed but wild values (negative, huge, unaligned, odd strings) must be handled by the
protocol itself (no internal error); wrongly typed values must still be answered."""
from __future__ import annotations

from typing import Any

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from mpcache.core_sm.effects import AttachInstance, ErrorReply, Reply
from mpcache.core_sm.errors import ErrorKind, ProtocolError
from mpcache.core_sm.lookup_client import LookupClient, LookupClientConfig
from mpcache.core_sm.messages import (
    InstanceAttached,
    Abort,
    CacheKey,
    Cleanup,
    Clear,
    CommitTransfer,
    CopyFinished,
    EndRequest,
    EndSession,
    EngineFinished,
    FreeLookupLocks,
    FreeUnusedLeases,
    GetChunkSize,
    L2ProbeFinished,
    L2ReadFinished,
    L2WriteFinished,
    Lookup,
    Ping,
    PrepareRetrieve,
    PrepareStore,
    QueryPrefetchStatus,
    RegisterInstance,
    ReplyReceived,
    RequestFailed,
    Retrieve,
    ServerEpoch,
    ServerHealth,
    Store,
    SubmitLookup,
    SubmitRetrieve,
    SubmitStore,
    TimerFired,
    TransferFinished,
    UnregisterInstance,
    WaitPrefetchStatus,
)
from mpcache.core_sm.server import LookupServer, ServerConfig
from mpcache.core_sm.transfer_client import TransferClient, TransferClientConfig

C = 4
ints = st.one_of(st.integers(-3, 20), st.sampled_from([2**31, 2**40, -(2**40)]))
small = st.integers(-2, 12)
names = st.sampled_from(["m", "", "a/b", "x" * 200, "ü\x00"])
rids = st.sampled_from(["r", "s", "", "t" * 300])
salts = st.sampled_from(["", "s", "bad@", "x" * 129])
toks = st.lists(st.integers(-1, 2**32), max_size=3 * C + 2).map(tuple)
good_toks = st.lists(st.integers(0, 5), max_size=3 * C + 2).map(tuple)
floats = st.sampled_from([0.0, -1.0, 0.5, 1e9, float("inf"), float("nan")])

keys = st.builds(CacheKey, names, small, st.one_of(st.none(), small), st.one_of(good_toks, toks),
                 small, small, rids, salts)
server_requests = st.one_of(
    st.builds(Ping), st.builds(GetChunkSize),
    st.builds(Lookup, keys, st.integers(0, 3),
              st.one_of(st.none(), st.lists(st.integers(-1, 3), max_size=3).map(tuple))),
    st.builds(QueryPrefetchStatus, rids),
    st.builds(WaitPrefetchStatus, rids, floats),
    st.builds(FreeLookupLocks, keys),
    st.builds(EndSession, rids),
    st.builds(Clear, st.booleans()),
    st.builds(RegisterInstance, small, names, small, ints, st.booleans()),
    st.builds(UnregisterInstance, small),
    st.builds(Store, keys, small, st.lists(ints, max_size=4).map(tuple)),
    st.builds(Retrieve, keys, small, st.lists(ints, max_size=4).map(tuple), st.integers(0, 20)),
    st.builds(PrepareStore, keys, small),
    st.builds(PrepareRetrieve, keys, small, st.integers(0, 20)),
    st.builds(CommitTransfer, ints, st.booleans()),
)
server_internal = st.one_of(
    st.builds(TransferFinished, ints, st.booleans()),
    st.builds(L2ReadFinished, ints, st.lists(st.booleans(), max_size=5).map(tuple)),
    st.builds(L2ProbeFinished, ints, st.lists(st.booleans(), max_size=5).map(tuple)),
    st.builds(L2WriteFinished, ints, st.booleans()),
    # a wild (stale or forged) attach answer: counted stale, or answers a registration it names
    st.builds(InstanceAttached, ints, ints,
              st.one_of(st.none(), st.builds(ProtocolError, st.sampled_from(ErrorKind), st.text(max_size=5)))),
    st.builds(TimerFired),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.one_of(server_requests, server_internal), st.sampled_from([0.0, 1.0, 100.0])),
                max_size=40),
       st.booleans(), st.booleans())
def test_server_survives_wild_input(events: list[tuple[Any, float]], l2: bool, probe: bool) -> None:
    s = LookupServer(ServerConfig(chunk_size=C, num_slots=8, slot_bytes=64, l2_enabled=l2,
                                  write_behind=l2, l2_probe=probe))
    def handle(ev: Any, now: float) -> list[Any]:
        """As a runtime: an AttachInstance is answered (here: accepted) before the next event."""
        out = s.handle(ev, now)
        for e in list(out):
            if isinstance(e, AttachInstance):
                out += handle(InstanceAttached(e.instance_id, e.registration_id, None, reply_to=e.reply_to), now)
        return out

    handle(RegisterInstance(1, "m", 1, 10, reply_to=("setup",)), 0.0)
    now = 0.0
    replies: dict[Any, int] = {}
    sent = []
    for i, (ev, dt) in enumerate(events):
        now += dt
        if type(ev) is InstanceAttached:
            ev = attrs.evolve(ev, reply_to=("wild", i))  # the registration it would answer
        elif hasattr(ev, "reply_to"):
            ev = attrs.evolve(ev, reply_to=i)
            sent.append(i)
        for e in handle(ev, now):
            if isinstance(e, (Reply, ErrorReply)):
                replies[e.reply_to] = replies.get(e.reply_to, 0) + 1
                if isinstance(e, ErrorReply) and type(ev) is not InstanceAttached:  # a runtime's error is its own
                    assert e.error.kind is not ErrorKind.INTERNAL, e
        s.check_invariants()
    assert s.stats()["internal_errors"] == 0
    # finish everything still in flight: then every request has exactly one reply
    for e in s.handle(TimerFired(), now + 1e6):
        if isinstance(e, (Reply, ErrorReply)):
            replies[e.reply_to] = replies.get(e.reply_to, 0) + 1
    assert all(n == 1 for n in replies.values())
    deferred = s.stats()["transfers"]  # server-driven transfers wait for the runtime
    assert len([i for i in sent if i not in replies]) <= deferred


def test_server_answers_wrongly_typed_requests() -> None:
    s = LookupServer(ServerConfig(chunk_size=C))
    bad: list[Any] = [
        EndSession(["unhashable"]),  # type: ignore[arg-type]
        QueryPrefetchStatus(None),  # type: ignore[arg-type]
        Lookup(CacheKey("m", 1, None, (1.5,) * C, 0, C, "r")),  # type: ignore[arg-type]
        Store(CacheKey("m", 1, "0", (1,) * C, 0, C, "r"), None),  # type: ignore[arg-type]
        Clear("yes"),  # type: ignore[arg-type]
    ]
    for i, ev in enumerate(bad):
        out = s.handle(attrs.evolve(ev, reply_to=i), 0.0)
        assert len([e for e in out if getattr(e, "reply_to", None) == i]) == 1
        s.check_invariants()


client_events = st.one_of(
    st.builds(SubmitLookup, rids, st.one_of(good_toks, toks), salts),
    st.builds(ReplyReceived, st.integers(-1, 2), st.integers(0, 30),
              st.one_of(st.none(), ints, st.booleans(), st.text(max_size=2))),
    st.builds(RequestFailed, st.integers(-1, 2), st.integers(0, 30),
              st.just(ProtocolError(ErrorKind.TIMEOUT))),
    st.builds(ServerHealth, st.integers(-1, 2), st.booleans()),
    st.builds(ServerEpoch, st.integers(-1, 2), st.sampled_from([1, 2, "x"])),
    st.builds(Cleanup, rids), st.builds(EndRequest, rids),
    st.builds(FreeUnusedLeases, rids, good_toks, small, small, salts),
    st.builds(TimerFired),
    st.builds(SubmitStore, rids, good_toks, small, small, st.lists(ints, max_size=4).map(tuple), salts),
    st.builds(SubmitRetrieve, rids, good_toks, small, small, st.lists(ints, max_size=4).map(tuple),
              st.integers(0, 20), salts),
    st.builds(CopyFinished, st.tuples(rids, st.integers(0, 30)), st.booleans()),
    st.builds(Abort, rids),
    st.builds(EngineFinished, st.lists(rids, max_size=3).map(tuple)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(client_events, st.sampled_from([0.0, 0.01, 10.0, 1000.0])), max_size=40),
       st.integers(1, 2), st.booleans())
def test_clients_survive_wild_input(events: list[tuple[Any, float]], n: int, engine: bool) -> None:
    lc = LookupClient(LookupClientConfig(num_servers=n, chunk_size=C))
    tc = TransferClient(TransferClientConfig(chunk_size=C, engine_driven=engine, op_timeout=5.0))
    now = 0.0
    for ev, dt in events:
        now += dt
        lc.handle(ev, now)
        tc.handle(ev, now)
        lc.check_invariants()
        tc.check_invariants()
        for rid in ("r", "s"):
            assert lc.check(rid) is None or isinstance(lc.check(rid), int)
        sending, recving = tc.finished()
        assert not (sending & recving)
    assert lc.stats()["internal_errors"] == 0 and tc.stats()["internal_errors"] == 0
