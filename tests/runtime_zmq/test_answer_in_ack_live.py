"""One round trip for an L1 hit, against a real server: the scheduler's LookupClient with
``answer_in_ack`` gets an L1 hit's count in the LOOKUP's ack; a lookup that goes to L2 takes the
ordinary two (LOOKUP, then the status query); a client without it, and LMCache's wire form, are
unchanged."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import msgpack
import pytest

from live_server import ServerProcess
from mpcache.core_sm.messages import CacheKey, Lookup, SubmitLookup
from mpcache.runtime_zmq.client import MPCacheClient, RemoteError
from mpcache.runtime_zmq.wire import encode_key, encode_request, request_to_wire
from test_server_faults import LookupDriver
from test_server_ops import CHUNK, register, store_chunks, tokens

# an L2 whose every probe or read takes 50 ms and misses: a lookup past L1 always has an L2 step
L2 = "python:slow_tier:make?delay=0.05"


def trips(drv: LookupDriver) -> int:
    s = drv.machine.stats()
    return s["lookups_sent"] + s["status_queries_sent"]


def test_an_l1_hit_takes_one_round_trip_a_lookup_reading_l2_two(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server("--l2", L2)
    hit = tokens(3, seed=31)
    with MPCacheClient(server.url, request_timeout=5.0) as c:
        register(c, 1)
        assert store_chunks(c, hit, "w")["stored"] == 3
        drv = LookupDriver(c, use_wait=True, answer_in_ack=True)
        drv.feed(SubmitLookup("hit", tuple(hit)))
        assert drv.result("hit", within=5.0) == 3 * CHUNK
        assert trips(drv) == 1 and drv.machine.stats()["answered_in_ack"] == 1

        # chunk 0 in L1, the rest past it: the server probes L2 and acks nil, the client asks
        partial = hit[: CHUNK] + tokens(2, seed=32)
        drv.feed(SubmitLookup("l2", tuple(partial)))
        assert drv.result("l2", within=5.0) == CHUNK
        assert trips(drv) == 1 + 2 and drv.machine.stats()["answered_in_ack"] == 1

        # a client that does not ask: two round trips for the same hit, as before
        plain = LookupDriver(c, use_wait=True)
        plain.feed(SubmitLookup("hit2", tuple(hit)))
        assert plain.result("hit2", within=5.0) == 3 * CHUNK
        assert trips(plain) == 2 and plain.machine.stats()["answered_in_ack"] == 0
        stats = c.stats()
        assert stats["lookups_answered_in_ack"] == 1


def test_lmcache_wire_form_of_a_lookup_is_unchanged(start_server: Callable[..., ServerProcess]) -> None:
    """A Lookup without ``answer_in_ack`` encodes as LMCache's (no new key field, no new payload),
    and a server acks LMCache's lookup of an L1 hit nil, as before."""
    toks = tokens(2, seed=33)
    k = CacheKey("m", 1, None, toks, 0, 2 * CHUNK, "lm")
    op, payloads = request_to_wire(Lookup(k, 1))
    assert op == "lookup" and payloads == (encode_key(k, 1), 1)
    assert "answer_in_ack" not in payloads[0]
    _, asked = request_to_wire(Lookup(k, 1, answer_in_ack=True))
    assert asked[0] == {**encode_key(k, 1), "answer_in_ack": True} and asked[1:] == (1,)
    # with ranks: the field rides in the key, ranks stay the third payload
    _, ranked = request_to_wire(Lookup(attrs.evolve(k, world_size=2), 1, (1,), answer_in_ack=True))
    assert len(ranked) == 3 and ranked[2] == [1]

    server = start_server()
    with MPCacheClient(server.url, request_timeout=5.0) as c:
        register(c, 1)
        assert store_chunks(c, toks, "w")["stored"] == 2
        # LMCache's frames, by its legacy op id: the nil ack, then the count from the status query
        assert c.submit(8, encode_key(k), 1).result(5.0) is None
        assert c.submit(9, "lm").result(5.0) == 2
        # the same lookup asking for the count in its ack (another request id)
        k2 = CacheKey("m", 1, None, toks, 0, 2 * CHUNK, "mp")
        assert c.submit("lookup", {**encode_key(k2), "answer_in_ack": True}, 1).result(5.0) == 2
        assert c.submit("query_prefetch_status", "mp").result(5.0) == 2  # the tombstone repeats it
        # a malformed field is refused like any bad key field
        with pytest.raises(RemoteError, match="answer_in_ack"):
            c.submit("lookup", {**encode_key(k2), "answer_in_ack": "yes"}, 1).result(5.0)
        assert msgpack.unpackb(encode_request(1, 8, [encode_key(k), 1])[1]) == 8

