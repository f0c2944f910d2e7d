"""A store or retrieve of many chunks takes its L1 slots, finishes its writes and takes its copy
leases as batches of the L1 index (``reserve_writes``, ``finish_writes``, ``lease_slots``): one
expiry step and one expiry entry per batch, not one per chunk (a 2,048-chunk store held the loop
13 ms, ~4 us a chunk). The batch forms do exactly what the per-key forms do."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpcache.core_sm.chunks import ObjectKey
from mpcache.core_sm.l1_index import L1Index
from mpcache.core_sm.messages import Retrieve, Store, TransferFinished

try:
    from .sm_helpers import ServerHarness, key, tokens
except ImportError:
    from sm_helpers import ServerHarness, key, tokens  # type: ignore[no-redef]

CHUNKS = 200


@contextmanager
def _counting_expiry_steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    calls = [0]
    expire = L1Index.expire

    def counted(self: L1Index, now: float) -> None:
        calls[0] += 1
        expire(self, now)

    monkeypatch.setattr(L1Index, "expire", counted)
    yield calls


def _harness() -> ServerHarness:
    h = ServerHarness(num_slots=4 * CHUNKS)
    h.register(1)
    return h


def test_a_store_reserves_and_finishes_its_chunks_as_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    h = _harness()
    toks = tokens(CHUNKS, seed=9)
    entries = len(h.server.index._expiries)
    with _counting_expiry_steps(monkeypatch) as calls:
        rt = h.send(Store(key("s", toks, worker_id=0), 1))
        assert calls[0] <= 8, calls  # per chunk: 200 and more
        assert len(h.server.index._expiries) - entries == 1  # one entry for the 200 reservations
        calls[0] = 0
        h.finish_all_transfers()
        assert calls[0] <= 8, calls
    assert h.result(rt).stored == CHUNKS  # type: ignore[attr-defined]
    assert h.server.index.stats()["objects"] == CHUNKS


def test_a_retrieve_leases_and_releases_its_chunks_as_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    h = _harness()
    toks = tokens(CHUNKS, seed=9)
    h.store(toks, rid="s")
    entries = len(h.server.index._expiries)
    with _counting_expiry_steps(monkeypatch) as calls:
        rt = h.send(Retrieve(key("s", toks, worker_id=0), 1))
        assert calls[0] <= 8, calls
        assert len(h.server.index._expiries) - entries == 1
        calls[0] = 0
        (tid,) = h.transfers
        del h.transfers[tid]
        h.feed(TransferFinished(tid, True))
        assert calls[0] <= 8, calls
    assert h.result(rt).ok  # type: ignore[attr-defined]
    assert h.server.index.stats()["leases_held"] == 0


def test_a_store_into_a_full_l1_still_evicts_for_each_chunk() -> None:
    h = ServerHarness(num_slots=CHUNKS)
    h.register(1)
    h.store(tokens(CHUNKS, seed=1), rid="a")
    h.store(tokens(CHUNKS, seed=2), rid="b")  # every chunk evicts one of a's
    stats = h.server.index.stats()
    assert stats["objects"] == CHUNKS and stats["evictions"] == CHUNKS


_ops = st.lists(st.tuples(st.sampled_from(["reserve", "finish", "abort"]),
                          st.lists(st.integers(0, 11), max_size=6), st.sampled_from(["a", "b"])),
                max_size=12)


@settings(max_examples=150, deadline=None)
@given(ops=_ops, slots=st.integers(0, 8), limit=st.one_of(st.none(), st.integers(0, 6)))
def test_the_batch_forms_are_the_per_key_forms(ops: list[tuple[str, list[int], str]], slots: int,
                                               limit: int | None) -> None:
    batch, single = L1Index(slots, 4), L1Index(slots, 4)
    single.quota.tenant_share = batch.quota.tenant_share = max(1, slots // 2)
    for t, (op, ids, owner) in enumerate(ops):
        keys = [ObjectKey(i.to_bytes(4, "little"), i % 2) for i in ids]
        now = float(t)
        if op == "reserve":
            got = batch.reserve_writes(keys, owner, 4, now, owner, limit)
            want: list[int | None] = []
            for k in keys:
                if limit is not None and sum(s is not None for s in want) >= limit:
                    break
                want.append(single.reserve_write(k, owner, 4, now, owner))
            assert got == want
        elif op == "finish":
            done = batch.finish_writes(keys, owner, now)
            assert done == [k for k in keys if single.finish_write(k, owner, now)]
        else:
            assert batch.abort_writes(keys, owner, now) == sum(single.abort_write(k, owner, now) for k in keys)
        batch.check_invariants()
        assert batch.stats() == single.stats()
        assert {k: batch.slot_of(k) for k in batch.objects()} == {k: single.slot_of(k) for k in single.objects()}
        assert [batch.state(k) for k in batch.objects()] == [single.state(k) for k in batch.objects()]


class _CountingGets(dict):  # type: ignore[type-arg]
    gets = 0

    def get(self, k, default=None):  # type: ignore[no-untyped-def, override]
        _CountingGets.gets += 1
        return super().get(k, default)


def test_a_finished_batch_s_expiry_entry_is_dropped_without_walking_its_keys() -> None:
    idx = L1Index(256, 4, lease_ttl=10.0)
    keys = [ObjectKey(i.to_bytes(4, "little"), 0) for i in range(200)]
    assert None not in idx.reserve_writes(keys, "w", 4, 0.0)
    assert len(idx.finish_writes(keys, "w", 1.0)) == 200
    idx._objects = _CountingGets(idx._objects)
    _CountingGets.gets = 0
    assert idx.next_expiry() is None  # the stale entry goes, its 200 keys unread
    idx.expire(10.0)
    assert _CountingGets.gets == 0
    idx.check_invariants()


def test_a_batch_s_unfinished_writes_still_expire() -> None:
    idx = L1Index(256, 4, lease_ttl=10.0)
    keys = [ObjectKey(i.to_bytes(4, "little"), 0) for i in range(20)]
    idx.reserve_writes(keys, "w", 4, 0.0)
    idx.finish_writes(keys[:15], "w", 1.0)
    idx.abort_writes(keys[15:17], "w", 1.0)
    idx.expire(10.0)
    assert idx.stats()["write_expirations"] == 3 and idx.stats()["objects"] == 15
    idx.check_invariants()
