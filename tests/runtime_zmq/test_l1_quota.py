"""L1 is shared by quota (mpcache.core_sm.l1_quota), live: two engines on one mpcache-server, one floods
L1 with committed objects, the other's hits survive."""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from adapter_driver import CHUNK, Engine
from mpcache.runtime_zmq.client import MPCacheClient

SLOTS = 16  # of 1 MiB; a tiny-model object is 64 KiB: one object per slot


def prompt(n_chunks: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n_chunks * CHUNK + 3)]


def test_a_flooding_engine_evicts_its_own_objects_and_the_other_engines_hits_survive(
        start_server: Callable[..., Any]) -> None:
    server = start_server("--chunk-size", str(CHUNK), "--l1-size-gb", str(SLOTS / 1024), "--slot-mb", "1")
    victim, flooder = Engine([server.url]), Engine([server.url])
    try:
        mine = prompt(4, seed=1)
        victim.add("v0", mine)
        victim.run_all()
        # the flooder commits 40 objects into 16 slots: far beyond its share of 8
        for i in range(10):
            flooder.add(f"f{i}", prompt(4, seed=100 + i))
            flooder.run_all()
        with MPCacheClient(server.url, request_timeout=5.0) as client:
            stats = dict(client.stats())
        assert stats["objects"] == SLOTS and stats["evictions"] == 40 - (SLOTS - 4), stats
        # every eviction took one of the flooder's own objects: the victim is within its share
        assert stats["evictions_for_others"] == 0, stats
        again = victim.add("v1", mine)
        victim.run_all()
        assert again.external == 4 * CHUNK and again.loaded_tokens == 4 * CHUNK
        # and the flooder still hits what it stored last (its share of L1 works for it)
        last = flooder.add("f9-again", prompt(4, seed=109))
        flooder.run_all()
        assert last.external == 4 * CHUNK
    finally:
        victim.close()
        flooder.close()
