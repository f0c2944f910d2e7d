from __future__ import annotations

import hashlib
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from mpcache.core_sm.chunks import (
    CHUNK_HASH_SIZE,
    DEFAULT_CHUNK_SIZE,
    ChunkChain,
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


def _block(role: bytes, key: bytes) -> bytes:
    return (b"mpcache-chunk-v3/" + role + b"/" + key).ljust(64, b"\0")


def _root_v3(key: bytes, model: str, world_size: int, salt: str) -> bytes:
    body = b"".join(struct.pack("<Q", len(f)) + f for f in (model.encode(), salt.encode()))
    return hashlib.sha256(_block(b"root", key) + body + struct.pack("<Q", world_size)).digest()[:16]


KEY = bytes(range(32))
PINNED_ROOT = "f3f4aa3c90cf1225f2b9de01d188f1a3"  # the public chain (all-zero key)
PINNED_CHUNK = "c205809da5ba449d0dfd74fde929f0c4"
PINNED_KEYED_CHUNK = "9b24e7a3a93c9b632df5aaba474c6e36"  # KEY


def test_hash_layout_is_truncated_keyed_sha256_over_prev_and_le_uint32() -> None:
    # An independent re-statement of the documented layout (v3): root, then one SHA-256 of the
    # key block, the previous hash and the chunk's packed ids per chunk, kept to 16 bytes.
    chain = ChunkChain(KEY)
    root = chain.root("m", 2, "s")
    assert root == _root_v3(KEY, "m", 2, "s")
    toks = [1, 2, 3, 0xFFFFFFFF, 7, 8, 9, 10]
    h1 = hashlib.sha256(_block(b"step", KEY) + root + struct.pack("<4I", *toks[:4])).digest()[:16]
    h2 = hashlib.sha256(_block(b"step", KEY) + h1 + struct.pack("<4I", *toks[4:])).digest()[:16]
    assert chain.hashes(toks, 4, root) == (h1, h2)
    assert chunk_hashes(toks, 4, root, chain=chain) == (h1, h2)
    assert len(h1) == CHUNK_HASH_SIZE == 16
    assert pack_tokens([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


def test_hashes_are_pinned_across_processes_and_releases() -> None:
    # Known-answer vectors: a change here orphans every persisted L2 object, so it must be a
    # deliberate layout-version bump, never an accident.
    assert identity_root("m", 1).hex() == PINNED_ROOT
    assert chunk_hashes(list(range(256)), 256, identity_root("llama", 2, "s"))[0].hex() == PINNED_CHUNK
    keyed = ChunkChain(KEY)
    assert keyed.hashes(list(range(256)), 256, keyed.root("llama", 2, "s"))[0].hex() == PINNED_KEYED_CHUNK


def test_the_key_changes_every_hash_and_cannot_be_guessed_from_them() -> None:
    toks = list(range(1024))
    a, b = ChunkChain(KEY), ChunkChain(bytes(31) + b"\x01")
    ha = a.hashes(toks, 256, a.root("m", 1))
    hb = b.hashes(toks, 256, b.root("m", 1))
    assert len(ha) == len(hb) == 4 and not set(ha) & set(hb)
    # a hash leaked (KV events publish them) does not let anyone continue the chain without the
    # key: the next chunk under another key from the same previous hash differs
    assert b.hashes(toks[256:512], 256, ha[0]) != (ha[1],)
    assert a.hashes(toks[256:512], 256, ha[0]) == (ha[1],)
    assert a.fingerprint != b.fingerprint and KEY.hex() not in repr(a)


@pytest.mark.parametrize("key", [b"", bytes(31), bytes(33), "0" * 32, bytearray(32)])
def test_a_chain_key_is_32_bytes(key: object) -> None:
    with pytest.raises(ValueError):
        ChunkChain(key)  # type: ignore[arg-type]


def test_keys_of_older_layouts_are_never_produced() -> None:
    # v1 (blake2b-256, 32 bytes) and v2 (unkeyed XXH3-128) named the L2 objects written before
    # the hash changed; no v3 key equals one, so such objects are misses (never read as KV).
    def old_root(version: bytes, hasher: object) -> bytes:
        h = hasher()  # type: ignore[operator]
        h.update(version)
        for field in (b"llama", b"s"):
            h.update(struct.pack("<Q", len(field)) + field)
        h.update(struct.pack("<Q", 2))
        return h.digest()  # type: ignore[no-any-return]

    r1 = old_root(b"mpcache-chunk-v1", lambda: hashlib.blake2b(digest_size=32))
    v1 = hashlib.blake2b(r1 + struct.pack("<256I", *range(256)), digest_size=32).digest()
    assert v1.hex() == "397b79ac03cabefd9c6e020e556d7fb4ba545c634e0995ddc7e8f0e00c7f382c"
    v2 = xxhash.xxh3_128_digest(old_root(b"mpcache-chunk-v2", xxhash.xxh3_128) + struct.pack("<256I", *range(256)))
    assert v2.hex() == "4abae4e9afc14195f284385b55a8ac6b"
    new = chunk_hashes(list(range(256)), 256, identity_root("llama", 2, "s"))[0]
    for old in (v1, v2):
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
    from mpcache.core_sm.chunks import PackedHashes, pack_hashes

    packed = pack_hashes(hashes)
    assert isinstance(packed, PackedHashes) or not hashes
    assert len(packed) == len(hashes) and list(packed) == hashes
    for i in range(-len(hashes), len(hashes)):
        assert packed[i] == hashes[i]
    assert tuple(packed[1:5]) == tuple(hashes[1:5])
    with pytest.raises(IndexError):
        packed[len(hashes)]


def test_mixed_size_hashes_stay_a_tuple() -> None:
    from mpcache.core_sm.chunks import pack_hashes

    mixed = (b"a" * 16, b"b" * 32)
    assert pack_hashes(mixed) == mixed
