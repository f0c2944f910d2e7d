"""Packed token ids (``TokenIds``), the keys built from them, and LMCache's reader-count rule."""
from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpcache.core_sm.chunks import ObjectKey, TokenIds, as_token_ids, chunk_hashes, identity_root, pack_tokens
from mpcache.core_sm.errors import ErrorKind
from mpcache.core_sm.messages import CacheKey, EndSession, FreeLookupLocks, Lookup, QueryPrefetchStatus, lookup_num_readers
from mpcache.core_sm.server import LookupServer, RequestKey, ServerConfig
from sm_helpers import C, MODEL, ServerHarness, key, tokens

# 8292 tokens spread over the whole uint32 range: 32 full chunks of 256 and a partial one.
PINNED_TOKENS = [(i * 2654435761) % 2**32 for i in range(8192 + 100)]
# Hash layout v3 (keyed SHA-256 per chunk, here the public chain; v2 XXH3-128, v1 blake2b-256). Disk and Redis L2 objects are keyed by
# these hashes: this must never change by accident, only with a layout-version bump.
PINNED_CHAIN_SHA256 = "41c39db4118281840774e0daa991efbfda0a9a49c763a4b3f5749021d402bb87"
PINNED_FIRST = "5a7bb7f48ca10ec98b89a5dc40c27fcd"
PINNED_LAST = "591c709d04d4f8604aa89ffa4a65e244"


def _le_bytes(toks: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in toks)


@pytest.mark.parametrize("form", ["list", "tuple", "from_ints", "from_packed", "cache_key"])
def test_chunk_hashes_are_pinned_whatever_the_token_form(form: str) -> None:
    toks = {
        "list": PINNED_TOKENS,
        "tuple": tuple(PINNED_TOKENS),
        "from_ints": TokenIds.from_ints(PINNED_TOKENS),
        "from_packed": TokenIds.from_packed(_le_bytes(PINNED_TOKENS)),
        "cache_key": CacheKey("m", 4, None, _le_bytes(PINNED_TOKENS), 0, 8192, "r").token_ids,
    }[form]
    hashes = chunk_hashes(toks, 256, identity_root("pinned/model", 4, "salt-1"))
    assert len(hashes) == 32
    assert hashes[0].hex() == PINNED_FIRST and hashes[-1].hex() == PINNED_LAST
    assert hashlib.sha256(b"".join(hashes)).hexdigest() == PINNED_CHAIN_SHA256


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=70), st.integers(1, 9), st.one_of(st.none(), st.integers(-1, 12)))
def test_packed_and_int_forms_hash_alike(toks: list[int], chunk: int, num_chunks: int | None) -> None:
    root = identity_root("m", 1)
    packed = TokenIds.from_packed(_le_bytes(toks))
    want = chunk_hashes(toks, chunk, root, num_chunks)
    assert chunk_hashes(packed, chunk, root, num_chunks) == want
    assert chunk_hashes(TokenIds.from_ints(toks), chunk, root, num_chunks) == want
    # a slice of the packed form hashes like the same slice of the ints
    assert chunk_hashes(packed[: chunk * 2], chunk, root) == chunk_hashes(toks[: chunk * 2], chunk, root)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.data())
def test_token_ids_behave_as_a_sequence_of_ints(toks: list[int], data: st.DataObject) -> None:
    t = TokenIds.from_packed(_le_bytes(toks))
    assert len(t) == len(toks) and list(t) == toks and t.tolist() == toks
    assert t == TokenIds.from_ints(toks) == TokenIds(tuple(toks)) == as_token_ids(t)
    assert hash(t) == hash(TokenIds.from_ints(toks))
    assert t.packed == pack_tokens(toks) == _le_bytes(toks)
    if toks:
        i = data.draw(st.integers(-len(toks), len(toks) - 1))
        assert t[i] == toks[i]
    sl = slice(data.draw(st.integers(-50, 50)), data.draw(st.integers(-50, 50)), data.draw(st.sampled_from([None, 1, 2, -1])))
    assert t[sl].tolist() == toks[sl]
    with pytest.raises(IndexError):
        t[len(toks)]


def test_token_ids_are_immutable_hashable_and_picklable() -> None:
    t = TokenIds.from_ints([1, 2, 3])
    with pytest.raises(AttributeError):
        t._packed = b""
    assert pickle.loads(pickle.dumps(t)) == t
    assert {t: 1}[TokenIds.from_packed(pack_tokens([1, 2, 3]))] == 1
    assert t != (1, 2, 3) and t != TokenIds.from_ints([1, 2])
    assert repr(t) == "TokenIds([1, 2, 3])"
    assert repr(TokenIds.from_ints(range(5000))) == "TokenIds([0, 1, 2, 3], ... 5000 tokens)"


@pytest.mark.parametrize("bad", [b"\x00" * 5, bytearray(8), "abcd"])
def test_malformed_packed_tokens_are_refused(bad: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        as_token_ids(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [[1, -1], [2**32], [1, "a"], [1.5]])
def test_non_uint32_tokens_are_kept_and_refused_when_hashed(bad: list[object]) -> None:
    t = TokenIds.from_ints(bad)  # type: ignore[arg-type]
    assert not t.valid and len(t) == len(bad) and list(t) == bad
    with pytest.raises((TypeError, ValueError, OverflowError)):
        t.packed
    with pytest.raises((TypeError, ValueError, OverflowError)):
        chunk_hashes(t, 1)


def test_cache_keys_from_either_form_are_equal() -> None:
    toks = tokens(3)
    a = CacheKey(MODEL, 1, None, toks, 0, 3 * C, "r")
    b = CacheKey(MODEL, 1, None, pack_tokens(toks), 0, 3 * C, "r")
    c = CacheKey(MODEL, 1, None, list(toks), 0, 3 * C, "r")
    assert a == b == c and hash(a) == hash(b)
    assert isinstance(a.token_ids, TokenIds) and len(b.token_ids) == 3 * C


def test_server_serves_packed_keys_like_int_keys() -> None:
    h = ServerHarness()
    h.register()
    toks = tokens(4, extra=3)
    h.store(toks, end=3 * C)
    packed = pack_tokens(toks)
    k = CacheKey(MODEL, 1, None, packed, 0, 4 * C, "p")
    assert h.call(Lookup(k)) is None
    assert h.call(QueryPrefetchStatus("p")) == 3
    assert h.server.leases_of("p") == 3
    # FREE with the int form releases the leases the packed form took, and only the range's
    assert h.call(FreeLookupLocks(key("p", toks, 2 * C, 4 * C))) is None
    assert h.server.leases_of("p") == 2
    assert h.call(EndSession("p")) is None
    assert h.server.leases_of("p") == 0


@pytest.mark.parametrize("toks", [(1, 2, -1, 4), (1, 2, 3, 2**32), (1, 2, 3, "x")])
def test_non_uint32_token_in_a_key_is_a_validation_error(toks: tuple[object, ...]) -> None:
    h = ServerHarness()
    k = CacheKey(MODEL, 1, None, toks, 0, C, "r")  # type: ignore[arg-type]
    assert h.error_kind(h.send(Lookup(k))) is ErrorKind.VALIDATION
    assert h.server.stats()["internal_errors"] == 0


def test_range_checks_count_tokens_not_bytes() -> None:
    h = ServerHarness()
    k = CacheKey(MODEL, 1, None, pack_tokens(tokens(1)), 0, 2 * C, "r")  # end past the tokens
    assert h.error_kind(h.send(Lookup(k))) is ErrorKind.VALIDATION


def test_lookup_leases_the_prefix_of_every_rank_once_per_reader() -> None:
    h = ServerHarness()
    h.register(world_size=2)
    toks = tokens(3)
    for rank in range(2):
        h.store(toks, worker_id=rank, world_size=2, end=2 * C)
    assert h.call(Lookup(key("r", toks, world_size=2), 3)) is None
    assert h.call(QueryPrefetchStatus("r")) == 2
    assert sorted(h.server.index.keys_leased_by(RequestKey(None, "r"))) == sorted(
        ObjectKey(hh, r) for hh in chunk_hashes(toks, C, identity_root(MODEL, 2))[:2] for r in range(2))
    assert h.server.leases_of("r") == 2 * 2 * 3


def test_an_overridden_per_object_lease_hook_still_sees_every_object() -> None:
    calls: list[tuple[RequestKey, ObjectKey, int]] = []

    class Recording(LookupServer):
        def _lease_for_lookup(self, owner: RequestKey, key: ObjectKey, num_readers: int, now: float) -> None:
            calls.append((owner, key, num_readers))
            super()._lease_for_lookup(owner, key, num_readers, now)

    h = ServerHarness(server=Recording(ServerConfig(chunk_size=C, num_slots=64, slot_bytes=100)))
    h.register()
    toks = tokens(3)
    h.store(toks)
    assert h.call(Lookup(key("r", toks), 2)) is None
    hashes: Sequence[bytes] = chunk_hashes(toks, C, identity_root(MODEL, 1))
    assert calls == [(RequestKey(None, "r"), ObjectKey(hh, 0), 2) for hh in hashes]
    assert h.server.leases_of("r") == 6


# ------------------------------------------------------------------------------ reader counts

@pytest.mark.parametrize(
    "num_kv_readers,tp_size,world_size,want",
    [
        (0, None, 1, 1),  # nothing given: one reader per object
        (0, 1, 1, 1),
        (0, 0, 4, 1),  # tp_size <= 1 falls back to world_size: extra 0
        (0, 2, 2, 1),  # plain TP: each rank reads its own objects
        (0, 4, 4, 1),
        (0, 2, 1, 2),  # MLA, TP 2: world_size = total / TP = 1, two ranks read each object
        (0, 8, 2, 8),  # tp > world_size: extra = tp - 1
        (3, 8, 2, 3),  # a later key's num_kv_readers wins; tp_size is a legacy field then
        (1, 4, 1, 1),
        (2, None, 1, 2),
        (-1, 2, 1, 2),  # a non-positive num_kv_readers counts as not given
    ],
)
def test_lookup_num_readers_follows_lmcache(num_kv_readers: int, tp_size: int | None, world_size: int,
                                            want: int) -> None:
    assert lookup_num_readers(num_kv_readers, tp_size, world_size) == want
