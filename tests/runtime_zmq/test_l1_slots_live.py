"""L1's slots follow the objects registered: with the default flags a server cuts L1 for the
first model that registers, so a small model fills L1 instead of a tenth of it (the README's
Qwen2.5-0.5B: 2 x 24 layers x 256 tokens x 2 KV heads x 64 x bf16 = 3 MiB objects, where 32 MiB
slots held 128 of them in 4 GiB). ``--slot-mb`` still fixes the size."""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from mpcache.runtime_zmq import cli
from mpcache.runtime_zmq.client import MPCacheClient, RemoteError
from mpcache.runtime_zmq.server import Server

MiB = 1 << 20
README_OBJECT = 2 * 24 * 256 * 2 * 64 * 2  # Qwen2.5-0.5B, chunk 256, bf16: one chunk of one rank
CHUNK = 256


def _serve(*flags: str) -> Iterator[tuple[Server, MPCacheClient]]:
    d = tempfile.mkdtemp(prefix="mpcache-slots-")
    args, _ = cli.parse_args(["--l1-size-gb", "0.25", "--ipc", f"{d}/s.sock", "--no-l1-reserve", *flags])
    server = Server(cli.config_from_args(args))
    loop = threading.Thread(target=server.serve_forever, name="server-loop")
    loop.start()
    c = MPCacheClient(server.bound_url, request_timeout=5.0)
    try:
        yield server, c
    finally:
        c.close()
        server.stop()
        loop.join(10)
        assert not loop.is_alive()


@pytest.fixture
def default_flags() -> Iterator[tuple[Server, MPCacheClient]]:
    yield from _serve()


def _layout(object_bytes: int, model: str = "Qwen/Qwen2.5-0.5B-Instruct") -> dict[str, Any]:
    return {"model_name": model, "world_size": 1, "object_bytes": object_bytes, "engine_driven": True}


def _key(n_chunks: int, rid: str, model: str = "Qwen/Qwen2.5-0.5B-Instruct") -> dict[str, Any]:
    seed = sum(rid.encode())  # another request, other chunks
    toks = [(seed * 7919 + i * 7 + 3) % 30000 for i in range(n_chunks * CHUNK)]
    return {"model_name": model, "world_size": 1, "worker_id": 0, "token_ids": toks, "start": 0,
            "end": len(toks), "request_id": rid, "cache_salt": "", "request_configs": None, "num_kv_readers": 0}


def _store(c: MPCacheClient, n_chunks: int, rid: str, model: str = "Qwen/Qwen2.5-0.5B-Instruct") -> int:
    """Store ``n_chunks`` chunks (slots left unwritten: only the count matters); the chunks placed."""
    plan = c.prepare_store(_key(n_chunks, rid, model), 1).result(5)
    assert plan["ok"]
    assert c.commit_store(plan["transfer_id"], True).result(5)["ok"]
    c.end_session(rid).result(5)
    return len(plan["placements"])


def test_readme_model_fills_l1_with_default_flags(default_flags: tuple[Server, MPCacheClient],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    server, c = default_flags
    l1_bytes = server.pool.size
    allowed = l1_bytes // README_OBJECT  # what L1's bytes allow
    with caplog.at_level(logging.WARNING):
        assert isinstance(c.register_instance(1, _layout(README_OBJECT)).result(5), int)
    # stores until L1 is full: as many objects as its bytes allow (>= 90%), not 256 MiB / 32 MiB
    placed = sum(_store(c, 16, f"r{i}") for i in range(allowed // 16 + 2))
    objects = c.stats()["objects"]
    assert placed >= allowed and objects >= 0.9 * allowed, (objects, allowed)
    info = c.submit("l1_info").result(5)
    assert info["slot_bytes"] == README_OBJECT and info["num_slots"] * README_OBJECT >= 0.9 * l1_bytes
    assert not [r for r in caplog.records if "L1 holds at most" in r.getMessage()], "warned at start"


def test_slot_mb_still_fixes_the_size() -> None:
    for server, c in _serve("--slot-mb", "32"):
        assert isinstance(c.register_instance(1, _layout(README_OBJECT)).result(5), int)
        assert c.submit("l1_info").result(5)["slot_bytes"] == 32 * MiB
        assert _store(c, 16, "r") == 8  # 256 MiB of 32 MiB slots


def test_a_larger_model_while_another_is_registered_is_refused(default_flags: tuple[Server, MPCacheClient]) -> None:
    """Engines of several sizes on one server need --slot-mb: the first registration set the
    size, and a larger object cannot be placed while the first instance's transfers use it."""
    _, c = default_flags
    assert isinstance(c.register_instance(1, _layout(README_OBJECT)).result(5), int)
    with pytest.raises(RemoteError) as e:
        c.register_instance(2, _layout(4 * README_OBJECT, "big")).result(5)
    assert e.value.kind == "too_large" and "--slot-mb" in e.value.message


def test_the_next_model_after_the_first_left_gets_its_own_slots(default_flags: tuple[Server, MPCacheClient]) -> None:
    """A server whose only engine comes back with a larger model cuts L1 again: the previous
    model's objects (nobody runs it) are dropped, the new ones fit."""
    _, c = default_flags
    assert isinstance(c.register_instance(1, _layout(README_OBJECT)).result(5), int)
    assert _store(c, 4, "small") == 4
    c.unregister_instance(1).result(5)
    assert isinstance(c.register_instance(1, _layout(4 * README_OBJECT, "big")).result(5), int)
    assert c.submit("l1_info").result(5)["slot_bytes"] == 4 * README_OBJECT
    assert c.stats()["objects"] == 0
    assert _store(c, 4, "big", "big") == 4
