"""Store admission (mpcache.core_sm.admission): a chunk is stored only once lookups asked for it
``threshold`` times; the sketch is bounded and ages."""
from __future__ import annotations

import hashlib
from typing import Any

import pytest

from mpcache.core_sm.admission import StoreAdmission
from mpcache.core_sm.messages import EndSession, Lookup, QueryPrefetchStatus, Store
from mpcache.core_sm.server import ServerConfig

from sm_helpers import C, ServerHarness, key, tokens


def h(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def test_counts_reach_the_threshold_then_admit() -> None:
    adm = StoreAdmission(3, width=1 << 10)
    assert not adm.admits(h(1))
    adm.record([h(1)])
    adm.record([h(1), h(2)])
    assert adm.count(h(1)) == 2 and not adm.admits(h(1))
    adm.record([h(1)])
    assert adm.admits(h(1)) and not adm.admits(h(2))


def test_off_admits_everything_and_keeps_no_counts() -> None:
    for threshold in (0, 1):
        adm = StoreAdmission(threshold, width=1 << 4)
        adm.record([h(1)] * 10)
        assert adm.admits(h(9)) and adm.stats["recorded"] == 0


def test_never_undercounts_and_memory_is_fixed() -> None:
    adm = StoreAdmission(2, width=1 << 8, window=1 << 30)
    truth: dict[int, int] = {}
    for i in range(5000):
        k = (i * 7919) % 700
        truth[k] = truth.get(k, 0) + 1
        adm.record([h(k)])
    assert all(adm.count(h(k)) >= min(n, 255) for k, n in truth.items())
    assert sum(len(r) for r in adm._rows) == 4 * (1 << 8)


def test_aging_halves_counts() -> None:
    adm = StoreAdmission(4, width=1 << 8, window=8)
    adm.record([h(1)] * 7)
    assert adm.count(h(1)) == 7
    adm.record([h(1)])  # the 8th recorded chunk: everything halves
    assert adm.count(h(1)) == 4 and adm.stats["agings"] == 1


def test_bad_settings_are_refused() -> None:
    for kw in ({"threshold": -1}, {"threshold": 256}, {"threshold": 2, "width": 3}, {"threshold": 2, "depth": 5}):
        with pytest.raises(ValueError):
            StoreAdmission(**kw)


# ------------------------------------------------------------------ through the server


def harness(threshold: int, **kw: Any) -> ServerHarness:
    h = ServerHarness(ServerConfig(chunk_size=C, num_slots=kw.pop("num_slots", 64), slot_bytes=100,
                                   store_threshold=threshold, **kw))
    h.register()
    return h


def lookup(h: ServerHarness, rid: str, toks: tuple[int, ...]) -> object:
    assert h.call(Lookup(key(rid, toks), 1)) is None
    hits = h.call(QueryPrefetchStatus(rid))
    h.call(EndSession(rid))
    return hits


def store(h: ServerHarness, toks: tuple[int, ...], rid: str) -> Any:
    rt = h.send(Store(key(rid, toks, worker_id=0), 1))
    h.finish_all_transfers()
    return h.result(rt)


def test_a_prompt_is_stored_at_its_second_lookup_with_threshold_two() -> None:
    h = harness(2)
    toks = tokens(3)
    assert lookup(h, "r1", toks) == 0
    first = store(h, toks, "r1")
    assert first.stored == 0 and first.skipped == 3 and h.server.stats()["objects"] == 0
    assert lookup(h, "r2", toks) == 0
    assert store(h, toks, "r2").stored == 3
    assert lookup(h, "r3", toks) == 3
    assert h.server.stats()["stores_not_admitted"] == 3


def test_a_refused_chunk_refuses_the_rest_of_the_store() -> None:
    h = harness(2)
    short, long = tokens(1), tokens(3)  # same first chunk
    lookup(h, "a", short)
    lookup(h, "b", long)  # chunk 0 now looked up twice, chunks 1-2 once
    result = store(h, long, "b")
    assert (result.stored, result.skipped) == (1, 2)


def test_one_off_prompts_do_not_evict_a_reused_one() -> None:
    def run(threshold: int) -> int:
        h = harness(threshold, num_slots=4)
        reused = tokens(2, seed=1)
        hits = 0
        for i in range(12):
            for toks, rid in ((reused, f"hot{i}"), (tokens(2, seed=100 + i), f"cold{i}"),
                              (tokens(2, seed=200 + i), f"colder{i}")):
                got = lookup(h, rid, toks)
                hits += int(got) if rid.startswith("hot") else 0
                store(h, toks, rid)
        return hits

    assert run(0) == 0  # without admission the one-offs push the reused prompt out every time
    assert run(2) == 2 * 10  # stored at its 2nd lookup, a hit from the 3rd on
