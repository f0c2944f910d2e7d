"""The vLLM adapters with CUDA KV caches (server-driven transfers: the server opens the cache by
CUDA IPC handle and copies after the worker's interprocess event), driven in vLLM's call order
against a real ``mpcache-server --gpu on``. Needs a CUDA GPU:

    make test-gpu      # or: python -m pytest -m gpu tests/runtime_zmq/test_adapters_gpu.py
"""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(600),
]

from adapter_driver import CHUNK, Engine  # noqa: E402

from mpcache.runtime_zmq.client import MPCacheClient  # noqa: E402

SERVER_FLAGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.0625", "--slot-mb", "1", "--gpu", "on")


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def stats(url: str) -> dict[str, Any]:
    with MPCacheClient(url, request_timeout=5.0) as client:
        return dict(client.stats())


@pytest.fixture
def gpu_engine(start_server: Callable[..., Any]) -> Iterator[tuple[Engine, Any]]:
    server = start_server(*SERVER_FLAGS)
    engine = Engine([server.url], device="cuda", request_timeout_s=30.0)
    yield engine, server
    engine.close()


def test_gpu_miss_hit_overlap_and_preemption(gpu_engine: tuple[Engine, Any]) -> None:
    engine, server = gpu_engine
    prompt = tokens(3 * CHUNK + 5, 1)
    engine.add("a", prompt)
    engine.run_all(timeout=120)
    assert stats(server.url)["objects"] == 3
    hit = engine.add("b", prompt)
    engine.run_all(timeout=60)
    assert hit.external == 3 * CHUNK and hit.checked
    overlap = engine.add("c", prompt, engine_hit=CHUNK + CHUNK // 2)
    engine.run_all(timeout=60)
    assert overlap.checked  # the engine-held blocks were not overwritten by the server's copy
    # Preempt a request right after its prompt was stored: the server's copy must have read the
    # blocks before they are reused.
    other_prompt = tokens(3 * CHUNK, 2)
    victim = engine.add("d", other_prompt, max_decode=3)
    engine.run_until(lambda: victim.status == "running", timeout=60)
    engine.preempt("d")
    engine.add("x", tokens(3 * CHUNK, 3))
    engine.run_all(timeout=60)
    check = engine.add("e", other_prompt)
    engine.run_all(timeout=60)
    assert check.external == 3 * CHUNK - 1 and check.checked
    assert engine.blocks_in_use() == 0
    s = stats(server.url)
    assert s["leases_held"] == 0 and s["transfers_failed"] == 0, s


def test_gpu_abort_with_the_load_in_flight(gpu_engine: tuple[Engine, Any]) -> None:
    engine, server = gpu_engine
    prompt = tokens(4 * CHUNK, 4)
    engine.add("a", prompt)
    engine.run_all(timeout=120)
    req = engine.add("b", prompt)
    engine.run_until(lambda: req.status == "loading", timeout=60)
    engine.abort("b")
    engine.run_all(timeout=60)
    assert req.freed and req.finished_reported == 1
    assert engine.blocks_in_use() == 0
