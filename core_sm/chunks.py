"""Chunk keys: which L1/L2 object a run of tokens maps to.

* Only **full** chunks of ``chunk_size`` tokens (default 256) are hashed, stored, looked up or
  counted; trailing tokens are ignored.
* The hash is prefix-chained: ``h_0 = identity_root(model_name, world_size, cache_salt)``,
  ``h_i = blake2b-256(h_{i-1} || tokens[(i-1)C : iC] as little-endian uint32)``. So chunk ``i``'s
  hash identifies the whole prefix up to its end, and two requests share a chunk's object only if
  they share the whole prefix, the model, the KV world size and the cache salt.
* The root is a fixed function of its inputs (no process seed), so hashes are identical across
  processes, restarts and servers sharing an L2 tier.
* One object = one chunk of one KV rank: ``ObjectKey(chunk_hash, kv_rank)``.

Errors: ``chunk_hashes`` raises ``ValueError`` for a token id outside ``[0, 2**32)`` and
``TypeError`` for a non-int; machines catch that and answer ``ErrorKind.VALIDATION``.
"""
from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

import attrs

DEFAULT_CHUNK_SIZE = 256
MAX_CACHE_SALT_LEN = 128
_FORBIDDEN_SALT_CHARS = ("@", "/", "\\", "\x00")
_DIGEST_SIZE = 32
# Bumped only if the hash layout changes: a new version makes every old L2 object a miss,
# which is the safe failure.
_HASH_LAYOUT_VERSION = b"mpcache-chunk-v1"
_BYTESWAP = sys.byteorder != "little"
assert array("I").itemsize == 4, "uint32 packing needs a 4-byte array('I')"


def validate_cache_salt(cache_salt: object) -> str | None:
    """Return None if ``cache_salt`` is acceptable, else the reason (for a VALIDATION error).

    A salt is a str of at most 128 characters without ``@``, ``/``, ``\\`` or NUL.
    """
    if not isinstance(cache_salt, str):
        return f"cache_salt must be a str, not {type(cache_salt).__name__}"
    if len(cache_salt) > MAX_CACHE_SALT_LEN:
        return f"cache_salt longer than {MAX_CACHE_SALT_LEN} characters ({len(cache_salt)})"
    for ch in _FORBIDDEN_SALT_CHARS:
        if ch in cache_salt:
            return f"cache_salt contains a forbidden character {ch!r}"
    return None


def identity_root(model_name: str, world_size: int, cache_salt: str = "") -> bytes:
    """The chain's starting value ``h_0``: folds model name, KV world size and cache salt.

    Each field is length-prefixed so no two different identities serialize alike.
    Raises ``ValueError`` for an invalid salt or a world size < 1.
    """
    reason = validate_cache_salt(cache_salt)
    if reason is not None:
        raise ValueError(reason)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, not {world_size}")
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    h.update(_HASH_LAYOUT_VERSION)
    for field in (model_name.encode("utf-8"), cache_salt.encode("utf-8")):
        h.update(struct.pack("<Q", len(field)))
        h.update(field)
    h.update(struct.pack("<Q", world_size))
    return h.digest()


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (raises ValueError/TypeError if not uint32)."""
    packed = array("I", token_ids)
    if _BYTESWAP:
        packed.byteswap()
    return packed.tobytes()


def num_full_chunks(num_tokens: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """How many full chunks ``num_tokens`` tokens hold."""
    return num_tokens // chunk_size


def chunk_hashes(
    token_ids: Sequence[int],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    root: bytes = b"",
    num_chunks: int | None = None,
) -> tuple[bytes, ...]:
    """Prefix-chained hashes of the full chunks of ``token_ids`` (32 bytes each).

    ``num_chunks`` limits the work to the first chunks (default: every full chunk).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, not {chunk_size}")
    n = len(token_ids) // chunk_size
    if num_chunks is not None:
        n = min(n, max(0, num_chunks))
    if n == 0:
        return ()
    data = pack_tokens(token_ids[: n * chunk_size])
    step = chunk_size * 4
    out: list[bytes] = []
    prev = root
    blake2b = hashlib.blake2b
    for i in range(n):
        h = blake2b(prev, digest_size=_DIGEST_SIZE)
        h.update(data[i * step : (i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return tuple(out)


@attrs.frozen(order=True)
class ObjectKey:
    """One L1/L2 object: one chunk (by its prefix hash) of one KV rank."""

    chunk_hash: bytes
    kv_rank: int

    def wire_name(self) -> str:
        """A stable printable name (L2 file/Redis key): hex hash, then the rank."""
        return f"{self.chunk_hash.hex()}-{self.kv_rank}"
