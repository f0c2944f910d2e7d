"""A lookup's L2 step is walked a slice of ``L2_SLICE_OBJECTS`` objects per loop turn
(mpcache.core_sm.server_l2 / server_jobs): gathering what to probe, reserving what to read after
the probe answered, and landing the finished read while its job's extension is leased. No turn
walks more than a slice (a 65,536-object probe answer held the loop 400 ms), the results are
those of one walk, and messages between two turns -- an end session, a free, another lookup of
the same keys, a store of them -- leave nothing leaked and no lease counted twice."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from mpcache.core_sm import server_l2
from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.l1_index import L1Index, ObjectState
from mpcache.core_sm.messages import (
    EndSession,
    FreeLookupLocks,
    L2ProbeFinished,
    L2ReadFinished,
    Lookup,
    QueryPrefetchStatus,
)

try:
    from .sm_helpers import ServerHarness, key, tokens
except ImportError:
    from sm_helpers import ServerHarness, key, tokens  # type: ignore[no-redef]

SLICE, RANKS, CHUNKS = 16, 4, 40  # 160 objects, 4 chunks x 4 ranks a slice


@pytest.fixture(autouse=True)
def _small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_l2, "L2_SLICE_OBJECTS", SLICE, raising=False)


@pytest.fixture
def walked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """(index method, objects it was handed) for every walk step of the L1 index."""
    calls: list[tuple[str, int]] = []
    for name in ("unreadable", "reserve_writes", "finish_writes", "readable_prefix"):
        method = getattr(L1Index, name, None)
        if method is None:
            continue

        def counted(self: L1Index, first: Any, *args: Any, _m: Any = method, _n: str = name, **kw: Any) -> Any:
            items = list(first)
            n = len(items) * (len(args[0]) if _n in ("unreadable", "readable_prefix") else 1)
            calls.append((_n, n))
            return _m(self, items, *args, **kw)

        monkeypatch.setattr(L1Index, name, counted)
    return calls


def _drain(h: ServerHarness) -> int:
    turns = 0
    while h.server.deferred_work:
        deadline = h.server.next_deadline()
        assert deadline is not None and deadline <= h.now  # a quiet server's timer runs the rest
        h.advance(0.0)
        turns += 1
    return turns


def _lookup(h: ServerHarness, rid: str, toks: Sequence[int]) -> None:
    h.send(Lookup(key(rid, tuple(toks), world_size=RANKS)))


def _answer_probe(h: ServerHarness) -> None:
    probe = h.probes.pop(max(h.probes))
    h.feed(L2ProbeFinished(probe.probe_id, (True,) * len(probe.keys)))


def _answer_read(h: ServerHarness, loaded: bool = True) -> None:
    read = h.reads.pop(max(h.reads))
    h.feed(L2ReadFinished(read.read_id, (loaded,) * len(read.items)))


def _harness() -> ServerHarness:
    return ServerHarness(num_slots=1024, l2_enabled=True, l2_probe=True)


def test_each_turn_walks_at_most_a_slice_and_the_lookup_hits_every_chunk(walked: list[tuple[str, int]]) -> None:
    h, toks = _harness(), tokens(CHUNKS, seed=4)
    _lookup(h, "r", toks)
    assert not h.probes  # the probe's keys are gathered over the turns to come
    _drain(h)
    (probe,) = h.probes.values()
    assert len(probe.keys) == CHUNKS * RANKS
    _answer_probe(h)
    assert not h.reads and h.server.deferred_work
    _drain(h)
    (read,) = h.reads.values()
    assert len(read.items) == CHUNKS * RANKS
    _answer_read(h)
    assert h.result(h.send(QueryPrefetchStatus("r"))) is None  # still landing
    _drain(h)
    assert h.result(h.send(QueryPrefetchStatus("r"))) == CHUNKS
    assert h.server.leases_of("r") == CHUNKS * RANKS
    assert walked and max(n for _name, n in walked) <= SLICE, walked
    assert sum(n for name, n in walked if name == "reserve_writes") == CHUNKS * RANKS
    assert sum(n for name, n in walked if name == "finish_writes") == CHUNKS * RANKS


def test_a_read_whose_objects_do_not_load_ends_the_hits_where_they_stop() -> None:
    h, toks = _harness(), tokens(CHUNKS, seed=4)
    _lookup(h, "r", toks)
    _drain(h)
    _answer_probe(h)
    _drain(h)
    read = h.reads.pop(max(h.reads))
    loaded = tuple(i < 10 * RANKS + 2 for i in range(len(read.items)))  # chunk 10 partly
    h.feed(L2ReadFinished(read.read_id, loaded))
    _drain(h)
    assert h.result(h.send(QueryPrefetchStatus("r"))) == 10
    assert h.server.leases_of("r") == 10 * RANKS
    stats = h.server.stats()
    assert stats["objects"] == 10 * RANKS + 2 and stats["writing"] == 0 and stats["pinned_slots"] == 0


def test_an_end_session_while_the_read_is_planned_lets_it_land_for_no_one() -> None:
    h, toks = _harness(), tokens(CHUNKS, seed=4)
    _lookup(h, "r", toks)
    _drain(h)
    _answer_probe(h)
    assert h.server.deferred_work and not h.reads
    h.send(EndSession("r"))  # between two turns of the read's walk
    _drain(h)
    (read,) = h.reads.values()  # what was reserved is read, for no one
    assert 0 < len(read.items) < CHUNKS * RANKS
    _answer_read(h)
    _drain(h)
    stats = h.server.stats()
    assert stats["leases_held"] == 0 and stats["writing"] == 0 and stats["pinned_slots"] == 0
    assert stats["objects"] == len(read.items)
    assert h.result(h.send(QueryPrefetchStatus("r"))) == 0


def test_lookups_and_a_free_between_landing_turns() -> None:
    h, toks = _harness(), tokens(CHUNKS, seed=4)
    _lookup(h, "r", toks)
    _drain(h)
    _answer_probe(h)
    _drain(h)
    _answer_read(h)
    # between two landing turns: a lookup of the same keys sees the landed prefix only ...
    h.server.run_deferred()
    _lookup(h, "other", toks)
    # ... and the first request frees its chunks 20.. (C = 4 tokens)
    h.send(FreeLookupLocks(key("r", tuple(toks), start=20 * 4, world_size=RANKS)))
    _drain(h)
    assert h.result(h.send(QueryPrefetchStatus("r"))) == CHUNKS  # freed chunks still count
    assert h.server.leases_of("r") == 20 * RANKS  # none of the freed chunks is held
    other = h.server.leases_of("other")
    assert 0 < other < CHUNKS * RANKS  # its prefix stopped at an object still landing
    # a third lookup after the landing sees every chunk in L1
    _lookup(h, "third", toks)
    _drain(h)
    assert h.result(h.send(QueryPrefetchStatus("third"))) == CHUNKS
    assert h.server.leases_of("third") == CHUNKS * RANKS
    h.server.check_invariants()


def test_a_store_of_the_same_chunks_between_landing_turns_reserves_nothing_twice() -> None:
    h, toks = _harness(), tokens(CHUNKS, seed=4)
    h.register(1, world_size=RANKS)
    _lookup(h, "r", toks)
    _drain(h)
    _answer_probe(h)
    _drain(h)
    _answer_read(h)
    h.server.run_deferred()
    writing = [k for k in h.server.index.objects() if h.server.index.state(k) is ObjectState.WRITING]
    assert writing  # some objects still land
    result = h.store(tuple(toks), worker_id=0, world_size=RANKS)
    assert result.stored == 0  # type: ignore[attr-defined]  # in L1 or landing: skipped
    _drain(h)
    assert h.result(h.send(QueryPrefetchStatus("r"))) == CHUNKS
    assert h.server.stats()["writing"] == 0
    assert all(h.server.index.state(ObjectKey(k.chunk_hash, k.kv_rank)) is not ObjectState.ABSENT
               for k in writing)
