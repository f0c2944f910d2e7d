"""Chunk keys: which L1/L2 object a run of tokens maps to.

* Only **full** chunks of ``chunk_size`` tokens (default 256) are hashed, stored, looked up or
  counted; trailing tokens are ignored.
* The hash is a **keyed** prefix chain (layout v3). A ``ChunkChain`` holds one 32-byte chain key
  (a server's or a fleet's secret: configuration, never read here) and hashes with truncated
  secret-prefix SHA-256 (AMAC)::

      root = SHA-256(B_root || u64 len(model) || model || u64 len(salt) || salt || u64 world_size)[:16]
      h_0  = root;  h_i = SHA-256(B_step || h_{i-1} || tokens[(i-1)C : iC] as LE uint32)[:16]

  where ``B_root`` / ``B_step`` are 64-byte blocks holding the layout tag, the role and the key
  (the hasher state after them is computed once and copied per call). Chunk ``i``'s hash
  identifies the whole prefix up to its end, the model, the KV world size, the cache salt and
  the key, so two requests share an object only if they share all of them.
* Why keyed: an unkeyed hash lets a client compute a victim's keys offline, and XXH3 (v2) is not
  collision-resistant (seed-independent collisions are known even for seeded XXH3), so a tenant
  allowed to store could craft tokens whose chain collides with another tenant's prefix and
  plant KV under it. Without the key nobody can predict a hash or aim a collision; and SHA-256
  stays collision-resistant even if the key leaks. Truncated secret-prefix SHA-256 is a PRF
  (Bellare, Bernstein, Tessaro: "AMAC", 2016) and cannot be length-extended since 16 of the 32
  digest bytes are kept. Why SHA-256 over keyed BLAKE3 / BLAKE2b: measured on the lookup path
  (``mpcache-bench hash``, docs/benchmarks.md "Keyed chunk chain"), every chunk is its own
  serial 1 KiB call, where SHA-NI's SHA-256 beats single-chunk BLAKE3 and BLAKE2b.
* Implementation: this module hashes with ``hashlib`` (one copy, two updates and a digest per
  chunk: about 1 us a chunk, half of it Python and EVP overhead around SHA-256). A runtime may
  inject a *batch* function that computes the whole chain in one native call
  (``ChunkChain(key, batch=factory)``, see ``ChainBatchFactory``); it must produce exactly these
  digests, and ``hashlib`` stays the reference and the fallback (runtime_zmq.sha256_chain).
* Servers that share an L2 tier must use the same chain key (runtime_zmq derives it from the L2
  sealing secret they already share), else each one's objects are the other's misses.
* The layout version is in ``B_root`` and ``B_step``: changing the hash or the layout changes
  every key, so an L2 tier written by an older layout is simply a miss (v1 was blake2b-256,
  v2 unkeyed XXH3-128).
* ``PUBLIC_CHAIN`` (an all-zero key) is what tests, tools and ``core_sm`` defaults use; it is not
  secret: a server always runs with its own key (runtime_zmq never uses this one).
* One object = one chunk of one KV rank: ``ObjectKey(chunk_hash, kv_rank)``.
* A request's tokens travel as ``TokenIds``: one immutable buffer of little-endian uint32, packed
  once (or taken as received from the wire), so hashing reads chunk slices of it directly and no
  step of the lookup path creates a Python object per token.

Errors: ``chunk_hashes`` raises ``ValueError`` for a token id outside ``[0, 2**32)`` and
``TypeError`` for a non-int; machines catch that and answer ``ErrorKind.VALIDATION``.
``ChunkChain`` raises ``ValueError`` for a key that is not 32 bytes.
"""
from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple, overload

DEFAULT_CHUNK_SIZE = 256
MAX_CACHE_SALT_LEN = 128
_FORBIDDEN_SALT_CHARS = ("@", "/", "\\", "\x00")
CHUNK_HASH_SIZE = 16
CHAIN_KEY_BYTES = 32
# Bumped whenever the hash or the layout changes: a new version makes every old L2 object a
# miss, which is the safe failure. v1: blake2b-256; v2: XXH3-128; v3: keyed SHA-256 (AMAC).
_HASH_LAYOUT_VERSION = b"mpcache-chunk-v3"
_SHA256_BLOCK = 64
_HASH_FORMAT = f"{CHUNK_HASH_SIZE}s"
_BYTESWAP = sys.byteorder != "little"
assert array("I").itemsize == 4, "uint32 packing needs a 4-byte array('I')"


# ``batch(root, packed, chunk_bytes, n)``: the n chained digests ``h_1 .. h_n`` (16 bytes each,
# concatenated) over the first ``n * chunk_bytes`` bytes of ``packed`` (``len(packed) >= n *
# chunk_bytes``), starting from ``root`` (any length, often 16), exactly as ``ChunkChain.hashes``
# computes them; or None to decline (e.g. not loaded yet), and ``hashes`` uses hashlib.
ChainBatch = Callable[[bytes, bytes, int, int], "bytes | bytearray | memoryview | None"]
# Called once per chain with ``B_step`` (the 64-byte block before every step's input: layout tag,
# role and key; a secret), returns that chain's batch function.
ChainBatchFactory = Callable[[bytes], ChainBatch]


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


class ChunkChain:
    """The keyed chain of one server or fleet: ``root`` and ``hashes`` under one chain key.

    Immutable; holds the SHA-256 states after the two key blocks (copied per call), never the
    key's bytes in a printable form. ``ValueError`` unless ``key`` is ``CHAIN_KEY_BYTES`` bytes.
    ``batch``: a ``ChainBatchFactory`` that ``hashes`` uses for the chunk steps (one native call
    per request instead of a hashlib call per chunk); ``root`` always uses hashlib.
    """

    __slots__ = ("_root_base", "_step_base", "_batch", "fingerprint")

    _root_base: "hashlib._Hash"
    _step_base: "hashlib._Hash"
    _batch: ChainBatch | None
    fingerprint: str

    def __init__(self, key: bytes, batch: ChainBatchFactory | None = None) -> None:
        if type(key) is not bytes or len(key) != CHAIN_KEY_BYTES:
            raise ValueError(f"a chain key is {CHAIN_KEY_BYTES} bytes")
        for name, role in (("_root_base", b"root"), ("_step_base", b"step")):
            block = (_HASH_LAYOUT_VERSION + b"/" + role + b"/" + key).ljust(_SHA256_BLOCK, b"\0")
            object.__setattr__(self, name, hashlib.sha256(block))
            if role == b"step":
                object.__setattr__(self, "_batch", batch(block) if batch is not None else None)
        # Printable and safe to log (a one-way function of the key): tells apart servers that
        # run with different keys (each sees the other's L2 objects as misses).
        fp = hashlib.sha256(_HASH_LAYOUT_VERSION + b"/fingerprint/" + key).hexdigest()[:16]
        object.__setattr__(self, "fingerprint", fp)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("ChunkChain is immutable")

    def __copy__(self) -> ChunkChain:
        return self  # immutable: a copied machine (the explorer's states) shares its chain

    def __deepcopy__(self, memo: dict[int, object]) -> ChunkChain:
        return self

    def __repr__(self) -> str:
        return f"ChunkChain(fingerprint={self.fingerprint})"

    def root(self, model_name: str, world_size: int, cache_salt: str = "") -> bytes:
        """The chain's starting value ``h_0``: folds model name, KV world size and cache salt.

        Each field is length-prefixed so no two different identities serialize alike.
        Raises ``ValueError`` for an invalid salt or a world size < 1.
        """
        reason = validate_cache_salt(cache_salt)
        if reason is not None:
            raise ValueError(reason)
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, not {world_size}")
        h = self._root_base.copy()
        for field in (model_name.encode("utf-8"), cache_salt.encode("utf-8")):
            h.update(struct.pack("<Q", len(field)))
            h.update(field)
        h.update(struct.pack("<Q", world_size))
        return h.digest()[:CHUNK_HASH_SIZE]

    def hashes(
        self,
        token_ids: TokenIds | Sequence[int],
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        root: bytes = b"",
        num_chunks: int | None = None,
    ) -> tuple[bytes, ...]:
        """Prefix-chained hashes of the full chunks of ``token_ids`` (``CHUNK_HASH_SIZE`` bytes
        each), starting from ``root``.

        ``num_chunks`` limits the work to the first chunks (default: every full chunk). A
        ``TokenIds`` is hashed from its packed buffer directly (chunk slices of a memoryview).
        """
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, not {chunk_size}")
        n = len(token_ids) // chunk_size
        if num_chunks is not None:
            n = min(n, max(0, num_chunks))
        if n == 0:
            return ()
        step = chunk_size * 4
        if isinstance(token_ids, TokenIds):
            packed = token_ids.packed
        else:
            packed = pack_tokens(token_ids[: n * chunk_size])
        if self._batch is not None:
            joined = self._batch(root, packed, step, n)
            if joined is not None:
                if len(joined) != n * CHUNK_HASH_SIZE:
                    raise RuntimeError(f"chain batch returned {len(joined)} bytes for {n} chunks")
                # one C call makes the n bytes objects (struct caches the format)
                return struct.unpack(_HASH_FORMAT * n, joined)
        data = memoryview(packed)
        out: list[bytes] = []
        append = out.append
        prev = root
        copy = self._step_base.copy
        for offset in range(0, n * step, step):
            h = copy()
            h.update(prev)
            h.update(data[offset : offset + step])
            prev = h.digest()[:CHUNK_HASH_SIZE]
            append(prev)
        return tuple(out)


PUBLIC_CHAIN_KEY = bytes(CHAIN_KEY_BYTES)
PUBLIC_CHAIN = ChunkChain(PUBLIC_CHAIN_KEY)


def identity_root(model_name: str, world_size: int, cache_salt: str = "",
                  chain: ChunkChain = PUBLIC_CHAIN) -> bytes:
    """``chain.root(...)`` (``PUBLIC_CHAIN`` by default: tests and tools)."""
    return chain.root(model_name, world_size, cache_salt)


def pack_tokens(token_ids: Iterable[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (raises ValueError/TypeError/OverflowError if
    not uint32). A list takes ``array.fromlist``'s fast path; a ``TokenIds`` is already packed."""
    if isinstance(token_ids, TokenIds):
        return token_ids.packed
    packed = array("I")
    if type(token_ids) is list:
        packed.fromlist(token_ids)
    else:
        packed.extend(token_ids)
    if _BYTESWAP:
        packed.byteswap()
    return packed.tobytes()


class TokenIds(Sequence[int]):
    """A request's token ids as one immutable buffer of little-endian uint32 (hashable, equal
    when the tokens are equal, whatever form they were built from).

    ``TokenIds.from_packed(b)`` wraps packed bytes as received (no copy, no per-token work;
    ``ValueError`` unless ``len(b) % 4 == 0``); ``TokenIds.from_ints(seq)`` packs a sequence once.
    A sequence holding a value that is not a uint32 is kept as given instead of raising, so an
    event carrying it can still be built and the machine answers it with a VALIDATION error:
    ``valid`` is False and ``packed`` raises what packing raised (``ValueError``, ``TypeError`` or
    ``OverflowError``). ``len`` counts tokens; indexing gives ints, slicing gives ``TokenIds``.
    """

    __slots__ = ("_packed", "_unpackable")

    _packed: bytes | None
    _unpackable: tuple[object, ...] | None

    def __init__(self, token_ids: Iterable[int] = ()) -> None:
        other = as_token_ids(token_ids)
        object.__setattr__(self, "_packed", other._packed)
        object.__setattr__(self, "_unpackable", other._unpackable)

    @classmethod
    def _make(cls, packed: bytes | None, unpackable: tuple[object, ...] | None) -> TokenIds:
        self = object.__new__(cls)
        object.__setattr__(self, "_packed", packed)
        object.__setattr__(self, "_unpackable", unpackable)
        return self

    @classmethod
    def from_packed(cls, packed: bytes) -> TokenIds:
        if type(packed) is not bytes:
            raise TypeError(f"packed token ids must be bytes, not {type(packed).__name__}")
        if len(packed) % 4:
            raise ValueError(f"{len(packed)} bytes is not a whole number of uint32 token ids")
        return cls._make(packed, None)

    @classmethod
    def from_ints(cls, token_ids: Iterable[int]) -> TokenIds:
        if type(token_ids) is not list and type(token_ids) is not tuple:
            token_ids = list(token_ids)
        try:
            return cls._make(pack_tokens(token_ids), None)
        except (TypeError, ValueError, OverflowError):
            return cls._make(None, tuple(token_ids))

    @property
    def valid(self) -> bool:
        """Whether every token id is a uint32."""
        return self._packed is not None

    @property
    def packed(self) -> bytes:
        """The little-endian uint32 bytes; raises if some token id is not a uint32."""
        if self._packed is None:
            assert self._unpackable is not None
            pack_tokens(self._unpackable)  # type: ignore[arg-type]  # raises the precise error
            raise ValueError("token ids are not all uint32")  # pragma: no cover
        return self._packed

    def tolist(self) -> list[int]:
        if self._packed is None:
            return list(self._unpackable or ())  # type: ignore[arg-type]
        a = array("I")
        a.frombytes(self._packed)
        if _BYTESWAP:
            a.byteswap()
        return a.tolist()

    def __len__(self) -> int:
        if self._packed is None:
            return len(self._unpackable or ())
        return len(self._packed) >> 2

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> TokenIds: ...

    def __getitem__(self, index: int | slice) -> int | TokenIds:
        packed = self._packed
        if isinstance(index, slice):
            if packed is None:
                return TokenIds._make(None, (self._unpackable or ())[index])
            start, stop, step = index.indices(len(packed) >> 2)
            if step == 1:
                return TokenIds._make(packed[start * 4 : max(start, stop) * 4], None)
            return TokenIds.from_ints(self.tolist()[index])
        if packed is None:
            return (self._unpackable or ())[index]  # type: ignore[return-value]
        n = len(packed) >> 2
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("token index out of range")
        return int.from_bytes(packed[index * 4 : index * 4 + 4], "little")

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenIds):
            return NotImplemented
        return self._packed == other._packed and self._unpackable == other._unpackable

    def __hash__(self) -> int:
        return hash((self._packed, self._unpackable))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("TokenIds is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("TokenIds is immutable")

    def __reduce__(self) -> tuple[object, ...]:
        return (TokenIds._make, (self._packed, self._unpackable))

    def __repr__(self) -> str:
        n = len(self)
        head = self[:4].tolist() if self._packed is not None else list(self[:4])
        more = f", ... {n} tokens" if n > 4 else ""
        return f"TokenIds({head!r}{more})"


def as_token_ids(value: Iterable[int] | bytes) -> TokenIds:
    """``TokenIds`` for packed bytes (as received), an existing ``TokenIds``, or a sequence of
    ints (packed once). The converter of ``CacheKey.token_ids``."""
    if type(value) is TokenIds:
        return value
    if type(value) is bytes:
        return TokenIds.from_packed(value)
    if isinstance(value, (str, bytearray, memoryview)):
        raise TypeError(f"token ids cannot be a {type(value).__name__}")
    return TokenIds.from_ints(value)


def num_full_chunks(num_tokens: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """How many full chunks ``num_tokens`` tokens hold."""
    return num_tokens // chunk_size


def chunk_hashes(
    token_ids: TokenIds | Sequence[int],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    root: bytes = b"",
    num_chunks: int | None = None,
    chain: ChunkChain = PUBLIC_CHAIN,
) -> tuple[bytes, ...]:
    """``chain.hashes(...)`` (``PUBLIC_CHAIN`` by default: tests and tools)."""
    return chain.hashes(token_ids, chunk_size, root, num_chunks)


class ObjectKey(NamedTuple):
    """One L1/L2 object: one chunk (by its prefix hash) of one KV rank. Immutable and ordered
    (by hash, then rank); a named tuple so hashing and comparing it, which the L1 index does
    for every object of every request, run in C."""

    chunk_hash: bytes
    kv_rank: int

    def wire_name(self) -> str:
        """A stable printable name (L2 file/Redis key): hex hash, then the rank."""
        return f"{self.chunk_hash.hex()}-{self.kv_rank}"


class PackedHashes(Sequence[bytes]):
    """One request's chunk hashes in one buffer, for records that outlive the request (a lookup
    job): 16 bytes a hash instead of a ``bytes`` object (~49 bytes) plus its tuple slot. Indexing
    gives the hash as ``bytes``. Built by ``pack_hashes`` when every hash has the same size."""

    __slots__ = ("_buf", "_width")

    def __init__(self, buf: bytes, width: int) -> None:
        self._buf = buf
        self._width = width

    def __len__(self) -> int:
        return len(self._buf) // self._width

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[bytes, ...]: ...

    def __getitem__(self, index: int | slice) -> bytes | tuple[bytes, ...]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            w, buf = self._width, self._buf
            return tuple(buf[i * w : i * w + w] for i in range(start, stop, step))
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("chunk index out of range")
        w = self._width
        return self._buf[index * w : index * w + w]

    def __iter__(self) -> Iterator[bytes]:
        w, buf = self._width, self._buf
        return (buf[i : i + w] for i in range(0, len(buf), w))


def pack_hashes(hashes: Sequence[bytes]) -> Sequence[bytes]:
    """``hashes`` as a ``PackedHashes`` when they all have one size (the plain chain), else as
    given (keyed chunks of ``mpcache.core_sm.keys`` can differ in size)."""
    if not hashes:
        return ()
    width = len(hashes[0])
    if width == 0 or any(len(h) != width for h in hashes):
        return tuple(hashes)
    return PackedHashes(b"".join(hashes), width)

