"""Run with LMCache 0.5.6's venv: drives an mpcache server through LMCache's own request client
and prints one JSON line {call: ["ok", result] | ["exc", type, message]}.

    python lmcache_client_script.py URL HIT_TOKENS_JSON
"""
import json
import sys

from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

url, hit_tokens = sys.argv[1], tuple(json.loads(sys.argv[2]))
c = RequestClientFactory.create(url)
out = {}


def run(name, fut, timeout=5.0):
    try:
        out[name] = ["ok", fut.result(timeout)]
    except Exception as e:  # noqa: BLE001 - the point is to see how each call ends
        out[name] = ["exc", type(e).__name__, str(e)[:300]]


def key(tokens, rid, start=0, end=None):
    end = len(tokens) // 256 * 256 if end is None else end
    return IPCCacheServerKey(model_name="m", world_size=1, worker_id=None, token_ids=tuple(tokens),
                             start=start, end=end, request_id=rid)


miss = tuple(range(512))
run("noop", c.noop())
run("get_chunk_size", c.get_chunk_size())
run("ping", c.ping(None))
run("lookup_miss", c.lookup(key(miss, "miss"), 1))
run("status_miss", c.query_prefetch_status("miss"))
run("status_unknown", c.query_prefetch_status("never"))
run("wait_unknown", c.wait_prefetch_status("never", 0.2))
run("lookup_hit", c.lookup(key(hit_tokens, "hit"), 1))
run("status_hit", c.query_prefetch_status("hit"))
run("status_hit_again", c.query_prefetch_status("hit"))
run("free_lookup_locks", c.free_lookup_locks(key(hit_tokens, "hit"), 1))
run("end_session", c.end_session("hit"))
run("report_block_allocation", c.report_block_allocation(1, "m", []))
run("bad_range_free", c.free_lookup_locks(key(miss, "bad", 0, 1024), 1))
run("clear", c.clear(False))
run("noop_after", c.noop())
print(json.dumps(out, default=repr), flush=True)
try:
    c.close()
except Exception:  # noqa: BLE001
    pass
