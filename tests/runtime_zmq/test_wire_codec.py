"""The codec table: the client-side forms are the mirror image of the server-side ones. Every core_sm
request a client machine sends goes through the real codec (``request_to_wire`` -> frames ->
``wire.decode_request`` -> ``to_event``) and comes back equal; every result the server encodes
(``result_to_wire``) decodes back to the same core_sm value (``result_from_wire``), with what
core_sm does not carry (event handles, a plan's memory) beside it."""

from __future__ import annotations

from typing import Any

import attrs
import msgpack  # type: ignore[import-untyped]
import pytest

from mpcache.core_sm import messages as m
from mpcache.runtime_zmq import wire

KEY = m.CacheKey("model", 2, 1, tuple(range(512)), 0, 512, "req-1", "salt")
SCHED_KEY = m.CacheKey("model", 2, None, tuple(range(512)), 0, 512, "req-1")
HANDLE = b"\x01" * 64

REQUESTS: list[tuple[Any, dict[str, Any]]] = [
    (m.Lookup(SCHED_KEY, 1), {}),
    (m.QueryPrefetchStatus("req-1"), {}),
    (m.WaitPrefetchStatus("req-1", 0.5), {}),
    (m.FreeLookupLocks(SCHED_KEY), {}),
    (m.EndSession("req-1"), {}),
    (m.Clear(True), {}),
    (m.Ping(), {}),
    (m.GetChunkSize(), {}),
    (m.RegisterInstance(7, "model", 2, 4096, True), {}),
    (m.RegisterInstance(7, "model", 2, 4096, False), {"layout_extra": {"kv_layout": "nhd", "num_blocks": 8}}),
    (m.UnregisterInstance(7), {}),
    (m.PrepareStore(KEY, 7), {}),
    (m.PrepareRetrieve(KEY, 7, 256), {}),
    (m.CommitTransfer(3, True), {}),
    (m.Store(KEY, 7, block_ids=tuple(range(32))), {"event_handle": HANDLE}),
    (m.Retrieve(KEY, 7, block_ids=tuple(range(32)), skip_first_n_tokens=16), {"event_handle": HANDLE}),
    # the worker's deadline at the server (TransferClient sets it)
    (m.PrepareStore(KEY, 7, not_after=1234.5), {}),
    (m.Store(KEY, 7, block_ids=(1, 2), not_after=99.25), {"event_handle": HANDLE}),
    (m.Retrieve(KEY, 7, block_ids=(1, 2), skip_first_n_tokens=16, not_after=7.0), {"event_handle": HANDLE}),
    # a resend after not_registered names the registration it follows
    (m.Store(KEY, 7, block_ids=(1, 2), not_after=99.25, registration=2**62 + 5), {"event_handle": HANDLE}),
    (m.Retrieve(KEY, 7, block_ids=(1, 2), not_after=7.0, registration=3), {"event_handle": HANDLE}),
]


def _through_the_codec(op: str, args: tuple[Any, ...]) -> wire.Request:
    frames = [b"peer", msgpack.packb(1), msgpack.packb(op), *(msgpack.packb(a, use_bin_type=True) for a in args)]
    decoded = wire.decode_request(frames, wire.Limits())
    assert isinstance(decoded, wire.Request), decoded
    return decoded


@pytest.mark.parametrize("request_, extra", REQUESTS, ids=lambda v: type(v).__name__ if not isinstance(v, dict) else "")
def test_every_client_request_survives_the_codec(request_: Any, extra: dict[str, Any]) -> None:
    op, args = wire.request_to_wire(request_, **extra)
    decoded = _through_the_codec(op, args)
    assert wire.to_event(decoded, reply_to="rt") == attrs.evolve(request_, reply_to="rt")
    if "event_handle" in extra:
        assert decoded.args[3] == HANDLE  # the server's copy waits on it
    if "layout_extra" in extra:
        assert decoded.args[1]["kv_layout"] == "nhd" and decoded.args[1]["engine_driven"] is False


def test_server_driven_requests_need_their_event_handle() -> None:
    for request_ in (m.Store(KEY, 7, block_ids=(1, 2)), m.Retrieve(KEY, 7, block_ids=(1, 2))):
        with pytest.raises(TypeError, match="event_handle"):
            wire.request_to_wire(request_)


def test_the_machine_names_the_engine_even_if_layout_extra_disagrees() -> None:
    _, args = wire.request_to_wire(m.RegisterInstance(7, "model", 2, 4096, False), layout_extra={"model_name": "other", "tensors": []})
    assert args[1]["model_name"] == "model" and args[1]["tensors"] == []


def _reply_value(op: str, result: Any, **kw: Any) -> Any:
    # what the client decodes: the server's msgpack value, through msgpack
    return msgpack.unpackb(msgpack.packb(wire.result_to_wire(op, result, **kw), use_bin_type=True), raw=False, strict_map_key=False)


def test_results_come_back_as_core_sm_values() -> None:
    plan = m.TransferPlan(5, ((0, 3), (1, 9)), True, m.TransferKind.RETRIEVE, 16)
    value = _reply_value("prepare_retrieve", plan, segment="/dev/shm/mpcache-1-ab", slot_bytes=1 << 20)
    assert wire.result_from_wire(m.PrepareRetrieve(KEY, 7, 16), value) == plan
    assert wire.plan_memory_from_wire(value) == wire.PlanMemory("/dev/shm/mpcache-1-ab", 1 << 20)
    refused = m.TransferPlan(-1, (), False, m.TransferKind.RETRIEVE, 0)
    assert wire.result_from_wire(m.PrepareRetrieve(KEY, 7), _reply_value("prepare_retrieve", refused, segment="s", slot_bytes=4096)) == refused
    stored = m.StoreResult(True, 2, 1)
    assert wire.result_from_wire(m.CommitTransfer(5, True), _reply_value("commit_store", stored)) == stored
    retrieved = m.RetrieveResult(True, 2)
    assert wire.result_from_wire(m.CommitTransfer(5, True), _reply_value("commit_retrieve", retrieved)) == retrieved
    # server-driven: LMCache's [event_handle, ok]
    for ok in (True, False):
        value = _reply_value("store", m.StoreResult(ok), event_handle=HANDLE)
        assert value == [HANDLE, ok]
        assert wire.result_from_wire(m.Store(KEY, 7, block_ids=(1,)), value) == m.StoreResult(ok)
        value = _reply_value("retrieve", m.RetrieveResult(ok), event_handle=HANDLE)
        assert wire.result_from_wire(m.Retrieve(KEY, 7, block_ids=(1,)), value) == m.RetrieveResult(ok)


def test_malformed_replies_are_errors_not_results() -> None:
    with pytest.raises(ValueError):
        wire.result_from_wire(m.Store(KEY, 7, block_ids=(1,)), True)
    with pytest.raises(ValueError):
        wire.plan_memory_from_wire({"transfer_id": 1, "placements": []})


def test_not_after_is_optional_on_the_wire() -> None:
    # LMCache's clients send no deadline: the request decodes with not_after None
    wkey = wire.encode_key(KEY)
    for op, args, want in (
        ("store", (wkey, 7, [1, 2], HANDLE), m.Store(KEY, 7, block_ids=(1, 2))),
        ("retrieve", (wkey, 7, [1, 2], HANDLE), m.Retrieve(KEY, 7, block_ids=(1, 2))),
        ("retrieve", (wkey, 7, [1, 2], HANDLE, 16), m.Retrieve(KEY, 7, block_ids=(1, 2), skip_first_n_tokens=16)),
        ("prepare_store", (wkey, 7), m.PrepareStore(KEY, 7)),
        ("store", (wkey, 7, [1, 2], HANDLE, None), m.Store(KEY, 7, block_ids=(1, 2))),
        ("prepare_store", (wkey, 7, 5), m.PrepareStore(KEY, 7, not_after=5.0)),
    ):
        event = wire.to_event(_through_the_codec(op, args), reply_to="rt")
        assert event == attrs.evolve(want, reply_to="rt"), (op, args)
    # a deadline that is not a number is refused by the codec
    frames = [b"peer", msgpack.packb(1), msgpack.packb("prepare_store"), msgpack.packb(wkey, use_bin_type=True),
              msgpack.packb(7), msgpack.packb("soon")]
    bad = wire.decode_request(frames, wire.Limits())
    assert isinstance(bad, wire.DecodeError) and bad.kind.value == "undecodable"


def test_only_a_resend_carries_a_registration_and_the_client_adds_it_to_the_frames_it_sent() -> None:
    original = m.Store(KEY, 7, block_ids=(1, 2), not_after=5.0)
    op, args = wire.request_to_wire(original, event_handle=HANDLE)
    assert len(args) == 5  # what a server without the field accepts
    frames = [msgpack.packb(a, use_bin_type=True) for a in args]
    resent = wire.resend_payloads(op, frames, 41)
    event = wire.to_event(_through_the_codec(op, tuple(msgpack.unpackb(f) for f in resent)), reply_to="rt")
    assert event == attrs.evolve(original, registration=41, reply_to="rt")
    # the same as encoding the resend itself; a retrieve sent without its optional payloads gets
    # them as nil before the registration
    assert resent == [msgpack.packb(a, use_bin_type=True)
                      for a in wire.request_to_wire(attrs.evolve(original, registration=41), event_handle=HANDLE)[1]]
    wkey = wire.encode_key(KEY)
    short = [msgpack.packb(a, use_bin_type=True) for a in (wkey, 7, [1, 2], HANDLE)]
    for name in ("retrieve", 7):
        padded = wire.resend_payloads(name, short, 9)
        assert [msgpack.unpackb(f) for f in padded[4:]] == [0, None, 9]
        event = wire.to_event(_through_the_codec("retrieve", tuple(msgpack.unpackb(f) for f in padded)), reply_to="rt")
        assert event == m.Retrieve(KEY, 7, block_ids=(1, 2), registration=9, reply_to="rt")
    # prepares, other ops, or no registration known: unchanged
    assert wire.resend_payloads("prepare_store", short[:2], 9) == short[:2]
    assert wire.resend_payloads("store", frames, None) == frames
    # a registration that is not an int is refused by the codec
    bad = wire.decode_request([b"peer", msgpack.packb(1), msgpack.packb("store"), *frames, msgpack.packb("x")],
                              wire.Limits())
    assert isinstance(bad, wire.DecodeError) and bad.kind.value == "undecodable"


# The decoder's fast paths (uid, op frame, short strings, cached reply frames) must give exactly
# what msgpack's ordinary path gives, refusals included.

UIDS = [0, 1, 127, 128, 255, 256, 65_535, 65_536, 2**32 - 1, 2**32, 2**63, 2**64 - 1, -1, -33, -2**40]


@pytest.mark.parametrize("uid", UIDS)
def test_uid_fast_path_matches_msgpack(uid: int) -> None:
    frame = msgpack.packb(uid)
    assert wire.decode_uid(frame) == uid
    assert wire.decode_uid(memoryview(frame)) == uid


@pytest.mark.parametrize("frame", [b"", b"\x05\x00", b"\xcc", b"\xcc\x01\x02", b"\xcf" + b"\x00" * 7,
                                   b"\xa1x", msgpack.packb(1.5), msgpack.packb(None), b"\xcd\x00\x05"])
def test_uid_fast_path_refuses_what_msgpack_refuses(frame: bytes) -> None:
    try:
        expected = msgpack.unpackb(frame)
        expected = expected if type(expected) is int else None
    except Exception:
        expected = None
    assert wire.decode_uid(frame) == expected


def test_every_op_frame_is_in_the_byte_table_and_matches_the_generic_decoder() -> None:
    for spec in wire.OPS:
        forms = [msgpack.packb(spec.name)] + ([msgpack.packb(spec.legacy_id)] if spec.legacy_id is not None else [])
        for frame in forms:
            assert wire._SPEC_BY_OP_FRAME[frame] is spec
            assert wire._spec_of_op_frame(frame) is spec
    # a non-canonical encoding of an op (str8 instead of fixstr) still decodes, the long way
    name = b"noop"
    frames = [b"peer", msgpack.packb(1), b"\xd9" + bytes([len(name)]) + name]
    req = wire.decode_request(frames, wire.Limits())
    assert isinstance(req, wire.Request) and req.op == "noop"


@pytest.mark.parametrize("payload", [
    msgpack.packb("req-1"),
    msgpack.packb("é" * 40),  # str8, multi-byte
    msgpack.packb("x" * 256),  # at the limit
    msgpack.packb("x" * 257),  # over it: refused
    b"\xa3\xff\xfe\xfd",  # invalid UTF-8: refused
    b"\xa5abc",  # truncated
    b"\xa2abc",  # trailing bytes
    msgpack.packb(12),  # not a string
    msgpack.packb(b"bytes"),
    msgpack.packb("x" * 40, use_bin_type=True)[:1] + b"x" * 40,
])
def test_request_id_fast_path_matches_the_ordinary_decoder(payload: bytes) -> None:
    limits = wire.Limits()
    frames = [b"peer", msgpack.packb(5), msgpack.packb("query_prefetch_status"), payload]
    fast = wire.decode_request(frames, limits)
    # the ordinary path alone: what decode_request gave before the fast path
    try:
        v = wire._unpack(payload, wire._compute_unpack_limits(wire.P.ID, limits), limits.max_containers)
        slow: Any = ("ok", wire._decode_param(wire.P.ID, v, "query_prefetch_status payload 0", limits))
    except wire._Bad as e:
        slow = ("refused", e.kind)
    except ValueError as e:
        slow = ("refused", wire.ErrorKind.TOO_LARGE if "exceeds max" in str(e) else wire.ErrorKind.UNDECODABLE)
    except Exception:
        slow = ("refused", wire.ErrorKind.UNDECODABLE)
    if isinstance(fast, wire.Request):
        assert slow == ("ok", fast.args[0])
    else:
        assert isinstance(fast, wire.DecodeError)
        assert slow == ("refused", fast.kind)


@pytest.mark.parametrize("result", [0, 1, 32, 4096, 4097, -1, True, False, "OK", "ok", 2**40, None])
def test_cached_reply_frames_are_msgpack_of_the_result(result: Any) -> None:
    frames = wire.encode_reply(b"peer", b"\x01", b"\xa4noop", result)
    if result is None:
        assert frames == [b"peer", b"\x01", b"\xa4noop"]
        return
    value = msgpack.unpackb(frames[3])
    assert value == result and type(value) is type(result)


def test_unpack_limits_follow_the_limits_object() -> None:
    small = wire.Limits(max_name_bytes=8)
    assert wire._unpack_limits(wire.P.ID, small).max_str_len == 8
    assert wire._unpack_limits(wire.P.ID, wire.Limits()).max_str_len == 256
    frames = [b"peer", msgpack.packb(5), msgpack.packb("end_session"), msgpack.packb("x" * 9)]
    refused = wire.decode_request(frames, small)
    assert isinstance(refused, wire.DecodeError) and refused.kind is wire.ErrorKind.TOO_LARGE


def _key_frame(token_ids: Any, model_name: str = "model") -> bytes:
    key = {"model_name": model_name, "world_size": 1, "worker_id": None, "token_ids": token_ids, "start": 0,
           "end": 512, "request_id": "r", "cache_salt": "", "request_configs": None, "num_kv_readers": 1}
    return msgpack.packb(key, use_bin_type=True)  # type: ignore[no-any-return]


def _count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls = [0]
    real = getattr(wire, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(wire, name, counted)
    return calls


def test_a_packed_key_frame_skips_the_list_scanner_and_a_list_one_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The list-form scanner declines a bin of token ids: a packed key frame is not handed to it
    (only msgpack decodes it), a list-form frame still is, and both decode to the same key."""
    from mpcache.runtime_zmq import tokens

    tokens.load()
    scanned = _count_calls(monkeypatch, "decode_key_frame")
    ids = list(range(1000, 1512))
    decoded = []
    for token_ids in (wire.pack_token_ids(ids), ids):
        frames = [b"peer", msgpack.packb(5), msgpack.packb("lookup"), memoryview(_key_frame(token_ids)), msgpack.packb(1)]
        req = wire.decode_request(frames, wire.Limits())
        assert isinstance(req, wire.Request), req
        decoded.append(req.args)
    assert scanned[0] == 1  # the list form only
    assert decoded[0] == decoded[1]


@pytest.mark.parametrize("model_name", ["©token_idsĄ", "©token_ids", "token_ids", "x" * 600 + "©token_idsĄ"])
def test_a_key_the_packed_shortcut_misreads_decodes_the_same(model_name: str) -> None:
    """A model name holding the bytes of the ``token_ids`` field and a bin header (``©`` ends in
    0xA9, ``Ą`` starts with 0xC4) fools the packed shortcut on a list-form frame: it then takes
    msgpack's slower walk and gives the same key as the scanner."""
    from mpcache.runtime_zmq import tokens

    tokens.load()
    ids = [(i * 7919) % 200_000 for i in range(512)]
    for token_ids in (ids, wire.pack_token_ids(ids)):
        frames = [b"peer", msgpack.packb(5), msgpack.packb("lookup"), _key_frame(token_ids, model_name), msgpack.packb(1)]
        req = wire.decode_request(frames, wire.Limits(max_name_bytes=1024))
        assert isinstance(req, wire.Request), req
        key = req.args[0].key
        assert key.model_name == model_name and list(key.token_ids) == ids


def test_a_fixint_payload_is_taken_without_msgpack(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup's tp size (a positive fixint, as every client sends it) is read from its one byte:
    msgpack decodes the key frame alone; the value is msgpack's, and a nil optional int or a
    bigger int still goes through msgpack."""
    unpacked = _count_calls(monkeypatch, "_unpack")
    frames = [b"peer", msgpack.packb(5), msgpack.packb("lookup"), _key_frame(wire.pack_token_ids(range(512))),
              msgpack.packb(3)]
    req = wire.decode_request(frames, wire.Limits())
    assert isinstance(req, wire.Request) and req.args[1] == 3 and type(req.args[1]) is int
    assert unpacked[0] == 1
    for payload, want in ((msgpack.packb(None), None), (msgpack.packb(300), 300), (msgpack.packb(0), 0)):
        req = wire.decode_request([b"peer", msgpack.packb(5), msgpack.packb("ping"), payload], wire.Limits())
        assert isinstance(req, wire.Request) and req.args == (want,)
    negative = wire.decode_request([b"peer", msgpack.packb(5), msgpack.packb("lookup"),
                                    _key_frame(wire.pack_token_ids(range(512))), b"\xff"], wire.Limits())
    assert isinstance(negative, wire.Request) and negative.args[1] == -1  # msgpack's (to_event refuses it)
