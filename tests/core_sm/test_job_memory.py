"""What an abandoned lookup job keeps: nothing per job beyond its record, its request id and its
table and reap-queue entries; in particular not its own copy of the peer (a runtime decodes the
peer of every message afresh: the connection identity is a new ``bytes`` each time)."""
from __future__ import annotations

import gc
import tracemalloc

import pytest

from mpcache.core_sm.messages import EndSession, Lookup, TimerFired
from mpcache.core_sm.server import LookupServer, ServerConfig
from sm_helpers import C, key, tokens

JOBS = 4000


def _server() -> LookupServer:
    return LookupServer(ServerConfig(chunk_size=C, abandoned_job_ttl=60.0, tombstone_ttl=60.0, lease_ttl=300.0))


def _peer() -> bytes:
    # what the runtime hands core_sm: the ROUTER identity frame copied out per message
    return bytes(bytearray(b"\x00k\x8b\x45\x67"))


def test_jobs_of_one_peer_share_its_peer_object() -> None:
    server = _server()
    toks = tokens(2)
    for i in range(50):
        server.handle(Lookup(key(f"r{i}", toks), 1, reply_to=("l", i), peer=_peer()), 1.0)
    jobs = list(server.jobs.jobs.values())
    assert len(jobs) == 50
    assert all(job.peer is jobs[0].peer for job in jobs)
    # another peer's jobs are its own
    server.handle(Lookup(key("r0", toks), 1, reply_to=("l", 99), peer=b"other"), 1.0)
    assert len(server.jobs.jobs) == 51
    # a peer whose jobs all ended is forgotten (no entry per peer that ever connected)
    for i in range(50):
        server.handle(EndSession(f"r{i}", reply_to=("e", i), peer=_peer()), 1.0)
    server.handle(TimerFired(), 62.0)
    assert len(server.jobs.jobs) == 0
    assert server.jobs.jobs._peers == {} and server.jobs.jobs.by_peer == {}


@pytest.mark.parametrize("peer", [None, "fresh"], ids=["no peer", "a fresh peer object per message"])
def test_an_abandoned_job_costs_under_200_bytes_and_is_given_back(peer: str | None) -> None:
    server = _server()
    toks = tokens(4)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(JOBS):  # the request ids and peers are made here: what the server keeps counts
        server.handle(Lookup(key(f"abandoned-{i:08d}", toks), 1, reply_to=("l", i),
                             peer=None if peer is None else _peer()), 1.0)
    gc.collect()
    live = tracemalloc.get_traced_memory()[0]
    server.handle(TimerFired(), 62.0)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert server.stats()["reaped_jobs"] == JOBS and server.stats()["jobs"] == 0
    # misses: no leases, so what is left is the job record (64 B; its hashes dropped once done),
    # its request id (64 B) and its entries in the job table and the reap queue (mpcache-bench
    # jobs measures 10,000); a copy of the 5-byte peer per job would add 38 B
    assert (live - base) / JOBS <= 180, (live - base) / JOBS
    assert (after - base) / JOBS < 8, (after - base) / JOBS
