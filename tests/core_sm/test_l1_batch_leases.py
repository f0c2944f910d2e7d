"""A lookup whose prefix L2 completes leases the loaded objects as one batch: one L1 expiry entry
for the whole extension, not one per object (each was a heap push and, past 1,024, a share of a
heap rebuild: 65,536 objects cost the loop ~300 ms). Same leases, same hits."""
from __future__ import annotations

from mpcache.core_sm.messages import L2ReadFinished, Lookup, QueryPrefetchStatus

try:
    from .sm_helpers import ServerHarness, key, tokens
except ImportError:
    from sm_helpers import ServerHarness, key, tokens  # type: ignore[no-redef]


def test_an_l2_extension_is_leased_in_one_batch() -> None:
    h = ServerHarness(num_slots=512, l2_enabled=True)
    toks = tokens(100, seed=3)
    h.send(Lookup(key("r", toks, world_size=2), num_readers=2))
    (read,) = h.reads.values()
    assert len(read.items) == 200
    entries = len(h.server.index._expiries)
    h.feed(L2ReadFinished(read.read_id, (True,) * len(read.items)))
    assert len(h.server.index._expiries) - entries <= 1
    rt = h.send(QueryPrefetchStatus("r"))
    assert h.result(rt) == 100
    assert h.server.leases_of("r") == 2 * 200  # two readers on every object of both ranks
