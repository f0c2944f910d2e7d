"""A lookup naming more objects than ``LEASE_SLICE_OBJECTS`` leases its L1 prefix a slice per loop
turn (mpcache.core_sm.server_jobs): no turn leases more than a slice, the server's deadline is due
while slices are left, and the finished lookup holds exactly what an unsliced one holds. Events
in between see a pending job: an end session drops it with nothing left held, a free of its
range is honoured by the slices still to come."""
from __future__ import annotations

import pytest

from mpcache.core_sm import server_jobs
from mpcache.core_sm.messages import EndSession, FreeLookupLocks, Lookup, QueryPrefetchStatus

try:
    from .sm_helpers import ServerHarness, key, tokens
except ImportError:
    from sm_helpers import ServerHarness, key, tokens  # type: ignore[no-redef]

RANKS, CHUNKS, SLICE = 4, 64, 32  # 256 objects, 8 chunks x 4 ranks a slice


def _stored() -> tuple[ServerHarness, tuple[int, ...]]:
    h = ServerHarness(num_slots=1024)
    h.register(1, world_size=RANKS)
    toks = tokens(CHUNKS, seed=5)
    for r in range(RANKS):
        h.store(toks, worker_id=r, world_size=RANKS)
    return h, toks


@pytest.fixture(autouse=True)
def _small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_jobs, "LEASE_SLICE_OBJECTS", SLICE)


def test_each_turn_leases_at_most_a_slice_and_the_result_is_the_whole_prefix() -> None:
    h, toks = _stored()
    h.send(Lookup(key("r", toks, world_size=RANKS), num_readers=2))
    held = [h.server.leases_of("r")]
    assert h.server.deferred_work
    assert h.result(h.send(QueryPrefetchStatus("r"))) is None  # pending meanwhile (one more slice ran)
    held.append(h.server.leases_of("r"))
    while h.server.deferred_work:
        deadline = h.server.next_deadline()
        assert deadline is not None and deadline <= h.now  # a quiet server's timer runs the rest
        h.advance(0.0)
        held.append(h.server.leases_of("r"))
    steps = [b - a for a, b in zip(held, held[1:])]
    # each turn runs one slice (2 counts x 32 objects)
    assert steps == [2 * SLICE] * (CHUNKS * RANKS // SLICE - 1), steps
    assert h.result(h.send(QueryPrefetchStatus("r"))) == CHUNKS
    assert h.server.leases_of("r") == 2 * CHUNKS * RANKS


def test_with_large_slices_the_same_lookup_is_leased_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_jobs, "LEASE_SLICE_OBJECTS", 1 << 20)
    h, toks = _stored()
    h.send(Lookup(key("r", toks, world_size=RANKS), num_readers=2))
    assert not h.server.deferred_work
    assert h.result(h.send(QueryPrefetchStatus("r"))) == CHUNKS
    assert h.server.leases_of("r") == 2 * CHUNKS * RANKS


def test_an_end_session_between_slices_leaves_nothing_held() -> None:
    h, toks = _stored()
    h.send(Lookup(key("r", toks, world_size=RANKS)))
    assert h.server.deferred_work and h.server.leases_of("r") > 0
    h.send(EndSession("r"))
    while h.server.deferred_work:
        h.advance(0.0)
    assert h.server.leases_of("r") == 0 and not h.server.leases_by_owner()
    assert h.result(h.send(QueryPrefetchStatus("r"))) == 0


def test_a_free_between_slices_is_honoured_by_the_slices_after_it() -> None:
    h, toks = _stored()
    h.send(Lookup(key("r", toks, world_size=RANKS)))
    h.send(FreeLookupLocks(key("r", toks, start=32 * 4, world_size=RANKS)))  # chunks 32.. (C = 4 tokens)
    while h.server.deferred_work:
        h.advance(0.0)
    assert h.result(h.send(QueryPrefetchStatus("r"))) == CHUNKS  # freed chunks still count
    assert h.server.leases_of("r") <= 32 * RANKS  # none of the freed chunks is held
