"""KV events from a live server in vLLM's wire format (msgpack decoded here; the decode with
vLLM's own classes is tests/e2e/test_kv_events_vllm.py): stored after a real store, removed on
eviction, cleared on clear, a bounded replay, and the restart marker."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from mpcache.core_sm.chunks import TokenIds
from mpcache.core_sm.effects import AllChunksCleared, ChunksRemoved, ChunksStored, Medium, StoredChunk
from mpcache.runtime_zmq.kv_events import to_vllm_events
from kv_events_scenario import CHUNK, free_port, replay, run_scenario


def events(frames: list[list[bytes]]) -> list[dict[str, Any]]:
    out = []
    for _topic, _seq, payload in frames:
        ts, batch = msgpack.unpackb(payload)[:2]
        assert isinstance(ts, float)
        out.extend(batch)
    return out


def test_stored_removed_cleared_replay_and_restart(start_server: Callable[..., Any]) -> None:
    s = run_scenario(start_server)
    replayed = events(s["replay"])
    # the restart marker: the first batch of a start is a clear
    assert replayed[0] == {"type": "AllBlocksCleared"}
    live = events(s["live"])
    assert live and live == replayed[len(replayed) - len(live):], "the replay repeats the live stream"
    seqs = [int.from_bytes(f[1], "big") for f in s["replay"]]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert all(f[0] == s["topic"] for f in s["replay"])
    stored = [e for e in replayed if e["type"] == "BlockStored"]
    a, b = s["a"], s["b"]
    first = stored[0]
    assert first["block_hashes"] == list(a) and first["parent_block_hash"] is None
    assert first["token_ids"] == s["a_tokens"] and first["block_size"] == CHUNK
    assert first["medium"] == "CPU" and first["lora_name"] == "tenant-lora"
    assert first["extra_keys"][0] == ["tenant-lora", "tenant-1"] and first["extra_keys"][1] == ["tenant-lora"]
    assert stored[1]["block_hashes"] == list(b) and stored[1]["lora_name"] is None and "extra_keys" not in stored[1]
    removed = [h for e in replayed if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert len(removed) >= 1 and set(removed) <= set(a)  # B's two chunks evicted A's oldest
    assert all(e["medium"] == "CPU" for e in replayed if e["type"] == "BlockRemoved")
    assert replayed[-1] == {"type": "AllBlocksCleared"}
    order = [e["type"] for e in replayed]
    assert order.index("BlockRemoved") < len(order) - 1

    # a bounded replay from a later sequence number; nothing from past the end
    rep_url = [a for a in s["server"].args if a.startswith("tcp://")][-1]
    tail = replay(rep_url, seqs[-2])
    assert [int.from_bytes(f[1], "big") for f in tail] == seqs[-2:]
    assert replay(rep_url, seqs[-1] + 100) == []

    # a restarted server's sequence numbers jump forward and it starts with a clear
    rep2 = f"tcp://127.0.0.1:{free_port()}"
    start_server("--kv-events", "tcp://127.0.0.1:*", "--kv-events-replay", rep2)
    again = replay(rep2, 0)
    assert int.from_bytes(again[0][1], "big") > seqs[-1]
    assert events(again) == [{"type": "AllBlocksCleared"}]


def test_translation_splits_runs_and_maps_media() -> None:
    c0 = StoredChunk(b"h0", None, TokenIds([1, 2]))
    c1 = StoredChunk(b"h1", b"h0", TokenIds([3, 4]))
    c3 = StoredChunk(b"h3", b"h2", TokenIds([7, 8]), chunk_extra=b"\x01")
    (run1, run2) = to_vllm_events(ChunksStored(Medium.L2, (c0, c1, c3)), 2)
    assert run1["block_hashes"] == [b"h0", b"h1"] and run1["token_ids"] == [1, 2, 3, 4] and run1["medium"] == "STORAGE"
    assert run2["parent_block_hash"] == b"h2" and run2["extra_keys"] == [("01",)]
    assert to_vllm_events(ChunksRemoved(Medium.L1, (b"h0",)), 2) == [
        {"type": "BlockRemoved", "block_hashes": [b"h0"], "medium": "CPU"}]
    assert to_vllm_events(AllChunksCleared(), 2) == [{"type": "AllBlocksCleared"}]
    assert to_vllm_events(object(), 2) == []
