"""Token ids and reader counts from the wire into core_sm events (no server process)."""
from __future__ import annotations

from typing import Any

import msgpack
import pytest

from mpcache.core_sm.chunks import TokenIds, pack_tokens
from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.messages import Lookup
from mpcache.runtime_zmq.wire import to_event
from mpcache.runtime_zmq.wire import DecodeError, Limits, Request, decode_request, token_ids_for_wire

TOKENS = [(i * 7919) % 200_000 for i in range(1000)]


def _key(token_ids: object, **extra: Any) -> dict[str, Any]:
    k = {"model_name": "m", "world_size": 1, "worker_id": None, "token_ids": token_ids, "start": 0,
         "end": 768, "request_id": "r", "cache_salt": "", "request_configs": None, "num_kv_readers": 0}
    k.update(extra)
    return k


def _decode(key: dict[str, Any], *more: Any, limits: Limits = Limits()) -> Request | DecodeError:
    frames = [b"peer", msgpack.packb(1), msgpack.packb("lookup"), msgpack.packb(key, use_bin_type=True)]
    frames += [msgpack.packb(m) for m in more]
    r = decode_request(frames, limits)
    assert isinstance(r, (Request, DecodeError))
    return r


def _lookup(key: dict[str, Any], *more: Any) -> Lookup:
    r = _decode(key, *more)
    assert isinstance(r, Request), r
    ev = to_event(r, "rt")
    assert isinstance(ev, Lookup)
    return ev


def test_list_and_packed_token_ids_build_the_same_key() -> None:
    from_list = _lookup(_key(TOKENS))
    from_bin = _lookup(_key(pack_tokens(TOKENS)))
    assert from_list.key == from_bin.key
    assert isinstance(from_bin.key.token_ids, TokenIds) and from_bin.key.token_ids.tolist() == TOKENS


def test_packed_token_ids_are_not_copied() -> None:
    packed = pack_tokens(TOKENS)
    ev = _lookup(_key(packed))
    assert ev.key.token_ids.packed == packed


@pytest.mark.parametrize("bad", [[1, -1, 3], [2**32], [1, "x"], [None]])
def test_a_list_with_non_uint32_ids_still_builds_an_event(bad: list[object]) -> None:
    ev = _lookup(_key(bad))
    assert not ev.key.token_ids.valid and len(ev.key.token_ids) == len(bad)


@pytest.mark.parametrize(
    "token_ids,kind",
    [(b"\x00" * 6, ErrorKind.UNDECODABLE), ("abc", ErrorKind.UNDECODABLE),
     ({"a": 1}, ErrorKind.UNDECODABLE), (list(range(11)), ErrorKind.TOO_LARGE),
     (pack_tokens(range(11)), ErrorKind.TOO_LARGE)],
)
def test_bad_token_frames_are_refused_while_decoding(token_ids: object, kind: ErrorKind) -> None:
    r = _decode(_key(token_ids), limits=Limits(max_tokens=10))
    assert isinstance(r, DecodeError) and r.kind is kind


def test_client_sends_packed_ids_as_held() -> None:
    t = TokenIds.from_ints(TOKENS)
    assert token_ids_for_wire(t) == t.packed == pack_tokens(TOKENS)
    assert token_ids_for_wire(TokenIds.from_ints([1, -1])) == [1, -1]
    assert token_ids_for_wire([1, 2**33]) == [1, 2**33]


@pytest.mark.parametrize(
    "num_kv_readers,tp_size,world_size,want",
    [(0, None, 1, 1), (0, 1, 1, 1), (0, 2, 2, 1), (0, 2, 1, 2), (0, 4, 1, 4), (3, 4, 1, 3), (1, 8, 1, 1)],
)
def test_lookup_reader_counts_come_from_the_raw_wire_fields(
        num_kv_readers: int, tp_size: int | None, world_size: int, want: int) -> None:
    more = () if tp_size is None else (tp_size,)
    ev = _lookup(_key(TOKENS, num_kv_readers=num_kv_readers, world_size=world_size), *more)
    assert ev.num_readers == want


# --- the compiled list-form scanner (runtime_zmq.tokens) ------------------------------------------

from array import array  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mpcache.runtime_zmq import tokens  # noqa: E402
from mpcache.runtime_zmq.tokens import decode_key_frame  # noqa: E402

tokens.load()  # the server loads it in the background at start; here, before the tests


def _ordinary(frame: bytes) -> object:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False, use_list=True)


def _agrees(frame: bytes) -> bool:
    """The scanner either declines, or gives msgpack's map with the ids packed; True if it took
    the fast path."""
    try:
        fast = decode_key_frame(frame)
    except Exception:
        with pytest.raises(Exception):
            _ordinary(frame)
        return False
    if fast is None:
        return False
    want = _ordinary(frame)
    assert isinstance(want, dict)
    ids = want.pop("token_ids")
    got = dict(fast)
    packed = got.pop("token_ids")
    assert got == want
    assert packed == array("I", ids).tobytes()
    return True


uint32s = st.lists(st.integers(0, 2**32 - 1), max_size=300)
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=40) | st.binary(max_size=300),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(uint32s, st.dictionaries(st.text(max_size=12).filter(lambda k: k != "token_ids"), msgpack_values, max_size=6))
def test_scanner_gives_what_msgpack_gives(ids: list[int], extra: dict[str, Any]) -> None:
    frame = msgpack.packb({**extra, **_key(ids)}, use_bin_type=True)
    assert _agrees(frame)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**64 - 1) | st.none() | st.floats() | st.text(max_size=3), max_size=20))
def test_scanner_declines_ids_that_are_not_uint32(ids: list[Any]) -> None:
    frame = msgpack.packb(_key(ids), use_bin_type=True)
    took = _agrees(frame)
    assert took == all(type(t) is int and 0 <= t < 2**32 for t in ids)


@settings(max_examples=500, deadline=None)
@given(uint32s, st.data())
def test_scanner_on_corrupted_frames_never_disagrees(ids: list[int], data: st.DataObject) -> None:
    frame = bytearray(msgpack.packb(_key(ids), use_bin_type=True))
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    _agrees(bytes(frame[:cut]) if data.draw(st.booleans()) else bytes(frame) + b"\x00")
    _agrees(bytes(frame))


@pytest.mark.parametrize("ids", [[0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1], list(range(70000))])
def test_scanner_every_unsigned_width(ids: list[int]) -> None:
    assert _agrees(msgpack.packb(_key(ids)))


def test_scanner_signed_and_wide_forms_from_other_writers() -> None:
    # int8..int64 and uint64 encodings of non-negative ids, which msgpack-python never writes
    body = b"\xd0\x05" b"\xd1\x01\x00" b"\xd2\x00\x01\x00\x00" b"\xd3" + (7).to_bytes(8, "big") + b"\xcf" + (2**32 - 1).to_bytes(8, "big")
    frame = b"\x81\xa9token_ids\x95" + body
    assert decode_key_frame(frame) == {"token_ids": array("I", [5, 256, 65536, 7, 2**32 - 1]).tobytes()}
    assert decode_key_frame(b"\x81\xa9token_ids\x91\xcf" + (2**32).to_bytes(8, "big")) is None
    assert decode_key_frame(b"\x81\xa9token_ids\x91\xd0\xff") is None


def test_scanner_switches_between_its_fast_and_checked_loops_mid_array() -> None:
    # the common forms are decoded by a branch-free loop while 5 bytes remain; another writer's
    # form mid-array, or the last ids of the frame, go to the checked loop, which reads the
    # rest: every id must come out in order whichever loop read it
    common = [3, 200, 70000, 127, 65535, 2**32 - 1, 0, 128]
    signed = b"\xd1\x01\x00"  # int16 256
    body = msgpack.packb(common)[1:] + signed + msgpack.packb(common)[1:]
    ids = [*common, 256, *common]
    head = b"\xdc" + len(ids).to_bytes(2, "big")
    for tail_field in (b"", b"\xa1x\x05"):
        frame = bytes([0x81 + (1 if tail_field else 0)]) + b"\xa9token_ids" + head + body + tail_field
        got = decode_key_frame(frame)
        assert got is not None and got["token_ids"] == array("I", ids).tobytes()
    for n in range(1, 7):  # arrays ending in each width, right at the end of the frame
        tail = common[-n:] + [2**32 - 1, 70000][: n % 2 + 1]
        assert _agrees(msgpack.packb(_key(tail)))


def test_scanner_declines_duplicates_bins_and_non_maps() -> None:
    one = msgpack.packb([1, 2])
    assert decode_key_frame(b"\x82\xa9token_ids" + one + b"\xa9token_ids" + one) is None
    # the same key as a str8 counts as a duplicate too (msgpack keeps the last)
    assert decode_key_frame(b"\x82\xa9token_ids" + one + b"\xd9\x09token_ids" + one) is None
    assert decode_key_frame(msgpack.packb({"token_ids": b"\x01\x00\x00\x00"}, use_bin_type=True)) is None
    assert decode_key_frame(msgpack.packb([1, 2, 3])) is None
    assert decode_key_frame(b"") is None


def test_scanner_header_counts_beyond_the_frame_allocate_nothing() -> None:
    # an array32 header claiming 2**32-1 ids in a 20-byte frame is declined before any allocation
    assert decode_key_frame(b"\x81\xa9token_ids\xdd\xff\xff\xff\xff\x01") is None
    assert decode_key_frame(b"\xdf\xff\xff\xff\xff") is None


def test_list_form_limit_is_enforced_through_the_scanner() -> None:
    r = _decode(_key(list(range(100))), limits=Limits(max_tokens=99))
    assert isinstance(r, DecodeError) and r.kind is ErrorKind.TOO_LARGE


def test_before_the_scanner_is_loaded_every_frame_takes_the_ordinary_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tokens, "_scan_frame", None)
    assert not tokens.ready()
    assert decode_key_frame(msgpack.packb(_key(TOKENS))) is None
    assert _lookup(_key(TOKENS)).key.token_ids.tolist() == TOKENS


def test_without_numba_the_scanner_is_one_warning_and_list_ids_still_decode() -> None:
    # a server installed without numba (or numpy) starts and serves; its background load used to
    # die with a traceback on its thread
    import os
    import subprocess
    import sys

    script = r'''
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("numba", "llvmlite"):
            raise ImportError("No module named %r" % name)
sys.meta_path.insert(0, Block())
import logging, msgpack
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
from mpcache.runtime_zmq import tokens, wire
tokens.load_in_background().join(60)
assert not tokens.ready()
key = {"model_name": "m", "world_size": 1, "worker_id": None, "token_ids": list(range(300)), "start": 0,
       "end": 300, "request_id": "r", "cache_salt": "", "request_configs": None, "num_kv_readers": 0}
r = wire.decode_request([b"p", msgpack.packb(1), msgpack.packb("lookup"), msgpack.packb(key)], wire.Limits())
assert isinstance(r, wire.Request), r
print("decoded", len(r.args[0].key.token_ids))
'''
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=repo))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "decoded 300", out.stdout
    assert "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("WARNING mpcache.tokens: list-form token ids are decoded by msgpack") == 1, out.stderr


# --- a lookup's ranks (tensor-parallel ranks spread over several servers) --------------------------

def test_a_lookups_ranks_travel_and_bad_ones_are_refused() -> None:
    """Before the trailing ``ranks`` payload, a server holding rank 1 of 2 was asked for both
    ranks and missed every lookup (tests/runtime_zmq/test_adapters.py, two servers two ranks)."""
    from mpcache.core_sm.messages import CacheKey
    from mpcache.runtime_zmq.wire import request_to_wire

    key = CacheKey(model_name="m", world_size=2, worker_id=None, token_ids=tuple(TOKENS[:512]), start=0,
                   end=512, request_id="r")
    for ranks in ((1,), (0, 1), None):
        op, payloads = request_to_wire(Lookup(key, ranks=ranks))
        assert op == "lookup" and len(payloads) == (2 if ranks is None else 3)
        encoded = dict(payloads[0])
        encoded["token_ids"] = list(key.token_ids)
        assert _lookup(encoded, *payloads[1:]).ranks == ranks
    assert _lookup(_key(TOKENS, world_size=2), 1).ranks is None  # LMCache's client: every rank
    bad = _decode(_key(TOKENS, world_size=2), 1, "one")
    assert isinstance(bad, DecodeError) and bad.kind == ErrorKind.UNDECODABLE
