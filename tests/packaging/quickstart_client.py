"""The quick start's engine side, reduced to what a server-only install can do: register one
engine-driven instance, store one prompt's chunks into L1, look the same prompt up again, and
read the hit from the server's /metrics. Run by an installed wheel's python (``python
quickstart_client.py ZMQ_URL HTTP_URL``) with no checkout on its path: it imports mpcache from the
wheel only. Prints ``hit_tokens N`` and exits 0 when the hit shows in the metrics, 1 otherwise."""

from __future__ import annotations

import sys
import time
import urllib.request

from mpcache.runtime_zmq.client import MPCacheClient
from mpcache.runtime_zmq.l1_pool import MappedSegment

OBJ_BYTES = 4096


def key(tokens: list[int], rid: str, worker_id: int | None) -> dict[str, object]:
    return {"model_name": "quickstart", "world_size": 1, "worker_id": worker_id, "token_ids": tokens,
            "start": 0, "end": len(tokens), "request_id": rid, "cache_salt": "",
            "request_configs": None, "num_kv_readers": 0}


def hit_tokens(http_url: str) -> float:
    with urllib.request.urlopen(http_url.rstrip("/") + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("mpcache_lookup_hit_tokens_total{"))


def main(zmq_url: str, http_url: str) -> int:
    c = MPCacheClient(zmq_url, request_timeout=10.0)
    try:
        assert c.wait_healthy(10.0), "server not healthy"
        chunk = int(c.get_chunk_size())
        tokens = [(i * 7919) % 50000 for i in range(2 * chunk)]
        iid = 42
        c.register_instance(iid, {"model_name": "quickstart", "world_size": 1, "object_bytes": OBJ_BYTES,
                                  "engine_driven": True}).result(10)
        plan = c.prepare_store(key(tokens, "store", 0), iid).result(10)
        assert plan["ok"], plan
        seg = MappedSegment(plan["segment"], plan["slot_bytes"], 1 << 30)
        try:
            for _chunk, slot, _offset in plan["placements"]:
                seg.view(slot, OBJ_BYTES)[:] = bytes(OBJ_BYTES)
        finally:
            seg.close()
        assert c.commit_store(plan["transfer_id"], True).result(10)["ok"]
        c.end_session("store").result(10)
        c.lookup(key(tokens, "again", None)).result(10)
        found = c.wait_prefetch_status("again", 5.0).result(10)
        deadline = time.monotonic() + 10
        seen = hit_tokens(http_url)
        while seen <= 0 and time.monotonic() < deadline:  # the metrics are read from the loop's snapshot
            time.sleep(0.1)
            seen = hit_tokens(http_url)
        print(f"found {found} hit_tokens {seen:g}")
        return 0 if seen >= len(tokens) else 1
    finally:
        c.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
