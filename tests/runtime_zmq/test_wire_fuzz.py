"""Adversarial frames against a live server: no crash, exactly one reply for every message whose
uid is readable, none for the rest, and leases / bytes / objects unchanged."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from live_server import RawDealer, ServerProcess
from mpcache.runtime_zmq.client import MPCacheClient
from test_server_ops import register, store_chunks, tokens

P = msgpack.packb

# every op name the server knows (minus clear, which legitimately drops objects), some it does
# not, and legacy ids served or not
OP_NAMES = ["noop", "ping", "get_chunk_size", "lookup", "query_prefetch_status", "wait_prefetch_status",
            "free_lookup_locks", "end_session", "report_block_allocation", "store", "retrieve", "health",
            "stats", "l1_info", "register_instance", "unregister_instance", "prepare_store",
            "prepare_retrieve", "commit_store", "commit_retrieve", "bogus", ""]
OP_IDS = [1, 2, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 17, 21, 22, 23, 24, 99, -1, 2**31]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=20),
)
values = st.recursive(scalars, lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=8), c, max_size=5), max_leaves=20)

token_lists = st.one_of(
    st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=600),
    st.lists(st.integers(min_value=-(2**63), max_value=2**64 - 1), max_size=300),
    st.just(list(range(20_000))),  # large
    st.lists(values, max_size=5),
    values,
)


@st.composite
def keys(draw: Any) -> Any:
    k: dict[str, Any] = {
        "model_name": draw(st.one_of(st.just("m"), values)),
        "world_size": draw(st.one_of(st.integers(-3, 9), values)),
        "worker_id": draw(st.one_of(st.none(), st.integers(-3, 9), values)),
        "token_ids": draw(token_lists),
        "start": draw(st.one_of(st.integers(-(2**40), 2**40), st.sampled_from([0, 256, 512]), values)),
        "end": draw(st.one_of(st.integers(-(2**40), 2**40), st.sampled_from([0, 256, 512]), values)),
        "request_id": draw(st.one_of(st.text(max_size=10), values)),
        "cache_salt": draw(st.one_of(st.just(""), st.text(max_size=200), values)),
        "num_kv_readers": draw(st.one_of(st.integers(-3, 2**40), values)),
    }
    drop = draw(st.sets(st.sampled_from(sorted(k)), max_size=3))
    for d in drop:
        del k[d]
    return k


payload = st.one_of(values, keys(), st.integers(-(2**63), 2**63 - 1), st.floats(), st.text(max_size=30))


@st.composite
def messages(draw: Any) -> tuple[list[bytes], bool]:
    """(frames, attributable): a raw message and whether its uid frame is a msgpack int."""
    kind = draw(st.sampled_from(["garbage", "uid_only", "structured", "structured", "structured"]))
    uid_ok = draw(st.booleans()) or kind == "structured"
    uid_frame = P(draw(st.integers(0, 2**63))) if uid_ok else draw(st.one_of(st.binary(max_size=12), st.just(P("x")), st.just(P(None))))
    attributable = True
    try:
        attributable = type(msgpack.unpackb(uid_frame)) is int
    except Exception:
        attributable = False
    if kind == "garbage":
        frames = [uid_frame] + draw(st.lists(st.binary(max_size=40), max_size=6))
    elif kind == "uid_only":
        frames = [uid_frame]
    else:
        op = draw(st.one_of(st.sampled_from(OP_NAMES), st.sampled_from(OP_IDS), values))
        args = draw(st.lists(payload, max_size=6))
        frames = [uid_frame, P(op)] + [P(a) for a in args]
        if draw(st.booleans()) and len(frames) > 2:
            i = draw(st.integers(2, len(frames) - 1))
            frames[i] = draw(st.binary(max_size=30))  # one undecodable frame
    return frames, attributable


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[tuple[ServerProcess, MPCacheClient, RawDealer]]:
    sp = ServerProcess(["--port", "0", "--l1-size-gb", "0.25", "--slot-mb", "1", "--metrics-port", "0"]).start()
    c = MPCacheClient(sp.url, request_timeout=5.0)
    # objects that lookups could lease if a bug let a malformed request through
    register(c, 1)
    assert store_chunks(c, tokens(4), "seed")["ok"]
    raw = RawDealer(sp.url)
    yield sp, c, raw
    raw.close()
    c.close()
    sp.kill()


_uids = itertools.count(10**12)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=st.lists(messages(), min_size=1, max_size=5))
def test_adversarial_frames(fuzz_server: tuple[ServerProcess, MPCacheClient, RawDealer], batch: list[tuple[list[bytes], bool]]) -> None:
    sp, client, raw = fuzz_server
    before = client.stats()
    expected: list[bytes] = []
    for frames, attributable in batch:
        raw.send(frames)
        if attributable:
            expected.append(frames[0])
    # a sentinel noop: every reply before it must belong to one attributable message, in order
    sentinel = P(next(_uids))
    raw.send([sentinel, P("noop")])
    got: list[bytes] = []
    while True:
        reply = raw.recv(10.0)
        assert reply is not None, "server stopped answering"
        if reply[0] == sentinel:
            assert reply == [sentinel, P("noop"), P("OK")]
            break
        got.append(reply[0])
        assert len(reply) in (2, 3)
    # one reply per attributable message (wait_prefetch_status on an unknown id answers at once)
    assert sorted(got) == sorted(expected)
    assert sp.alive
    after = client.stats()
    for name in ("leases_held", "bytes", "objects", "writing", "transfers", "outstanding_requests"):
        assert after[name] == before[name], (name, before[name], after[name])
