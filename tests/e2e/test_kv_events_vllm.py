"""The server's KV-event stream decoded with vLLM's OWN classes (``vllm.distributed.kv_events``
``KVEventBatch`` through msgspec, as vLLM's subscribers and llm-d's indexer read it): stored after
a real store, removed after an eviction, cleared after a clear. Runs in ``.venv-vllm``
(``make e2e``); the scenario is tests/runtime_zmq/kv_events_scenario.py."""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

RUNTIME_ZMQ_TESTS = Path(__file__).resolve().parents[1] / "runtime_zmq"
sys.path.insert(0, str(RUNTIME_ZMQ_TESTS))

kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="needs vLLM: run `make e2e`")
msgspec = pytest.importorskip("msgspec")

# the mpcache-server fixture of tests/runtime_zmq (by path: tests/conftest.py is also "conftest")
_spec = importlib.util.spec_from_file_location("runtime_zmq_conftest", RUNTIME_ZMQ_TESTS / "conftest.py")
assert _spec is not None and _spec.loader is not None
_runtime_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_runtime_conftest)
start_server = _runtime_conftest.start_server
from kv_events_scenario import CHUNK, run_scenario  # noqa: E402


def test_vllm_decodes_stored_removed_cleared(start_server: Callable[..., Any]) -> None:
    s = run_scenario(start_server)
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    events: list[Any] = []
    for topic, _seq, payload in s["replay"]:
        assert topic == s["topic"]
        batch = decoder.decode(payload)
        assert isinstance(batch, kv_events.KVEventBatch) and batch.ts > 0
        events.extend(batch.events)
    assert isinstance(events[0], kv_events.AllBlocksCleared)  # restart marker
    stored = [e for e in events if isinstance(e, kv_events.BlockStored)]
    removed = [e for e in events if isinstance(e, kv_events.BlockRemoved)]
    assert stored[0].block_hashes == list(s["a"]) and stored[0].parent_block_hash is None
    assert stored[0].token_ids == s["a_tokens"] and stored[0].block_size == CHUNK
    assert stored[0].medium == kv_events.MEDIUM_CPU and stored[0].lora_name == "tenant-lora"
    assert stored[0].extra_keys is not None and stored[0].extra_keys[0] == ("tenant-lora", "tenant-1")
    assert stored[1].block_hashes == list(s["b"]) and stored[1].token_ids == s["b_tokens"]
    assert removed and {h for e in removed for h in e.block_hashes} <= set(s["a"])
    assert all(e.medium == kv_events.MEDIUM_CPU for e in removed)
    assert isinstance(events[-1], kv_events.AllBlocksCleared)
    assert events.index(removed[0]) < len(events) - 1


def test_vllm_decodes_the_default_hashes_only_stream(start_server: Callable[..., Any]) -> None:
    # without --kv-events-tokens: no token ids, LoRA name or salt, and still vLLM's KVEventBatch
    s = run_scenario(start_server, tokens=False)
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    events = [e for _topic, _seq, payload in s["replay"] for e in decoder.decode(payload).events]
    stored = [e for e in events if isinstance(e, kv_events.BlockStored)]
    assert stored[0].block_hashes == list(s["a"]) and stored[1].block_hashes == list(s["b"])
    assert all(e.token_ids == [] and e.lora_name is None and e.extra_keys is None for e in stored)
    assert isinstance(events[0], kv_events.AllBlocksCleared) and isinstance(events[-1], kv_events.AllBlocksCleared)
