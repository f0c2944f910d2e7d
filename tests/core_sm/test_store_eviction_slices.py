"""A store into a full L1 evicts an object per chunk; it makes at most ``STORE_EVICTION_SLICE``
evictions per loop turn and reserves the rest on the turns after (mpcache.core_sm.server_transfers):
a 2,048-chunk store into a full L1 held the loop 23 ms. The result is the unsliced store's;
between turns its objects are being written (a lookup stops before them, another store skips
them), and an instance that goes meanwhile gets its store refused with nothing left behind."""
from __future__ import annotations

import pytest

from mpcache.core_sm import server_transfers
from mpcache.core_sm.effects import StartTransfer
from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.messages import Lookup, QueryPrefetchStatus, Store, StoreResult, TransferFinished, UnregisterInstance

try:
    from .sm_helpers import ServerHarness, key, tokens
except ImportError:
    from sm_helpers import ServerHarness, key, tokens  # type: ignore[no-redef]

SLICE, CHUNKS = 8, 40


@pytest.fixture(autouse=True)
def _small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_transfers, "STORE_EVICTION_SLICE", SLICE, raising=False)


def _full() -> ServerHarness:
    """L1 full of objects of a gone instance; instance 2 registered, holding nothing."""
    h = ServerHarness(num_slots=CHUNKS)
    h.register(1)
    h.store(tokens(CHUNKS, seed=1), rid="old")
    h.call(UnregisterInstance(1))
    h.register(2)
    return h


def _drain(h: ServerHarness) -> int:
    turns = 0
    while h.server.deferred_work:
        deadline = h.server.next_deadline()
        assert deadline is not None and deadline <= h.now
        h.advance(0.0)
        turns += 1
    return turns


def _copies(h: ServerHarness) -> list[StartTransfer]:
    return [e for e in h.log if isinstance(e, StartTransfer)]


def test_each_turn_evicts_at_most_a_slice_and_the_store_stores_every_chunk() -> None:
    h = _full()
    copies = len(_copies(h))
    rt = h.send(Store(key("s", tokens(CHUNKS, seed=2), worker_id=0), 2))
    evictions = [h.server.stats()["evictions"]]
    assert evictions[0] <= SLICE and h.server.deferred_work
    assert len(_copies(h)) == copies  # its copy starts once every chunk has a slot
    while h.server.deferred_work:
        h.advance(0.0)
        evictions.append(h.server.stats()["evictions"])
    assert max(b - a for a, b in zip(evictions, evictions[1:])) <= SLICE
    assert evictions[-1] == CHUNKS
    (copy,) = _copies(h)[copies:]
    assert len(copy.placements) == CHUNKS
    h.finish_all_transfers()
    result = h.result(rt)
    assert isinstance(result, StoreResult) and result.ok and result.stored == CHUNKS


def test_a_lookup_and_a_store_of_the_same_chunks_between_turns() -> None:
    h = _full()
    toks = tokens(CHUNKS, seed=2)
    rt = h.send(Store(key("s", toks, worker_id=0), 2))
    h.send(Lookup(key("r", toks)))  # the first chunks are being written: no hit
    assert h.result(h.send(QueryPrefetchStatus("r"))) == 0
    h.register(3)
    other = h.send(Store(key("s2", toks, worker_id=0), 3))  # between turns: skips what the first is writing
    _drain(h)
    h.finish_all_transfers()
    first, second = h.result(rt), h.result(other)
    assert isinstance(first, StoreResult) and isinstance(second, StoreResult)
    assert first.stored + second.stored == CHUNKS and first.stored >= SLICE
    stats = h.server.stats()
    assert stats["writing"] == 0 and stats["objects"] == CHUNKS and stats["transfers"] == 0
    h.send(Lookup(key("r2", toks)))
    assert h.result(h.send(QueryPrefetchStatus("r2"))) == CHUNKS


def test_an_instance_gone_between_turns_gets_its_store_refused_and_nothing_left() -> None:
    h = _full()
    rt = h.send(Store(key("s", tokens(CHUNKS, seed=2), worker_id=0), 2))
    assert h.server.deferred_work
    h.call(UnregisterInstance(2))
    _drain(h)
    assert h.error_kind(rt) is ErrorKind.NOT_REGISTERED
    stats = h.server.stats()
    assert stats["writing"] == 0 and stats["transfers"] == 0 and stats["pinned_slots"] == 0
    assert not _copies(h)[1:]
    h.server.check_invariants()


def test_a_store_with_room_is_not_sliced() -> None:
    h = ServerHarness(num_slots=4 * CHUNKS)
    h.register(1)
    h.send(Store(key("s", tokens(CHUNKS, seed=2), worker_id=0), 1))
    assert not h.server.deferred_work
    (copy,) = h.transfers.values()
    h.feed(TransferFinished(copy.transfer_id, True))
