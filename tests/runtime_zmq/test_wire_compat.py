"""Frame-level behaviour: replies shaped exactly as LMCache's client expects (reference
lmcache_wire.md), typed error replies for every error kind, and no wedge on malformed input."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from live_server import RawDealer, ServerProcess
from mpcache.runtime_zmq.client import MPCacheClient, RemoteError

P = msgpack.packb


def U(b: bytes) -> Any:
    return msgpack.unpackb(b, raw=False)


def key(tokens: list[int], rid: str, **over: Any) -> dict[str, Any]:
    k = {"model_name": "m", "world_size": 1, "worker_id": None, "token_ids": tokens, "start": 0,
         "end": len(tokens) // 256 * 256, "request_id": rid, "cache_salt": "", "request_configs": None,
         "num_kv_readers": 0}
    k.update(over)
    return k


def assert_error(reply: list[bytes], uid: int, kind: str) -> dict[str, Any]:
    assert len(reply) == 3, reply
    assert U(reply[0]) == uid
    assert reply[1] == P("error")
    body = U(reply[2])
    assert body["kind"] == kind, body
    assert isinstance(body["message"], str)
    return dict(body)


def test_success_replies_match_lmcache_shapes(raw: RawDealer) -> None:
    # result None -> exactly [uid, op]; otherwise [uid, op, result]; uid and op echoed byte for byte
    assert raw.request([P(0), P("noop")]) == [P(0), P("noop"), P("OK")]
    assert raw.request([P(1), P(24)]) == [P(1), P(24), P("OK")]
    assert raw.request([P(2), P("get_chunk_size")]) == [P(2), P("get_chunk_size"), P(256)]
    assert raw.request([P(3), P(22), P(None)]) == [P(3), P(22), P(True)]
    toks = list(range(512))
    assert raw.request([P(4), P(8), P(key(toks, "r")), P(1)]) == [P(4), P(8)]
    assert raw.request([P(5), P(9), P("r")]) == [P(5), P(9), P(0)]
    assert raw.request([P(6), P(9), P("r")]) == [P(6), P(9), P(0)]
    assert raw.request([P(7), P(10), P("r"), P(0.5)]) == [P(7), P(10), P(0)]
    assert raw.request([P(8), P(12), P(key(toks, "r")), P(1)]) == [P(8), P(12)]
    assert raw.request([P(9), P(13), P("r")]) == [P(9), P(13)]
    # clear is an admin operation (docs/security.md): without the server's token, forbidden
    assert_error(raw.request([P(10), P(20), P(False)]), 10, "forbidden")
    assert raw.request([P(11), P(23), P(1), P("m"), P([])]) == [P(11), P(23)]
    # extra key fields (request_configs, future fields) are ignored
    assert raw.request([P(12), P("lookup"), P(key(toks, "x", future_field=[1, 2])), P(1)]) == [P(12), P("lookup")]
    # a large uid (LMCache's counter after a long run) is echoed unchanged
    big = 2**40 + 3
    assert raw.request([P(big), P("noop")]) == [P(big), P("noop"), P("OK")]


def test_error_kinds(raw: RawDealer) -> None:
    toks = list(range(512))
    assert_error(raw.request([P(1), P("no_such_op")]), 1, "unknown_op")
    assert_error(raw.request([P(2), P(99)]), 2, "unknown_op")
    body = assert_error(raw.request([P(3), P(11), P("r")]), 3, "unknown_op")
    assert "query_prefetch_lookup_hits" in body["message"]
    assert_error(raw.request([P(4), P(1.5)]), 4, "unknown_op")
    assert_error(raw.request([P(5), P("lookup")]), 5, "bad_arity")
    assert_error(raw.request([P(6), P("noop"), P(1)]), 6, "bad_arity")
    assert_error(raw.request([P(7)]), 7, "bad_arity")  # LMCache's server thread dies on this one
    assert_error(raw.request([P(8), P("query_prefetch_status"), b"\xc1"]), 8, "undecodable")
    assert_error(raw.request([P(9), P("query_prefetch_status"), P(17)]), 9, "undecodable")
    assert_error(raw.request([P(10), P("lookup"), P({"model_name": "m"}), P(1)]), 10, "undecodable")
    assert_error(raw.request([P(11), P("lookup"), P(key(toks, "r", cache_salt="a/b")), P(1)]), 11, "validation")
    assert_error(raw.request([P(12), P("free_lookup_locks"), P(key(toks, "r", start=512, end=256)), P(1)]), 12, "validation")
    assert_error(raw.request([P(13), P("lookup"), P(key([-1] * 256, "r")), P(1)]), 13, "validation")
    assert_error(raw.request([P(14), P("lookup"), P(key([2**40] * 256, "r")), P(1)]), 14, "validation")
    assert_error(raw.request([P(15), P("commit_store"), P(12345), P(True)]), 15, "unknown_transfer")
    assert_error(raw.request([P(16), P("prepare_store"), P(key(toks, "r", worker_id=0)), P(77)]), 16, "not_registered")
    # the server still serves after all that
    assert raw.request([P(17), P("noop")]) == [P(17), P("noop"), P("OK")]


def test_limits(start_server: Callable[..., ServerProcess]) -> None:
    sp = start_server("--max-tokens", "1024", "--max-frame-mb", "0.05")
    raw = RawDealer(sp.url)
    try:
        assert_error(raw.request([P(1), P("lookup"), P(key(list(range(2048)), "r")), P(1)]), 1, "too_large")
        assert_error(raw.request([P(2), P("query_prefetch_status"), P("x" * 100_000)]), 2, "too_large")
        assert raw.request([P(3), P("lookup"), P(key(list(range(1024)), "r")), P(1)]) == [P(3), P("lookup")]
    finally:
        raw.close()


def test_unattributable_messages_are_counted_not_answered(raw: RawDealer, client: MPCacheClient) -> None:
    before = client.stats()["malformed"]
    raw.send([b"\xc1"])  # not msgpack
    raw.send([P("uid-as-str"), P("noop")])
    raw.send([b""])
    raw.send([P(None), P("noop")])
    # the next reply on this connection is the noop's: nothing was sent for the four above
    assert raw.request([P(42), P("noop")]) == [P(42), P("noop"), P("OK")]
    assert client.stats()["malformed"] == before + 4


def test_client_surfaces_typed_errors(client: MPCacheClient) -> None:
    with pytest.raises(RemoteError) as e:
        client.call("no_such_op")
    assert e.value.kind == "unknown_op"
    with pytest.raises(RemoteError) as e:
        client.call("lookup", key(list(range(256)), "r", cache_salt="bad@salt"), 1)
    assert e.value.kind == "validation"
    assert client.noop() == "OK"


def test_packed_token_ids_address_the_same_objects(raw: RawDealer, client: MPCacheClient) -> None:
    from mpcache.runtime_zmq.wire import pack_token_ids
    from test_server_ops import register, store_chunks, tokens

    toks = tokens(3, seed=4)
    register(client, 5)
    assert store_chunks(client, toks, "list-form", iid=5)["ok"]  # stored with the list form
    packed = key(toks, "bin", token_ids=pack_token_ids(toks))
    assert raw.request([P(1), P("lookup"), P(packed), P(1)]) == [P(1), P("lookup")]
    assert raw.request([P(2), P("query_prefetch_status"), P("bin")]) == [P(2), P("query_prefetch_status"), P(3)]
    assert_error(raw.request([P(3), P("lookup"), P(key(toks, "odd", token_ids=b"\x00" * 5)), P(1)]), 3, "undecodable")
    assert raw.request([P(4), P("end_session"), P("bin")]) == [P(4), P("end_session")]
