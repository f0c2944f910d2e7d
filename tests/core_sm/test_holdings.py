"""The server's KV-event facts: ChunksStored / ChunksRemoved / AllChunksCleared (mpcache.core_sm.holdings)."""
from __future__ import annotations

from typing import Any

import attrs

from mpcache.core_sm.chunks import chunk_hashes, identity_root
from mpcache.core_sm.effects import AllChunksCleared, ChunksRemoved, ChunksStored, Medium
from mpcache.core_sm.holdings import HeldChunks
from mpcache.core_sm.keys import KeyExtras
from mpcache.core_sm.messages import Clear, L2WriteFinished, Store
from mpcache.core_sm.server import ServerConfig

from sm_helpers import C, MODEL, ServerHarness, key, tokens


def harness(**kw: Any) -> ServerHarness:
    return ServerHarness(ServerConfig(chunk_size=C, num_slots=kw.pop("num_slots", 64), slot_bytes=100,
                                      kv_events=True, **kw))


def reports(h: ServerHarness, since: int = 0) -> list[Any]:
    return [e for e in h.log[since:] if isinstance(e, (ChunksStored, ChunksRemoved, AllChunksCleared))]


def store(h: ServerHarness, toks: tuple[int, ...], rank: int = 0, ws: int = 1, salt: str = "",
          extras: KeyExtras | None = None) -> None:
    k = key("w", toks, worker_id=rank, world_size=ws, salt=salt)
    if extras is not None:
        k = attrs.evolve(k, extras=extras)
    rt = h.send(Store(k, 1))
    h.finish_all_transfers()
    assert h.result(rt) is not None


def test_a_store_reports_its_chunks_once_with_hashes_parents_and_tokens() -> None:
    h = harness()
    h.register()
    toks = tokens(3)
    store(h, toks, salt="tenant", extras=KeyExtras("lora=1:a"))
    (ev,) = reports(h)
    assert isinstance(ev, ChunksStored) and ev.medium is Medium.L1
    from mpcache.core_sm.keys import keyed_root
    hashes = chunk_hashes(toks, C, keyed_root(identity_root(MODEL, 1, "tenant"), "lora=1:a"))
    assert [c.chunk_hash for c in ev.chunks] == list(hashes)
    assert [c.parent_hash for c in ev.chunks] == [None, hashes[0], hashes[1]]
    assert [c.token_ids.tolist() for c in ev.chunks] == [list(toks[i * C:(i + 1) * C]) for i in range(3)]
    assert {(c.cache_salt, c.identity) for c in ev.chunks} == {("tenant", "lora=1:a")}
    mark = len(h.log)
    store(h, toks, salt="tenant", extras=KeyExtras("lora=1:a"))  # already held: nothing new
    assert reports(h, mark) == []


def test_a_chunk_is_held_only_when_every_rank_is() -> None:
    h = harness()
    h.register(world_size=2)
    toks = tokens(2, seed=1)
    store(h, toks, rank=0, ws=2)
    assert reports(h) == []
    store(h, toks, rank=1, ws=2)
    (ev,) = reports(h)
    assert isinstance(ev, ChunksStored) and len(ev.chunks) == 2


def test_eviction_reports_removed_and_clear_reports_cleared() -> None:
    h = harness(num_slots=2)
    h.register()
    first = tokens(2, seed=1)
    store(h, first)
    mark = len(h.log)
    store(h, tokens(2, seed=2))  # evicts both chunks of the first prompt
    removed = [e for e in reports(h, mark) if isinstance(e, ChunksRemoved)]
    stored = [e for e in reports(h, mark) if isinstance(e, ChunksStored)]
    assert [set(e.chunk_hashes) for e in removed] == [set(chunk_hashes(first, C, identity_root(MODEL, 1, "")))]
    assert len(stored) == 1 and len(stored[0].chunks) == 2
    assert h.log.index(removed[0]) < h.log.index(stored[0])
    mark = len(h.log)
    h.call(Clear(True, admin=True))
    assert reports(h, mark) == [AllChunksCleared()]
    mark = len(h.log)
    store(h, first)  # reported again after the clear
    assert [type(e) for e in reports(h, mark)] == [ChunksStored]


def test_l2_writes_are_reported_stored_in_l2_once_written_ok() -> None:
    h = harness(write_behind=True, l2_enabled=True)
    h.register()
    toks = tokens(2, seed=3)
    store(h, toks)
    (wid,) = h.writes
    mark = len(h.log)
    h.feed(L2WriteFinished(wid, True))
    (ev,) = reports(h, mark)
    assert isinstance(ev, ChunksStored) and ev.medium is Medium.L2 and len(ev.chunks) == 2
    h2 = harness(write_behind=True, l2_enabled=True)
    h2.register()
    store(h2, toks)
    (wid2,) = h2.writes
    mark = len(h2.log)
    h2.feed(L2WriteFinished(wid2, False))
    assert reports(h2, mark) == []


def test_off_by_default_and_bounded_l2_sets() -> None:
    h = ServerHarness()
    h.register()
    store(h, tokens(2))
    assert reports(h) == [] and h.server.index.dropped is None
    held = HeldChunks(l2_reported_cap=2, l2_partial_cap=2)
    from mpcache.core_sm.chunks import ObjectKey
    from mpcache.core_sm.effects import StoredChunk
    from mpcache.core_sm.chunks import TokenIds
    out: list[Any] = []
    chunks = {bytes([i]): StoredChunk(bytes([i]), None, TokenIds(())) for i in range(5)}
    held.written_l2([ObjectKey(bytes([i]), 0) for i in range(5)], chunks, 1, out)
    assert held.reported(Medium.L2) == 2
    held.written_l2([ObjectKey(bytes([i]), 0) for i in range(5)], chunks, 2, out)  # partial: capped
    assert len(held._l2_ranks) <= 2
