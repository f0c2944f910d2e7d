"""Token ids and reader counts from the wire into core_sm events (no server process)."""
from __future__ import annotations

from typing import Any

import msgpack
import pytest

from core_sm.chunks import TokenIds, pack_tokens
from core_sm.messages import Lookup
from runtime_zmq.bridge import to_event
from runtime_zmq.wire import DecodeError, Limits, Request, WireErrorKind, decode_request, token_ids_for_wire

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
    [(b"\x00" * 6, WireErrorKind.UNDECODABLE), ("abc", WireErrorKind.UNDECODABLE),
     ({"a": 1}, WireErrorKind.UNDECODABLE), (list(range(11)), WireErrorKind.TOO_LARGE),
     (pack_tokens(range(11)), WireErrorKind.TOO_LARGE)],
)
def test_bad_token_frames_are_refused_while_decoding(token_ids: object, kind: WireErrorKind) -> None:
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
