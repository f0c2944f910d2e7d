"""L2 object integrity: every value mpcache puts in an L2 tier is sealed, and checked on read.

A tier is storage mpcache does not control: a disk other processes can write, a Redis other
clients can `SET` into. A value read back is served as KV to an engine, so a short, long, flipped
or planted value must never reach a slot. Each value is an envelope (L2 layout version 4; v4 came
with the keyed chunk chain of mpcache.core_sm.chunks layout v3, so objects of older servers are misses):

    offset  size  field
    0       4     magic b"MPL4" (the layout version is in the magic: older layouts never match)
    4       1     MAC algorithm: 1 = BLAKE2b-256 keyed, 2 = BLAKE3 keyed (256-bit)
    5       3     zero
    8       8     payload size in bytes (u64 little endian)
    16      32    tag = MAC(secret, "mpcache-l2-v4" | u32 len(key) | key | u64 size | payload)
    48      size  payload (the object's bytes, exactly as they were in the L1 slot)

The tag covers the object's L2 key, so a valid envelope copied under another key is rejected as
well. The secret (32 random bytes) is the server's; servers that share a tier (one Redis for a
fleet) must share the secret file, or each sees the others' objects as forged (misses).

Writers use BLAKE3 when the `blake3` package is importable (about 5x faster than BLAKE2b on
32 MiB objects, see docs/benchmarks.md), else BLAKE2b from the standard library. A reader checks
an envelope with the algorithm it names, so mixed fleets interoperate as long as every reader can
compute BLAKE3 whenever any writer does.

The same secret keys the chunk chain (``Sealer.chain_key``, a key derived for that purpose only):
servers sharing a tier must hash a prompt to the same chunk keys, and they already share this
file. ``load_or_create_secret`` also makes and checks a separate chain key file
(``--chunk-key-file``) for servers that want one without L2.
"""
from __future__ import annotations

import enum
import hashlib
import hmac
import os
import secrets
import struct
from typing import Any

from mpcache.runtime_zmq.private_file import PrivateFileError, read_private_file

_blake3: Any
try:  # optional, faster
    import blake3 as _blake3
except ImportError:  # pragma: no cover - exercised only where blake3 is missing
    _blake3 = None

__all__ = [
    "LAYOUT_VERSION",
    "HEADER_BYTES",
    "MacAlgorithm",
    "Opening",
    "Rejection",
    "Sealer",
    "SecretFileError",
    "load_or_create_secret",
]

LAYOUT_VERSION = 4
_MAGIC = b"MPL4"
_HEADER = struct.Struct("<4sB3xQ32s")
HEADER_BYTES = _HEADER.size
_DOMAIN = b"mpcache-l2-v4"
_CHAIN_KEY_DOMAIN = b"mpcache-chunk-chain-key-v3"
SECRET_BYTES = 32


class MacAlgorithm(enum.IntEnum):
    BLAKE2B = 1
    BLAKE3 = 2


class Rejection(enum.Enum):
    """Why a value read from L2 is not served (each is a miss)."""

    SHORT = "short"  # shorter than its header or than the size it declares
    LONG = "long"  # longer than the size it declares
    BAD_HEADER = "bad_header"  # not an envelope of this layout (old layout, foreign value)
    FORGED = "forged"  # the tag does not match: corrupted, or written without the secret
    UNVERIFIABLE = "unverifiable"  # sealed with BLAKE3 and this process has no blake3


class SecretFileError(Exception):
    """The secret file cannot be created or used (mode, owner, content)."""


def load_or_create_secret(path: str, what: str = "L2 secret file") -> bytes:
    """The 32-byte secret in ``path`` (64 hex digits), creating the file (mode 0600, directory
    0700 if it has to be made) with a fresh random secret when it does not exist.

    Refused (``SecretFileError``): a file that is not a regular file, not owned by this user,
    readable or writable by group/others, or that does not hold exactly 64 hex digits. ``what``
    names the file in the errors."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as e:
        raise SecretFileError(f"{what} {path}: cannot create {directory}: {e}") from e
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    except OSError as e:
        raise SecretFileError(f"{what} {path}: cannot create it: {e}") from e
    else:
        try:
            os.write(fd, secrets.token_bytes(SECRET_BYTES).hex().encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
    try:
        text = read_private_file(path).decode("ascii", errors="replace")
    except PrivateFileError as e:
        raise SecretFileError(f"{what} {path}: {e}") from None
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) != SECRET_BYTES:
        raise SecretFileError(
            f"{what} {path}: must hold {SECRET_BYTES * 2} hex digits "
            f"(delete it to have a new one made)"
        )
    return secret


class Sealer:
    """Seals and checks L2 values with one server secret. Thread-safe (no mutable state)."""

    def __init__(self, secret: bytes, algorithm: MacAlgorithm | None = None) -> None:
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"the L2 secret must be {SECRET_BYTES} bytes")
        if algorithm is None:
            algorithm = MacAlgorithm.BLAKE3 if _blake3 is not None else MacAlgorithm.BLAKE2B
        if algorithm is MacAlgorithm.BLAKE3 and _blake3 is None:
            raise ValueError("BLAKE3 needs the blake3 package")
        self._secret = secret
        self.algorithm = algorithm

    def chain_key(self) -> bytes:
        """The chunk-chain key (mpcache.core_sm.chunks.ChunkChain) of servers sharing this secret: a
        keyed hash of a fixed label, so the secret itself never keys anything but seals."""
        return hashlib.blake2b(_CHAIN_KEY_DOMAIN, key=self._secret, digest_size=32).digest()

    def seal(self, key: bytes, payload: bytes | memoryview) -> bytes:
        """The envelope of ``payload`` stored under ``key``."""
        return self.seal_header(key, payload) + payload

    def seal_header(self, key: bytes, payload: bytes | memoryview) -> bytes:
        """The first ``HEADER_BYTES`` of ``payload``'s envelope: a writer sends them and then
        the payload where it lies (an L1 slot), never joining the two in a new buffer."""
        size = len(payload)
        tag = self._tag(self.algorithm, key, size, payload)
        return _HEADER.pack(_MAGIC, int(self.algorithm), size, tag)

    def open(self, key: bytes, blob: bytes | memoryview) -> memoryview | Rejection:
        """The payload of ``blob`` (a view into it, no copy), or why it is rejected."""
        opening = self.opening(key, memoryview(blob)[:HEADER_BYTES], len(blob))
        if isinstance(opening, Rejection):
            return opening
        payload = memoryview(blob)[HEADER_BYTES:]
        opening.update(payload)
        if not opening.verify():
            return Rejection.FORGED
        return payload

    def opening(self, key: bytes, header: bytes | memoryview, total: int) -> Opening | Rejection:
        """The check of a value of ``total`` bytes whose first bytes are ``header`` (at least
        ``HEADER_BYTES`` of them, else SHORT), before its payload is read: what the header
        declares is checked now (layout, algorithm, size against ``total``), the tag once the
        payload went through ``Opening.update``. A reader can so place the payload where it
        belongs (an L1 slot) and check it piece by piece while the rest is still arriving."""
        if total < HEADER_BYTES or len(header) < HEADER_BYTES:
            return Rejection.SHORT
        magic, alg, size, tag = _HEADER.unpack_from(header)
        if magic != _MAGIC or alg not in (MacAlgorithm.BLAKE2B, MacAlgorithm.BLAKE3):
            return Rejection.BAD_HEADER
        actual = total - HEADER_BYTES
        if actual < size:
            return Rejection.SHORT
        if actual > size:
            return Rejection.LONG
        algorithm = MacAlgorithm(alg)
        if algorithm is MacAlgorithm.BLAKE3 and _blake3 is None:
            return Rejection.UNVERIFIABLE
        return Opening(self._hasher(algorithm, key, size), size, tag)

    def _hasher(self, algorithm: MacAlgorithm, key: bytes, size: int, threads: bool = False) -> Any:
        prefix = _DOMAIN + struct.pack("<I", len(key)) + key + struct.pack("<Q", size)
        h: Any
        if algorithm is MacAlgorithm.BLAKE3:
            assert _blake3 is not None
            h = _blake3.blake3(key=self._secret, max_threads=_blake3.blake3.AUTO if threads else 1)
        else:
            h = hashlib.blake2b(key=self._secret, digest_size=32)
        h.update(prefix)
        return h

    def _tag(self, algorithm: MacAlgorithm, key: bytes, size: int, payload: bytes | memoryview) -> bytes:
        h = self._hasher(algorithm, key, size, threads=size >= 1 << 22)
        h.update(payload)
        return bytes(h.digest())


class Opening:
    """The check of one value whose header was accepted: feed the payload in order with
    ``update`` (pieces of any size; the hash releases the GIL on large pieces), then ``verify``.
    ``size``: the payload's bytes, as the header declares and the value's length confirms."""

    __slots__ = ("_hasher", "size", "_tag", "_fed")

    def __init__(self, hasher: Any, size: int, tag: bytes) -> None:
        self._hasher = hasher
        self.size = size
        self._tag = tag
        self._fed = 0

    def update(self, piece: bytes | memoryview) -> None:
        self._hasher.update(piece)
        self._fed += len(piece)

    def verify(self) -> bool:
        """Whether exactly ``size`` bytes were fed and their tag is the one sealed."""
        return self._fed == self.size and hmac.compare_digest(self._tag, bytes(self._hasher.digest()))
