from __future__ import annotations

import hashlib
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from core_sm.chunks import (
    CHUNK_HASH_SIZE,
    DEFAULT_CHUNK_SIZE,
    ObjectKey,
    chunk_hashes,
    identity_root,
    pack_tokens,
    validate_cache_salt,
)

tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=40)


def test_only_full_chunks_are_hashed() -> None:
    root = identity_root("m", 1)
    assert chunk_hashes(list(range(255)), 256, root) == ()
    assert len(chunk_hashes(list(range(256)), 256, root)) == 1
    assert len(chunk_hashes(list(range(1023)), 256, root)) == 3
    assert len(chunk_hashes(list(range(1024)), 256, root, num_chunks=2)) == 2


def _root_v(version: bytes, model: str, world_size: int, salt: str, hasher: object) -> bytes:
    h = hasher()  # type: ignore[operator]
    h.update(version)
    for field in (model.encode(), salt.encode()):
        h.update(struct.pack("<Q", len(field)) + field)
    h.update(struct.pack("<Q", world_size))
    return h.digest()  # type: ignore[no-any-return]


def test_hash_layout_is_xxh3_128_over_prev_and_le_uint32() -> None:
    # An independent re-statement of the documented layout (v2): root, then one XXH3-128 per chunk.
    root = identity_root("m", 2, "s")
    assert root == _root_v(b"mpcache-chunk-v2", "m", 2, "s", xxhash.xxh3_128)
    toks = [1, 2, 3, 0xFFFFFFFF, 7, 8, 9, 10]
    h1 = xxhash.xxh3_128_digest(root + struct.pack("<4I", *toks[:4]))
    h2 = xxhash.xxh3_128_digest(h1 + struct.pack("<4I", *toks[4:]))
    assert chunk_hashes(toks, 4, root) == (h1, h2)
    assert len(h1) == CHUNK_HASH_SIZE == 16
    assert pack_tokens([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_hashes_are_pinned_across_processes_and_releases() -> None:
    # Known-answer vectors: a change here orphans every persisted L2 object, so it must be a
    # deliberate layout-version bump, never an accident.
    assert identity_root("m", 1).hex() == "0e95d151f8677c32de10898568201ade"
    assert chunk_hashes(list(range(256)), 256, identity_root("llama", 2, "s"))[0].hex() == "4abae4e9afc14195f284385b55a8ac6b"


def test_keys_of_the_v1_layout_are_never_produced() -> None:
    # v1 (blake2b-256, 32 bytes) named the L2 objects written before the hash changed; no v2 key
    # can equal one, so such objects are misses (never read as this layout's KV).
    old_root = _root_v(b"mpcache-chunk-v1", "llama", 2, "s", lambda: hashlib.blake2b(digest_size=32))
    old = hashlib.blake2b(old_root + struct.pack("<256I", *range(256)), digest_size=32).digest()
    assert old.hex() == "397b79ac03cabefd9c6e020e556d7fb4ba545c634e0995ddc7e8f0e00c7f382c"
    new = chunk_hashes(list(range(256)), 256, identity_root("llama", 2, "s"))[0]
    assert new != old[:CHUNK_HASH_SIZE] and ObjectKey(new, 0).wire_name() != ObjectKey(old, 0).wire_name()


@pytest.mark.parametrize(
    "a,b",
    [(("m", 1, ""), ("m", 2, "")), (("m", 1, ""), ("n", 1, "")), (("m", 1, ""), ("m", 1, "x")),
     (("ab", 1, "c"), ("a", 1, "bc"))],
)
def test_identity_folds_model_world_size_salt(a: tuple[str, int, str], b: tuple[str, int, str]) -> None:
    assert identity_root(*a) != identity_root(*b)


@settings(max_examples=60, deadline=None)
@given(tokens_st, tokens_st)
def test_prefix_chaining(a: list[int], b: list[int]) -> None:
    root = identity_root("m", 1)
    ha, hb = chunk_hashes(a, 4, root), chunk_hashes(b, 4, root)
    for i in range(min(len(ha), len(hb))):
        same_prefix = a[: 4 * (i + 1)] == b[: 4 * (i + 1)]
        assert (ha[i] == hb[i]) == same_prefix
    assert chunk_hashes(a + b, 4, root)[: len(a) // 4] == ha


@pytest.mark.parametrize("salt", ["", "abc", "x" * 128, "tenant-1_ä"])
def test_valid_salts(salt: str) -> None:
    assert validate_cache_salt(salt) is None


@pytest.mark.parametrize("salt", ["x" * 129, "a@b", "a/b", "a\\b", "a\x00b", 5, None])
def test_invalid_salts(salt: object) -> None:
    assert validate_cache_salt(salt) is not None
    if isinstance(salt, str):
        with pytest.raises(ValueError):
            identity_root("m", 1, salt)


@pytest.mark.parametrize("bad", [[-1], [2**32], ["a"]])
def test_bad_tokens_raise_typed(bad: list[object]) -> None:
    with pytest.raises((ValueError, TypeError, OverflowError)):
        chunk_hashes(bad * 4, 4, b"")  # type: ignore[arg-type]


def test_object_key() -> None:
    k = ObjectKey(b"\x01\x02", 3)
    assert k.wire_name() == "0102-3"
    assert k == ObjectKey(b"\x01\x02", 3) and k < ObjectKey(b"\x01\x02", 4)
    assert DEFAULT_CHUNK_SIZE == 256


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=16, max_size=16), max_size=40))
def test_packed_hashes_index_like_the_tuple(hashes: list[bytes]) -> None:
    from core_sm.chunks import PackedHashes, pack_hashes

    packed = pack_hashes(hashes)
    assert isinstance(packed, PackedHashes) or not hashes
    assert len(packed) == len(hashes) and list(packed) == hashes
    for i in range(-len(hashes), len(hashes)):
        assert packed[i] == hashes[i]
    assert tuple(packed[1:5]) == tuple(hashes[1:5])
    with pytest.raises(IndexError):
        packed[len(hashes)]


def test_mixed_size_hashes_stay_a_tuple() -> None:
    from core_sm.chunks import pack_hashes

    mixed = (b"a" * 16, b"b" * 32)
    assert pack_hashes(mixed) == mixed
