"""Tenant-safe chunk keys: everything besides model, ranks, salt and tokens that changes the KV.

Two requests may share a chunk's object only if every input that shaped that chunk's KV is the
same. ``mpcache.core_sm.chunks`` folds model name, KV world size, cache salt and token ids; a
``KeyExtras`` carries the rest:

* ``identity`` -- one string for what holds for the whole request: the LoRA adapter (name and
  path, as vLLM's own prefix cache keys it), the KV cache dtype, the model revision, dtype and
  quantization, and an operator-given model identity. ``request_identity`` builds it
  canonically; the server folds it into the chain's root, so it applies to every chunk,
  decode chunks included.
* ``chunk_extras`` -- per full chunk ``i`` of the key (from token 0), a digest of that chunk's
  own extra keys (multimodal input hashes with their offsets, prompt-embedding hashes; vLLM's
  block extra keys), ``b""`` for a chunk with none; chunks past the tuple's end have none.
  ``chunk_extra_digest`` builds one from vLLM's extra-key tuples.

Hash layout, with ``h_i`` from ``mpcache.core_sm.chunks.ChunkChain.hashes`` (keyed by the chain key): ``root' = root`` when
``identity`` is empty, else ``blake2b(root || "id" || len || identity)``; a chunk with a
non-empty extra ``e_i`` is ``h_i' = blake2b(h_i || "ck" || len || e_i)`` (digests as long as the
chain's, ``CHUNK_HASH_SIZE``) and the chain
continues from ``h_i'``. A key with no extras hashes exactly as before (LMCache's own client,
which sends none, keeps its hits), and no keyed input serializes like an unkeyed one.

Errors: ``validate_extras`` returns the reason an extras value is refused (for a VALIDATION
error); ``chunk_extra_digest`` raises ``TypeError`` for an extra key it cannot encode
unambiguously (the caller must then not cache the request: never guess a key).
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import attrs

from mpcache.core_sm.chunks import CHUNK_HASH_SIZE, PUBLIC_CHAIN, ChunkChain, TokenIds

MAX_IDENTITY_LEN = 1024
MAX_CHUNK_EXTRA_LEN = 64
# Keyed roots and chunks are as long as core_sm.chunks' own hashes (one ObjectKey layout).
_DIGEST_SIZE = CHUNK_HASH_SIZE
_EXTRA_DIGEST_SIZE = 16


def _bytes_tuple(values: Sequence[bytes]) -> tuple[bytes, ...]:
    return tuple(values)


@attrs.frozen
class KeyExtras:
    """The identity of a request's KV beyond model/ranks/salt/tokens (see the module doc).
    The default (empty) is what LMCache's client implies: nothing extra."""

    identity: str = ""
    chunk_extras: tuple[bytes, ...] = attrs.field(default=(), converter=_bytes_tuple)

    @property
    def empty(self) -> bool:
        return not self.identity and not any(self.chunk_extras)

    def prefix(self, num_chunks: int) -> KeyExtras:
        """The same extras for a key of ``num_chunks`` chunks (per-chunk extras beyond dropped)."""
        if len(self.chunk_extras) <= num_chunks:
            return self
        return KeyExtras(self.identity, self.chunk_extras[:num_chunks])


NO_EXTRAS = KeyExtras()


def validate_extras(extras: object, max_chunks: int) -> str | None:
    """None if ``extras`` is acceptable for a key of at most ``max_chunks`` chunks, else why not."""
    if not isinstance(extras, KeyExtras):
        return "key extras must be a KeyExtras"
    if not isinstance(extras.identity, str):
        return "key identity must be a str"
    if len(extras.identity) > MAX_IDENTITY_LEN:
        return f"key identity longer than {MAX_IDENTITY_LEN} characters ({len(extras.identity)})"
    if len(extras.chunk_extras) > max_chunks:
        return f"{len(extras.chunk_extras)} chunk extras for at most {max_chunks} chunks"
    for extra in extras.chunk_extras:
        if type(extra) is not bytes or len(extra) > MAX_CHUNK_EXTRA_LEN:
            return f"a chunk extra must be bytes of at most {MAX_CHUNK_EXTRA_LEN}"
    return None


def _field(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<Q", len(value)) + value


def keyed_root(root: bytes, identity: str) -> bytes:
    """The chain's root with the request identity folded in (``root`` itself when empty)."""
    if not identity:
        return root
    return hashlib.blake2b(root + _field(b"id", identity.encode("utf-8")), digest_size=_DIGEST_SIZE).digest()


def keyed_chunk_hashes(
    token_ids: TokenIds | Sequence[int],
    chunk_size: int,
    root: bytes,
    num_chunks: int,
    chunk_extras: Sequence[bytes] = (),
    chain: ChunkChain = PUBLIC_CHAIN,
) -> tuple[bytes, ...]:
    """Prefix-chained hashes of the first ``num_chunks`` full chunks under ``chain``, with
    per-chunk extras folded in (the module doc's layout). Without extras: ``chain.hashes``."""
    last_keyed = max((i + 1 for i, e in enumerate(chunk_extras[:num_chunks]) if e), default=0)
    if last_keyed == 0:
        return chain.hashes(token_ids, chunk_size, root, num_chunks)
    n = min(num_chunks, len(token_ids) // chunk_size)
    out: list[bytes] = []
    prev = root
    for i in range(min(last_keyed, n)):
        (h,) = chain.hashes(token_ids[i * chunk_size : (i + 1) * chunk_size], chunk_size, prev, 1)
        extra = chunk_extras[i]
        if extra:
            h = hashlib.blake2b(h + _field(b"ck", extra), digest_size=_DIGEST_SIZE).digest()
        out.append(h)
        prev = h
    if n > last_keyed:
        out.extend(chain.hashes(token_ids[last_keyed * chunk_size :], chunk_size, prev, n - last_keyed))
    return tuple(out)


def _encode(value: object, out: list[bytes]) -> None:
    # Tagged and length-prefixed, so no two different extra keys encode alike.
    if value is None:
        out.append(b"n")
    elif isinstance(value, bool):
        out.append(b"T" if value else b"F")
    elif isinstance(value, int):
        text = str(value).encode()
        out.append(_field(b"i", text))
    elif isinstance(value, str):
        out.append(_field(b"s", value.encode("utf-8")))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        out.append(_field(b"b", bytes(value)))
    elif isinstance(value, (tuple, list)):
        out.append(_field(b"t", struct.pack("<Q", len(value))))
        for item in value:
            _encode(item, out)
    else:
        raise TypeError(f"cannot key an extra key of type {type(value).__name__}")


def chunk_extra_digest(extra_keys: Sequence[object] | None) -> bytes:
    """The per-chunk extra for vLLM-style extra keys (tuples of str/bytes/int/None, nested);
    ``b""`` for none. Raises ``TypeError`` for a value it cannot encode unambiguously."""
    if not extra_keys:
        return b""
    parts: list[bytes] = []
    _encode(tuple(extra_keys), parts)
    return hashlib.blake2b(b"".join(parts), digest_size=_EXTRA_DIGEST_SIZE).digest()


def request_identity(
    *,
    lora_name: str | None = None,
    lora_path: str | None = None,
    kv_cache_dtype: str = "",
    model_revision: str = "",
    model_dtype: str = "",
    quantization: str = "",
    model_identity: str = "",
    kv_layout: str = "",
) -> str:
    """The canonical ``KeyExtras.identity`` (``""`` when every field is empty, so a plain
    request keys as LMCache's client does). Fields are length-prefixed in a fixed order.
    ``kv_layout``: the engine's KV-cache groups when it has several
    (``core_sm.kv_groups.layout_identity``: their objects are laid out group after group)."""
    fields = (
        ("lora", lora_name or ""),
        ("lora_path", lora_path or ""),
        ("kv_dtype", kv_cache_dtype),
        ("model_rev", model_revision),
        ("model_dtype", model_dtype),
        ("quant", quantization),
        ("model_id", model_identity),
        ("kv_layout", kv_layout),
    )
    present = [(name, value) for name, value in fields if value]
    if not present:
        return ""
    return ";".join(f"{name}={len(value)}:{value}" for name, value in present)


def identity_fields(identity: str) -> dict[str, str]:
    """The fields of a ``request_identity`` string (``{}`` for ``""`` or for a string not in
    that form: an identity is opaque to the server; this is only for reporting it)."""
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(identity):
        eq = identity.find("=", pos)
        colon = identity.find(":", eq + 1)
        if eq < 0 or colon < 0 or not identity[eq + 1 : colon].isdigit():
            return {}
        end = colon + 1 + int(identity[eq + 1 : colon])
        if end > len(identity) or (end < len(identity) and identity[end] != ";"):
            return {}
        fields[identity[pos:eq]] = identity[colon + 1 : end]
        pos = end + 1
    return fields


class PrehashedTokens(TokenIds):
    """Token ids known only by count and chunk hashes (a replayed trace key, core_sm.trace):
    ``len`` is the recorded count, the ids read as zeros, ``hashes`` are what the server hashed
    them to (``ServerContext.hashes`` takes them as they are instead of hashing)."""

    __slots__ = ("hashes",)

    hashes: tuple[bytes, ...]

    @classmethod
    def make(cls, num_tokens: int, hashes: Sequence[bytes]) -> PrehashedTokens:
        self = object.__new__(cls)
        object.__setattr__(self, "_packed", bytes(4 * num_tokens))
        object.__setattr__(self, "_unpackable", None)
        object.__setattr__(self, "hashes", tuple(hashes))
        return self
