"""The adapters with two KV-cache groups (vLLM's hybrid KV-cache manager: full-attention and
sliding-window layers mixed), called in vLLM's order by hand against a real ``mpcache-server``,
CPU KV tensors in vLLM's CPU layout. No vLLM needed.

One object per chunk holds both groups' layers; each group is copied with its own blocks; a
load writes a window group's blocks only from the first one vLLM keeps (the others are its null
block); a store never reads a window block vLLM freed, and a chunk it could not store is a miss
for every group."""
from __future__ import annotations

import random
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from mpcache.core_sm.kv_groups import GroupKind, KVGroup, first_live_token, layout_identity
from mpcache.core_sm.planner import ScheduledRequest
from mpcache.runtime_zmq.adapters import ConnectorConfig, SchedulerAdapter, WorkerAdapter
from mpcache.runtime_zmq.client import MPCacheClient
from one_worker_engine import OneWorkerEngine
from mpcache.runtime_zmq.vllm_keys import RequestKeyer

BLOCK, CHUNK, HEADS, HEAD, NUM_BLOCKS = 16, 64, 2, 32, 64
NULL_BLOCK = 0  # vLLM's null block: never a request's own


def group_setup(window: int) -> tuple[tuple[KVGroup, ...], tuple[tuple[str, ...], ...]]:
    """Layers 0 and 2 slide over ``window`` tokens, 1 and 3 attend to everything; vLLM lists the
    full-attention group first here."""
    groups = (KVGroup(GroupKind.FULL, BLOCK, name="group 0"),
              KVGroup(GroupKind.SLIDING_WINDOW, BLOCK, window, name="group 1"))
    return groups, (("layers.1", "layers.3"), ("layers.0", "layers.2"))


class HybridEngine(OneWorkerEngine):
    """One scheduler and one worker over one server, with per-group block pools."""

    def __init__(self, url: str, window: int) -> None:
        super().__init__()
        self.groups, self.names = group_setup(window)
        config = ConnectorConfig(server_urls=url, chunk_size=CHUNK, request_timeout_s=1.0)
        self.scheduler = SchedulerAdapter.connect(config, model_name="tiny-hybrid", world_size=1, block_size=BLOCK,
                                                  cpu_engine=True, kv_groups=self.groups)
        self.worker = WorkerAdapter.connect(config, model_name="tiny-hybrid", world_size=1, rank=0, block_size=BLOCK)
        self.kv = {name: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD) for names in self.names for name in names}
        self.worker.register_kv_caches(self.kv, self.groups, self.names)

    def forward(self, group_blocks: list[list[int]], start: int, end: int, seed: int) -> None:
        """Write a KV vector per token and layer, as a forward would (a function of the seed)."""
        for names, blocks in zip(self.names, group_blocks):
            for name in names:
                for t in range(start, end):
                    block = blocks[t // BLOCK]
                    assert block != NULL_BLOCK
                    self.kv[name][block, :, t % BLOCK] = value(seed, name, t)


def value(seed: int, name: str, token: int) -> torch.Tensor:
    base = float(seed * 100_000 + int(name.rsplit(".", 1)[1]) * 10_000 + token)
    return torch.full((HEADS, 2 * HEAD), base)


def objects(url: str) -> int:
    with MPCacheClient(url, request_timeout=5.0) as client:
        return int(client.stats()["objects"])


@pytest.fixture
def make_engine(start_server: Callable[..., Any]) -> Iterator[Callable[[int], tuple[HybridEngine, Any]]]:
    engines: list[HybridEngine] = []

    def make(window: int) -> tuple[HybridEngine, Any]:
        server = start_server("--chunk-size", str(CHUNK), "--l1-size-gb", "0.0625", "--slot-mb", "1")
        engine = HybridEngine(server.url, window)
        engines.append(engine)
        return engine, server

    yield make
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("window", [BLOCK * 2, CHUNK + BLOCK], ids=["window-within-a-chunk", "window-over-chunks"])
def test_two_groups_store_together_and_load_every_group(make_engine: Any, window: int) -> None:
    engine, server = make_engine(window)
    url = server.url
    prompt = [random.Random(1).randrange(50_000) for _ in range(3 * CHUNK + 5)]
    n_blocks = -(-len(prompt) // BLOCK)
    # run 1: a miss; one step computes the prompt and stores its 3 chunks, both groups' blocks
    assert engine.match("a", prompt) == (0, False)
    source = [engine.blocks(n_blocks), engine.blocks(n_blocks)]
    engine.scheduler.update_state_after_alloc("a", source[0], 0, [source[1]])
    engine.forward(source, 0, len(prompt), seed=1)
    plan = engine.run_step([ScheduledRequest("a", 0, len(prompt), source[0], True, (source[1],))])
    assert [(s.start, s.end) for s in plan.stores] == [(0, 3 * CHUNK)]
    engine.finish("a")
    assert objects(url) == 3  # one object per chunk, holding both groups

    # run 2: the same prompt hits all 3 chunks, loaded asynchronously (several groups)
    assert engine.match("b", prompt) == (3 * CHUNK, True)
    hit = 3 * CHUNK
    live = first_live_token(engine.groups[1], hit)  # vLLM hands null blocks before it
    full = engine.blocks(n_blocks)
    windowed = [NULL_BLOCK] * (live // BLOCK) + engine.blocks(n_blocks - live // BLOCK)
    engine.scheduler.update_state_after_alloc("b", full, hit, [windowed])
    plan = engine.run_step([])
    (retrieve,) = plan.retrieves
    assert plan.sync_loads == () and (retrieve.start, retrieve.end) == (0, hit)
    engine.wait_loaded("b")
    for name in engine.names[0]:  # full attention: every token of the hit
        for t in range(hit):
            assert torch.equal(engine.kv[name][full[t // BLOCK], :, t % BLOCK], value(1, name, t)), (name, t)
    for name in engine.names[1]:  # the window: every token it keeps; its null block untouched
        for t in range(live, hit):
            assert torch.equal(engine.kv[name][windowed[t // BLOCK], :, t % BLOCK], value(1, name, t)), (name, t)
        assert not engine.kv[name][NULL_BLOCK].any()
    engine.finish("b")


def vllm_first_live_token(window: int, computed: int) -> int:
    """vLLM's first window token whose block it keeps once ``computed`` tokens are computed
    (``SlidingWindowManager.get_num_skipped_tokens``); it hands null blocks before it."""
    return max(0, computed - window + 1) // BLOCK * BLOCK


@pytest.mark.parametrize("window", [2 * BLOCK + 1, 2 * BLOCK + 2], ids=["window-block-boundary", "beside-it"])
def test_a_whole_prompt_hit_writes_every_window_block_vllm_keeps(make_engine: Any, window: int) -> None:
    """A hit of the whole prompt (3 chunks): vLLM resumes one token short of the chunks' end (it
    computes the last prompt token), so its window keeps the blocks from ``resume - window + 1``
    on. With ``3 * CHUNK - window + 1`` a multiple of the block size that is one block more than
    at the end: the connector then loads 2 chunks, resumed at their end; beside it, the whole
    hit. Either way every window block vLLM keeps holds the stored KV."""
    engine, _server = make_engine(window)
    prompt = [random.Random(4).randrange(50_000) for _ in range(3 * CHUNK)]
    n_blocks = len(prompt) // BLOCK
    assert engine.match("a", prompt) == (0, False)
    source = [engine.blocks(n_blocks), engine.blocks(n_blocks)]
    engine.scheduler.update_state_after_alloc("a", source[0], 0, [source[1]])
    engine.forward(source, 0, len(prompt), seed=4)
    assert [(s.start, s.end) for s in engine.run_step(
        [ScheduledRequest("a", 0, len(prompt), source[0], True, (source[1],))]).stores] == [(0, 3 * CHUNK)]
    engine.finish("a")

    resume, _ = engine.match("b", prompt)  # vLLM's num_computed_tokens once the load lands
    boundary = (len(prompt) - window + 1) % BLOCK == 0
    assert resume == (2 * CHUNK if boundary else len(prompt) - 1)
    live = vllm_first_live_token(window, resume)
    full = engine.blocks(n_blocks)
    windowed = [NULL_BLOCK] * (live // BLOCK) + engine.blocks(n_blocks - live // BLOCK)
    engine.scheduler.update_state_after_alloc("b", full, resume, [windowed])
    (retrieve,) = engine.run_step([]).retrieves
    assert (retrieve.start, retrieve.end) == (0, -(-resume // CHUNK) * CHUNK)
    engine.wait_loaded("b")
    for name in engine.names[0]:
        for t in range(resume):
            assert torch.equal(engine.kv[name][full[t // BLOCK], :, t % BLOCK], value(4, name, t)), (name, t)
    for name in engine.names[1]:  # every token in a block vLLM keeps, its null block untouched
        for t in range(live, resume):
            assert torch.equal(engine.kv[name][windowed[t // BLOCK], :, t % BLOCK], value(4, name, t)), (name, t)
        assert not engine.kv[name][NULL_BLOCK].any()
    engine.finish("b")


def test_a_store_stops_at_a_freed_window_block_and_the_chunk_is_a_miss(make_engine: Any) -> None:
    """Chunked prefill with a window of one block: when the step that completes chunk 0 starts,
    vLLM already freed the window's first blocks (another request may hold them), so chunk 0 is
    not stored for any group -- nor any later chunk -- and the next request misses."""
    engine, server = make_engine(BLOCK)
    url = server.url
    prompt = [random.Random(2).randrange(50_000) for _ in range(3 * CHUNK)]
    assert engine.match("a", prompt) == (0, False)
    blocks = [engine.blocks(12), engine.blocks(12)]
    engine.scheduler.update_state_after_alloc("a", blocks[0], 0, [blocks[1]])
    first = CHUNK - BLOCK
    engine.forward(blocks, 0, first, seed=2)
    assert engine.run_step([ScheduledRequest("a", 0, first, blocks[0], True, (blocks[1],))]).stores == ()
    engine.forward(blocks, first, len(prompt), seed=2)
    assert engine.run_step([ScheduledRequest("a", first, len(prompt) - first, None)]).stores == ()
    engine.finish("a")
    assert objects(url) == 0
    assert engine.match("b", prompt) == (0, False)  # no chunk of it: a miss, never a partial restore
    engine.finish("b")


def test_a_failed_load_of_two_groups_is_reported_by_request_id(make_engine: Any) -> None:
    """vLLM cannot map block ids back to a request when there are several groups: the worker
    reports the request whose load failed (the connector passes it on as failed_recving)."""
    engine, server = make_engine(CHUNK)
    prompt = [random.Random(3).randrange(50_000) for _ in range(2 * CHUNK + 1)]
    engine.match("a", prompt)
    source = [engine.blocks(2 * CHUNK // BLOCK + 1), engine.blocks(2 * CHUNK // BLOCK + 1)]
    engine.scheduler.update_state_after_alloc("a", source[0], 0, [source[1]])
    engine.forward(source, 0, len(prompt), seed=3)
    engine.run_step([ScheduledRequest("a", 0, len(prompt), source[0], True, (source[1],))])
    engine.finish("a")
    assert engine.match("b", prompt) == (2 * CHUNK, True)
    blocks = [engine.blocks(2 * CHUNK // BLOCK + 1), engine.blocks(2 * CHUNK // BLOCK + 1)]
    engine.scheduler.update_state_after_alloc("b", blocks[0], 2 * CHUNK, [blocks[1]])
    server.kill()  # the load cannot be served
    engine.run_step([])
    engine.wait_loaded("b")  # reported done (failed), so vLLM stops waiting for it
    assert engine.worker.failed_loads() == {"b"}
    assert engine.worker.failed_loads() == set()  # said once


def test_an_engine_with_several_groups_keys_apart() -> None:
    """Its objects hold the layers group after group: a one-group engine of the same model
    (vLLM's hybrid manager off) must never read them."""
    config = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype="float32"),
                                   cache_config=types.SimpleNamespace(cache_dtype="auto"))
    groups, _ = group_setup(BLOCK)
    plain = RequestKeyer.from_vllm_config(config, CHUNK, extra_keys_fn=None)
    hybrid = RequestKeyer.from_vllm_config(config, CHUNK, extra_keys_fn=None, kv_layout=layout_identity(groups))
    request = types.SimpleNamespace(request_id="r", lora_request=None)
    assert plain.extras(request).identity != hybrid.extras(request).identity
    assert layout_identity(groups) in hybrid.extras(request).identity
